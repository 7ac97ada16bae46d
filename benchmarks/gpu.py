"""GPT-2 small (124M) on one CUDA GPU, bfloat16: kzoo beside keras-hub and transformers (SDPA).

Run (from the repository root, on a machine with a CUDA GPU):

    python -m benchmarks.gpu                          # every system, GPT-2 small
    python -m benchmarks.gpu --systems kzoo/jax,transformers/torch
    python -m benchmarks.gpu --quick                  # tiny model, runs on a CPU: a smoke test

Systems: kzoo and keras-hub on the Keras backends named (jax, torch; tensorflow where a
CUDA build of it is installed), transformers on torch with `attn_implementation="sdpa"`.
A system name may end in `+jit` (e.g. `kzoo/torch+jit`): the Keras model is compiled
with `jit_compile=True` (torch: `torch.compile`; TensorFlow: XLA) instead of Keras' default.
Each runs in a fresh process (this same Python, KERAS_BACKEND set), one after the other;
a system that fails or times out is reported as such and the others still run.

Model: GPT-2 small as Hugging Face's `gpt2` checkpoint has it (vocabulary 50257, context
1024, 12 pre-LN layers, width 768, 12 heads, feed-forward 3072, tied LM head, tanh GELU), no
dropout, random initialisation (speed does not depend on the weights).

- `train`: AdamW steps (lr 1e-4, weight decay 0.01) on batches of 8 x 1024 tokens,
  next-token cross-entropy; mixed bfloat16: float32 weights and optimizer state, bfloat16
  matmuls and activations (Keras' `mixed_bfloat16` policy; transformers under
  `torch.autocast("cuda", torch.bfloat16)`, which is what its `Trainer(bf16=True)` does).
  Input tokens/s; each step ends with the loss on the host (a device sync), for all alike.
- `decode`: greedy decoding, KV cache, 128 new tokens for 4 prompts of 32 tokens (the CPU
  benchmark's shape), stop tokens disabled; bfloat16 weights (Keras' `bfloat16` policy;
  transformers `model.to(torch.bfloat16)`). New tokens/s. kzoo on torch replays each step
  as a CUDA graph; its worker also decodes with `KZOO_CUDA_GRAPHS=0`, reports that speed and
  whether the tokens are the same, and how many steps replayed the graph.
- MFU: model FLOPs of a training token (matmuls, 2 x multiply-adds, forward + backward = 3x
  forward, attention over all 1024 keys: the PaLM convention; `peers.train_flops_per_token`)
  times tokens/s, over the GPU's dense bfloat16 peak: the datasheet figure given with
  `--peak-tflops` (default 989.4, H100 SXM) and the best bf16 matmul measured in the same run
  (8192^3, each worker on its own backend).
- GPU memory: the allocator's peak bytes in use in the worker's process up to the end of
  training (weights, gradients, optimizer state, activations; JAX: `memory_stats()`'s
  `peak_bytes_in_use`, torch: `max_memory_allocated`).

- `--profile` (torch systems): where a training step's time goes, from `torch.profiler`
  over 3 more steps: the device's kernel time a step, kernel launches, and the host's waits
  for the device (stream / device / event synchronisations), beside the timed step; a step
  much longer than its kernels is bound by the host. (An H200, Dec 1 2026: kzoo's step 84
  ms for 45 ms of kernels, 13 waits; transformers' 69 ms for 57 ms, 2 waits.)

Forward (predict) is not timed here: Keras' `predict_on_batch` returns NumPy, and copying
8 x 1024 x 50257 logits to the host would dominate the figure.
"""

import argparse
import json
import sys
import time

from benchmarks.peers import (
    RESULT_MARK,
    _fmt,
    _median_time,
    count_new_tokens,
    format_table,
    ratio,
    run_worker_process,
    train_flops_per_token,
)

SIZES = {
    "gpt2": dict(vocab=50257, layers=12, width=768, heads=12, ff=3072, context=1024,
                 batch=8, seq=1024, prompts=4, prompt_len=32, new_tokens=128, matmul=8192,
                 warmup=3, steps=10, decode_calls=3),
    "quick": dict(vocab=512, layers=2, width=64, heads=2, ff=256, context=64,
                  batch=2, seq=32, prompts=2, prompt_len=8, new_tokens=8, matmul=256,
                  warmup=1, steps=2, decode_calls=1),
}
SYSTEMS = ("kzoo/jax", "kzoo/torch", "keras-hub/jax", "keras-hub/torch", "transformers/torch",
           "kzoo/tensorflow", "keras-hub/tensorflow")
DEFAULT_SYSTEMS = SYSTEMS[:5]


def _data(size, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, size["vocab"], (size["batch"], size["seq"] + 1)).astype("int32")
    prompts = rng.integers(2, size["vocab"], (size["prompts"], size["prompt_len"]))
    return tokens, prompts.astype("int32")


# === Workers ===


def _sync_backend():
    """A function that waits for the device's queued work (Keras backend in use)."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return lambda: None  # JAX / TF: the results below are read on the host anyway


def _gpu_peak_mib():
    """Peak bytes the backend's GPU allocator had in use in this process, MiB (None on CPU)."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if backend == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else peak / 2**20
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        return tf.config.experimental.get_memory_info(gpus[0].name)["peak"] / 2**20 if gpus \
            else None
    return None


def _bf16_matmul_tflops(backend, n):
    """Best of 10 timed (n x n) @ (n x n) bfloat16 products on `backend`, TFLOP/s."""
    import numpy as np

    a = np.random.default_rng(0).normal(size=(n, n)).astype("float32")
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        x = jnp.asarray(a, jnp.bfloat16)
        f = jax.jit(lambda p, q: p @ q)
        run = lambda: f(x, x).block_until_ready()  # noqa: E731
    elif backend == "torch":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.from_numpy(a).to(dev, torch.bfloat16)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def run():
            torch.mm(x, x)
            sync()
    else:
        import tensorflow as tf

        x = tf.cast(tf.constant(a), tf.bfloat16)
        f = tf.function(lambda p, q: tf.linalg.matmul(p, q))
        run = lambda: f(x, x)[0, 0].numpy()  # noqa: E731
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def _keras_train(model, tokens, size):
    """(tokens/s, loss) of `train_on_batch` steps on next-token prediction."""
    t = size["seq"]
    x = {"token_ids": tokens[:, :t], "padding_mask": tokens[:, :t] >= 0}
    y = tokens[:, 1:]
    losses = []

    def step():
        losses.append(float(model.train_on_batch(x, y, return_dict=True)["loss"]))

    seconds = _median_time(step, size["steps"], size["warmup"])
    return size["batch"] * t / seconds, losses[-1], step


# The profiler's names of a kernel launch and of the host waiting for the device.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _torch_step_profile(step, steps=3):
    """`steps` calls of `step` under `torch.profiler` (CPU, and CUDA where there is one):
    per step, the device's kernel time in ms (None without CUDA; the sum torch's own table
    prints as "Self CUDA time total"), kernel launches and host waits for the device."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events
                  if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    return {"kernels_ms": kernels / 1e3 / steps if cuda else None,
            "launches": sum(e.count for e in events if e.key in LAUNCHES) / steps,
            "waits": sum(e.count for e in events if e.key in WAITS) / steps}


def _kzoo_models(size):
    """dtype policy name -> kzoo's `gpt2` preset at `size` (GPT-2 small at the default)."""
    import kzoo.presets

    shape = dict(num_layers=size["layers"], num_heads=size["heads"], hidden_dim=size["width"],
                 intermediate_dim=size["ff"], vocabulary_size=size["vocab"],
                 max_sequence_length=size["context"], dropout=0.0,
                 stop_token_ids=None)  # (decoding runs to its length; GPT-2's id 50256
    # lies outside the quick size's vocabulary)
    return lambda dtype: kzoo.presets.load("gpt2", dtype=dtype, **shape)


def _keras_worker(library, size, jit="auto", profile=False):
    import keras
    import numpy as np

    tokens, prompts = _data(size)
    backend = keras.backend.backend()
    keras.utils.set_random_seed(0)
    optimizer = lambda: keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=0.01)  # noqa
    if library == "kzoo":
        make = _kzoo_models(size)
        model = make("mixed_bfloat16")
        model.compile(optimizer=optimizer(), jit_compile=jit)  # kzoo's default loss
    else:
        import keras_hub

        shape = dict(num_layers=size["layers"], num_heads=size["heads"],
                     hidden_dim=size["width"], intermediate_dim=size["ff"],
                     vocabulary_size=size["vocab"], max_sequence_length=size["context"],
                     dropout=0.0)

        def make(dtype):
            backbone = keras_hub.models.GPT2Backbone(dtype=dtype, **shape)
            return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

        model = make("mixed_bfloat16")
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=None, jit_compile=jit)
    params = model.count_params()
    train, loss, step = _keras_train(model, tokens, size)
    out = {"train": train, "loss": loss, "params": params, "train_gpu_mib": _gpu_peak_mib()}
    if profile and backend == "torch":
        out["profile"] = _torch_step_profile(step)
    del model
    keras.backend.clear_session()

    model = make("bfloat16")
    b, p, n = size["prompts"], size["prompt_len"], size["new_tokens"]
    new = {}
    if library == "kzoo":
        plist = prompts.tolist()

        def decode():
            res = model.generate(plist, max_new_tokens=n, strategy="greedy",
                                 stop_token_ids=None)
            new["n"] = count_new_tokens(res)
    else:
        model.compile(sampler="greedy")
        ids = np.zeros((b, p + n), "int32")
        ids[:, :p] = prompts
        inputs = {"token_ids": ids, "padding_mask": np.arange(p + n)[None].repeat(b, 0) < p}

        def decode():
            res = model.generate(inputs, stop_token_ids=None)
            new["n"] = int(np.sum(np.asarray(res["padding_mask"]))) - b * p

    seconds = _median_time(decode, size["decode_calls"], 1)
    out.update(decode=new["n"] / seconds, new_tokens=new["n"])
    if library == "kzoo" and backend == "torch":
        out.update(_torch_graph_check(model, prompts.tolist(), n, decode, size))
    out["matmul_tflops"] = _bf16_matmul_tflops(backend, size["matmul"])
    return out


def _torch_graph_check(model, prompts, n, decode, size):
    """kzoo on torch: how many decode steps replayed a CUDA graph, whether the tokens equal
    those of the loop without graphs (`KZOO_CUDA_GRAPHS=0`), and that loop's speed."""
    import os

    from kzoo import generation

    counted = {"replays": 0}

    class Counted(generation.GRAPH_CLASS):
        def replay(self):
            counted["replays"] += 1
            return super().replay()

    original = generation.GRAPH_CLASS
    generation.GRAPH_CLASS = Counted
    try:
        with_graphs = model.generate(prompts, max_new_tokens=n, strategy="greedy",
                                     stop_token_ids=None)
    finally:
        generation.GRAPH_CLASS = original
    os.environ[generation.GRAPHS_ENV] = "0"
    try:
        without = model.generate(prompts, max_new_tokens=n, strategy="greedy",
                                 stop_token_ids=None)
        tokens = count_new_tokens(without)
        seconds = _median_time(decode, size["decode_calls"], 1)
    finally:
        del os.environ[generation.GRAPHS_ENV]
    return {"graph_replays": counted["replays"], "graph_tokens_equal": with_graphs == without,
            "decode_no_graphs": tokens / seconds}


def _transformers_worker(size, profile=False):
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    tokens, prompts = _data(size)
    config = transformers.GPT2Config(
        vocab_size=size["vocab"], n_positions=size["context"], n_embd=size["width"],
        n_layer=size["layers"], n_head=size["heads"], n_inner=size["ff"],
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(config).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = torch.as_tensor(tokens[:, :size["seq"]], dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))  # the host reads the loss: a sync, as Keras' steps do
        sync()

    model.train()
    seconds = _median_time(step, size["steps"], size["warmup"])
    out = {"train": size["batch"] * size["seq"] / seconds, "loss": losses[-1],
           "params": sum(p.numel() for p in model.parameters()),
           "train_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda"
           else None, "attention": model.config._attn_implementation}
    if profile:
        out["profile"] = _torch_step_profile(step)
    del opt
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    p = torch.as_tensor(prompts, dtype=torch.long, device=dev)
    new = {}

    def decode():
        with torch.no_grad():
            res = model.generate(input_ids=p, attention_mask=torch.ones_like(p),
                                 max_new_tokens=size["new_tokens"], do_sample=False,
                                 num_beams=1, pad_token_id=0)
        sync()
        new["n"] = (res.shape[1] - p.shape[1]) * res.shape[0]

    seconds = _median_time(decode, size["decode_calls"], 1)
    out.update(decode=new["n"] / seconds, new_tokens=new["n"],
               matmul_tflops=_bf16_matmul_tflops("torch", size["matmul"]))
    return out


def run_worker(system, size, profile=False):
    import warnings

    warnings.filterwarnings("ignore")
    library, backend = _split(system)
    jit = True if system.endswith("+jit") else "auto"
    out = _transformers_worker(size, profile) if library == "transformers" else \
        _keras_worker(library, size, jit, profile)
    out["device"] = _device_name(backend)
    return out


def _split(system):
    """"kzoo/torch+jit" -> ("kzoo", "torch")."""
    library, backend = system.split("+")[0].split("/")
    return library, backend


def _device_name(backend):
    try:
        if backend == "jax":
            import jax

            return str(jax.devices()[0].device_kind)
        if backend == "torch":
            import torch

            return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        return gpus[0].name if gpus else "cpu"
    except Exception as error:  # the name is a label: never fail the figures for it
        return f"unknown ({error})"


# === Driver ===


def run_system(system, size_name, timeout, profile=False):
    """One system in a fresh process: (results, error message or None)."""
    return run_worker_process(["benchmarks.gpu", "--worker", system, "--size", size_name]
                              + (["--profile"] if profile else []), _split(system)[1], timeout)


def report(results, size, peak_tflops):
    """The printed tables: speed with ratios to transformers and keras-hub, then MFU and GPU
    memory."""
    hf = results.get("transformers/torch", {})
    rows = []
    for system, r in results.items():
        lib, backend = _split(system)
        kh = results.get(f"keras-hub/{backend}", {}) if lib == "kzoo" else {}
        rows.append((system, r.get("device", "n/a"), _fmt(r.get("train")), _fmt(r.get("decode")),
                     _fmt(ratio(r.get("train"), hf.get("train")), "ratio"),
                     _fmt(ratio(r.get("decode"), hf.get("decode")), "ratio"),
                     _fmt(ratio(r.get("train"), kh.get("train")), "ratio") if kh else "",
                     _fmt(ratio(r.get("decode"), kh.get("decode")), "ratio") if kh else ""))
    text = ["GPT-2 small, one run per system; higher is better.",
            format_table(("system", "device", "train tok/s (mixed bf16)",
                          "decode new tok/s (bf16)", "train/transformers",
                          "decode/transformers", "train/keras-hub", "decode/keras-hub"),
                         rows, left=2)]
    measured = max((r.get("matmul_tflops") or 0 for r in results.values()), default=0) or None
    flops = train_flops_per_token("gpt", size)
    util = []
    for system, r in results.items():
        if r.get("train") is None:
            continue
        achieved = flops * r["train"] / 1e12
        util.append((system, _fmt(r["train"]), f"{achieved:.1f}",
                     _fmt(ratio(achieved, peak_tflops), "pct"),
                     _fmt(ratio(achieved, measured), "pct"),
                     _fmt(r.get("train_gpu_mib")), _fmt(r.get("loss"))))
    text += ["", f"MFU: {flops / 1e9:.3f} GFLOP per training token (3 x forward matmuls, "
                 f"attention over all {size['seq']} keys); peak {peak_tflops:g} TFLOP/s "
                 f"(datasheet, dense bf16) and {_fmt(measured)} TFLOP/s (best bf16 "
                 f"{size['matmul']}^3 matmul measured in this run).",
             format_table(("system", "train tok/s", "TFLOP/s", "MFU (datasheet)",
                           "MFU (measured peak)", "GPU peak MiB", "last loss"), util,
                          left=1)]
    profiled = [(system, r) for system, r in results.items() if r.get("profile")]
    if profiled:
        rows = []
        for system, r in profiled:
            prof, step_ms = r["profile"], ratio(1e3 * size["batch"] * size["seq"], r["train"])
            kernels = prof.get("kernels_ms")
            bound = "n/a" if not kernels or not step_ms else \
                "host" if step_ms > 1.15 * kernels else "device"
            rows.append((system, _fmt(step_ms), _fmt(kernels), _fmt(prof.get("launches")),
                         _fmt(prof.get("waits")), bound))
        text += ["", "Where a training step's time goes (torch.profiler, 3 steps; a step over "
                     "1.15x its kernels' time is bound by the host):",
                 format_table(("system", "step ms", "kernels ms/step", "launches/step",
                               "host waits/step", "bound by"), rows, left=1)]
    for system, r in results.items():
        if "graph_replays" in r:
            text.append(f"{system} decode: {r['graph_replays']} steps of a call replayed a CUDA "
                        f"graph; tokens equal to the loop without graphs: "
                        f"{r['graph_tokens_equal']}; without graphs "
                        f"{_fmt(r.get('decode_no_graphs'))} new tok/s.")
    return "\n".join(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, from {list(SYSTEMS)}; a Keras system may end in "
                             "'+jit' (jit_compile=True)")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per system")
    parser.add_argument("--peak-tflops", type=float, default=989.4,
                        help="the GPU's dense bf16 datasheet peak (default: H100 SXM)")
    parser.add_argument("--profile", action="store_true",
                        help="torch systems: profile 3 training steps (kernel time, launches, "
                             "host waits for the device)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_MARK + json.dumps(run_worker(args.worker, SIZES[args.size],
                                                  args.profile)), flush=True)
        return
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in chosen if s.removesuffix("+jit") not in SYSTEMS
           or s.startswith("transformers") and s.endswith("+jit")]
    if bad or not chosen:
        parser.error(f"--systems must name some of {list(SYSTEMS)}; got {bad or chosen}.")
    if args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be > 0; got {args.peak_tflops}.")
    size_name = "quick" if args.quick else args.size
    results, notes = {}, []
    for system in chosen:
        start = time.perf_counter()
        values, error = run_system(system, size_name, args.timeout, args.profile)
        print(f"{system}: {time.perf_counter() - start:.0f} s"
              + (f" FAILED ({error})" if error else "") + f" {json.dumps(values)}",
              file=sys.stderr, flush=True)
        results[system] = values
        if error:
            notes.append(f"{system}: {error}")
        if args.json:  # after every system: nothing measured is lost if a later one hangs
            with open(args.json, "w") as f:
                json.dump({"size": SIZES[size_name], "results": results, "notes": notes}, f,
                          indent=1)
    print(report(results, SIZES[size_name], args.peak_tflops))
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
