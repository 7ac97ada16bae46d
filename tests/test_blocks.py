"""TransformerBlock written out in NumPy from its own weights; fit, masks, config; where each
bias, dropout and initialiser lands; ALiBi through `attention_bias`; the exact weight paths of
every family's backbone and files saved with the families' former block classes."""

import re

import h5py
import keras
import numpy as np
import pytest

from kzoo.layers import ALiBiBias, TransformerBlock
from kzoo.models.bert import BertBackbone
from kzoo.models.gpt import GPTBackbone
from kzoo.models.graphormer import GraphormerBackbone
from kzoo.models.t5 import T5Backbone
from kzoo.models.vit import ViTBackbone
from kzoo.layers.utils import broadcast_leading, gradient_boundary, project
from tests.harness import assert_close, ref, roundtrip_layer, to_numpy
from tests.helpers import value_and_grads


_dense = ref.apply_dense  # (layer, x)


def _np_block(block, x, pad=None, enc=None, enc_pad=None, bias=None):
    eps = block.layer_norm_epsilon
    def norm_fn(h, norm, eps):
        return ref.norm(norm, h, eps)

    def mha(layer, h, value, mask, causal, bias_):
        b, t, _ = h.shape
        s = value.shape[1]
        nh, hd, hk = layer.num_heads, layer._head_dim, layer._kv_heads
        q = _dense(layer.query_dense, h).reshape(b, t, nh, hd)
        k = _dense(layer.key_dense, value).reshape(b, s, hk, hd)
        v = _dense(layer.value_dense, value).reshape(b, s, hk, hd)
        if layer.rotary is not None and value is h:
            q, k = (ref.rope(a, base=layer.rotary.max_wavelength) for a in (q, k))
        o = ref.attention(q, k, v, mask=mask, causal=causal, bias=bias_, scale=layer.scale)
        return _dense(layer.output_dense, o.reshape(b, t, nh * hd))

    def ffn(h):
        f = block.feedforward_layer
        if block.feedforward == "gated":
            act = ref.silu(_dense(f.gate_dense, h))
            return _dense(f.output_dense, act * _dense(f.up_dense, h))
        inner = _dense(f.intermediate_dense, h)
        inner = ref.gelu(inner) if block.activation == "gelu" else ref.relu(inner)
        return _dense(f.output_dense, inner)

    def sub(h, norm, fn):
        if block.norm_first:
            return h + fn(norm_fn(h, norm, eps))
        return norm_fn(h + fn(h), norm, eps)

    mask = None if pad is None else pad[:, None, None, :]
    x = sub(x, block.self_attention_norm,
            lambda h: mha(block.self_attention, h, h, mask, block.causal, bias))
    if block.cross_attention:
        emask = None if enc_pad is None else enc_pad[:, None, None, :]
        x = sub(x, block.cross_attention_norm,
                lambda h: mha(block.cross_attention_layer, h, enc, emask, False, None))
    return sub(x, block.feedforward_norm, ffn)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(norm_first=False, activation="gelu", layer_norm_epsilon=1e-12),  # BERT
        dict(norm_first=True, causal=True),  # GPT-2
        dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
             num_kv_heads=2, causal=True),  # modern decoder
        dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
             cross_attention=True, head_dim=3),  # T5-like decoder
        dict(qkv_bias=False, layer_norm_epsilon=1e-6),  # ViT without q/k/v biases
        dict(norm_first=False, use_bias=False, feedforward_bias=True),  # Graphormer
    ],
)
def test_block_matches_numpy(kwargs):
    r = np.random.default_rng(0)
    x = r.normal(size=(2, 5, 16)).astype("float32")
    enc = r.normal(size=(2, 7, 16)).astype("float32")
    pad = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    enc_pad = np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    bias = r.normal(size=(1, 4, 5, 5)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, **kwargs)
    call = dict(padding_mask=pad, attention_bias=bias)
    if block.cross_attention:
        call.update(encoder_outputs=enc, encoder_padding_mask=enc_pad)
    out = block(x, **call)
    expected = _np_block(block, x, pad, enc, enc_pad, bias)
    real = pad[:, :, None].repeat(16, -1)
    assert_close(to_numpy(out)[real], expected[real], atol=3e-5, rtol=1e-4)


def _query_rows(monkeypatch):
    """The number of query rows of each attention computed from here on (a wrapper around
    `dot_product_attention` where the Keras layer and torch's `block_forward` find it)."""
    from kzoo.layers import attention, kernels

    seen, original = [], kernels.dot_product_attention

    def spy(query, *args, **kwargs):
        seen.append(query.shape[1])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(attention, "dot_product_attention", spy)
    monkeypatch.setattr(kernels, "dot_product_attention", spy)
    return seen


# (block arguments, whether only the selected rows are computed)
_OUTPUT_POSITION_BLOCKS = [
    (dict(norm_first=False, activation="gelu", layer_norm_epsilon=1e-12), True),  # BERT
    (dict(norm_first=True, causal=True), True),  # GPT-2: each row sees keys up to itself
    (dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
          num_kv_heads=2, causal=True), True),
    (dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
          cross_attention=True, head_dim=3), True),  # T5-like decoder
    (dict(norm_first=True, causal=True, rope_max_wavelength=10000), False),  # rotary
]


@pytest.mark.parametrize("kwargs, rows_only", _OUTPUT_POSITION_BLOCKS)
@pytest.mark.parametrize("wrapped", [False, True])
def test_block_output_positions_match_numpy(kwargs, rows_only, wrapped, monkeypatch):
    """`output_positions` gives NumPy's block output at those rows (repeats, any order), with
    a padding mask and per-row causal masks; blocks whose attention depends on the query's
    position (rotary) run whole. `wrapped`: the block inside a functional model, where torch
    runs it in torch calls (`fast_decode.block_forward`)."""
    r = np.random.default_rng(5)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    enc = r.normal(size=(2, 4, 16)).astype("float32")
    pad = np.array([[1] * 6, [1, 1, 1, 1, 0, 0]], bool)
    positions = np.array([[5, 0, 2], [3, 3, 1]], "int32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, **kwargs)
    extra = dict(encoder_outputs=enc) if block.cross_attention else {}
    block(x, padding_mask=pad, **extra)  # (built)
    expected = np.take_along_axis(_np_block(block, x, pad, enc), positions[..., None], axis=1)
    rows = _query_rows(monkeypatch)
    if wrapped and not block.cross_attention:
        inputs = [keras.Input((6, 16)), keras.Input((6,), dtype="bool"),
                  keras.Input((3,), dtype="int32")]
        model = keras.Model(inputs, block(inputs[0], padding_mask=inputs[1],
                                          output_positions=inputs[2]))
        rows.clear()
        out = model([x, pad, positions])
    else:
        out = block(x, padding_mask=pad, output_positions=positions, **extra)
    assert tuple(out.shape) == (2, 3, 16)
    assert_close(to_numpy(out), expected, atol=3e-5, rtol=1e-4)
    assert rows[0] == (3 if rows_only else 6) and len(rows) == 1 + block.cross_attention


@pytest.mark.spread
@pytest.mark.parametrize("kwargs", [dict(norm_first=False), dict(norm_first=True, causal=True),
                                    dict(norm_first=False, remat=True)])
def test_block_output_positions_gradients_equal_the_whole_blocks(kwargs):
    """The gradients of a loss on the selected rows, with respect to the block's input and
    its weights, are those of the whole block's output gathered at those rows (the rows'
    keys and values still depend on every input row)."""
    r = np.random.default_rng(6)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    pad = np.array([[1] * 6, [1, 1, 1, 1, 1, 0]], bool)
    positions = np.array([[1, 4], [0, 0]], "int32")
    w = r.normal(size=(2, 2, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, **kwargs)
    block(x)
    kernel = block.self_attention.key_dense.kernel
    results = []
    for rows_only in (True, False):
        def loss(t, k):
            t = keras.ops.add(t, 0.0)  # (a tensor: TensorFlow's tape watches a variable)
            with keras.StatelessScope(state_mapping=[(kernel, k)]):
                if rows_only:
                    out = block(t, padding_mask=pad, output_positions=positions)
                else:
                    out = keras.ops.take_along_axis(block(t, padding_mask=pad),
                                                    positions[..., None], axis=1)
            return keras.ops.sum(keras.ops.convert_to_tensor(w) * out)

        results.append(value_and_grads(loss, x, to_numpy(kernel)))
    (v_rows, g_rows), (v_all, g_all) = results
    assert_close(v_rows, v_all, atol=1e-5)
    assert np.abs(g_all[0]).max() > 1e-3 and np.abs(g_all[0][1, 5]).max() == 0  # (padded key)
    for a, b in zip(g_rows, g_all):
        assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_block_output_positions_of_a_block_layerdrop_skips_are_the_input_rows():
    """A block that LayerDrop skips in training is the identity: at `output_positions`, the
    input's rows (the skipped branch gathers them too)."""
    x = np.random.default_rng(7).normal(size=(2, 5, 8)).astype("float32")
    positions = np.array([[4, 0], [2, 2]], "int32")
    block = TransformerBlock(num_heads=2, intermediate_dim=16, layerdrop=0.5)
    block._layerdrop_keep = lambda: keras.ops.convert_to_tensor(False)  # (this draw: skip)
    out = block(x, output_positions=positions, training=True)
    np.testing.assert_array_equal(to_numpy(out), np.take_along_axis(x, positions[..., None], 1))
    assert np.abs(to_numpy(block(x, output_positions=positions)) - to_numpy(out)).max() > 1e-3


def test_block_output_positions_refused_with_a_cache():
    block = TransformerBlock(num_heads=2, intermediate_dim=8, causal=True)
    x = np.zeros((1, 1, 8), "float32")
    with pytest.raises(ValueError, match="`output_positions`.*no `cache`"):
        block(x, cache=keras.ops.zeros((1, 2, 2, 4, 4)), cache_index=0,
              output_positions=np.zeros((1, 1), "int32"))


def test_block_cache_decoding_equals_full_pass():
    r = np.random.default_rng(1)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    enc = r.normal(size=(2, 4, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, causal=True, cross_attention=True,
                             rope_max_wavelength=10000, num_kv_heads=2)
    full = to_numpy(block(x, encoder_outputs=enc))
    cache = keras.ops.zeros((2, 2, 2, 6, 4))  # (batch, k/v, kv_heads, length, head_dim)
    k, v = block.cross_attention_layer.project_key_value(keras.ops.convert_to_tensor(enc))
    cross = keras.ops.transpose(keras.ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))
    outs = []
    for i in range(6):
        out, cache, _ = block(x[:, i:i + 1], cache=cache, cache_index=i, cross_cache=cross)
        outs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=3e-5)


@pytest.mark.spread
def test_block_with_moe_fits_and_serializes(tmp_path):
    block = TransformerBlock(num_heads=2, intermediate_dim=16, feedforward="moe",
                             num_experts=4, top_k=2, causal=True)
    roundtrip_layer(block)
    inp = keras.Input((8, 16))
    model = keras.Model(inp, keras.layers.Dense(1)(block(inp)))
    # XLA-compiled on JAX and TensorFlow. On torch Keras' jit means torch.compile, which took
    # 260 s for this model on a 2-core CPU; torch trains eagerly here.
    jit = keras.backend.backend() != "torch"
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=jit)
    r = np.random.default_rng(0)
    x = r.normal(size=(32, 8, 16)).astype("float32")
    y = (x.mean(-1, keepdims=True) > 0).astype("float32")
    hist = model.fit(x, y, epochs=6, batch_size=16, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    path = tmp_path / "moe.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(x[:2])), to_numpy(model(x[:2])), atol=1e-5)


def test_block_validation():
    with pytest.raises(ValueError, match="norm"):
        TransformerBlock(num_heads=2, intermediate_dim=8, norm="batchnorm")
    with pytest.raises(ValueError, match="feedforward"):
        TransformerBlock(num_heads=2, intermediate_dim=8, feedforward="conv")
    with pytest.raises(ValueError, match="num_experts"):
        TransformerBlock(num_heads=2, intermediate_dim=8, feedforward="moe")
    with pytest.raises(ValueError, match="intermediate_dim"):
        TransformerBlock(num_heads=2, intermediate_dim=0)
    with pytest.raises(ValueError, match="encoder_outputs"):
        TransformerBlock(num_heads=2, intermediate_dim=8, cross_attention=True)(
            np.zeros((1, 3, 8), "float32"))
    for kwargs, name in [
        (dict(qkv_bias=1), "qkv_bias"),
        (dict(feedforward_bias="no"), "feedforward_bias"),
        (dict(use_bias=None), "use_bias"),
        (dict(causal="yes"), "causal"),
        (dict(norm_first=0), "norm_first"),
        (dict(activation_dropout=1.0), "activation_dropout"),
        (dict(expert_type="dense"), "expert_type"),
    ]:
        with pytest.raises(ValueError, match=f"`{name}`.*{name}="):
            TransformerBlock(num_heads=2, intermediate_dim=8, **kwargs)


# === Where each bias, dropout and initialiser lands ===


def _bias_count(block):
    return {path: int(any(w.path.endswith(f"{path}/bias") for w in block.weights))
            for path in ("query_dense", "key_dense", "value_dense", "attention/output_dense",
                         "intermediate_dense", "feedforward/output_dense")}


@pytest.mark.parametrize(
    "kwargs, qkv, out, ffn",
    [
        (dict(), 1, 1, 1),
        (dict(use_bias=False), 0, 0, 0),
        (dict(qkv_bias=False), 0, 1, 1),  # ViT's qkv_bias=False
        (dict(use_bias=False, qkv_bias=True), 1, 0, 0),
        (dict(use_bias=False, feedforward_bias=True), 0, 0, 1),  # Graphormer, bias=False
        (dict(feedforward_bias=False), 1, 1, 0),
    ],
)
def test_bias_switches(kwargs, qkv, out, ffn):
    block = TransformerBlock(num_heads=2, intermediate_dim=8, **kwargs)
    block(np.zeros((1, 3, 4), "float32"))
    assert _bias_count(block) == {
        "query_dense": qkv, "key_dense": qkv, "value_dense": qkv,
        "attention/output_dense": out, "intermediate_dense": ffn,
        "feedforward/output_dense": ffn,
    }


@pytest.mark.parametrize("feedforward", ["plain", "gated", "moe"])
def test_every_initializer_reaches_its_kernels(feedforward):
    const = keras.initializers.Constant
    block = TransformerBlock(
        num_heads=2, intermediate_dim=8, cross_attention=True, feedforward=feedforward,
        num_experts=2 if feedforward == "moe" else None,
        kernel_initializer=const(0.1), query_initializer=const(0.2),
        key_value_initializer=const(0.3), attention_output_initializer=const(0.4),
        feedforward_initializer=const(0.5), feedforward_output_initializer=const(0.6),
        router_initializer=const(0.7),
    )
    roundtrip_layer(block)
    block(np.zeros((1, 3, 4), "float32"), encoder_outputs=np.zeros((1, 2, 4), "float32"))
    expected = {
        "query_dense": 0.2, "key_dense": 0.3, "value_dense": 0.3, "attention/output_dense": 0.4,
        "intermediate_dense": 0.5, "gate_dense": 0.5, "up_dense": 0.5,
        "feedforward/output_dense": 0.6,
        "gate_kernel": 0.5, "up_kernel": 0.5, "feedforward/output_kernel": 0.6, "router": 0.7,
    }
    kernels = [w for w in block.weights if "kernel" in w.path]
    assert len(kernels) == {"plain": 10, "gated": 11, "moe": 12}[feedforward]
    for w in kernels:
        value = next(v for k, v in expected.items() if k in w.path)
        np.testing.assert_array_equal(to_numpy(w), np.full(w.shape, value, "float32"), w.path)

    # Every role left unset falls back to `kernel_initializer`.
    plain = TransformerBlock(num_heads=2, intermediate_dim=8, feedforward=feedforward,
                             num_experts=2 if feedforward == "moe" else None,
                             kernel_initializer=const(0.1))
    plain(np.zeros((1, 3, 4), "float32"))
    for w in plain.weights:
        if "kernel" in w.path:
            np.testing.assert_array_equal(to_numpy(w), np.full(w.shape, 0.1, "float32"))


def test_unseeded_initializers_draw_every_kernel_afresh():
    init = keras.initializers.RandomNormal(stddev=1.0)  # one instance for every role
    block = TransformerBlock(num_heads=2, intermediate_dim=4, kernel_initializer=init,
                             query_initializer=init, key_value_initializer=init,
                             attention_output_initializer=init, feedforward_initializer=init,
                             feedforward_output_initializer=init)
    block(np.zeros((1, 3, 4), "float32"))
    square = [to_numpy(w) for w in block.weights if w.shape == (4, 4)]
    assert len(square) == 6  # q, k, v, o, FF in, FF out
    for i in range(len(square)):
        for j in range(i):
            assert not np.allclose(square[i], square[j])


@pytest.mark.spread
@pytest.mark.parametrize("feedforward", ["plain", "gated", "moe"])
def test_dropout_placement(feedforward):
    moe = dict(num_experts=2) if feedforward == "moe" else {}

    def block(**kwargs):
        return TransformerBlock(num_heads=2, intermediate_dim=16, feedforward=feedforward,
                                **moe, **kwargs)

    b = block(dropout=0.1, attention_dropout=0.2, activation_dropout=0.3)
    assert b.self_attention_dropout.rate == 0.1 and b.feedforward_dropout.rate == 0.1
    assert b.self_attention.dropout == 0.2
    assert b.feedforward_layer.dropout == 0.3
    assert block(dropout=0.1).feedforward_layer.dropout == 0.1  # None follows `dropout`
    # Only the feed-forward's hidden activations are dropped: training changes the output,
    # and with activation_dropout=0 it does not.
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    only_hidden = block(activation_dropout=0.5)
    assert not np.allclose(to_numpy(only_hidden(x, training=True)), to_numpy(only_hidden(x)))
    none = block(activation_dropout=0.0)
    np.testing.assert_array_equal(to_numpy(none(x, training=True)), to_numpy(none(x)))


# === ALiBi through `attention_bias` ===


def _np_alibi(heads, q_len, k_len, start=0):
    slopes = np.array([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    distance = (start + np.arange(q_len))[:, None] - np.arange(k_len)[None, :]
    return (-slopes[:, None, None] * distance)[None].astype("float32")


def test_alibi_block_matches_numpy_and_cached_decoding():
    r = np.random.default_rng(2)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=32, causal=True, num_kv_heads=2)
    alibi = ALiBiBias(num_heads=4)
    full = to_numpy(block(x, attention_bias=alibi(x)))
    assert_close(full, _np_block(block, x, bias=_np_alibi(4, 6, 6)), atol=3e-5, rtol=1e-4)
    # Decoding one token at a time: the bias of query i over the whole cache.
    cache = keras.ops.zeros((2, 2, 2, 6, 4))  # (batch, k/v, kv_heads, length, head_dim)
    outs = []
    for i in range(6):
        keys = keras.ops.transpose(cache[:, 0], (0, 2, 1, 3))  # (batch, length, heads, dim)
        bias = alibi(x[:, i:i + 1], keys, start_index=i)
        out, cache = block(x[:, i:i + 1], attention_bias=bias, cache=cache, cache_index=i)
        outs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=3e-5)
    # ALiBi does change the output (the test above is not vacuous).
    assert np.abs(to_numpy(block(x)) - full).max() > 1e-3


# === Weight paths of every family (converters and saved files address them) ===


FAMILY_BACKBONES = {
    "bert": (
        lambda n=1: BertBackbone(vocabulary_size=10, num_layers=n, num_heads=2, hidden_dim=8,
                             intermediate_dim=16, max_sequence_length=8),
        [
            "embeddings_layer_norm/beta", "embeddings_layer_norm/gamma", "pooler_dense/bias",
            "pooler_dense/kernel", "position_embedding/embeddings",
            "segment_embedding/embeddings", "token_embedding/embeddings",
            "transformer_layer_0/feedforward/intermediate_dense/bias",
            "transformer_layer_0/feedforward/intermediate_dense/kernel",
            "transformer_layer_0/feedforward/output_dense/bias",
            "transformer_layer_0/feedforward/output_dense/kernel",
            "transformer_layer_0/feedforward_norm/beta",
            "transformer_layer_0/feedforward_norm/gamma",
            "transformer_layer_0/self_attention/key_dense/bias",
            "transformer_layer_0/self_attention/key_dense/kernel",
            "transformer_layer_0/self_attention/output_dense/bias",
            "transformer_layer_0/self_attention/output_dense/kernel",
            "transformer_layer_0/self_attention/query_dense/bias",
            "transformer_layer_0/self_attention/query_dense/kernel",
            "transformer_layer_0/self_attention/value_dense/bias",
            "transformer_layer_0/self_attention/value_dense/kernel",
            "transformer_layer_0/self_attention_norm/beta",
            "transformer_layer_0/self_attention_norm/gamma",
        ],
    ),
    "gpt2": (
        lambda n=1: GPTBackbone(vocabulary_size=10, num_layers=n, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, max_sequence_length=8),
        [
            "final_norm/beta", "final_norm/gamma", "position_embedding/embeddings",
            "token_embedding/embeddings",
            "transformer_layer_0/feedforward/intermediate_dense/bias",
            "transformer_layer_0/feedforward/intermediate_dense/kernel",
            "transformer_layer_0/feedforward/output_dense/bias",
            "transformer_layer_0/feedforward/output_dense/kernel",
            "transformer_layer_0/feedforward_norm/beta",
            "transformer_layer_0/feedforward_norm/gamma",
            "transformer_layer_0/self_attention/key_dense/bias",
            "transformer_layer_0/self_attention/key_dense/kernel",
            "transformer_layer_0/self_attention/output_dense/bias",
            "transformer_layer_0/self_attention/output_dense/kernel",
            "transformer_layer_0/self_attention/query_dense/bias",
            "transformer_layer_0/self_attention/query_dense/kernel",
            "transformer_layer_0/self_attention/value_dense/bias",
            "transformer_layer_0/self_attention/value_dense/kernel",
            "transformer_layer_0/self_attention_norm/beta",
            "transformer_layer_0/self_attention_norm/gamma",
        ],
    ),
    "gpt_moe": (
        lambda n=1: GPTBackbone(vocabulary_size=10, num_layers=n, num_heads=2, hidden_dim=8,
                            intermediate_dim=16, max_sequence_length=8, norm="rmsnorm",
                            position="rotary", feedforward="moe", num_experts=2,
                            use_bias=False, num_kv_heads=1, tie_embeddings=False),
        [
            "final_norm/scale", "token_embedding/embeddings",
            "token_embedding/reverse_embeddings",
            "transformer_layer_0/feedforward/gate_kernel",
            "transformer_layer_0/feedforward/output_kernel",
            "transformer_layer_0/feedforward/router/kernel",
            "transformer_layer_0/feedforward/up_kernel",
            "transformer_layer_0/feedforward_norm/scale",
            "transformer_layer_0/self_attention/key_dense/kernel",
            "transformer_layer_0/self_attention/output_dense/kernel",
            "transformer_layer_0/self_attention/query_dense/kernel",
            "transformer_layer_0/self_attention/value_dense/kernel",
            "transformer_layer_0/self_attention_norm/scale",
        ],
    ),
    "t5": (
        lambda n=1: T5Backbone(vocabulary_size=10, num_layers=n, num_heads=2, hidden_dim=8,
                           key_value_dim=4, intermediate_dim=16, feedforward="gated-gelu"),
        [
            "decoder_layer_0/cross_attention/key_dense/kernel",
            "decoder_layer_0/cross_attention/output_dense/kernel",
            "decoder_layer_0/cross_attention/query_dense/kernel",
            "decoder_layer_0/cross_attention/value_dense/kernel",
            "decoder_layer_0/cross_attention_norm/scale",
            "decoder_layer_0/feedforward/gate_dense/kernel",
            "decoder_layer_0/feedforward/output_dense/kernel",
            "decoder_layer_0/feedforward/up_dense/kernel",
            "decoder_layer_0/feedforward_norm/scale",
            "decoder_layer_0/self_attention/key_dense/kernel",
            "decoder_layer_0/self_attention/output_dense/kernel",
            "decoder_layer_0/self_attention/query_dense/kernel",
            "decoder_layer_0/self_attention/value_dense/kernel",
            "decoder_layer_0/self_attention_norm/scale",
            "decoder_output_norm/scale", "decoder_relative_attention_bias/embeddings",
            "encoder_layer_0/feedforward/gate_dense/kernel",
            "encoder_layer_0/feedforward/output_dense/kernel",
            "encoder_layer_0/feedforward/up_dense/kernel",
            "encoder_layer_0/feedforward_norm/scale",
            "encoder_layer_0/self_attention/key_dense/kernel",
            "encoder_layer_0/self_attention/output_dense/kernel",
            "encoder_layer_0/self_attention/query_dense/kernel",
            "encoder_layer_0/self_attention/value_dense/kernel",
            "encoder_layer_0/self_attention_norm/scale",
            "encoder_output_norm/scale", "encoder_relative_attention_bias/embeddings",
            "token_embedding/embeddings",
        ],
    ),
    "vit": (
        lambda n=1: ViTBackbone(image_size=8, patch_size=4, num_layers=n, num_heads=2,
                            hidden_dim=8, intermediate_dim=16, qkv_bias=False),
        [
            "embedding/class_token", "embedding/patch_embedding/projection/bias",
            "embedding/patch_embedding/projection/kernel", "embedding/position_embedding",
            "final_norm/beta", "final_norm/gamma",
            "transformer_layer_0/feedforward/intermediate_dense/bias",
            "transformer_layer_0/feedforward/intermediate_dense/kernel",
            "transformer_layer_0/feedforward/output_dense/bias",
            "transformer_layer_0/feedforward/output_dense/kernel",
            "transformer_layer_0/feedforward_norm/beta",
            "transformer_layer_0/feedforward_norm/gamma",
            "transformer_layer_0/self_attention/key_dense/kernel",
            "transformer_layer_0/self_attention/output_dense/bias",
            "transformer_layer_0/self_attention/output_dense/kernel",
            "transformer_layer_0/self_attention/query_dense/kernel",
            "transformer_layer_0/self_attention/value_dense/kernel",
            "transformer_layer_0/self_attention_norm/beta",
            "transformer_layer_0/self_attention_norm/gamma",
        ],
    ),
    "graphormer": (
        lambda n=1: GraphormerBackbone(num_atoms=8, num_in_degree=4, num_out_degree=4,
                                   num_edges=4, num_spatial=4, num_edge_dis=2,
                                   multi_hop_max_dist=2, num_layers=n, hidden_dim=8,
                                   intermediate_dim=16, num_heads=2, use_attention_bias=False),
        [
            "attention_bias/edge_distance_weights", "attention_bias/edge_embeddings",
            "attention_bias/spatial_embeddings", "attention_bias/virtual_distance",
            "head_transform/dense/bias", "head_transform/dense/kernel",
            "head_transform/layer_norm/beta", "head_transform/layer_norm/gamma",
            "node_feature/atom_embeddings", "node_feature/graph_token",
            "node_feature/in_degree_embeddings", "node_feature/out_degree_embeddings",
            "transformer_layer_0/feedforward/intermediate_dense/bias",
            "transformer_layer_0/feedforward/intermediate_dense/kernel",
            "transformer_layer_0/feedforward/output_dense/bias",
            "transformer_layer_0/feedforward/output_dense/kernel",
            "transformer_layer_0/feedforward_norm/beta",
            "transformer_layer_0/feedforward_norm/gamma",
            "transformer_layer_0/self_attention/key_dense/kernel",
            "transformer_layer_0/self_attention/output_dense/kernel",
            "transformer_layer_0/self_attention/query_dense/kernel",
            "transformer_layer_0/self_attention/value_dense/kernel",
            "transformer_layer_0/self_attention_norm/beta",
            "transformer_layer_0/self_attention_norm/gamma",
        ],
    ),
}


@pytest.mark.spread
@pytest.mark.parametrize("family", sorted(FAMILY_BACKBONES))
def test_family_weight_paths(family):
    make, expected = FAMILY_BACKBONES[family]
    backbone = make()
    # Sorted: the order in which a functional model lists its layers differs by backend.
    assert sorted(w.path for w in backbone.weights) == expected
    for block in [layer for layer in backbone.layers if isinstance(layer, TransformerBlock)]:
        assert type(block) is TransformerBlock  # no family subclass


# === Files saved while each family had its own block class ===


def _rename_groups(path, old, new):
    """Rename every HDF5 group `.../old` or `.../old_<i>` of a weights file to
    `.../new...`; returns how many were renamed."""
    pattern = re.compile(rf"{old}(_\d+)?")
    with h5py.File(path, "r+") as f:
        found = []
        f.visit(lambda name: found.append(name) if pattern.fullmatch(name.split("/")[-1])
                and isinstance(f[name], h5py.Group) else None)
        for name in found:
            parent, leaf = name.rsplit("/", 1)
            f.move(name, f"{parent}/{new}{leaf[len(old):]}")
        return len(found)


@pytest.mark.parametrize(
    "family, legacy",
    [("gpt2", "gpt_block"), ("bert", "bert_encoder_block"), ("vit", "vi_t_encoder_layer"),
     ("graphormer", "graphormer_encoder_layer")],
)
def test_weights_saved_with_former_block_classes_load(tmp_path, family, legacy):
    make, _ = FAMILY_BACKBONES[family]
    model = make(2)
    rng = np.random.default_rng(0)
    for w in model.weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    # Keras addresses list members by class name: the former classes' files hold
    # ".../gpt_block" where TransformerBlock is ".../transformer_block".
    assert _rename_groups(path, "transformer_block", legacy) == 2
    fresh = make(2)
    fresh.load_weights(path)
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b), a.path)


@pytest.mark.parametrize("shape, trailing", [((2, 5, 3), (5, 3)), ((2, 4, 5, 3), (3,)),
                                             ((7, 3), (7, 3))])
def test_broadcast_leading_values_and_gradient(shape, trailing):
    """`broadcast_leading(x, shape)` is NumPy's broadcast, and its gradient the incoming one
    summed over the new leading axes (NumPy, float64); on JAX on CPU the compiled gradient
    sums them as a matrix product, not a reduce."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=trailing).astype("float32")
    w = rng.normal(size=shape).astype("float32")

    def f(t):
        return keras.ops.sum(keras.ops.convert_to_tensor(w) * broadcast_leading(t, shape))

    np.testing.assert_array_equal(
        to_numpy(broadcast_leading(keras.ops.convert_to_tensor(x), shape)),
        np.broadcast_to(x, shape))
    value, (grad,) = value_and_grads(f, x)
    lead = tuple(range(len(shape) - len(trailing)))
    np.testing.assert_allclose(grad, w.astype("float64").sum(axis=lead), rtol=1e-5, atol=1e-5)
    assert_close(value, np.sum(w * x))
    if keras.backend.backend() == "jax" and lead:
        import jax

        if jax.default_backend() == "cpu":
            hlo = jax.jit(jax.grad(f)).lower(x).as_text()
            assert "dot_general" in hlo and "reduce" not in hlo


def test_gradient_boundary_is_the_identity_and_passes_gradients_exactly():
    """`gradient_boundary(x)` is `x` and its gradient the incoming one, bit for bit (NumPy's
    `2 w x` below); on JAX on CPU the compiled gradient holds the conditional that stops
    XLA from fusing the residual stream's gradient into every consumer."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3)).astype("float32")
    w = rng.normal(size=(2, 5, 3)).astype("float32")

    def f(t):
        return keras.ops.sum(keras.ops.convert_to_tensor(w) * gradient_boundary(t) ** 2)

    value, (grad,) = value_and_grads(f, x)
    np.testing.assert_array_equal(grad, 2 * w * x)
    assert_close(value, np.sum(w * x**2))
    np.testing.assert_array_equal(to_numpy(gradient_boundary(keras.ops.convert_to_tensor(x))), x)
    empty = keras.ops.zeros((0, 3))
    assert gradient_boundary(empty) is empty
    if keras.backend.backend() == "jax":
        import jax

        grad_bf16 = jax.grad(lambda t: jax.numpy.sum(gradient_boundary(t).astype("float32")))(
            jax.numpy.ones((4,), "bfloat16"))
        assert grad_bf16.dtype == "bfloat16" and np.all(np.asarray(grad_bf16, "float32") == 1)
        if jax.default_backend() == "cpu":
            hlo = jax.jit(jax.grad(f)).lower(x).compile().as_text()
            assert "conditional(" in hlo
    else:
        t = keras.ops.convert_to_tensor(x)
        assert gradient_boundary(t) is t


@pytest.mark.parametrize("lora", [False, True])
def test_project_equals_the_dense_layer_with_numpys_gradients(lora):
    """`project(dense, x)` for a rank-3 `x`: the values of `dense(x)` and the gradients of
    `sum(w * out)` with respect to `x` and the kernel, against NumPy (`w @ K^T` and
    `x^T w` over every leading position), also with Keras' LoRA enabled."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 6)).astype("float32")
    w = rng.normal(size=(2, 5, 4)).astype("float32")
    dense = keras.layers.Dense(4, bias_initializer="random_normal")
    dense.build((None, None, 6))
    if lora:
        dense.enable_lora(2)
        dense.lora_kernel_b.assign(rng.normal(size=(2, 4)).astype("float32"))
    kernel = to_numpy(dense.kernel)
    bias = to_numpy(dense.bias)
    np.testing.assert_allclose(to_numpy(project(dense, keras.ops.convert_to_tensor(x))),
                               x @ kernel + bias, rtol=1e-5, atol=1e-5)
    weight = dense.lora_kernel_b if lora else dense._kernel

    def f(t, k):
        with keras.StatelessScope(state_mapping=[(weight, k)]):
            out = project(dense, t)
        return keras.ops.sum(keras.ops.convert_to_tensor(w) * out)

    _, (g_x, g_k) = value_and_grads(f, x, to_numpy(weight))
    np.testing.assert_allclose(g_x, w @ kernel.T, rtol=1e-5, atol=1e-5)
    g_kernel = np.einsum("bti,bto->io", x, w)
    if lora:
        scale = dense.lora_alpha / dense.lora_rank
        g_kernel = to_numpy(dense.lora_kernel_a).T @ g_kernel * scale
    np.testing.assert_allclose(g_k, g_kernel, rtol=1e-5, atol=1e-5)
