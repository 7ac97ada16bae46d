"""kzoo beside its peers: keras-hub (each Keras backend) and Hugging Face transformers (torch).

Run (from the repository root):

    python -m benchmarks.peers                      # 3 rounds, GPT, BERT and T5, 3 backends
    python -m benchmarks.peers --quick              # tiny sizes, 1 round: a smoke test
    python -m benchmarks.peers --only gpt --backends jax,torch --rounds 5

Systems: kzoo and keras-hub on every backend in `--backends` (KERAS_BACKEND), and
transformers on torch, eager (always run: it is the reference of the `kzoo/transformers`
ratios of every backend). Every system runs each model in a fresh process (this same Python,
started with KERAS_BACKEND set), one process per system, model and round, the systems
interleaved (the order rotates each round) so that a change of the machine's load hits them
alike, and no model's figures (its memory above all) depend on another model run before it
in the same process. The table gives the median over the rounds; with two rounds or more
a second table gives each ratio round by round (a round's kzoo over the same round's peer)
as its median and range, which shows how far the machine moved the ratios in that run.

Models (random initialisation, float32, no dropout, same sizes everywhere):
- GPT-2 style: vocabulary 8192, 4 pre-LN layers, width 256, 4 heads, feed-forward 1024,
  tied LM head (kzoo `gpt_mini`, keras-hub `GPT2CausalLM`, transformers `GPT2LMHeadModel`).
  `train`: AdamW steps on batches of 8 x 256 tokens, next-token cross-entropy (input
  tokens/s); `forward`: logits for the same batch (tokens/s); `decode`: greedy decoding of 128
  new tokens for 4 prompts of 32 tokens with the KV cache, stop tokens disabled so every
  system makes all 4 x 128 (new tokens/s; prompts are not counted).
- BERT of the same size (kzoo `bert_tiny_uncased` resized, keras-hub `BertMaskedLM`,
  transformers `BertForMaskedLM`): `train` and `forward` at 8 x 256, masked-LM loss on 15%
  of the positions (38 a row). `train`: each library's own way to train that loss: kzoo and
  keras-hub take the masked positions as `mask_positions` and run the LM head and the loss
  there only (kzoo also its last layer's queries, attention and feed-forward, as
  `BertBackbone`'s `output_positions`); transformers' `BertForMaskedLM` has no such input:
  its head runs at every position and the loss ignores the unmasked ones (labels -100).
  `forward`: logits at every position for all three (keras-hub is given every position as
  `mask_positions`).
- T5 v1.0 style: width 256, 4 heads of 64, ReLU feed-forward 1024, 4 + 4 layers,
  vocabulary 8192 (kzoo `t5_small` resized, keras-hub `T5Seq2SeqLM`, transformers
  `T5ForConditionalGeneration.generate`): `decode` as for GPT, from encoder inputs of 32.

Every measurement warms up first (compilation excluded; `generate` twice, `DECODE_WARMUP`,
since kzoo's torch loop compiles its decode step at a shape's second call) and takes the
median of its timed calls. Keras models use `model.compile` defaults (`jit_compile="auto"`:
XLA on JAX, eager torch, and on TensorFlow XLA only where an accelerator exists: none on a
CPU-only machine, where kzoo's models still predict with XLA, see `FunctionalModel.xla_prediction`)
with each library's default loss (kzoo's token models:
`kzoo.losses.TokenCrossentropy`, one autograd function on torch and Keras' op
elsewhere; keras-hub: Keras' `SparseCategoricalCrossentropy(from_logits=True)`),
`train_on_batch`, `predict_on_batch` and each library's `generate`; transformers runs a
plain eager loop with `torch.optim.AdamW` and its models' own loss.

Matmul floor: each kzoo worker (and transformers', for torch) also times the step's matmuls
alone (`gemm_shapes`: fused q/k/v, output projection, feed-forward, the two attention products,
the head; the backward pass's two products per matmul for `train`) on its backend's own kernels
(one `jax.jit` / `tf.function` program, eager torch). No implementation on that backend can
run a step faster than its matmuls, so `floor / transformers` bounds the kzoo/transformers
ratio reachable there; `kzoo / floor` says how much of the step is matmul time. For decode,
the floor is a loop of `new_tokens` steps of just one decode step's matmuls (`decode_shapes`:
the projections, the attention products over the cache, the head), each weight its own array,
compiled as kzoo's loop is (`decode_loop`): at 4 rows a step these products stream every
weight from memory, so the floor is the rate at which this machine reads them, and
`floor / keras-hub` bounds the kzoo/keras-hub ratio of a float32 decode on that backend (on
JAX and TensorFlow; torch's floor loop is eager, one Python call a product, and kzoo's
compiled torch step, `kzoo.layers.compiled_decode`, runs above it).

Training memory, two figures of each training row (Linux /proc; the high-water mark is
reset through /proc/self/clear_refs): `train_peak_mib`, the resident set's high-water mark
over the training calls (warm-up and compilation included) minus the resident set before
them: the activations, gradients, optimizer state and compiler buffers that training adds to
a process holding the model; and `model_peak_mib`, the high-water mark from the moment the
worker's libraries were imported (and its data made) to the end of the training calls, minus
the resident set at that moment: the model's weights, its building, and its training. The
first flatters a process whose allocator kept the memory of building the model (training
reuses it: kzoo's, below); the second counts that memory too.

Allocator: `import kzoo` sets glibc's malloc to keep freed memory for reuse (`kzoo.allocator`,
its default; on JAX it also runs XLA's CPU programs inline), so kzoo's workers run with it and
the peers' with glibc's defaults. `--same-allocator` gives keras-hub's and transformers'
workers the same settings (`kzoo.allocator.keep_freed_memory`, loaded without the rest of
kzoo), to show how much of a difference is the allocator's.

Training utilisation: each training row's model FLOPs per token (matmuls only: 2 x
multiply-adds forward, 3x that for forward + backward; attention counted over all keys, the
PaLM convention, embedding lookups not counted) times tokens/s, as GFLOP/s and as a fraction
of this machine's float32 matmul peak, measured in the same run: the best of the square
matmuls (`--matmul`, 2048) that every worker times on its own backend.

The report opens with the machine (`machine_line`: CPU model and family, logical CPUs,
last-level cache, AVX-512, the packages' versions; `--json` keeps it as "machine"): the same
code measured JAX GPT training at 1.21x transformers on one 2-core AMD EPYC and 2.06x on the next
generation, whose XLA products ran twice as fast while torch's did not.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("gpt", "bert", "t5")
METRICS = {"gpt": ("train", "forward", "decode"), "bert": ("train", "forward"),
           "t5": ("decode",)}
UNITS = {"train": "tokens/s", "forward": "tokens/s", "decode": "new tokens/s"}
BACKENDS = ("jax", "torch", "tensorflow")
LIBRARIES = ("kzoo", "keras-hub", "transformers")

SIZES = {
    "full": dict(vocab=8192, layers=4, width=256, heads=4, ff=1024, batch=8, seq=256,
                 prompts=4, prompt_len=32, new_tokens=128, matmul=2048,
                 warmup=2, steps=10, decode_calls=3),
    "quick": dict(vocab=512, layers=2, width=64, heads=2, ff=256, batch=2, seq=32,
                  prompts=2, prompt_len=8, new_tokens=8, matmul=512,
                  warmup=1, steps=3, decode_calls=1),
}
RESULT_MARK = "PEERS_RESULT "
# Untimed `generate` calls before the timed ones, every system alike: kzoo's torch loop
# compiles its step at a shape's second call (`kzoo.layers.compiled_decode`, "auto").
DECODE_WARMUP = 2


# === Results: medians, ratios, FLOPs and the tables (no framework imported here) ===


def system_key(library, backend):
    return f"{library}/{backend}"


def rotation(order, r):
    """`order` rotated left by round `r`'s index: each round starts with another system."""
    shift = r % len(order)
    return order[shift:] + order[:shift]


def systems(backends):
    """The (library, backend) pairs to run: kzoo and keras-hub per backend, transformers once."""
    pairs = [(lib, b) for b in backends for lib in ("kzoo", "keras-hub")]
    return pairs + [("transformers", "torch")]


def median_results(rounds):
    """Per-round results `[{system: {model: {metric: value|None}, "matmul": value}}]` ->
    the same structure with each value the median over the rounds that measured it (None
    where no round did)."""
    out = {}
    for result in rounds:
        for system, per_system in result.items():
            slot = out.setdefault(system, {})
            for model, values in per_system.items():
                if isinstance(values, dict):
                    for metric, value in values.items():
                        slot.setdefault(model, {}).setdefault(metric, []).append(value)
                else:
                    slot.setdefault(model, []).append(values)

    def med(values):
        spread = _spread(values)
        return spread[0] if spread else None

    return {s: {m: ({k: med(v) for k, v in vals.items()} if isinstance(vals, dict) else med(vals))
                for m, vals in per.items()} for s, per in out.items()}


def ratio(a, b):
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def forward_flops_per_token(model, size):
    """Matmul FLOPs (2 x multiply-adds) of one token's forward pass at `size` (SIZES entry):
    attention over all `seq` keys; GPT's tied LM head, BERT's head transform and LM head."""
    d, ff, layers, seq, vocab = (size[k] for k in ("width", "ff", "layers", "seq", "vocab"))
    per_layer = 2 * (4 * d * d + 2 * d * ff) + 2 * 2 * seq * d
    if model == "gpt":
        return layers * per_layer + 2 * d * vocab
    if model == "bert":
        return layers * per_layer + 2 * d * d + 2 * d * vocab
    raise ValueError(f"`model` must be 'gpt' or 'bert' (trained here); got model={model!r}.")


def masked_count(size):
    """Masked positions a BERT row has in the benchmark's data (15% of `seq`, at least 1)."""
    return max(1, round(0.15 * size["seq"]))


def train_flops_per_token(model, size):
    """Forward + backward: three times the forward matmuls the loss needs. BERT's head
    (transform and LM head) and its last layer's query projection, attention, output
    projection and feed-forward count at the masked positions only: the loss reads no other
    logits, and nothing else reads the last layer's other rows (its keys and values count at
    every position). transformers computes them anyway; that work is not counted as
    useful."""
    if model == "bert":
        d, ff, seq, vocab = (size[k] for k in ("width", "ff", "seq", "vocab"))
        head = 2 * d * d + 2 * d * vocab
        last_rows = 2 * (2 * d * d + 2 * d * ff) + 2 * 2 * seq * d
        unused = 1 - masked_count(size) / seq
        return 3 * (forward_flops_per_token(model, size) - (head + last_rows) * unused)
    return 3 * forward_flops_per_token(model, size)


def gemm_shapes(model, size, train=False):
    """The matmuls of one step of `model` ("gpt" or "bert") at `size`, as `(batch, m, k, n)`
    (`batch` independent `(m, k) @ (k, n)` products): fused q/k/v and the output projection,
    the two feed-forward matmuls, the two attention products per head, and the head (GPT's
    tied LM head; BERT's transform and LM head). BERT's `train` step needs its head and its
    last layer at the masked positions only, but for the keys and values of every position
    (see `train_flops_per_token`). `train` adds the backward pass: each `A @ B -> C` also
    computes `dC @ B^T` and `A^T @ dC`.
    """
    d, ff, layers, t, vocab = (size[k] for k in ("width", "ff", "layers", "seq", "vocab"))
    b, h = size["batch"], size["heads"]
    rows, hd = b * t, d // h
    per_layer = [(1, rows, d, 3 * d), (1, rows, d, d), (1, rows, d, ff), (1, rows, ff, d),
                 (b * h, t, hd, t), (b * h, t, t, hd)]
    last = per_layer
    if model == "gpt":
        head = [(1, rows, d, vocab)]
    elif model == "bert":
        head_rows = b * masked_count(size) if train else rows
        head = [(1, head_rows, d, d), (1, head_rows, d, vocab)]
        if train:
            m = masked_count(size)
            last = [(1, rows, d, 2 * d), (1, b * m, d, d), (1, b * m, d, d), (1, b * m, d, ff),
                    (1, b * m, ff, d), (b * h, m, hd, t), (b * h, m, t, hd)]
    else:
        raise ValueError(f"`model` must be 'gpt' or 'bert' (trained here); got model={model!r}.")
    forward = per_layer * (layers - 1) + last + head
    if not train:
        return forward
    return forward + [(n, m, q, k) for n, m, k, q in forward] + [
        (n, k, m, q) for n, m, k, q in forward]


def decode_shapes(model, size):
    """The matmuls of one greedy decode step of `model` ("gpt" or "t5") at `size`, in the
    order they run, as `(batch, m, k, n)` (see `gemm_shapes`): the `prompts` rows through each
    layer's fused q/k/v projection, the two attention products per head over the cache
    (GPT: `prompt_len + new_tokens` slots, T5: `new_tokens`), the output projection (T5 then
    its cross-attention: query, the two products over the `prompt_len` encoder keys, output),
    the feed-forward; then the tied head. Every weight, and every cache slot, is read once a
    step."""
    d, ff, layers, vocab = (size[k] for k in ("width", "ff", "layers", "vocab"))
    rows, heads = size["prompts"], size["heads"]
    hd, bh = d // heads, size["prompts"] * heads

    def attend(keys):
        return [(bh, 1, hd, keys), (bh, 1, keys, hd)]

    if model == "gpt":
        self_attention = [(1, rows, d, 3 * d)] + attend(size["prompt_len"] + size["new_tokens"])
        cross = []
    elif model == "t5":
        self_attention = [(1, rows, d, 3 * d)] + attend(size["new_tokens"])
        cross = [(1, rows, d, d)] + attend(size["prompt_len"]) + [(1, rows, d, d)]
    else:
        raise ValueError(f"`model` must be 'gpt' or 't5' (decoded here); got model={model!r}.")
    layer = self_attention + [(1, rows, d, d)] + cross + [(1, rows, d, ff), (1, rows, ff, d)]
    return layer * layers + [(1, rows, d, vocab)]


def gemm_flops(shapes):
    return sum(2 * n * m * k * q for n, m, k, q in shapes)


def matmul_peak(medians):
    """(best GFLOP/s, {backend: GFLOP/s}) of the workers' matmuls."""
    per_backend = {}
    for system, per in medians.items():
        value = per.get("matmul")
        backend = system.split("/", 1)[1]
        if value is not None:
            per_backend[backend] = max(per_backend.get(backend, 0.0), value)
    return (max(per_backend.values()) if per_backend else None), per_backend


def comparison_rows(medians, backends, models):
    """Rows (model, metric, backend, kzoo, keras-hub, transformers, kzoo/transformers,
    kzoo/keras-hub); transformers (torch) is the same on every backend's row."""
    rows = []
    for model in models:
        for metric in METRICS[model]:
            hf = medians.get(system_key("transformers", "torch"), {}).get(model, {}).get(metric)
            for backend in backends:
                kz = medians.get(system_key("kzoo", backend), {}).get(model, {}).get(metric)
                kh = medians.get(system_key("keras-hub", backend), {}).get(model, {}).get(
                    metric)
                rows.append((model, metric, backend, kz, kh, hf, ratio(kz, hf), ratio(kz, kh)))
    return rows


def _spread(values):
    """(median, lowest, highest) of the values that are not None, or None."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def round_ratio_rows(per_round, backends, models):
    """Rows (model, metric, backend, kzoo/transformers, kzoo/keras-hub), each ratio taken
    round by round (a round's kzoo value over the same round's peer value, processes of one
    round minutes apart) and given as (median, lowest, highest) over the rounds, or None
    where no round measured both. Beside the table of medians, it says how far one run's
    ratios move: a target inside the range is one the run cannot decide."""
    hf_key = system_key("transformers", "torch")
    rows = []

    def value(result, key, model, metric):
        return result.get(key, {}).get(model, {}).get(metric)

    for model in models:
        for metric in METRICS[model]:
            for backend in backends:
                kz_key = system_key("kzoo", backend)
                kh_key = system_key("keras-hub", backend)
                rows.append((model, metric, backend,
                             _spread([ratio(value(r, kz_key, model, metric),
                                            value(r, hf_key, model, metric))
                                      for r in per_round]),
                             _spread([ratio(value(r, kz_key, model, metric),
                                            value(r, kh_key, model, metric))
                                      for r in per_round])))
    return rows


def _fmt_spread(spread):
    if spread is None:
        return "n/a"
    mid, low, high = spread
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


def floor_rows(medians, backends, models):
    """Rows (model, metric, backend, floor, kzoo, kzoo/floor, floor/transformers,
    floor/keras-hub): how close kzoo runs to a step (a decode loop) of nothing but its matmuls
    on that backend, and the largest kzoo/transformers and kzoo/keras-hub ratios such a step
    would allow."""
    rows = []
    hf = medians.get(system_key("transformers", "torch"), {})
    for model in models:
        for metric in METRICS[model]:
            for backend in backends:
                kz = medians.get(system_key("kzoo", backend), {}).get(model, {})
                floor = kz.get(f"{metric}_floor")
                if floor is None:
                    continue
                kh = medians.get(system_key("keras-hub", backend), {}).get(model, {})
                rows.append((model, metric, backend, floor, kz.get(metric),
                             ratio(kz.get(metric), floor),
                             ratio(floor, hf.get(model, {}).get(metric)),
                             ratio(floor, kh.get(metric))))
    return rows


def memory_rows(medians, backends, models, metric="train_peak_mib"):
    """Rows (model, backend, kzoo MiB, keras-hub MiB, transformers MiB, kzoo/transformers,
    kzoo/keras-hub) of a memory figure (`train_peak_mib` or `model_peak_mib`; lower is
    better)."""
    rows = []
    for model in models:
        if "train" not in METRICS[model]:
            continue
        hf = medians.get(system_key("transformers", "torch"), {}).get(model, {}).get(metric)
        for backend in backends:
            kz, kh = (medians.get(system_key(lib, backend), {}).get(model, {}).get(metric)
                      for lib in ("kzoo", "keras-hub"))
            if kz is None and kh is None:
                continue
            rows.append((model, backend, kz, kh, hf, ratio(kz, hf), ratio(kz, kh)))
    return rows


def utilisation_rows(medians, size, models, peak):
    """Rows (model, system, train tokens/s, GFLOP/s, fraction of `peak`) for trained models."""
    rows = []
    for model in models:
        if "train" not in METRICS[model]:
            continue
        flops = train_flops_per_token(model, size)
        for system, per in medians.items():
            tps = per.get(model, {}).get("train") if isinstance(per.get(model), dict) else None
            if tps is None:
                continue
            gflops = flops * tps / 1e9
            rows.append((model, system, tps, gflops, ratio(gflops, peak)))
    return rows


def allocator_note(same_allocator):
    """The report's line on malloc's settings in the workers (see the module docstring)."""
    if same_allocator:
        return ("every system ran with kzoo's allocator settings (--same-allocator: freed "
                "memory kept for reuse; on JAX, XLA's CPU programs inline)")
    return ("kzoo's processes keep freed memory for reuse (kzoo.allocator, kzoo's default); "
            "keras-hub's and transformers' run with glibc's default malloc (--same-allocator "
            "gives them kzoo's settings)")


def token_count_notes(medians, models, expected):
    """Notes for every system whose decode made other than `expected` new tokens (its rate
    would not compare like with like)."""
    notes = []
    for system, per in medians.items():
        for model in models:
            values = per.get(model)
            count = values.get("new_tokens") if isinstance(values, dict) else None
            if count is not None and count != expected:
                notes.append(f"{system} {model}: decoded {count:g} new tokens, "
                             f"not {expected}; its decode rate is not comparable.")
    return notes


# The packages whose versions a run depends on (read from their metadata, nothing imported).
VERSIONED = ("keras", "jax", "jaxlib", "torch", "tensorflow", "keras-hub", "transformers")


def machine(cpuinfo=None, versions=None):
    """What a run measured on, as a dict: the CPU (model name and, on x86, its family /
    model numbers, which tell processor generations apart when the model name does not),
    logical CPUs, its last-level cache (`cache`: "L3 32768K" from Linux' sysfs, else
    /proc/cpuinfo's "cache size"), whether AVX-512 is there, and the packages' versions.
    `cpuinfo`: the text of /proc/cpuinfo (read when None; "" where there is none; then the
    cache is looked up in sysfs only when `cpuinfo` was read here)."""
    import platform

    read_here = cpuinfo is None
    if read_here:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    first = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block describes them all
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    logical = sum(1 for line in cpuinfo.splitlines() if line.startswith("processor"))
    if versions is None:
        from importlib import metadata

        versions = {}
        for name in VERSIONED:
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    flags = first.get("flags", "").split()
    cache = _last_level_cache() if read_here else None
    if cache is None and first.get("cache size"):
        cache = first["cache size"]
    return {"cpu": first.get("model name") or platform.processor() or platform.machine(),
            "family": first.get("cpu family"), "model": first.get("model"),
            "logical_cpus": logical or os.cpu_count(), "cache": cache,
            "avx512": "avx512f" in flags if flags else None, "versions": versions}


def _last_level_cache(root="/sys/devices/system/cpu/cpu0/cache"):
    """"L<level> <size>" of CPU 0's highest-level data or unified cache (Linux sysfs), or
    None where sysfs does not say."""
    best = None
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size)
    return None if best is None else f"L{best[0]} {best[1]}"


def machine_line(info):
    """One line of `machine(...)` for the report's head."""
    cpu = info["cpu"]
    if info.get("family") is not None:
        cpu += f" (family {info['family']}, model {info['model']})"
    parts = [cpu, f"{info['logical_cpus']} logical CPUs"]
    if info.get("cache"):
        parts.append(f"cache {info['cache']}")
    if info.get("avx512") is not None:
        parts.append("AVX-512" if info["avx512"] else "no AVX-512")
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return "Machine: " + "; ".join(parts) + (f". Versions: {versions}." if versions else ".")


def _fmt(value, kind="num"):
    if value is None:
        return "n/a"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:#.3g}"


def format_table(header, rows, left=3):
    """A plain-text table: columns padded to their widest cell; the first `left` columns
    left-aligned, the others (numbers) right-aligned."""
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def report(medians, backends, models, size, rounds, notes=(), per_round=None):
    """The text the benchmark prints: the comparison table, the per-round ratios (with
    `per_round`, the rounds' results, when there are two rounds or more), then training
    utilisation, memory and the matmul floors."""
    rows = [(m, f"{metric} ({UNITS[metric]})", b, _fmt(kz), _fmt(kh), _fmt(hf),
             _fmt(r1, "ratio"), _fmt(r2, "ratio"))
            for m, metric, b, kz, kh, hf, r1, r2 in comparison_rows(medians, backends, models)]
    text = [f"Medians of {rounds} round(s); higher is better; ratios > 1: kzoo is faster.",
            format_table(("model", "metric", "backend", "kzoo", "keras-hub",
                          "transformers(torch)", "kzoo/transformers", "kzoo/keras-hub"),
                         rows)]
    if per_round is not None and len(per_round) >= 2:
        text.extend(["", f"Ratios round by round: each round's kzoo over the same round's peer, "
                     f"median (lowest-highest) of {len(per_round)} rounds; a target inside a "
                     "range is one this run cannot decide.",
                     format_table(("model", "metric", "backend", "kzoo/transformers",
                                   "kzoo/keras-hub"),
                                  [(m, metric, b, _fmt_spread(r1), _fmt_spread(r2))
                                   for m, metric, b, r1, r2 in round_ratio_rows(
                                       per_round, backends, models)], left=3)])
    peak, per_backend = matmul_peak(medians)
    util = utilisation_rows(medians, size, models, peak)
    if util:
        text.append("")
        text.append(f"Training utilisation: float32 matmul {size['matmul']}^2 peak "
                    + ", ".join(f"{b} {v:.1f}" for b, v in sorted(per_backend.items()))
                    + f" GFLOP/s; fraction of the best ({_fmt(peak)} GFLOP/s).")
        text.append(format_table(
            ("model", "system", "train tokens/s", "GFLOP/s", "of peak"),
            [(m, s, _fmt(t), _fmt(g), _fmt(f, "pct")) for m, s, t, g, f in util], left=2))
    def section(title, header, rows, left):
        if rows:
            text.extend(["", title, format_table(header, rows, left=left)])

    for metric, title in (
            ("train_peak_mib", "Training memory: MiB the training calls added to the process' "
             "resident set at their peak (compilation included); lower is better, ratios < 1: "
             "kzoo uses less."),
            ("model_peak_mib", "Model and training memory: MiB above the process after its "
             "imports, at the peak of building the model and training it (weights, optimizer "
             "state, activations, compiler buffers, and what the allocator kept).")):
        section(title, ("model", "backend", "kzoo", "keras-hub", "transformers(torch)",
                        "kzoo/transformers", "kzoo/keras-hub"),
                [(m, b, _fmt(kz), _fmt(kh), _fmt(hf), _fmt(r1, "ratio"), _fmt(r2, "ratio"))
                 for m, b, kz, kh, hf, r1, r2 in memory_rows(medians, backends, models,
                                                             metric)], 2)
    section("Matmul floor: tokens/s of a step (new tokens/s of a decode loop) that ran only "
            "its matmuls (same shapes, the backend's own kernels, nothing else); "
            "'floor/transformers' and 'floor/keras-hub' are the largest kzoo/transformers and "
            "kzoo/keras-hub ratios any float32 implementation on that backend could reach.",
            ("model", "metric", "backend", "floor", "kzoo", "kzoo/floor",
             "floor/transformers", "floor/keras-hub"),
            [(m, k, b, _fmt(f), _fmt(kz), _fmt(r1, "pct"), _fmt(r2, "ratio"), _fmt(r3, "ratio"))
             for m, k, b, f, kz, r1, r2, r3 in floor_rows(medians, backends, models)], 3)
    if notes:
        text.append("")
        text.extend(f"note: {n}" for n in notes)
    return "\n".join(text)


# === Workers: one system, in its own process ===


def _median_time(fn, calls, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_new_tokens(out):
    """New tokens in what a `generate` returned: a list of per-row lists, or an array."""
    if hasattr(out, "shape"):
        size = 1
        for n in out.shape:
            size *= int(n)
        return size
    return sum(len(row) for row in out)


def _data(size, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    b, t, v = size["batch"], size["seq"], size["vocab"]
    tokens = rng.integers(2, v, (b, t + 1)).astype("int32")
    masked = np.zeros((b, t), bool)
    count = masked_count(size)
    for row in masked:
        row[rng.choice(t, count, replace=False)] = True
    mlm_inputs = np.where(masked, v - 1, tokens[:, :t]).astype("int32")  # id v-1: [MASK]
    prompts = rng.integers(2, v, (size["prompts"], size["prompt_len"])).astype("int32")
    mask_positions = np.stack([np.flatnonzero(row) for row in masked]).astype("int32")
    return dict(tokens=tokens, masked=masked, mlm_inputs=mlm_inputs, mlm_targets=tokens[:, :t],
                prompts=prompts, mask_positions=mask_positions,
                masked_targets=np.take_along_axis(tokens[:, :t], mask_positions, axis=1))


def _keras_matmul(backend, n):
    import numpy as np

    a = np.random.default_rng(0).normal(size=(n, n)).astype("float32")
    if backend == "jax":
        import jax

        x = jax.numpy.asarray(a)
        f = jax.jit(lambda p, q: p @ q)
        run = lambda: f(x, x).block_until_ready()  # noqa: E731
    elif backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(a)
        f = tf.function(lambda p, q: tf.linalg.matmul(p, q), jit_compile=True)
        run = lambda: f(x, x)[0, 0].numpy()  # noqa: E731
    else:
        return _torch_matmul(n)
    return 2 * n ** 3 / _median_time(run, 3, 1) / 1e9


def _torch_matmul(n):
    import torch

    x = torch.randn(n, n)
    return 2 * n ** 3 / _median_time(lambda: torch.mm(x, x), 3, 1) / 1e9


def _gemm_seconds(backend, shapes, calls=5):
    """Median seconds of running just `shapes`' matmuls (see `gemm_shapes`), one after the
    other, on `backend`'s own kernels: one `jax.jit` / `tf.function` program, or eager torch
    (no autograd). The floor under a step that does these matmuls and nothing else."""
    import numpy as np

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(n, m, k)[n == 1:]).astype("float32"),  # 2-D when n == 1
              rng.normal(size=(n, k, q)[n == 1:]).astype("float32")) for n, m, k, q in shapes]
    if backend == "jax":
        import jax

        f = jax.jit(lambda ps: [a @ b for a, b in ps])
        args = [(jax.numpy.asarray(a), jax.numpy.asarray(b)) for a, b in pairs]
        run = lambda: jax.block_until_ready(f(args))  # noqa: E731
    elif backend == "tensorflow":
        import tensorflow as tf

        args = [(tf.constant(a), tf.constant(b)) for a, b in pairs]
        f = tf.function(lambda ps: [tf.linalg.matmul(a, b) for a, b in ps])
        run = lambda: [tf.reshape(o, [-1])[0].numpy() for o in f(args)]  # noqa: E731
    else:
        import torch

        args = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in pairs]

        def run():
            with torch.no_grad():
                return [torch.matmul(a, b) for a, b in args]

    return _median_time(run, calls, 1)


def _fit(x, count, concat):
    """The first `count` values of the flat `x`, repeated as often as needed."""
    size = x.shape[0]
    if size < count:
        x = concat([x] * -(-count // size))
    return x[:count]


def decode_loop(backend, shapes, steps, weights, start):
    """A function running `steps` decode steps that do only `shapes`' matmuls (see
    `decode_shapes`) with `weights` (NumPy, one per shape: `(k, n)`, or `(batch, k, n)`), one
    after the other, and returning the flat NumPy values the last step ends with. Each
    product's left operand is made from the output of the one before it (the first of a step
    from the flat `start`, then from the step before), its values taken in order and repeated
    as often as needed (`_fit`), so nothing can be hoisted out of the loop or run ahead; each
    weight is its own array, read from memory every step. The loop as kzoo's decode runs it:
    one compiled `while_loop` (JAX; TensorFlow under XLA), eager torch without autograd."""

    import numpy as np

    def step(x, ws, concat, reshape):
        for (n, m, k, _), w in zip(shapes, ws):
            x = reshape(reshape(_fit(x, n * m * k, concat), (n, m, k)[n == 1:]) @ w, (-1,))
        return _fit(x, start.shape[0], concat)

    if backend == "jax":
        import jax

        jnp = jax.numpy
        f = jax.jit(lambda x, ws: jax.lax.fori_loop(
            0, steps, lambda i, y: step(y, ws, jnp.concatenate, jnp.reshape), x))
        args = (jnp.asarray(start), [jnp.asarray(w) for w in weights])
        return lambda: np.asarray(f(*args))
    if backend == "tensorflow":
        import tensorflow as tf

        def concat(xs):
            return tf.concat(xs, 0)

        @tf.function(jit_compile=True)
        def f(x, ws):
            return tf.while_loop(lambda i, y: i < steps,
                                 lambda i, y: (i + 1, step(y, ws, concat, tf.reshape)),
                                 (tf.constant(0), x))[1]

        args = (tf.constant(start), [tf.constant(w) for w in weights])
        return lambda: f(*args).numpy()
    import torch

    class FewRows:
        """A `(k, n)` weight that 2 to 4 rows multiply as `(W^T x^T)^T` with a row-major
        copy of `W^T`: MKL's fast path for them, as kzoo's torch loop takes it (see
        `kzoo.layers.fast_decode._few_rows`)."""

        def __init__(self, w):
            self.t = torch.from_numpy(np.ascontiguousarray(w.T))

        def __rmatmul__(self, a):
            return torch.mm(self.t, a.t()).t()

    def torch_weight(shape, w):
        n, m = shape[:2]
        return FewRows(w) if n == 1 and 2 <= m <= 4 else torch.from_numpy(w)

    args = (torch.from_numpy(start), [torch_weight(s, w) for s, w in zip(shapes, weights)])

    def run():
        with torch.no_grad():
            x = args[0]
            for _ in range(steps):
                x = step(x, args[1], torch.cat, torch.reshape)
            return x.numpy()

    return run


def _decode_seconds(backend, shapes, steps, calls=3):
    """Median seconds of `decode_loop` over `shapes` for `steps` steps, with random weights
    scaled by `1 / sqrt(k)` (the values stay finite)."""
    import numpy as np

    rng = np.random.default_rng(0)
    weights = [(rng.normal(size=(n, k, q)[n == 1:]) / np.sqrt(k)).astype("float32")
               for n, m, k, q in shapes]
    start = rng.normal(size=shapes[0][1] * shapes[0][2]).astype("float32")
    return _median_time(decode_loop(backend, shapes, steps, weights, start), calls, 1)


def _gemm_floors(backend, models, size):
    """{model: {"train_floor", "forward_floor"} or {"decode_floor"}}: tokens/s of a step that
    did only its matmuls, on `backend` (see `gemm_shapes`), and new tokens/s of a decode loop
    of only its matmuls (see `decode_shapes`)."""
    tokens = size["batch"] * size["seq"]
    out = {}
    for model in models:
        if "train" in METRICS[model]:
            out[model] = {
                f"{kind}_floor": tokens / _gemm_seconds(backend, gemm_shapes(
                    model, size, train=kind == "train")) for kind in ("train", "forward")}
        if "decode" in METRICS[model]:
            out.setdefault(model, {})["decode_floor"] = (
                size["prompts"] * size["new_tokens"]
                / _decode_seconds(backend, decode_shapes(model, size), size["new_tokens"]))
    return out


def _keras_optimizer():
    import keras

    return keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=0.01)


def _memory_mib():
    """(resident set, its high-water mark) of this process, MiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in f
               if line.startswith(("VmRSS", "VmHWM"))}
    return kib["VmRSS"] / 1024, kib["VmHWM"] / 1024


def _reset_high_water_mark():
    try:
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark := now
            f.write("5")
    except OSError:
        pass


# The resident set (MiB) after the worker's imports and data, its high-water mark reset
# there (`mark_baseline`): the zero of `model_peak_mib`.
_BASELINE = {}


def mark_baseline():
    """Reset the high-water mark and take the resident set as the zero of `model_peak_mib`."""
    _reset_high_water_mark()
    _BASELINE["mib"] = _memory_mib()[0]


def _timed_training(step, size):
    """(median seconds of `step`, training peak MiB, model peak MiB or None).
    Training peak: the resident set's high-water mark over all the training calls (warm-up
    and compilation included) above the resident set before the first, i.e. what training
    adds to a process holding the model. Model peak (after `mark_baseline`, else None): the
    high-water mark from the baseline to the end of the calls, above the baseline."""
    _, before_training = _memory_mib()  # the building's peak, since the baseline
    _reset_high_water_mark()
    before, _ = _memory_mib()
    seconds = _median_time(step, size["steps"], size["warmup"])
    peak = _memory_mib()[1]
    model = (max(peak, before_training) - _BASELINE["mib"]) if "mib" in _BASELINE else None
    return seconds, peak - before, model


def _keras_train_forward(model, x, y, w, size, forward_x=None):
    """{"train": tokens/s, "train_peak_mib", "forward": tokens/s} of a compiled Keras model:
    `train_on_batch(x, y, sample_weight=w)`, then `predict_on_batch(forward_x)` (default
    `x`)."""
    tokens = size["batch"] * size["seq"]
    step, peak, model_peak = _timed_training(
        lambda: model.train_on_batch(x, y, sample_weight=w), size)
    forward_x = x if forward_x is None else forward_x
    fwd = _median_time(lambda: model.predict_on_batch(forward_x), size["steps"],
                       size["warmup"])
    return {"train": tokens / step, "train_peak_mib": peak, "model_peak_mib": model_peak,
            "forward": tokens / fwd}


def _kzoo_worker(models, size, data):
    import kzoo.presets

    shape = dict(num_layers=size["layers"], num_heads=size["heads"], hidden_dim=size["width"],
                 intermediate_dim=size["ff"], vocabulary_size=size["vocab"])
    t, results = size["seq"], {}
    if "gpt" in models:
        model = kzoo.presets.load("gpt_mini", dropout=0.0, max_sequence_length=max(
            t, size["prompt_len"] + size["new_tokens"]), **shape)
        model.compile(optimizer=_keras_optimizer())  # kzoo's default loss
        x = {"token_ids": data["tokens"][:, :t], "padding_mask": data["tokens"][:, :t] >= 0}
        rates = _keras_train_forward(model, x, data["tokens"][:, 1:], None, size)
        prompts = data["prompts"].tolist()
        new = {}

        def decode():
            out = model.generate(prompts, max_new_tokens=size["new_tokens"], strategy="greedy",
                                 stop_token_ids=None)
            new["n"] = count_new_tokens(out)

        seconds = _median_time(decode, size["decode_calls"], DECODE_WARMUP)
        results["gpt"] = dict(**rates, decode=new["n"] / seconds, new_tokens=new["n"])
    if "bert" in models:
        model = kzoo.presets.load("bert_tiny_uncased", dropout=0.0, attention_dropout=0.0,
                                  max_sequence_length=t, **shape)
        model.compile(optimizer=_keras_optimizer())  # kzoo's default loss
        x = {"token_ids": data["mlm_inputs"], "segment_ids": 0 * data["mlm_inputs"],
             "padding_mask": data["mlm_inputs"] >= 0}
        train_x = {**x, "mask_positions": data["mask_positions"]}
        results["bert"] = _keras_train_forward(model, train_x, data["masked_targets"], None,
                                               size, forward_x=x)
    if "t5" in models:
        model = kzoo.presets.load(
            "t5_small", dropout=0.0, num_decoder_layers=size["layers"],
            key_value_dim=size["width"] // size["heads"], **shape)
        new = {}

        def decode():
            out = model.generate(data["prompts"], max_new_tokens=size["new_tokens"],
                                 strategy="greedy", stop_token_ids=None)
            new["n"] = count_new_tokens(out)

        seconds = _median_time(decode, size["decode_calls"], DECODE_WARMUP)
        results["t5"] = dict(decode=new["n"] / seconds, new_tokens=new["n"])
    return results


def _keras_hub_worker(models, size, data):
    import keras
    import keras_hub
    import numpy as np

    shape = dict(num_layers=size["layers"], num_heads=size["heads"], hidden_dim=size["width"],
                 intermediate_dim=size["ff"], vocabulary_size=size["vocab"])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    t, results = size["seq"], {}
    b, p, n = size["prompts"], size["prompt_len"], size["new_tokens"]
    if "gpt" in models:
        backbone = keras_hub.models.GPT2Backbone(
            dropout=0.0, max_sequence_length=max(t, p + n), **shape)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=_keras_optimizer(), loss=loss, weighted_metrics=None,
                      sampler="greedy")
        x = {"token_ids": data["tokens"][:, :t], "padding_mask": data["tokens"][:, :t] >= 0}
        rates = _keras_train_forward(model, x, data["tokens"][:, 1:], None, size)
        ids = np.zeros((b, p + n), "int32")
        ids[:, :p] = data["prompts"]
        inputs = {"token_ids": ids, "padding_mask": np.arange(p + n)[None].repeat(b, 0) < p}
        new = {}

        def decode():
            out = model.generate(inputs, stop_token_ids=None)
            new["n"] = int(np.sum(np.asarray(out["padding_mask"]))) - b * p

        seconds = _median_time(decode, size["decode_calls"], DECODE_WARMUP)
        results["gpt"] = dict(**rates, decode=new["n"] / seconds, new_tokens=new["n"])
    if "bert" in models:
        backbone = keras_hub.models.BertBackbone(dropout=0.0, max_sequence_length=t, **shape)
        model = keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=_keras_optimizer(), loss=loss, weighted_metrics=None)
        x = {"token_ids": data["mlm_inputs"], "segment_ids": 0 * data["mlm_inputs"],
             "padding_mask": data["mlm_inputs"] >= 0}
        every = np.arange(t, dtype="int32")[None].repeat(size["batch"], 0)
        results["bert"] = _keras_train_forward(
            model, {**x, "mask_positions": data["mask_positions"]}, data["masked_targets"],
            None, size, forward_x={**x, "mask_positions": every})
    if "t5" in models:
        if not hasattr(keras_hub.models, "T5Seq2SeqLM"):
            results["t5"] = dict(decode=None, note="keras-hub has no T5 generate")
        else:
            backbone = keras_hub.models.T5Backbone(
                dropout=0.0, key_value_dim=size["width"] // size["heads"], activation="relu",
                use_gated_activation=False, tie_embedding_weights=True, **shape)
            model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
            model.compile(sampler="greedy")
            inputs = {
                "encoder_token_ids": data["prompts"],
                "encoder_padding_mask": np.ones(data["prompts"].shape, bool),
                "decoder_token_ids": np.zeros((b, n + 1), "int32"),  # start token 0 first
                "decoder_padding_mask": np.arange(n + 1)[None].repeat(b, 0) < 1,
            }
            new = {}

            def decode():
                out = model.generate(inputs, stop_token_ids=None)
                new["n"] = int(np.sum(np.asarray(out["decoder_padding_mask"]))) - b

            seconds = _median_time(decode, size["decode_calls"], DECODE_WARMUP)
            results["t5"] = dict(decode=new["n"] / seconds, new_tokens=new["n"])
    return results


def _transformers_worker(models, size, data):
    import torch
    import transformers

    torch.manual_seed(0)
    t, results = size["seq"], {}
    b, p, n = size["prompts"], size["prompt_len"], size["new_tokens"]
    tokens_per_batch = size["batch"] * t

    def train_forward(model, inputs, labels):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            model(**inputs, labels=labels).loss.backward()
            opt.step()

        model.train()
        train, peak, model_peak = _timed_training(step, size)
        model.eval()

        def forward():
            with torch.no_grad():
                model(**inputs).logits

        fwd = _median_time(forward, size["steps"], size["warmup"])
        return {"train": tokens_per_batch / train, "train_peak_mib": peak,
                "model_peak_mib": model_peak, "forward": tokens_per_batch / fwd}

    def decode_rate(model, inputs, prompt_width):
        model.eval()
        model.generation_config.eos_token_id = None  # every row makes all n tokens
        new = {}

        def decode():
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=n,
                                     do_sample=False, num_beams=1, pad_token_id=0)
            new["n"] = (out.shape[1] - prompt_width) * out.shape[0]

        return new, _median_time(decode, size["decode_calls"], DECODE_WARMUP)

    if "gpt" in models:
        config = transformers.GPT2Config(
            vocab_size=size["vocab"], n_positions=max(t, p + n), n_embd=size["width"],
            n_layer=size["layers"], n_head=size["heads"], n_inner=size["ff"],
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.as_tensor(data["tokens"][:, :t], dtype=torch.long)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        rates = train_forward(model, inputs, ids)
        prompts = torch.as_tensor(data["prompts"], dtype=torch.long)
        new, seconds = decode_rate(
            model, {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}, p)
        results["gpt"] = dict(**rates, decode=new["n"] / seconds, new_tokens=new["n"])
    if "bert" in models:
        config = transformers.BertConfig(
            vocab_size=size["vocab"], hidden_size=size["width"],
            num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
            intermediate_size=size["ff"], hidden_act="gelu", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, max_position_embeddings=t, type_vocab_size=2)
        model = transformers.BertForMaskedLM(config)
        ids = torch.as_tensor(data["mlm_inputs"], dtype=torch.long)
        labels = torch.as_tensor(data["mlm_targets"], dtype=torch.long)
        labels = torch.where(torch.as_tensor(data["masked"]), labels, -100)
        inputs = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
                  "attention_mask": torch.ones_like(ids)}
        results["bert"] = train_forward(model, inputs, labels)
    if "t5" in models:
        config = transformers.T5Config(
            vocab_size=size["vocab"], d_model=size["width"], d_kv=size["width"] // size["heads"],
            d_ff=size["ff"], num_layers=size["layers"], num_decoder_layers=size["layers"],
            num_heads=size["heads"], dropout_rate=0.0, feed_forward_proj="relu",
            tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config)
        prompts = torch.as_tensor(data["prompts"], dtype=torch.long)
        new, seconds = decode_rate(
            model, {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}, 1)
        results["t5"] = dict(decode=new["n"] / seconds, new_tokens=new["n"])
    return results


def use_kzoo_allocator():
    """A peer's worker with kzoo's allocator settings (`--same-allocator`): the module
    `kzoo/allocator.py` loaded alone (no `import kzoo`), its `keep_freed_memory()`, and on JAX
    XLA's CPU programs run inline, as `import kzoo` does. Returns whether malloc took them."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "_kzoo_allocator_alone", os.path.join(root, "kzoo", "allocator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if os.environ.get("KERAS_BACKEND") == "jax":
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    return module.keep_freed_memory()


# The classes the workers build, by library: touched before the memory baseline so that their
# modules' lazy imports (transformers', keras-hub's) are not counted as the model's memory.
_WORKER_CLASSES = {
    "kzoo": ("kzoo.presets", ()),
    "keras-hub": ("keras_hub", ("models.GPT2CausalLM", "models.GPT2Backbone",
                                "models.BertMaskedLM", "models.BertBackbone",
                                "models.T5Seq2SeqLM", "models.T5Backbone")),
    "transformers": ("transformers", (
        "GPT2Config", "GPT2LMHeadModel", "BertConfig", "BertForMaskedLM", "T5Config",
        "T5ForConditionalGeneration")),
}


def import_libraries(library):
    """Import what `library`'s worker uses, down to the classes it builds (those a library
    lacks are skipped: its worker says so)."""
    import importlib

    if library == "transformers":
        import torch  # noqa: F401
    else:
        import keras  # noqa: F401
    name, attributes = _WORKER_CLASSES[library]
    module = importlib.import_module(name)
    for path in attributes:
        target = module
        for part in path.split("."):
            target = getattr(target, part, None)
            if target is None:
                break


def run_worker(library, models, size, same_allocator=False):
    """Measure one system in this process; return {model: {metric: value}, "matmul": GFLOP/s}.
    `same_allocator`: a peer (not kzoo) runs with kzoo's allocator settings."""
    import warnings

    warnings.filterwarnings("ignore")
    if same_allocator and library != "kzoo":
        use_kzoo_allocator()
    data = _data(size)
    import_libraries(library)
    mark_baseline()
    if library == "transformers":
        results = _transformers_worker(models, size, data)
        results["matmul"] = _torch_matmul(size["matmul"])
        backend = "torch"
    else:
        import keras

        keras.utils.set_random_seed(0)
        worker = _kzoo_worker if library == "kzoo" else _keras_hub_worker
        results = worker(models, size, data)
        backend = keras.backend.backend()
        results["matmul"] = _keras_matmul(backend, size["matmul"])
    if library != "keras-hub":  # one floor per backend: kzoo's workers and transformers'
        for model, floors in _gemm_floors(backend, models, size).items():
            results.setdefault(model, {}).update(floors)
    return results


# === Driver ===


def _quiet_env(backend):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", GRPC_VERBOSITY="ERROR",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", USE_TF="0",
               USE_FLAX="0", TOKENIZERS_PARALLELISM="false")
    return env


def run_system(library, backend, models, size_name, timeout, same_allocator=False):
    """One system in a fresh process: (results, error message or None)."""
    return run_worker_process(
        ["benchmarks.peers", "--worker", library, "--size", size_name, "--only",
         ",".join(models)] + (["--same-allocator"] if same_allocator else []), backend,
        timeout)


def run_worker_process(module_args, backend, timeout):
    """`python -m *module_args` in a fresh process with KERAS_BACKEND=`backend`: (the JSON
    after its last RESULT_MARK line, None), or ({}, what went wrong: the timeout, or the
    exit code and the last lines of its output)."""
    cmd = [sys.executable, "-m", *module_args]
    try:
        proc = subprocess.run(cmd, env=_quiet_env(backend), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"timed out after {timeout} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):]), None
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return {}, f"exit {proc.returncode}: " + " | ".join(tail)


def run_rounds(order, models, rounds, size_name, timeout, same_allocator=False):
    """Every (library, backend) of `order` on every model, a fresh process each, `rounds`
    times, interleaved (`rotation`): (per-round results for `median_results`, notes). A
    system's round result merges its models' processes; its "matmul" is the best of them."""
    per_round, notes = [], []
    for r in range(rounds):
        result = {}
        for library, backend in rotation(order, r):
            key = system_key(library, backend)
            merged = result.setdefault(key, {})
            for model in rotation(list(models), r):
                start = time.perf_counter()
                values, error = run_system(library, backend, [model], size_name, timeout,
                                           same_allocator)
                print(f"round {r + 1}/{rounds} {key} {model}: "
                      f"{time.perf_counter() - start:.0f} s"
                      + (f" FAILED ({error})" if error else ""), file=sys.stderr, flush=True)
                if error:
                    notes.append(f"{key} {model}, round {r + 1}: {error}")
                for name, vals in values.items():
                    if isinstance(vals, dict):
                        if "note" in vals:
                            note = f"{key} {name}: {vals.pop('note')}"
                            if note not in notes:
                                notes.append(note)
                        merged.setdefault(name, {}).update(vals)
                    elif vals is not None:
                        merged[name] = max(vals, merged.get(name) or vals)
        per_round.append(result)
    return per_round, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 1 round: a smoke test of a couple of minutes")
    parser.add_argument("--rounds", type=int, default=None,
                        help="processes per system, interleaved (default 3; --quick: 1)")
    parser.add_argument("--only", default=",".join(MODELS), help="models, e.g. gpt,bert")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="Keras backends for kzoo and keras-hub")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    parser.add_argument("--json", default=None, help="also write the medians to this file")
    parser.add_argument("--same-allocator", action="store_true",
                        help="run keras-hub and transformers with kzoo's allocator settings "
                             "too (kzoo.allocator; by default only kzoo's processes have them)")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    models = [m.strip() for m in args.only.split(",") if m.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for name, values, allowed in (("--only", models, MODELS), ("--backends", backends, BACKENDS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"{name} must name some of {list(allowed)}; got {bad or values}.")
    if args.worker:
        results = run_worker(args.worker, models, SIZES[args.size], args.same_allocator)
        print(RESULT_MARK + json.dumps(results), flush=True)
        return

    size_name = "quick" if args.quick else args.size
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        parser.error(f"--rounds must be >= 1; got {rounds}.")
    per_round, notes = run_rounds(systems(backends), models, rounds, size_name, args.timeout,
                                  args.same_allocator)
    medians = median_results(per_round)
    size = SIZES[size_name]
    notes += token_count_notes(medians, models, size["prompts"] * size["new_tokens"])
    notes.append(allocator_note(args.same_allocator))
    info = machine()
    print(machine_line(info))
    print(report(medians, backends, models, size, rounds, notes, per_round))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "rounds": rounds, "machine": info, "medians": medians,
                       "per_round": per_round}, f, indent=1)


if __name__ == "__main__":
    main()
