"""Forward cost of the sparse MixtureOfExperts against one dense FeedForward of the same width.

Run once per backend:

    KERAS_BACKEND=jax .venv/bin/python -m benchmarks.moe
    KERAS_BACKEND=torch .venv/bin/python -m benchmarks.moe [--torch-compile]
    KERAS_BACKEND=tensorflow .venv/bin/python -m benchmarks.moe

Every forward is compiled: `jax.jit` on JAX, `tf.function(jit_compile=True)` (XLA) on
TensorFlow; on PyTorch eager by default (Keras' own default there), or `torch.compile` with
`--torch-compile`. Times are the median of `--runs` calls after `--warmup` calls. The
"ratio" column is the time divided by the time of the dense layer of the same expert type
(FeedForward for plain experts, GatedFeedForward for gated ones) and the same width; an
ideal top-k MoE costs about top_k times that dense layer plus the routing.
"""

import argparse
import statistics
import time

import keras
import numpy as np

from kzoo.layers.feedforward import FeedForward
from kzoo.layers.feedforward import GatedFeedForward
from kzoo.layers.moe import MixtureOfExperts


def _compiled_forward(layer, x, torch_compile):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        @jax.jit
        def fwd(tv, ntv, inputs):
            return layer.stateless_call(tv, ntv, inputs)[0]

        return lambda: fwd(trainable, non_trainable, x).block_until_ready()
    if backend == "tensorflow":
        import tensorflow as tf

        fwd = tf.function(lambda inputs: layer(inputs), jit_compile=True)
        return lambda: fwd(x).numpy()
    import torch

    fwd = torch.compile(layer) if torch_compile else layer

    def run():
        with torch.no_grad():
            return fwd(x).cpu()

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--torch-compile", action="store_true")
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    x_np = np.random.default_rng(0).normal(size=(args.batch, args.seq, args.dim))
    x = keras.ops.convert_to_tensor(x_np.astype("float32"))
    e, i = args.experts, args.intermediate
    # (name, layer, is the reference for the rows that follow)
    configs = [
        ("dense FeedForward", FeedForward(i, activation="gelu"), True),
        (f"MoE {e}x top-1", MixtureOfExperts(e, i, top_k=1), False),
        (f"MoE {e}x top-2", MixtureOfExperts(e, i, top_k=2), False),
        (f"MoE {e}x top-2 cf=1.25", MixtureOfExperts(e, i, top_k=2, capacity_factor=1.25), False),
        ("dense GatedFeedForward", GatedFeedForward(i, activation="silu"), True),
        (f"MoE {e}x top-2 gated", MixtureOfExperts(e, i, top_k=2, expert_type="gated"), False),
    ]
    backend = keras.backend.backend()
    mode = {
        "jax": "jax.jit",
        "tensorflow": "XLA",
        "torch": "torch.compile" if args.torch_compile else "eager",
    }[backend]
    rows = []
    for name, layer, is_reference in configs:
        layer.build(tuple(x.shape))
        note = ""
        if isinstance(layer, MixtureOfExperts):
            # Busiest expert relative to a perfectly balanced load, for the record.
            probs = keras.ops.softmax(layer.router(keras.ops.reshape(x, (-1, args.dim))))
            top = keras.ops.convert_to_numpy(keras.ops.top_k(probs, layer.top_k)[1])
            counts = np.bincount(top.reshape(-1), minlength=e)
            note = f"busiest expert {counts.max() / (top.size / e):.2f}x balanced load"
        fn = _compiled_forward(layer, x, args.torch_compile)
        for _ in range(args.warmup):
            fn()
        rows.append((name, fn, is_reference, note, []))
    # Interleave the configs run by run so that a change in machine load hits all alike.
    for _ in range(args.runs):
        for _, fn, _, _, times in rows:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000.0)

    shape = f"{args.batch}x{args.seq}x{args.dim}, intermediate {i}"
    print(f"backend={backend} ({mode}), input {shape}, median of {args.runs} interleaved runs")
    print(f"| {'backend':<10} | {'config':<24} | {'ms/forward':>10} | {'ratio':>5} | note")
    print(f"|{'-' * 12}|{'-' * 26}|{'-' * 12}|{'-' * 7}|------")
    dense_ms = None
    for name, _, is_reference, note, times in rows:
        ms = statistics.median(times)
        if is_reference:
            dense_ms = ms
        print(f"| {backend:<10} | {name:<24} | {ms:>10.1f} | {ms / dense_ms:>5.2f} | {note}")


if __name__ == "__main__":
    main()
