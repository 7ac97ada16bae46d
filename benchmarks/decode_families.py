"""Greedy decoding of today's decoder kinds beside their peers: Llama, Mistral (sliding
window), Mixtral (mixture of experts) and T5 v1.1, kzoo on each Keras backend against
keras-hub (each backend) and Hugging Face transformers (torch, eager).

Run (from the repository root):

    python -m benchmarks.decode_families                  # 3 rounds, 4 kinds, 3 backends
    python -m benchmarks.decode_families --quick          # tiny sizes, 1 round: a smoke test
    python -m benchmarks.decode_families --only llama,mixtral --backends torch --rounds 5

`benchmarks/peers.py` measures the issue's GPT-2, BERT and T5 v1.0 models; this script the
other kinds kzoo's presets have (`gpt_modern_mini`, `gpt_long_mini`, `gpt_moe_mini`,
`t5_v1_1_small`), at the same width: vocabulary 8192, 4 layers, width 256, 4 query heads
(2 key/value heads for the GPTs), RMSNorm, rotary positions, SwiGLU feed-forward 704, untied
head; Mistral's window 64 (shorter than the 160 positions decoded, so the window binds);
Mixtral's 8 experts of 704, top 2; T5 v1.1: 4 + 4 layers, gated-GELU feed-forward 1024,
untied head. Random initialisation, float32, no dropout. Each system greedily decodes 128
new tokens for 4 prompts of 32 tokens (stop tokens disabled: every row makes all 128) with
its own `generate`: kzoo's, keras-hub's `*CausalLM` / `T5Seq2SeqLM` (`sampler="greedy"`),
transformers' `LlamaForCausalLM`, `MistralForCausalLM`, `MixtralForCausalLM`,
`T5ForConditionalGeneration`. Every system runs in a fresh process, one per system per
round, the systems' order rotating each round; `generate` is called `DECODE_WARMUP` times
untimed first (kzoo's torch loop compiles its step at a shape's second call,
`kzoo.layers.compiled_decode`), then the median of the timed calls is taken; the table gives
the median over the rounds of new tokens per second, and the ratios.
"""

import argparse
import json
import sys

from benchmarks.peers import (
    BACKENDS,
    DECODE_WARMUP,
    RESULT_MARK,
    _median_time,
    count_new_tokens,
    median_results,
    rotation,
    run_worker_process,
)

KINDS = ("llama", "mistral", "mixtral", "t5_v1_1")
LIBRARIES = ("kzoo", "keras-hub", "transformers")
SIZES = {
    "full": dict(vocab=8192, layers=4, width=256, heads=4, kv_heads=2, ff=704, t5_ff=1024,
                 experts=8, top_k=2, window=64, prompts=4, prompt_len=32, new_tokens=128,
                 decode_calls=3),
    "quick": dict(vocab=512, layers=2, width=64, heads=2, kv_heads=1, ff=128, t5_ff=128,
                  experts=4, top_k=2, window=8, prompts=2, prompt_len=8, new_tokens=16,
                  decode_calls=1),
}


def _prompts(size, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(2, size["vocab"], (size["prompts"], size["prompt_len"])).astype("int32")


def _rate(generate, size):
    """New tokens/s of `generate() -> count of new tokens` (warm-up calls first)."""
    new = {}

    def call():
        new["n"] = generate()

    seconds = _median_time(call, size["decode_calls"], DECODE_WARMUP)
    return new["n"] / seconds


# === Workers (one system in this process) ===


def kzoo_model(kind, size):
    """(model, prompts as `generate` takes them) of kzoo's `kind` at `size`: the preset of that
    kind resized."""
    import kzoo.presets

    prompts = _prompts(size)
    if kind == "t5_v1_1":
        return kzoo.presets.load(
            "t5_v1_1_small", dropout=0.0, num_layers=size["layers"],
            num_decoder_layers=size["layers"], num_heads=size["heads"],
            hidden_dim=size["width"], key_value_dim=size["width"] // size["heads"],
            intermediate_dim=size["t5_ff"], vocabulary_size=size["vocab"]), prompts
    presets = {"llama": ("gpt_modern_mini", {}),
               "mistral": ("gpt_long_mini", dict(window=size["window"])),
               "mixtral": ("gpt_moe_mini", dict(num_experts=size["experts"],
                                                top_k=size["top_k"]))}
    name, extra = presets[kind]
    model = kzoo.presets.load(
        name, num_layers=size["layers"], num_heads=size["heads"], hidden_dim=size["width"],
        intermediate_dim=size["ff"], vocabulary_size=size["vocab"],
        num_kv_heads=size["kv_heads"], dropout=0.0, tie_embeddings=False,
        max_sequence_length=size["prompt_len"] + size["new_tokens"], **extra)
    return model, prompts.tolist()


def _kzoo_worker(kinds, size):
    results = {}
    for kind in kinds:
        model, rows = kzoo_model(kind, size)
        results[kind] = _rate(lambda: count_new_tokens(model.generate(
            rows, max_new_tokens=size["new_tokens"], strategy="greedy",
            stop_token_ids=None)), size)
    return results


def _keras_hub_worker(kinds, size):
    import keras_hub
    import numpy as np

    prompts = _prompts(size)
    b, p, n = size["prompts"], size["prompt_len"], size["new_tokens"]
    common = dict(vocabulary_size=size["vocab"], num_layers=size["layers"],
                  num_query_heads=size["heads"], hidden_dim=size["width"],
                  intermediate_dim=size["ff"], num_key_value_heads=size["kv_heads"],
                  dropout=0.0)
    builders = {
        "llama": lambda: keras_hub.models.LlamaCausalLM(
            keras_hub.models.LlamaBackbone(**common), preprocessor=None),
        "mistral": lambda: keras_hub.models.MistralCausalLM(
            keras_hub.models.MistralBackbone(sliding_window=size["window"], **common),
            preprocessor=None),
        "mixtral": lambda: keras_hub.models.MixtralCausalLM(
            keras_hub.models.MixtralBackbone(num_experts=size["experts"], top_k=size["top_k"],
                                             **common), preprocessor=None),
    }
    results = {}
    for kind in kinds:
        if kind == "t5_v1_1":
            backbone = keras_hub.models.T5Backbone(
                vocabulary_size=size["vocab"], num_layers=size["layers"],
                num_heads=size["heads"], hidden_dim=size["width"],
                intermediate_dim=size["t5_ff"], key_value_dim=size["width"] // size["heads"],
                dropout=0.0, activation="gelu", use_gated_activation=True,
                tie_embedding_weights=False)
            model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
            inputs = {"encoder_token_ids": prompts,
                      "encoder_padding_mask": np.ones(prompts.shape, bool),
                      "decoder_token_ids": np.zeros((b, n + 1), "int32"),  # start token 0
                      "decoder_padding_mask": np.arange(n + 1)[None].repeat(b, 0) < 1}
            mask, already = "decoder_padding_mask", b
        else:
            model = builders[kind]()
            ids = np.zeros((b, p + n), "int32")
            ids[:, :p] = prompts
            inputs = {"token_ids": ids, "padding_mask": np.arange(p + n)[None].repeat(b, 0) < p}
            mask, already = "padding_mask", b * p
        model.compile(sampler="greedy")
        results[kind] = _rate(lambda: int(np.sum(np.asarray(
            model.generate(inputs, stop_token_ids=None)[mask]))) - already, size)
    return results


def _transformers_worker(kinds, size):
    import torch
    import transformers

    torch.manual_seed(0)
    prompts = torch.as_tensor(_prompts(size), dtype=torch.long)
    p, n = size["prompt_len"], size["new_tokens"]
    common = dict(vocab_size=size["vocab"], hidden_size=size["width"],
                  intermediate_size=size["ff"], num_hidden_layers=size["layers"],
                  num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                  hidden_act="silu", max_position_embeddings=p + n, tie_word_embeddings=False,
                  attention_dropout=0.0, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    builders = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
        "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
            sliding_window=size["window"], **common)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=size["experts"], num_experts_per_tok=size["top_k"], **common)),
        "t5_v1_1": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=size["vocab"], d_model=size["width"],
            d_kv=size["width"] // size["heads"], d_ff=size["t5_ff"],
            num_layers=size["layers"], num_decoder_layers=size["layers"],
            num_heads=size["heads"], dropout_rate=0.0, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=None)),
    }
    results = {}
    for kind in kinds:
        model = builders[kind]().eval()
        model.generation_config.eos_token_id = None  # every row makes all n tokens
        width = 1 if kind == "t5_v1_1" else p  # (T5's output starts with its start token)

        def generate():
            with torch.no_grad():
                out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                     max_new_tokens=n, do_sample=False, num_beams=1,
                                     pad_token_id=0)
            return (out.shape[1] - width) * out.shape[0]

        results[kind] = _rate(generate, size)
    return results


def run_worker(library, kinds, size):
    import warnings

    warnings.filterwarnings("ignore")
    if library == "transformers":
        return _transformers_worker(kinds, size)
    import keras

    keras.utils.set_random_seed(0)
    worker = _kzoo_worker if library == "kzoo" else _keras_hub_worker
    return worker(kinds, size)


# === Driver ===


def systems(backends):
    return [(lib, b) for b in backends for lib in ("kzoo", "keras-hub")] + [
        ("transformers", "torch")]


def rows(medians, kinds, backends):
    """Table rows `(kind, backend, kzoo, keras-hub, transformers, kzoo/transformers,
    kzoo/keras-hub)` from `{system: {kind: {"decode": value}}}` medians (None: not
    measured)."""
    def value(library, backend, kind):
        return medians.get(f"{library}/{backend}", {}).get(kind, {}).get("decode")

    def ratio(a, b):
        return None if a is None or not b else a / b

    out = []
    for kind in kinds:
        reference = value("transformers", "torch", kind)
        for backend in backends:
            ours, hub = value("kzoo", backend, kind), value("keras-hub", backend, kind)
            out.append((kind, backend, ours, hub, reference, ratio(ours, reference),
                        ratio(ours, hub)))
    return out


def table(table_rows):
    def number(v):
        return "-" if v is None else f"{v:,.0f}"

    def times(v):
        return "-" if v is None else f"{v:.2f}x"

    lines = ["| kind | backend | kzoo | keras-hub | transformers (torch) | kzoo / transformers "
             "| kzoo / keras-hub |", "|---|---|---|---|---|---|---|"]
    for kind, backend, ours, hub, ref, vs_ref, vs_hub in table_rows:
        lines.append(f"| {kind} | {backend} | {number(ours)} | {number(hub)} | {number(ref)} "
                     f"| {times(vs_ref)} | {times(vs_hub)} |")
    return "\n".join(lines)


def _choices(text, allowed, name):
    chosen = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in chosen if c not in allowed]
    if bad or not chosen:
        raise SystemExit(f"--{name} must be a comma-separated subset of {', '.join(allowed)}; "
                         f"got --{name}={text!r}.")
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--only", default=",".join(KINDS), help="kinds, e.g. llama,mixtral")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--timeout", type=int, default=900, help="seconds a worker may take")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kinds = _choices(args.only, KINDS, "only")
    size_name = args.size or ("quick" if args.quick else "full")
    if args.worker:
        result = run_worker(args.worker, kinds, SIZES[size_name])
        print(RESULT_MARK + json.dumps(result))
        return 0
    backends = _choices(args.backends, BACKENDS, "backends")
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        raise SystemExit(f"--rounds must be a positive integer; got --rounds={rounds}.")
    order = systems(backends)
    per_round, failures = [], []
    for r in range(rounds):
        result = {}
        for library, backend in rotation(order, r):
            key = f"{library}/{backend}"
            print(f"round {r + 1}/{rounds}: {key} ...", file=sys.stderr, flush=True)
            got, error = run_worker_process(
                ["benchmarks.decode_families", "--worker", library, "--size", size_name,
                 "--only", ",".join(kinds)], backend, args.timeout)
            if error:
                failures.append(f"{key} (round {r + 1}): {error}")
            result[key] = {kind: {"decode": v} for kind, v in got.items()}
        per_round.append(result)
    medians = median_results(per_round)
    print(f"Greedy decode, new tokens/s (median of {rounds} round(s), size {size_name}):")
    print(table(rows(medians, kinds, backends)))
    for line in failures:
        print("failed:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
