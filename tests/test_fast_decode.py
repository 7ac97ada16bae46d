"""The torch decode fast path (`kzoo.layers.fast_decode`): token-by-token cached decoding
through `decode_block` equals a full causal pass written in NumPy (or, for rotary and
mixture-of-experts blocks, the block's own full pass), for every block configuration the
families use; it only runs inside the decode loop, with autograd off, on torch; and
`generate` returns the same tokens with it on and off.

On JAX and TensorFlow `decode_block` is the Keras call: the tests of the loop's numbers (cached
steps against NumPy, padding, the compiled loops' joined and transposed weights) run there too,
and `test_fast_path_only_in_the_loop_without_autograd` checks that torch's path is not taken;
the tests of torch's own forms (its products of a few rows, rotation, experts, training
pass, where the path applies), marked `torch_path`, run there with `make test-all`."""

import contextlib

import keras
import numpy as np
import pytest

from kzoo.layers import TransformerBlock, fast_decode
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import to_numpy
from tests.test_blocks import _np_block

TORCH = keras.backend.backend() == "torch"

CONFIGS = {
    "gpt2": dict(norm_first=True, causal=True),
    "post_ln": dict(norm_first=False, causal=True, activation="relu"),
    "llama": dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
                  num_kv_heads=2, causal=True, rope_max_wavelength=10000),
    "t5_decoder": dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
                       cross_attention=True, head_dim=3, causal=True),
    "moe": dict(causal=True, feedforward="moe", num_experts=4, top_k=2),
    "gqa": dict(causal=True, num_kv_heads=1),
}


def _no_grad():
    if TORCH:
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _decode(block, x, enc, bias, pad, index="int", causal_bias=False):
    """Step-by-step cached decoding of `x` through `decode_block` inside the loop context.
    `index`: the cache index as a Python int (the host path of `block_step`) or as a scalar
    tensor; `causal_bias`: the bias rows with the keys after each query set to the float32
    minimum, passed with `causal_bias=True`."""
    b, t, _ = x.shape
    heads = block.self_attention._kv_heads
    cache = keras.ops.zeros((b, 2, heads, t, block.self_attention._head_dim))
    cross = None
    if block.cross_attention:
        k, v = block.cross_attention_layer.project_key_value(keras.ops.convert_to_tensor(enc))
        cross = keras.ops.transpose(keras.ops.stack([k, v], axis=1), (0, 1, 3, 2, 4))
    outs = []
    with _no_grad(), fast_decode.fast_steps():
        for i in range(t):
            kwargs = dict(padding_mask=keras.ops.convert_to_tensor(pad), cache=cache,
                          cache_index=i if index == "int" else keras.ops.convert_to_tensor(
                              i, "int32"))
            if bias is not None:
                rows = bias[:, :, i:i + 1].copy()
                if causal_bias:
                    rows[..., i + 1:] = np.finfo("float32").min
                    kwargs["causal_bias"] = True
                kwargs["attention_bias"] = keras.ops.convert_to_tensor(rows)
            if cross is not None:
                kwargs.update(cross_cache=cross,
                              encoder_padding_mask=keras.ops.convert_to_tensor(
                                  np.ones(enc.shape[:2], "int32")))
            result = fast_decode.decode_block(block, keras.ops.convert_to_tensor(x[:, i:i + 1]),
                                              **kwargs)
            out, cache = result[0], result[1]
            outs.append(to_numpy(out))
    return np.concatenate(outs, 1)


@pytest.mark.spread
@pytest.mark.parametrize("index", ["int", "tensor"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_steps_equal_the_full_causal_pass(name, index):
    kwargs = CONFIGS[name]
    r = np.random.default_rng(3)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    enc = r.normal(size=(2, 5, 16)).astype("float32")
    bias = r.normal(size=(1, 4, 6, 6)).astype("float32") if name == "t5_decoder" else None
    pad = np.ones((2, 6), "int32")
    block = TransformerBlock(num_heads=4, intermediate_dim=24, **kwargs)
    call = dict(attention_bias=bias)
    if block.cross_attention:
        call["encoder_outputs"] = enc
    full = to_numpy(block(x, **call))  # builds the block
    if "rope_max_wavelength" in kwargs or kwargs.get("feedforward") == "moe":
        expected = full  # the NumPy block has neither rotary positions nor experts
    else:
        expected = _np_block(block, x, None, enc, None, bias)
        np.testing.assert_allclose(full, expected, atol=3e-5, rtol=1e-4)
    got = _decode(block, x, enc, bias, pad, index=index)
    np.testing.assert_allclose(got, expected, atol=3e-5, rtol=1e-4)
    if bias is not None:  # the same with the causal mask folded into the bias (T5's loop)
        got = _decode(block, x, enc, bias, pad, index=index, causal_bias=True)
        np.testing.assert_allclose(got, expected, atol=3e-5, rtol=1e-4)


def test_padding_slots_are_not_attended():
    r = np.random.default_rng(4)
    x = r.normal(size=(2, 5, 16)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=24, causal=True)
    block(x)
    pad = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], "int32")  # row 1 left-padded by 2
    expected = _np_block(block, x, pad.astype(bool))
    for index in ("int", "tensor"):
        got = _decode(block, x, None, None, pad, index=index)
        np.testing.assert_allclose(got[:, 2:], expected[:, 2:], atol=3e-5, rtol=1e-4)


def test_fast_path_only_in_the_loop_without_autograd(monkeypatch):
    assert not fast_decode.enabled()  # outside the decode loop
    with fast_decode.fast_steps():
        with _no_grad():
            assert fast_decode.enabled() is TORCH
            assert not fast_decode.enabled(training=True)
            monkeypatch.setenv("KZOO_FAST_DECODE", "0")
            assert not fast_decode.enabled()
            monkeypatch.delenv("KZOO_FAST_DECODE")
        if TORCH:
            assert not fast_decode.enabled()  # autograd on: the Keras path
    assert not fast_decode.enabled()


def test_call_with_cache_outside_the_loop_leaves_the_callers_cache_alone():
    backbone = GPTBackbone(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
                           intermediate_dim=16, max_sequence_length=16)
    cache = backbone.init_cache(1, 8)
    before = to_numpy(cache).copy()
    with _no_grad():
        _, new = backbone.call_with_cache(np.array([[3, 4, 5]]), cache, 0)
    np.testing.assert_array_equal(to_numpy(cache), before)
    assert np.abs(to_numpy(new)).sum() > 0


LLAMA_STYLE = dict(norm="rmsnorm", position="rotary", feedforward="gated", activation="silu",
                   num_kv_heads=1, use_bias=False)
GENERATE_STYLES = {
    "gpt2": {},
    "llama": LLAMA_STYLE,
    # an untied head (its transposed kernel for a few rows), interleaved rotary pairs scaled
    "llama_untied": dict(LLAMA_STYLE, tie_embeddings=False),  # (+ rotary set below)
    # experts: every expert on the prompt's rows, the chosen ones gathered at a step's
    # 2 rows x top 1 < 3 experts, and some assignments over capacity dropped
    "moe": dict(feedforward="moe", num_experts=3, top_k=1, capacity_factor=1.0),
    "moe_top2": dict(LLAMA_STYLE, feedforward="moe", num_experts=4, top_k=2),
    # rolling caches: 5 slots, rolled over by the 12 new tokens; 14 slots, which hold
    # the left padding of the prompts (padded to 8) and slots not written yet at first
    "window": dict(LLAMA_STYLE, attention="sliding_window", attention_options={"window": 5}),
    "window_learned": dict(attention="sliding_window", attention_options={"window": 14}),
}


# On JAX and TensorFlow the torch path never runs (`fast_decode.enabled`), so `generate` with
# it "off" is the same code again: there the test checks, with one style that holds all of its
# parts (rotary, experts, a rolling window) and greedy decoding, that none of them ran (it
# was two styles, greedy and beam: 65 / 118 s of the JAX / TensorFlow suites for the same
# check; beam search's compiled loop is checked against transformers in test_generation.py).
GENERATE_STYLES["all_parts"] = dict(LLAMA_STYLE, feedforward="moe", num_experts=4, top_k=2,
                                    attention="sliding_window", attention_options={"window": 5})
STYLES_HERE = sorted(GENERATE_STYLES) if TORCH else ["all_parts"]


@pytest.mark.spread
@pytest.mark.parametrize("style", STYLES_HERE)
def test_generate_gives_the_same_tokens_with_the_fast_path_off(monkeypatch, style):
    extra = GENERATE_STYLES[style]
    keras.utils.set_random_seed(5)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=97, num_layers=2, num_heads=2, hidden_dim=16,
                                 intermediate_dim=32, max_sequence_length=40, **extra))
    if style == "llama_untied":  # interleaved rotary pairs, positions scaled
        for block in lm.backbone.transformer_layers:
            block.self_attention.rotary.interleaved = True
            block.self_attention.rotary.scaling_factor = 2.5
    prompts = [[5, 6, 7, 8], [9, 10]]
    ran = _count_torch_parts(monkeypatch)
    strategies = (("greedy", {}), ("beam", dict(num_beams=3))) if TORCH else (("greedy", {}),)
    for strategy, kw in strategies:
        fast = lm.generate(prompts, max_new_tokens=12, strategy=strategy, **kw)
        assert all(len(row) == 12 for row in fast)
        if TORCH:
            monkeypatch.setenv("KZOO_FAST_DECODE", "0")
            slow = lm.generate(prompts, max_new_tokens=12, strategy=strategy, **kw)
            monkeypatch.delenv("KZOO_FAST_DECODE")
            assert fast == slow
    if TORCH:  # the torch versions ran, not the layers' calls
        assert (ran["rotate"] > 0) == (extra.get("position") == "rotary"), ran
        assert (ran["experts"] > 0) == (extra.get("feedforward") == "moe"), ran
        assert (ran["window"] > 0) == (extra.get("attention") == "sliding_window"), ran
    else:
        assert ran == {"rotate": 0, "experts": 0, "window": 0}


def _count_torch_parts(monkeypatch):
    """Counts of the fast path's torch rotations, experts (those that did not hand back to
    the layer's own call) and sliding-window steps."""
    ran = {"rotate": 0, "experts": 0, "window": 0}
    rotate, experts, window = fast_decode._rotate, fast_decode._experts, fast_decode._window_step

    def counted_window(*args):
        ran["window"] += 1
        return window(*args)

    monkeypatch.setattr(fast_decode, "_window_step", counted_window)

    def counted_rotate(rotary, x, start):
        ran["rotate"] += 1
        return rotate(rotary, x, start)

    def counted_experts(layer, x):
        out = experts(layer, x)
        ran["experts"] += out is not None
        return out

    monkeypatch.setattr(fast_decode, "_rotate", counted_rotate)
    monkeypatch.setattr(fast_decode, "_experts", counted_experts)
    return ran


def test_t5_v1_1_generate_gives_the_same_tokens_with_the_fast_path_off(monkeypatch):
    """T5 v1.1's untied `lm_head` through `fast_decode.dense` (a few rows by its transposed
    kernel on torch) and its gated-GELU blocks: the tokens of the Keras path."""
    import kzoo.presets

    keras.utils.set_random_seed(6)
    lm = kzoo.presets.load("t5_v1_1_small", dropout=0.0, num_layers=2, num_decoder_layers=2,
                           num_heads=2, hidden_dim=16, key_value_dim=8, intermediate_dim=24,
                           vocabulary_size=71)
    taken = []
    original = fast_decode._few_rows_product
    monkeypatch.setattr(fast_decode, "_few_rows_product",
                        lambda x, w, b=None: taken.append(tuple(w.shape)) or original(x, w, b))
    prompts = np.array([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]], "int32")
    fast = lm.generate(prompts, max_new_tokens=10, strategy="greedy", stop_token_ids=None)
    monkeypatch.setenv("KZOO_FAST_DECODE", "0")
    slow = lm.generate(prompts, max_new_tokens=10, strategy="greedy", stop_token_ids=None)
    assert [list(r) for r in fast] == [list(r) for r in slow]
    assert all(len(r) == 10 for r in fast)
    # the head's transposed kernel (vocabulary, width) multiplied a step's 2 rows
    assert (taken.count((71, 16)) >= 9) is TORCH, taken


@pytest.mark.torch_path
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_weights_written_during_a_loop_are_seen(batch):
    """What the fast path joins or copies once per loop (the q/k/v kernel side by side, the
    transposed tied embeddings, the transposed kernels of a step of 2 to 4 rows) follows a
    weight assigned in place inside the loop."""
    from kzoo.layers.embedding import TokenEmbedding

    r = np.random.default_rng(6)
    block = TransformerBlock(num_heads=2, intermediate_dim=12, causal=True)
    x = r.normal(size=(batch, 1, 8)).astype("float32")
    block(x)
    embedding = TokenEmbedding(20, 8, tie_weights=True)
    embedding(np.zeros((1, 1), "int32"))

    def step():  # (inside one loop context: what was made for the first step is kept)
        cache = keras.ops.zeros((batch, 2, 2, 3, 4))
        out, _ = fast_decode.decode_block(block, keras.ops.convert_to_tensor(x), cache=cache,
                                          cache_index=0)
        return to_numpy(out), to_numpy(fast_decode.unembed(embedding, out))

    with _no_grad(), fast_decode.fast_steps():
        first = step()
        attention = block.self_attention
        for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                      attention.output_dense, block.feedforward_layer.intermediate_dense):
            dense.kernel.assign(r.normal(size=tuple(dense.kernel.shape)).astype("float32"))
        embedding.embeddings.assign(r.normal(size=(20, 8)).astype("float32"))
        second = step()
    # The Keras path on the new weights (one query over a one-slot cache).
    cache = keras.ops.zeros((batch, 2, 2, 3, 4))
    out, _ = block(x, cache=cache, cache_index=0)
    expected = (to_numpy(out), to_numpy(embedding(out, reverse=True)))
    for got, want, before in zip(second, expected, first):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert np.abs(before - want).max() > 1e-2  # the weights did change the result


@pytest.mark.torch_path
@pytest.mark.parametrize("use_bias", [True, False])
def test_products_of_a_few_rows_equal_numpy(monkeypatch, use_bias):
    """A decode step's products of 2 to 4 rows (`_few_rows_product`: the transposed weight
    times the rows' transpose, on torch's CPU) give `x @ W + b`, the tied logits `h @ E.T`
    (soft-capped) and the q / k / v projections of NumPy, for every row count from 1 to 6;
    only 2 to 4 rows, float32, inside the loop and without autograd take that form (other
    backends: the Keras calls, never that form)."""
    from kzoo.layers.embedding import TokenEmbedding

    r = np.random.default_rng(11)
    taken = []
    original = fast_decode._few_rows_product
    monkeypatch.setattr(fast_decode, "_few_rows_product",
                        lambda *a, **k: taken.append(a[0].shape) or original(*a, **k))
    dense = keras.layers.Dense(24, use_bias=use_bias)
    dense.build((None, 16))
    for w in dense.weights:
        w.assign(r.normal(size=tuple(w.shape)).astype("float32"))
    kernel = to_numpy(dense.kernel)
    bias = to_numpy(dense.bias) if use_bias else 0.0
    embedding = TokenEmbedding(53, 16, tie_weights=True, logit_soft_cap=4.0)
    embedding(np.zeros((1, 1), "int32"))
    table = r.normal(size=(53, 16)).astype("float32")
    embedding.embeddings.assign(table)
    attention = TransformerBlock(num_heads=2, intermediate_dim=8, use_bias=use_bias)
    attention(np.zeros((1, 1, 16), "float32"))
    attention = attention.self_attention
    qkv = [(to_numpy(d.kernel), to_numpy(d.bias) if use_bias else 0.0)
           for d in (attention.query_dense, attention.key_dense, attention.value_dense)]
    for rows in range(1, 7):
        x = r.normal(size=(rows, 1, 16)).astype("float32")
        taken.clear()
        with _no_grad(), fast_decode.fast_steps():
            if TORCH:
                got = fast_decode._dense(dense, keras.ops.convert_to_tensor(x))
                q, k, v = fast_decode._project_qkv(attention, keras.ops.convert_to_tensor(x))
            else:
                got = dense(x)
                q, k, v = (d(x) for d in (attention.query_dense, attention.key_dense,
                                          attention.value_dense))
            logits = fast_decode.unembed(embedding, keras.ops.convert_to_tensor(x[:, 0]))
        np.testing.assert_allclose(to_numpy(got), x @ kernel + bias, rtol=1e-5, atol=1e-5)
        for value, (w, b) in zip((q, k, v), qkv):
            np.testing.assert_allclose(to_numpy(value), x @ w + b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_numpy(logits), 4.0 * np.tanh(x[:, 0] @ table.T / 4.0),
                                   rtol=1e-5, atol=1e-5)
        assert len(taken) == (3 if TORCH and 2 <= rows <= 4 else 0), (rows, taken)
    if TORCH:
        import torch

        x = torch.from_numpy(r.normal(size=(3, 16)).astype("float32"))
        w = torch.from_numpy(kernel)
        assert not fast_decode._few_rows(x, w)  # outside the loop
        with fast_decode.fast_steps():
            assert not fast_decode._few_rows(x, w)  # autograd on
            with torch.no_grad():
                assert fast_decode._few_rows(x, w)
                assert not fast_decode._few_rows(x.to(torch.bfloat16), w.to(torch.bfloat16))
                assert not fast_decode._few_rows(x, w, copied=fast_decode._COPY_LIMIT + 1)


@pytest.mark.parametrize("use_bias", [True, False])
def test_torch_linear_takes_onednn_outside_autograd_and_equals_numpy(monkeypatch, use_bias):
    """`torch_linear(x, W, b)` (the products of the torch fast path and the tied logits) is
    `x @ W.T + b` of NumPy in float64, for 2-D and 3-D inputs, a transposed-view weight (a
    Dense kernel's `.t()`) or a row-major one, and 1 to 300 rows; oneDNN's op (found in this
    torch build) is taken on CPU in float32 outside autograd only, and for one row only with
    the row-major weight: with grad mode on and an operand that
    requires a gradient it is `F.linear` (gradients against NumPy), as in bfloat16 and with
    `torch.backends.mkldnn.enabled = False`. Pure torch, so it runs on every backend."""
    import torch

    from kzoo.layers import utils

    assert utils._onednn_linear_op() is not None  # torch 2.13's CPU build has it
    taken = []
    op = utils._onednn_linear_op()
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR",
                        [lambda *a: taken.append(tuple(a[0].shape)) or op(*a)])
    r = np.random.default_rng(3)
    kernel = r.normal(size=(16, 24)).astype("float32")  # (in, out), as a Dense kernel
    bias = r.normal(size=(24,)).astype("float32") if use_bias else None
    weight = torch.from_numpy(kernel).t()  # (out, in), a column-major view
    b = None if bias is None else torch.from_numpy(bias)
    row_major = weight.contiguous()
    for shape in ((1, 16), (1, 1, 16), (4, 16), (7, 16), (2, 5, 16), (300, 16)):
        x = r.normal(size=shape).astype("float32")
        want = x.astype(np.float64) @ kernel.astype(np.float64) + (0.0 if bias is None else bias)
        one_row = x.size == 16  # (with the transposed view: F.linear)
        taken.clear()
        with torch.no_grad():
            got = utils.torch_linear(torch.from_numpy(x), weight, b)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
            assert taken == ([] if one_row else [shape])
            got = utils.torch_linear(torch.from_numpy(x), row_major, b)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
            assert len(taken) == (1 if one_row else 2)
        # grad mode on but nothing requires a gradient: still oneDNN
        got = utils.torch_linear(torch.from_numpy(x), row_major, b)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        assert len(taken) == (2 if one_row else 3)
    x = torch.from_numpy(r.normal(size=(3, 16)).astype("float32")).requires_grad_()
    w = weight.detach().clone().requires_grad_()
    taken.clear()
    out = utils.torch_linear(x, w, b)
    out.backward(torch.ones_like(out))
    assert taken == []
    np.testing.assert_allclose(x.grad.numpy(), np.tile(kernel.sum(1), (3, 1)), rtol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), np.tile(x.detach().numpy().sum(0), (24, 1)),
                               rtol=1e-5)
    with torch.no_grad():
        utils.torch_linear(x.to(torch.bfloat16), weight.to(torch.bfloat16),
                           None if b is None else b.to(torch.bfloat16))
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # torch's own switch
        got = utils.torch_linear(x, weight, b)
        monkeypatch.undo()
        assert torch.backends.mkldnn.enabled
    assert taken == []
    np.testing.assert_allclose(got.numpy(), x.detach().numpy() @ kernel
                               + (0.0 if bias is None else bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("layout", ["kernel_view", "row_major"])
def test_torch_linear_trains_through_onednn_and_equals_numpy(monkeypatch, use_bias, layout):
    """Under autograd, from `ONEDNN_TRAIN_ROWS` rows, `torch_linear` runs the product and the
    input's gradient through oneDNN (two calls of its op) and the weight's gradient through
    `torch.mm`: values and gradients of `x`, the weight (a Dense kernel's `.t()` or a
    row-major leaf) and the bias equal NumPy's in float64, the weight's gradient has the
    weight's layout (the kernel's gradient row-major, no copy), and a second derivative
    (`create_graph`) equals NumPy's. Fewer rows, `torch.backends.mkldnn.enabled = False` and
    bfloat16 take `F.linear` with the same values. Pure torch: every backend."""
    import torch

    from kzoo.layers import utils

    op = utils._onednn_linear_op()
    assert op is not None  # torch 2.13's CPU build has it
    taken = []
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR",
                        [lambda *a: taken.append(tuple(a[0].shape)) or op(*a)])
    r = np.random.default_rng(11)
    kernel = r.normal(size=(16, 24))  # (in, out)
    bias = r.normal(size=(24,)) if use_bias else None
    rows = utils.ONEDNN_TRAIN_ROWS

    def run(shape):
        x = r.normal(size=shape)
        upstream = r.normal(size=shape[:-1] + (24,))
        xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
        if layout == "kernel_view":
            leaf = torch.tensor(kernel, dtype=torch.float32, requires_grad=True)
            weight = leaf.t()
        else:
            leaf = weight = torch.tensor(np.ascontiguousarray(kernel.T), dtype=torch.float32,
                                         requires_grad=True)
        bt = None if bias is None else torch.tensor(bias, dtype=torch.float32,
                                                    requires_grad=True)
        taken.clear()
        y = utils.torch_linear(xt, weight, bt)
        y.backward(torch.tensor(upstream, dtype=torch.float32))
        want = x @ kernel + (0.0 if bias is None else bias)
        np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-5, atol=1e-5)
        g2, x2 = upstream.reshape(-1, 24), x.reshape(-1, 16)
        np.testing.assert_allclose(xt.grad.numpy(), upstream @ kernel.T, rtol=1e-5, atol=1e-5)
        d_kernel = x2.T @ g2
        np.testing.assert_allclose(leaf.grad.numpy(), d_kernel if layout == "kernel_view"
                                   else d_kernel.T, rtol=1e-5, atol=1e-5)
        if bias is not None:
            np.testing.assert_allclose(bt.grad.numpy(), g2.sum(0), rtol=1e-5, atol=1e-5)
        return xt, leaf, weight, bt, upstream

    _, leaf, weight, bt, _ = run((2, rows // 2 + 3, 16))
    assert taken == [(2, rows // 2 + 3, 16), (2 * (rows // 2 + 3), 24)]
    # the weight's own gradient as autograd hands it over (no accumulation): its layout
    x = torch.tensor(r.normal(size=(rows, 16)), dtype=torch.float32)
    (raw,) = torch.autograd.grad(utils.torch_linear(x, weight, bt).sum(), leaf)
    assert raw.is_contiguous()
    # a second derivative: d/dW sum((G W)^2) = 2 G^T (G W), through differentiable ops
    xt = x.clone().requires_grad_()
    upstream = r.normal(size=(rows, 24))
    taken.clear()
    (d_x,) = torch.autograd.grad(utils.torch_linear(xt, weight, bt), xt,
                                 torch.tensor(upstream, dtype=torch.float32), create_graph=True)
    leaf.grad = None
    (d_x ** 2).sum().backward()
    w_np = kernel.T  # (out, in)
    d_w = 2 * upstream.T @ (upstream @ w_np)
    np.testing.assert_allclose(leaf.grad.numpy(), d_w.T if layout == "kernel_view" else d_w,
                               rtol=1e-5, atol=1e-4)
    assert taken == [(rows, 16)]  # (the forward; the create_graph backward is torch ops)
    run((rows - 1, 16))  # fewer rows: F.linear
    assert taken == []
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    run((3, rows, 16))
    assert taken == []
    monkeypatch.undo()
    xb = torch.tensor(r.normal(size=(rows, 16)), dtype=torch.bfloat16, requires_grad=True)
    utils.torch_linear(xb, weight.detach().to(torch.bfloat16).requires_grad_(),
                       None if bt is None else bt.detach().to(torch.bfloat16)).sum().backward()
    assert taken == []


def _activation_reference(activation, pre):
    import math

    return {
        "gelu": 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2))),
        "gelu_tanh": 0.5 * pre * (1 + np.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre ** 3))),
        "relu": np.maximum(pre, 0),
    }[activation]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_torch_linear_activation_equals_numpy_on_both_paths(monkeypatch, activation):
    """`torch_linear(..., activation=...)`: oneDNN's post-op (no autograd) and `F.linear`
    then the torch function (autograd on) both give NumPy's exact GELU (erf), tanh GELU or
    ReLU of `x @ W.T + b` in float64; an unknown name is refused naming it."""
    import torch

    from kzoo.layers import utils

    taken = []
    op = utils._onednn_linear_op()
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR",
                        [lambda *a: taken.append(a[3:]) or op(*a)])
    r = np.random.default_rng(4)
    x = r.normal(size=(2, 9, 16)).astype("float32")
    kernel = r.normal(scale=0.5, size=(16, 24)).astype("float32")
    bias = r.normal(size=(24,)).astype("float32")
    want = _activation_reference(
        activation, x.astype(np.float64) @ kernel.astype(np.float64) + bias)
    weight = torch.from_numpy(kernel).t()
    with torch.no_grad():
        got = utils.torch_linear(torch.from_numpy(x), weight, torch.from_numpy(bias),
                                 activation=activation)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    assert taken == [(utils._TORCH_LINEAR_ACTIVATIONS[activation][0], [],
                      utils._TORCH_LINEAR_ACTIVATIONS[activation][1])]
    w = weight.detach().clone().requires_grad_()
    got = utils.torch_linear(torch.from_numpy(x), w, torch.from_numpy(bias),
                             activation=activation)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-5)
    assert len(taken) == 1
    with pytest.raises(ValueError, match="activation='swish'"):
        utils.torch_linear(torch.from_numpy(x), weight, activation="swish")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_torch_linear_activation_is_timed_once_a_shape_and_the_faster_way_kept(
        monkeypatch, activation):
    """On oneDNN's path, "auto": the first product of an activation and shape with
    `ACTIVATION_TIMING_ROWS` rows or more times the post-op against the torch ops after the
    product (once; later products of that shape reuse the verdict); fewer rows take the
    post-op untimed; "fused" / "separate" never time. Every way gives NumPy's float64 values."""
    import torch

    from kzoo.layers import utils

    op = utils._onednn_linear_op()
    attrs = []
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR", [lambda *a: attrs.append(a[3]) or op(*a)])
    monkeypatch.setattr(utils, "_ACTIVATION_MODE", ["auto"])
    monkeypatch.setattr(utils, "_ACTIVATION_CHOICE", {})
    verdicts, timed = [False], []
    monkeypatch.setattr(utils, "_time_post_op",
                        lambda act, rows, w, b: timed.append((act, tuple(rows.shape)))
                        or verdicts[0])
    r = np.random.default_rng(5)
    rows = utils.ACTIVATION_TIMING_ROWS
    x = r.normal(size=(2, rows // 2 + 3, 16)).astype("float32")
    kernel = r.normal(scale=0.5, size=(16, 40)).astype("float32")  # (the tanh GELU's passes
    bias = r.normal(size=(40,)).astype("float32")                  # from 8192 values)
    want = _activation_reference(
        activation, x.astype(np.float64) @ kernel.astype(np.float64) + bias)
    weight, b = torch.from_numpy(kernel).t(), torch.from_numpy(bias)
    post_op = utils._TORCH_LINEAR_ACTIVATIONS[activation][0]

    def run(inputs=x):
        with torch.no_grad():
            return utils.torch_linear(torch.from_numpy(inputs), weight, b,
                                      activation=activation).numpy()

    for _ in range(2):  # the torch ops after the product won: timed once
        np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)
    assert timed == [(activation, (rows + 6, 16))] and attrs == ["none", "none"]
    few = x[:1, :rows // 2]  # fewer rows: the post-op, untimed
    np.testing.assert_allclose(run(few), want[:1, :rows // 2], rtol=1e-5, atol=1e-5)
    assert len(timed) == 1 and attrs[-1] == post_op
    verdicts[0] = True  # another shape (8 inputs), where the post-op wins
    weight8 = torch.from_numpy(np.ascontiguousarray(kernel[:8])).t()
    with torch.no_grad():
        got = utils.torch_linear(torch.from_numpy(np.ascontiguousarray(x[:, :, :8])), weight8,
                                 b, activation=activation).numpy()
    np.testing.assert_allclose(got, _activation_reference(
        activation, x[:, :, :8].astype(np.float64) @ kernel[:8].astype(np.float64) + bias),
        rtol=1e-5, atol=1e-5)
    assert len(timed) == 2 and attrs[-1] == post_op
    for mode, attr in (("separate", "none"), ("fused", post_op)):
        assert utils.set_onednn_activation(mode) in ("auto", "separate")
        np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)
        assert len(timed) == 2 and attrs[-1] == attr
    assert utils.set_onednn_activation("auto") == "fused" and utils._ACTIVATION_CHOICE == {}
    with pytest.raises(ValueError, match="mode='always'"):
        utils.set_onednn_activation("always")


@pytest.mark.parametrize("fused_time, separate_time, fused_wins",
                         [(1.0, 2.0, True), (3.0, 2.0, False), (2.0, 2.0, True)])
def test_post_op_timing_compares_medians_past_the_first_call(monkeypatch, fused_time,
                                                            separate_time, fused_wins):
    """`_time_post_op` with a clock that makes each way take a set time: the first call of
    each way (made 100x slower for the post-op, 100x faster for the other) is not counted;
    the medians of the rest decide, a tie for the post-op. It times at most
    2 x ACTIVATION_TIMING_ROWS rows."""
    import torch

    from kzoo.layers import utils

    assert utils.onednn_linear_available()
    seen = []
    real = utils._ONEDNN_LINEAR[0]
    durations = []
    for call in range(1 + utils._ACTIVATION_TIMING_CALLS):
        durations += [fused_time * (100 if call == 0 else 1),
                      separate_time / (100 if call == 0 else 1)]
    ticks, now = [], 0.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1
    clock = iter(ticks).__next__
    rows = torch.randn(3 * utils.ACTIVATION_TIMING_ROWS, 8)
    weight, bias = torch.randn(4, 8), torch.randn(4)
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR",
                        [lambda *a: seen.append(a[0].shape[0]) or real(*a)])
    got = utils._time_post_op("gelu_tanh", rows, weight, bias, clock=clock)
    assert got is fused_wins
    assert seen == [2 * utils.ACTIVATION_TIMING_ROWS] * len(durations)


# === Compiled loops (JAX / TensorFlow): values made once before the while_loop ===


def test_loop_constant_is_made_once_before_the_loop_and_in_place_inside_it():
    made = []

    def make(tag):
        return lambda: made.append(tag) or len(made)

    assert fast_decode.loop_constant("a", make("a")) == 1  # no compiled loop: every call
    assert fast_decode.loop_constant("a", make("a")) == 2
    made.clear()
    with fast_decode.compiled_loop():
        first = fast_decode.loop_constant("a", make("a"))
        with fast_decode.loop_body():
            assert fast_decode.loop_constant("a", make("a")) == first  # the prefill's value
            inside = fast_decode.loop_constant("b", make("b"))
            assert fast_decode.loop_constant("b", make("b")) == inside + 1  # not kept
        assert fast_decode.loop_constant("a", make("a")) == first
        with fast_decode.compiled_loop():  # a nested trace starts afresh
            assert fast_decode.loop_constant("a", make("a")) == 4
        assert fast_decode.loop_constant("a", make("a")) == first
    assert made == ["a", "b", "b", "a"]
    assert fast_decode.loop_constant("a", make("a")) == 5


def _round_to_bfloat16(x):
    """float32 -> nearest bfloat16 (ties to even), back as float32."""
    bits = x.astype("float32").view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("soft_cap, reverse_dtype", [(None, None), (3.0, "float32")])
def test_unembed_in_a_compiled_loop_equals_numpy(soft_cap, reverse_dtype):
    """The tied logits with the transposed table made once (`_hoisted_unembed`), under mixed
    precision too (`reverse_dtype`), against `h @ E.T` (soft-capped) in NumPy."""
    from kzoo.layers.embedding import TokenEmbedding

    r = np.random.default_rng(3)
    policy = "mixed_bfloat16" if reverse_dtype else "float32"
    layer = TokenEmbedding(37, 8, tie_weights=True, logit_soft_cap=soft_cap,
                           reverse_dtype=reverse_dtype, dtype=policy)
    layer(np.zeros((1, 1), "int32"))
    table = r.normal(size=(37, 8)).astype("float32")
    layer.embeddings.assign(table)
    hidden = r.normal(size=(3, 8)).astype("float32")
    # The layer's call rounds its input to the compute dtype (bfloat16) first.
    seen = _round_to_bfloat16(hidden) if reverse_dtype else hidden

    def expected(h):
        logits = h @ table.T
        return soft_cap * np.tanh(logits / soft_cap) if soft_cap else logits

    with fast_decode.compiled_loop():
        got = fast_decode.unembed(layer, keras.ops.convert_to_tensor(hidden))
        again = fast_decode.unembed(layer, keras.ops.convert_to_tensor(2 * hidden))
    assert keras.backend.standardize_dtype(got.dtype) == (reverse_dtype or "float32")
    np.testing.assert_allclose(to_numpy(got), expected(seen), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(again), expected(2 * seen), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_joined_qkv_in_a_compiled_loop_equals_numpy(use_bias):
    """JAX's compiled loop projects q / k / v with the three kernels side by side, joined
    once per loop (`hoisted_qkv`): the projections equal NumPy's, with and without biases
    and with fewer key/value heads; LoRA layers, other backends and calls outside a
    compiled loop keep the three `Dense` calls (None)."""
    from kzoo.layers.attention import MultiHeadAttention

    r = np.random.default_rng(12)
    layer = MultiHeadAttention(num_heads=4, head_dim=4, num_kv_heads=2, use_bias=use_bias)
    x = r.normal(size=(3, 1, 16)).astype("float32")
    layer(x)
    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    for d in denses:
        for w in d.weights:
            w.assign(r.normal(size=tuple(w.shape)).astype("float32"))
    expected = [x @ to_numpy(d.kernel) + (to_numpy(d.bias) if use_bias else 0.0)
                for d in denses]
    assert fast_decode.hoisted_qkv(layer, keras.ops.convert_to_tensor(x)) is None
    with fast_decode.compiled_loop():
        got = fast_decode.hoisted_qkv(layer, keras.ops.convert_to_tensor(x))
        if keras.backend.backend() != "jax":
            assert got is None
            return
        with fast_decode.loop_body():
            again = fast_decode.hoisted_qkv(layer, keras.ops.convert_to_tensor(2 * x))
        layer.value_dense.enable_lora(2)
        assert fast_decode.hoisted_qkv(layer, keras.ops.convert_to_tensor(x)) is None
    for value, doubled, d, want in zip(got, again, denses, expected):
        np.testing.assert_allclose(to_numpy(value), want, rtol=1e-5, atol=1e-5)
        bias = to_numpy(d.bias) if use_bias else 0.0
        np.testing.assert_allclose(to_numpy(doubled), 2 * x @ to_numpy(d.kernel) + bias,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_compiled_generate_makes_the_transposed_table_once(monkeypatch, family):
    """JAX / TensorFlow: the compiled loop's steps read one `E^T` made before the
    `while_loop` (one `loop_constant` made for the trace, the hoisted product in the prefill
    and in the body; on JAX also each self-attention's joined q / k / v kernel) and give the
    tokens of the uncompiled loop (the layer's own calls). PyTorch's Python loop never takes
    them."""
    from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM

    keras.utils.set_random_seed(9)
    if family == "gpt":
        lm = GPTCausalLM(GPTBackbone(vocabulary_size=97, num_layers=2, num_heads=2,
                                     hidden_dim=16, intermediate_dim=32,
                                     max_sequence_length=40))
        prompts = [[5, 6, 7, 8], [9, 10]]
    else:
        lm = T5Seq2SeqLM(T5Backbone(vocabulary_size=97, num_layers=2, num_heads=2,
                                    hidden_dim=16, intermediate_dim=32, key_value_dim=8))
        prompts = np.array([[5, 6, 7, 8, 1], [9, 10, 11, 1, 0]], "int32")
    made, products = [], []
    real_constant, real_unembed = fast_decode.loop_constant, fast_decode._hoisted_unembed

    def loop_constant(tag, make):
        return real_constant(tag, lambda: made.append(tag[0]) or make())

    def hoisted(layer, hidden):
        products.append(layer)
        return real_unembed(layer, hidden)

    monkeypatch.setattr(fast_decode, "loop_constant", loop_constant)
    monkeypatch.setattr(fast_decode, "_hoisted_unembed", hoisted)
    for strategy, kw in (("greedy", {}), ("beam", dict(num_beams=3))):
        made.clear(), products.clear()
        compiled = lm.generate(prompts, max_new_tokens=9, strategy=strategy,
                               stop_token_ids=None, **kw)
        if keras.backend.backend() == "torch":
            assert made == [] and products == []
        else:
            # One trace: each made once, before the loop (the joined q / k / v kernels of
            # each self-attention layer on JAX, see test_joined_qkv_in_a_compiled_loop...).
            joined = 2 if keras.backend.backend() == "jax" else 0
            assert sorted(made) == ["qkv"] * joined + ["unembed_t"]
            assert len(products) == 2  # the prefill's and the body's product
        if strategy == "beam" and keras.backend.backend() == "jax":
            # (JAX's eager beam loop compiles each of its ops' shapes: ~60 s of the suite for a
            # token check that test_generation.py makes of the compiled beam loop against
            # transformers; greedy's eager tokens are still compared below)
            continue
        eager = lm.generate(prompts, max_new_tokens=9, strategy=strategy, stop_token_ids=None,
                            compile=False, **kw)
        np.testing.assert_array_equal(np.asarray(compiled), np.asarray(eager))


# === Whole-sequence forward passes (predict / no_grad model calls) ===

FORWARD_CONFIGS = {
    "gpt2": dict(norm_first=True, causal=True),
    "bert": dict(norm_first=False, activation="gelu"),
    "llama": dict(norm="rmsnorm", feedforward="gated", activation="silu", use_bias=False,
                  num_kv_heads=2, causal=True, rope_max_wavelength=10000),
    "t5_encoder": dict(norm="rmsnorm", activation="relu", use_bias=False, attention_scale=1.0,
                       head_dim=3),
    "moe": dict(causal=True, feedforward="moe", num_experts=4, top_k=2),
}


def _count_block_forward(monkeypatch):
    """A list that gets an item at every `block_forward` call (which still runs)."""
    calls = []
    real = fast_decode.block_forward
    monkeypatch.setattr(fast_decode, "block_forward",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _block_model(block, with_bias):
    """A Functional model around `block` (the fast forward runs inside a model's call)."""
    x = keras.Input((6, 16))
    pad = keras.Input((6,), dtype="int32")
    inputs = [x, pad]
    kwargs = {"padding_mask": pad}
    if with_bias:
        bias = keras.Input((4, 6, 6))
        inputs.append(bias)
        kwargs["attention_bias"] = bias
    return keras.Model(inputs, block(x, **kwargs))


@pytest.mark.parametrize("name", sorted(FORWARD_CONFIGS))
def test_forward_in_inference_equals_the_numpy_block(name, monkeypatch):
    """A model call under no_grad runs each block through `block_forward` on torch (counted)
    and gives the NumPy block's numbers, with padded rows (left and right padding) and, for
    T5's encoder, a relative-position bias. The rotary and MoE blocks, which the NumPy block
    lacks, are checked against their Keras call (KZOO_FAST_DECODE=0)."""
    kwargs = FORWARD_CONFIGS[name]
    r = np.random.default_rng(7)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    pad = np.array([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]], "int32")
    with_bias = name == "t5_encoder"
    bias = r.normal(size=(2, 4, 6, 6)).astype("float32")
    block = TransformerBlock(num_heads=4, intermediate_dim=24, **kwargs)
    model = _block_model(block, with_bias)
    for w in block.weights:  # non-trivial biases and norm scales
        if "seed" not in w.path:
            w.assign(r.normal(scale=0.3, size=w.shape).astype(w.dtype))
    inputs = [x, pad] + ([bias] if with_bias else [])
    calls = _count_block_forward(monkeypatch)
    with _no_grad():
        got = to_numpy(model(inputs, training=False))
    assert len(calls) == (1 if TORCH else 0)
    keep = pad.astype(bool)
    if "rope_max_wavelength" in kwargs or kwargs.get("feedforward") == "moe":
        monkeypatch.setenv("KZOO_FAST_DECODE", "0")  # the Keras path
        expected = to_numpy(model(inputs, training=False))
        assert len(calls) == (1 if TORCH else 0)
    else:
        expected = _np_block(block, x, keep, bias=bias if with_bias else None)
    np.testing.assert_allclose(got[keep], expected[keep], atol=3e-5, rtol=1e-4)


@pytest.mark.torch_path
def test_forward_path_where_it_applies(monkeypatch):
    """Inside a model's call only (not for a block called on its own), not with a
    packed-document mask, not with KZOO_FAST_DECODE=0. In inference with autograd off, any
    block; with autograd on or training, only a block that `trains_plainly` (no LayerDrop,
    rematerialisation or MoE; dropout does). Mixed precision takes it too (bfloat16 out, as
    the Keras layers give)."""
    x = np.random.default_rng(0).normal(size=(1, 4, 8)).astype("float32")
    calls = _count_block_forward(monkeypatch)
    inp = keras.Input((4, 8))

    def wrapped(**kwargs):
        block = TransformerBlock(num_heads=2, intermediate_dim=8, causal=True, **kwargs)
        return block, keras.Model(inp, block(inp))

    block, model = wrapped()
    mask_in = keras.Input((1, 4, 4), dtype="bool")
    packed = keras.Model([inp, mask_in], block(inp, attention_mask=mask_in))
    with _no_grad():
        block(x)  # the outermost layer
        packed([x, np.ones((1, 1, 4, 4), bool)])
        monkeypatch.setenv("KZOO_FAST_DECODE", "0")
        model(x)
        model(x, training=True)
        monkeypatch.delenv("KZOO_FAST_DECODE")
    assert calls == []
    with _no_grad():
        model(x)
        model.predict_on_batch(x)
    model(x)  # autograd on
    model(x, training=True)  # (a training step's forward)
    assert len(calls) == (4 if TORCH else 0)
    for kwargs in (dict(layerdrop=0.1), dict(remat=True),
                   dict(feedforward="moe", num_experts=2, top_k=1)):
        calls.clear()
        _, model = wrapped(**kwargs)
        model(x, training=True)
        model(x)  # autograd on (a backward pass may follow)
        assert calls == [], kwargs
        with _no_grad():
            model(x)
        assert len(calls) == (1 if TORCH else 0), kwargs
    calls.clear()
    _, model = wrapped(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    model(x, training=True)
    assert len(calls) == (1 if TORCH else 0)
    # (two blocks: the second one is handed bfloat16 hidden states by the first, which gets
    # float32 and so runs its Keras call)
    calls.clear()
    mixed = [TransformerBlock(num_heads=2, intermediate_dim=8, causal=True,
                              dtype="mixed_bfloat16") for _ in range(2)]
    mixed_model = keras.Model(inp, mixed[1](mixed[0](inp)))
    out = mixed_model(x)
    assert len(calls) == (1 if TORCH else 0)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"


TRAIN_CONFIGS = {k: v for k, v in FORWARD_CONFIGS.items() if k != "moe"}
# Every dropout of a block (residual, attention probabilities, feed-forward activations);
# post-LN with a gated feed-forward, to reach the other dropout sites.
TRAIN_CONFIGS["gpt2_dropout"] = dict(norm_first=True, causal=True, dropout=0.3,
                                     attention_dropout=0.2, activation_dropout=0.4)
TRAIN_CONFIGS["gated_dropout"] = dict(norm_first=False, feedforward="gated",
                                      activation="silu", dropout=0.3, activation_dropout=0.4)


@pytest.mark.torch_path
@pytest.mark.parametrize("name", sorted(TRAIN_CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_training_gradients_equal_the_keras_layers(name, dtype, monkeypatch):
    """A training forward and backward through `block_forward` (torch, counted) give the
    loss and the gradients of every weight and of the input that the Keras layers' call
    gives (KZOO_FAST_DECODE=0), with padded rows, T5's relative bias and dropout (both
    passes start from the same random state, so they draw the same masks; a pass from
    another differs): float32 to 1e-5, mixed bfloat16 to bfloat16's resolution. Other
    backends: their Keras call, the loss checked finite (there is no second path to
    compare)."""
    from keras import ops

    kwargs = TRAIN_CONFIGS[name]
    r = np.random.default_rng(8)
    x = r.normal(size=(2, 6, 16)).astype("float32")
    pad = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], "int32")
    with_bias = name == "t5_encoder"
    bias = r.normal(size=(2, 4, 6, 6)).astype("float32")
    g = r.normal(size=(2, 6, 16)).astype("float32")
    calls = _count_block_forward(monkeypatch)
    first = keras.Input((6, 16))
    dense = keras.layers.Dense(16, dtype=dtype)  # (hands the block its compute dtype)
    block = TransformerBlock(num_heads=4, intermediate_dim=24, dtype=dtype, **kwargs)
    pad_in = keras.Input((6,), dtype="int32")
    inputs, call = [first, pad_in], {"padding_mask": pad_in}
    if with_bias:
        bias_in = keras.Input((4, 6, 6))
        inputs.append(bias_in)
        call["attention_bias"] = bias_in
    model = keras.Model(inputs, block(dense(first), **call))
    for w in model.weights:
        if "seed" not in w.path:
            w.assign(r.normal(scale=0.3, size=w.shape).astype(w.dtype))
    values = [x, pad] + ([bias] if with_bias else [])

    # Dropout's random state: the seed generators' (seeded ones) and torch's own (Keras'
    # torch dropout draws unseeded generators' masks from it), both reset before each pass.
    seeds = [(gen.state, to_numpy(gen.state.value)) for layer in model._flatten_layers()
             for gen in getattr(layer, "_seed_generators", ())]

    def loss_and_grads(seed=0):
        for state, value in seeds:
            state.assign(value)
        if not TORCH:
            out = model(values, training=True)
            return [to_numpy(ops.sum(ops.cast(out, "float32") * g))]
        import torch

        torch.manual_seed(seed)
        xt = torch.tensor(x, requires_grad=True)
        out = model([xt] + [torch.as_tensor(v) for v in values[1:]], training=True)
        loss = (out.float() * torch.from_numpy(g)).sum()
        weights = [w.value for w in model.trainable_weights]
        grads = torch.autograd.grad(loss, weights + [xt])
        return [loss.detach().numpy()] + [t.float().numpy() for t in grads]

    fast = loss_and_grads()
    if TORCH and "dropout" in name:
        other = loss_and_grads(seed=1)  # (other masks: the dropout is live)
        assert not np.allclose(other[0], fast[0], atol=1e-3, rtol=1e-3)
    assert len(calls) == (2 if TORCH and "dropout" in name else 1 if TORCH else 0)
    monkeypatch.setenv("KZOO_FAST_DECODE", "0")
    slow = loss_and_grads()
    assert len(calls) == (2 if TORCH and "dropout" in name else 1 if TORCH else 0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    assert len(fast) == len(slow) == (2 + len(model.trainable_weights) if TORCH else 1)
    for got, want in zip(fast, slow):
        assert np.isfinite(got).all()
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got / scale, want / scale, **tol)


def _np_rotary(x, positions, base, scaling, interleaved):
    """RoPE in NumPy (float64): pairs (i, i + d/2) or (2i, 2i + 1) of `x (b, t, h, d)` turned
    by `positions[t] / scaling * base ** (-2i / d)`."""
    d = x.shape[-1]
    theta = base ** (-np.arange(0, d, 2) / d)
    angles = (np.asarray(positions, "float64") / scaling)[:, None] * theta  # (t, d/2)
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    x = x.astype("float64")
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x.shape)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.torch_path
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_rotation_equals_numpy_and_the_layer(interleaved, scaling):
    """The decode loop's rotation (`_rotate`: torch calls, a step's cosines and sines shared
    by its layers) turns queries and keys as NumPy's RoPE does, at a Python int and at a
    tensor start, and gives exactly the layer's numbers on torch; a per-row start takes the
    layer's own call. Other backends: the layer's call."""
    from kzoo.layers.position import RotaryEmbedding

    rotary = RotaryEmbedding(max_wavelength=500.0, scaling_factor=scaling,
                             interleaved=interleaved)
    r = np.random.default_rng(13)
    for start, seq in ((0, 5), (7, 1), (7, 1), (30, 3)):
        for index in ("int", "tensor"):
            x = r.normal(size=(2, seq, 3, 8)).astype("float32")
            given = start if index == "int" else keras.ops.convert_to_tensor(start, "int32")
            with _no_grad(), fast_decode.fast_steps():
                if TORCH:
                    got = fast_decode._rotate(rotary, keras.ops.convert_to_tensor(x), given)
                else:
                    got = rotary(x, start_index=given)
            expected = _np_rotary(x, np.arange(start, start + seq), 500.0, scaling,
                                  interleaved)
            np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(to_numpy(got),
                                          to_numpy(rotary(x, start_index=given)))
    if TORCH:
        import torch

        x = torch.from_numpy(r.normal(size=(2, 1, 3, 8)).astype("float32"))
        calls = []
        original = rotary.call
        rotary.call = lambda *a, **k: calls.append(1) or original(*a, **k)
        per_row = torch.tensor([3, 9], dtype=torch.int32)
        got = fast_decode._rotate(rotary, x, per_row)
        assert calls, "a per-row start goes to the layer's call"
        for row, start in enumerate((3, 9)):
            np.testing.assert_allclose(
                to_numpy(got)[row:row + 1],
                _np_rotary(x.numpy()[row:row + 1], [start], 500.0, scaling, interleaved),
                rtol=1e-5, atol=1e-5)


def test_untied_logits_and_a_dense_head_of_a_few_rows_equal_numpy(monkeypatch):
    """An untied head (`unembed` of a `TokenEmbedding` without tied weights) and a `Dense`
    head (`fast_decode.dense`, T5 v1.1's `lm_head`) give `h @ W` of NumPy for 1 to 6 rows;
    on torch 2 to 4 rows multiply the transposed kernel (`_few_rows_product`)."""
    from kzoo.layers.embedding import TokenEmbedding
    from kzoo.layers.utils import RowDense

    r = np.random.default_rng(17)
    taken = []
    original = fast_decode._few_rows_product
    monkeypatch.setattr(fast_decode, "_few_rows_product",
                        lambda *a, **k: taken.append(tuple(a[1].shape)) or original(*a, **k))
    embedding = TokenEmbedding(59, 16, tie_weights=False)
    embedding(np.zeros((1, 1), "int32"))
    reverse = r.normal(size=(16, 59)).astype("float32")
    embedding.reverse_embeddings.assign(reverse)
    head = RowDense(43, use_bias=False)
    head.build((None, None, 16))
    kernel = r.normal(size=(16, 43)).astype("float32")
    head.kernel.assign(kernel)
    for rows in range(1, 7):
        h = r.normal(size=(rows, 16)).astype("float32")
        taken.clear()
        with _no_grad(), fast_decode.fast_steps():
            logits = fast_decode.unembed(embedding, keras.ops.convert_to_tensor(h))
            dense = fast_decode.dense(head, keras.ops.convert_to_tensor(h[:, None]))
        np.testing.assert_allclose(to_numpy(logits), h @ reverse, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_numpy(dense)[:, 0], h @ kernel, rtol=1e-5, atol=1e-5)
        expected = [(59, 16), (43, 16)] if TORCH and 2 <= rows <= 4 else []
        assert taken == expected, (rows, taken)


def _np_experts(x, router, w_in, w_out, b_in, b_out, top_k, capacity_factor, gated):
    """A mixture of experts in NumPy: softmax router, top-k renormalised, capacity in
    choice-major then row order (an expert keeps its first `capacity` assignments), SiLU
    gated experts (gate units first) or GELU (erf) plain ones, choices summed."""
    from math import ceil, erf

    rows, experts = x.shape[0], router.shape[1]
    logits = x @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(p, order, -1)
    weight /= weight.sum(-1, keepdims=True)
    keep = np.ones_like(weight, bool)
    if capacity_factor is not None:
        capacity = min(rows, max(1, ceil(capacity_factor * rows * top_k / experts)))
        used = np.zeros(experts, int)
        for j in range(top_k):
            for i in range(rows):
                keep[i, j] = used[order[i, j]] < capacity
                used[order[i, j]] += 1
    out = np.zeros_like(x, dtype="float64")
    for i in range(rows):
        for j in range(top_k):
            e = order[i, j]
            h = x[i] @ w_in[e] + b_in[e]
            if gated:
                gate, up = np.split(h, 2)
                h = gate / (1 + np.exp(-gate)) * up
            else:
                h = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
            out[i] += keep[i, j] * weight[i, j] * (h @ w_out[e] + b_out[e])
    return out


@pytest.mark.torch_path
@pytest.mark.parametrize("rows, experts, top_k, capacity_factor, gated", [
    (3, 4, 1, None, True),    # 3 assignments < 4 experts: the chosen kernels gathered
    (4, 4, 2, None, True),    # every expert on every row, the chosen outputs picked
    (6, 3, 2, 0.5, False),    # plain experts with biases; over capacity: dropped
])
def test_experts_of_a_decode_step_equal_numpy(rows, experts, top_k, capacity_factor, gated,
                                              monkeypatch):
    """A mixture of experts inside the decode loop (torch: `fast_decode._experts`, the
    compiled step's routing run eagerly; elsewhere the layer's call) equals NumPy's experts
    for a step's rows, dropping what the capacity drops."""
    from kzoo.layers.moe import MixtureOfExperts

    r = np.random.default_rng(19)
    layer = MixtureOfExperts(experts, 12, top_k=top_k, capacity_factor=capacity_factor,
                             expert_type="gated" if gated else "plain",
                             use_bias=not gated)
    layer.build((None, None, 8))
    for w in layer.weights:
        w.assign(r.normal(size=tuple(w.shape)).astype("float32") * 0.5)
    x = r.normal(size=(rows, 1, 8)).astype("float32")
    value = {w.path.split("/")[-1]: to_numpy(w) for w in layer.weights}
    if gated:
        w_in = np.concatenate([value["gate_kernel"], value["up_kernel"]], -1)
        b_in = np.zeros((experts, 24), "float32")
        b_out = np.zeros((experts, 8), "float32")
    else:
        w_in, b_in, b_out = (value["intermediate_kernel"], value["intermediate_bias"],
                             value["output_bias"])
    expected = _np_experts(x[:, 0], value["kernel"], w_in, value["output_kernel"], b_in,
                           b_out, top_k, capacity_factor, gated)
    ran = _count_torch_parts(monkeypatch)
    with _no_grad(), fast_decode.fast_steps():
        got = fast_decode._feedforward(layer, keras.ops.convert_to_tensor(x))
    np.testing.assert_allclose(to_numpy(got)[:, 0], expected, rtol=1e-4, atol=1e-5)
    assert ran["experts"] == (1 if TORCH else 0) and ran["window"] == 0
    if capacity_factor is not None:  # the capacity binds: without it the rows differ
        free = _np_experts(x[:, 0], value["kernel"], w_in, value["output_kernel"], b_in,
                           b_out, top_k, None, gated)
        assert np.abs(free - expected).max() > 1e-3


@pytest.mark.torch_path
def test_no_padding_is_asked_once_per_mask_tensor_where_asking_waits(monkeypatch):
    """`kernels_torch.no_padding`: where asking waits for the device (CUDA; here the CPU
    put in its place), a padding mask's "every token real?" is asked once per tensor and
    remembered with its version counter (an in-place change asks again); never while a CUDA
    graph is captured; rank-3 masks and non-tensors are never "no padding". A GPT forward
    of two layers asks once, and its outputs equal those of the same model without the
    mask, and (with a padded row) those of the path that never asks. (JAX / TensorFlow:
    the outputs with an all-true mask equal those without one.)"""
    model = GPTCausalLM(GPTBackbone(vocabulary_size=40, num_layers=2, num_heads=2,
                                    hidden_dim=8, intermediate_dim=16,
                                    max_sequence_length=16, dropout=0.0))
    ids = np.random.default_rng(3).integers(1, 40, (2, 7)).astype("int32")
    full = np.ones((2, 7), "int32")
    padded = full.copy()
    padded[1, :2] = 0
    with _no_grad():
        never = {name: to_numpy(model({"token_ids": ids, "padding_mask": m}))
                 for name, m in (("full", full), ("padded", padded))}
        unmasked = to_numpy(model({"token_ids": ids}))
    np.testing.assert_allclose(never["full"], unmasked, rtol=1e-6, atol=1e-6)
    if not TORCH:
        return
    import torch

    from kzoo.layers import kernels_torch

    asked = []
    original_all = torch.Tensor.all

    def counted_all(self, *args, **kwargs):
        asked.append(tuple(self.shape))
        return original_all(self, *args, **kwargs)

    monkeypatch.setattr(kernels_torch, "ASKED_ONCE", ("cpu", "cuda"))
    monkeypatch.setattr(torch.Tensor, "all", counted_all)
    mask = torch.ones((2, 5), dtype=torch.int32)
    assert kernels_torch.no_padding(mask) and kernels_torch.no_padding(mask)
    assert asked == [(2, 5)]
    mask[1, 3] = 0  # (in place: the version counter moves)
    assert not kernels_torch.no_padding(mask) and len(asked) == 2
    assert not kernels_torch.no_padding(mask) and len(asked) == 2
    assert not kernels_torch.no_padding(torch.ones((2, 5, 5), dtype=torch.bool))
    assert not kernels_torch.no_padding([[1, 1]]) and not kernels_torch.no_padding(None)
    with monkeypatch.context() as capture:
        capture.setattr(kernels_torch, "_capturing", lambda device: True)
        assert not kernels_torch.no_padding(torch.ones((2, 5), dtype=torch.int32))
    answers = torch.func.vmap(  # (a batched tensor cannot be asked: the mask is kept)
        lambda m: torch.tensor(float(kernels_torch.no_padding(m))))(
        torch.ones((3, 2, 5), dtype=torch.int32))
    assert answers.tolist() == [0.0, 0.0, 0.0]
    with torch.inference_mode():  # (no version counter: never asked, never remembered)
        assert not kernels_torch.no_padding(torch.ones((2, 5), dtype=torch.int32))
        inferred = to_numpy(model({"token_ids": ids, "padding_mask": full}))
    np.testing.assert_allclose(inferred, unmasked, rtol=1e-6, atol=1e-6)

    asked.clear()
    with _no_grad():
        once = to_numpy(model({"token_ids": ids, "padding_mask": full}))
        assert asked == [(2, 7)]  # (two layers, one question)
        with_padding = to_numpy(model({"token_ids": ids, "padding_mask": padded}))
    np.testing.assert_allclose(once, unmasked, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(with_padding, never["padded"], rtol=1e-6, atol=1e-6)
