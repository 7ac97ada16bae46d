"""Run by tests/test_distribution.py in a subprocess: JAX on 8 virtual CPU devices.

For every family (tiny models of `CASES`), three Adam steps on the same batch from the same
initial weights: on one device, under `kzoo.distribution.data_parallel()` (8 devices) and
under `model_parallel` on a 2 x 4 (batch x model) mesh. Prints one JSON object: losses and
step times a family and mode, each variable's sharding spec and local shard shape, and (with
`--errors`) the errors the distribution checks raise: a batch that does not split (in `fit`
of the first family) and a variable that does not (a GPT built under a family-name map).

XLA's device count must be set before JAX starts, hence a process of its own.
"""

import os
import sys

if __name__ == "__main__":  # imported by the test for CASES / batch: no side effects then
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kzoo  # noqa: E402
from kzoo import registry  # noqa: E402
from kzoo.distribution import data_parallel, device_mesh, model_parallel  # noqa: E402

MESH = (2, 4)  # (batch, model) of the model-parallel runs

BATCH, SEQ, STEPS = 8, 8, 3

# family, backbone config, task config: tiny, dropout 0, every split dimension divisible by 4.
CASES = {
    "bert": ("bert", dict(vocabulary_size=64, num_layers=1, num_heads=4, hidden_dim=16,
                          intermediate_dim=32, max_sequence_length=SEQ, dropout=0.0,
                          attention_dropout=0.0), {}),
    "gpt": ("gpt", dict(vocabulary_size=64, num_layers=1, num_heads=4, hidden_dim=16,
                        intermediate_dim=32, max_sequence_length=SEQ, dropout=0.0), {}),
    # modern style: RMSNorm, rotary, GQA (8 query / 4 key-value heads), 4 SwiGLU experts,
    # untied head; vocabulary 62 does not divide by 4, so the embedding is split on hidden.
    # capacity_factor 2 gives every expert room for all 64 tokens (nothing dropped) in one
    # compiled branch instead of the no-drop ladder of capacities (a quarter of the compile).
    "gpt_moe": ("gpt", dict(vocabulary_size=62, num_layers=1, num_heads=8, num_kv_heads=4,
                            hidden_dim=32, intermediate_dim=16, max_sequence_length=SEQ,
                            dropout=0.0, norm="rmsnorm", position="rotary", feedforward="moe",
                            num_experts=4, top_k=2, capacity_factor=2.0, use_bias=False,
                            activation="silu",
                            tie_embeddings=False), {}),
    "t5": ("t5", dict(vocabulary_size=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                      hidden_dim=16, key_value_dim=4, intermediate_dim=32, dropout=0.0,
                      feedforward="gated-gelu", tie_embeddings=False), {}),
    "vit": ("vit", dict(image_size=16, patch_size=8, num_layers=1, num_heads=4, hidden_dim=16,
                        intermediate_dim=32), {"num_classes": 3}),
    "graphormer": ("graphormer", dict(num_atoms=31, num_in_degree=16, num_out_degree=16,
                                      num_edges=15, num_spatial=16, num_edge_dis=8,
                                      multi_hop_max_dist=2, num_layers=1, hidden_dim=16,
                                      intermediate_dim=24, num_heads=4, dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0),
                   {"num_classes": 1}),
}


def build(name):
    family, config, task_config = CASES[name]
    return registry.family(family).build(config, task_config=task_config)


def config(name):
    """The family config of case `name` (what `model_parallel` checks the mesh against)."""
    family, fields, _ = CASES[name]
    return registry.family(family).config_class.from_dict(fields)


def batch(name):
    rng = np.random.default_rng(0)
    ids = lambda high, shape=(BATCH, SEQ): rng.integers(0, high, shape).astype("int32")  # noqa
    mask = np.ones((BATCH, SEQ), bool)
    mask[:, -2:] = np.arange(BATCH)[:, None] % 2 == 0  # some rows padded
    if name == "bert":
        return {"token_ids": ids(64), "segment_ids": ids(2), "padding_mask": mask}, ids(64)
    if name in ("gpt", "gpt_moe"):
        vocab = CASES[name][1]["vocabulary_size"]
        return {"token_ids": ids(vocab), "padding_mask": mask}, ids(vocab)
    if name == "t5":
        return ({"encoder_token_ids": ids(64), "encoder_padding_mask": mask,
                 "decoder_token_ids": ids(64), "decoder_padding_mask": np.ones_like(mask)},
                ids(64))
    if name == "vit":
        return rng.normal(size=(BATCH, 16, 16, 3)).astype("float32"), ids(3, (BATCH,))
    graphs = []
    for b in range(BATCH):  # rings and chains of 3-6 atoms, one atom and one bond feature
        n = 3 + b % 4
        edges = [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if b % 2 else [])
        index = np.array(edges + [(j, i) for i, j in edges]).T
        graphs.append({"num_nodes": n, "edge_index": index,
                       "node_feat": rng.integers(1, 30, (n, 1)),
                       "edge_attr": rng.integers(1, 10, (index.shape[1], 1))})
    x = kzoo.graphs.batch(graphs, multi_hop_max_dist=2, spatial_pos_max=8, pad_to_nodes=6)
    x.pop("labels", None)
    return x, rng.normal(size=(BATCH, 1)).astype("float32")


def compile_model(model, name):
    loss = "auto"
    if name == "vit":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "graphormer":
        loss = "mse"
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)


def train(model, name, x, y):
    compile_model(model, name)
    losses, times = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        losses.append(float(logs["loss"]))
        times.append(time.perf_counter() - start)
    return losses, times[1:]  # the first step compiles


def spec(variable):
    sharding = variable.value.sharding
    axes = list(getattr(sharding, "spec", ()))
    axes += [None] * (len(variable.shape) - len(axes))
    shard = variable.value.addressable_shards[0].data.shape
    return {"spec": [a if a is None or isinstance(a, str) else list(a) for a in axes],
            "shape": list(variable.shape), "shard": list(shard)}


def run_family(name, out, errors, with_errors=False):
    x, y = batch(name)
    keras.utils.set_random_seed(0)
    model = build(name)
    initial = model.get_weights()
    losses, times = train(model, name, x, y)
    out[name] = {"single": {"losses": losses, "step_s": times}}
    modes = {"data": data_parallel,
             "model": lambda: model_parallel(config(name), device_mesh(*MESH))}
    for mode, make in modes.items():
        start = time.perf_counter()
        dist = make()
        with dist.scope():
            keras.utils.set_random_seed(0)
            model = build(name)
            model.set_weights(initial)
            losses, times = train(model, name, x, y)
            if with_errors:  # a batch that does not split: caught in fit, before compiling
                n = {"data": 4, "model": 5}[mode]
                try:
                    model.fit(keras.tree.map_structure(lambda a: a[:n], x), y[:n],
                              batch_size=n, verbose=0)
                except ValueError as e:
                    errors[f"batch_{mode}"] = str(e)
            out[name][mode] = {
                "losses": losses, "step_s": times,
                "variables": {v.path: spec(v) for v in model.weights},
                "optimizer": {v.path: spec(v) for v in model.optimizer.variables
                              if len(v.shape) >= 2},
            }
        out[name][mode]["seconds"] = time.perf_counter() - start


def variable_error(found):
    """The message of the check that runs as a variable is created (JAX only)."""
    mesh = device_mesh(*MESH)
    # A family name alone: the split variables are checked as they are created.
    family, fields, _ = CASES["gpt"]
    try:
        with model_parallel("gpt", mesh).scope():
            registry.family(family).build({**fields, "intermediate_dim": 30})
    except ValueError as e:
        found["variable"] = str(e)


def main():
    """`python tests/distribution_run.py [--errors] [family ...]` (default: every family)."""
    args = sys.argv[1:]
    with_errors = "--errors" in args
    names = [a for a in args if a != "--errors"] or list(CASES)
    if keras.backend.backend() != "jax" or len(keras.distribution.list_devices()) != 8:
        raise SystemExit("needs KERAS_BACKEND=jax and "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts")
    out = {"devices": len(keras.distribution.list_devices()), "families": {}, "errors": {}}
    for i, name in enumerate(names):
        start = time.perf_counter()
        run_family(name, out["families"], out["errors"], with_errors and i == 0)
        out["families"][name]["seconds"] = time.perf_counter() - start
    if with_errors:
        variable_error(out["errors"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
