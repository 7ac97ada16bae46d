"""`kzoo.losses.TokenCrossentropy` against the formula written in NumPy and against Keras'
`SparseCategoricalCrossentropy(from_logits=True)`; the token task models' default loss."""

import keras
import numpy as np
import pytest

from kzoo.losses import TokenCrossentropy
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from tests.harness import to_numpy
from tests.helpers import value_and_grads


def _np_token_ce(y, logits):
    logits = logits.astype("float64")
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]


@pytest.mark.parametrize("shape", [(5, 7), (2, 4, 11), (3, 1, 2, 6)])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "none",
                                       "mean_with_sample_weight"])
def test_matches_the_formula_and_keras(shape, reduction):
    r = np.random.default_rng(len(shape))
    logits = (4 * r.normal(size=shape)).astype("float32")
    y = r.integers(0, shape[-1], shape[:-1]).astype("int32")
    w = r.uniform(size=shape[:-1]).astype("float32")
    per_token = _np_token_ce(y, logits)
    got = to_numpy(TokenCrossentropy(reduction=reduction)(y, logits, sample_weight=w))
    expected = {
        "sum_over_batch_size": (per_token * w).sum() / per_token.size,
        "sum": (per_token * w).sum(),
        "none": per_token * w,
        "mean_with_sample_weight": (per_token * w).sum() / w.sum(),
    }[reduction]
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                            reduction=reduction)
    np.testing.assert_allclose(got, to_numpy(keras_loss(y, logits, sample_weight=w)),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight"])
def test_gradient_is_softmax_minus_one_hot(reduction):
    """d loss / d logits = w * (softmax(logits) - one_hot(y)) / normaliser, against NumPy
    (large logits too: the softmax must not overflow); on torch this is the loss' own
    backward function."""
    r = np.random.default_rng(11)
    logits = (6 * r.normal(size=(3, 4, 9))).astype("float32")
    logits[0, 0, 2] = 80.0
    y = r.integers(0, 9, (3, 4)).astype("int32")
    w = r.uniform(size=(3, 4)).astype("float32")
    loss = TokenCrossentropy(reduction=reduction)
    value, (grad,) = value_and_grads(lambda z: loss(y, z, sample_weight=w), logits)
    z = logits.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    norm = y.size if reduction == "sum_over_batch_size" else w.sum()
    expected = w[..., None] * (p - np.eye(9)[y]) / norm
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, (_np_token_ce(y, logits) * w).sum() / norm, rtol=1e-5)


def test_torch_function_ignore_index_and_out_of_range_targets():
    """The torch path's autograd function (pure torch, so checked under every backend): a
    target of -100 gives a zero loss and gradient (`F.cross_entropy`'s ignore_index), the
    others equal `F.cross_entropy`'s losses and gradients, and any other target outside the
    vocabulary gives a NaN loss and a zero gradient (the loss refuses such targets before
    this function whenever they hold values)."""
    import torch
    import torch.nn.functional as F

    from kzoo.losses import _torch_cross_entropy

    fn = _torch_cross_entropy()
    data = np.random.default_rng(2).normal(size=(4, 5)).astype("float32")
    ours = torch.tensor(data, requires_grad=True)
    theirs = torch.tensor(data, requires_grad=True)
    y = torch.tensor([1, -100, 4, 0])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0])
    losses = fn.apply(ours, y)
    reference = F.cross_entropy(theirs, y, reduction="none")
    assert float(losses[1].detach()) == 0.0
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=1e-6)
    (losses * weights).sum().backward()
    (reference * weights).sum().backward()
    assert float(ours.grad[1].abs().sum()) == 0.0
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    bad = torch.tensor(data, requires_grad=True)
    losses = fn.apply(bad, torch.tensor([1, 5, -1, 0]))
    assert torch.isnan(losses[1:3]).all()
    torch.testing.assert_close(losses[[0, 3]], reference.detach()[[0, 3]])
    losses[[0, 3]].sum().backward()
    assert float(bad.grad[1:3].abs().sum()) == 0.0


def test_jax_function_out_of_range_targets_and_gradient():
    """The JAX path's custom-gradient function (pure JAX, so checked under every backend):
    the loss and its gradient against NumPy, large logits included; a target outside the
    vocabulary gives a zero gradient, and a loss of zero for -100 and NaN for any other
    (negative or too large)."""
    import jax
    import jax.numpy as jnp

    from kzoo.losses import _jax_cross_entropy

    fn = _jax_cross_entropy()
    r = np.random.default_rng(3)
    logits = (5 * r.normal(size=(6, 7))).astype("float32")
    logits[2, 3] = 90.0
    y = np.array([1, -100, 3, 7, -1, 6], "int32")
    weights = r.uniform(size=6).astype("float32")
    losses = np.asarray(fn(jnp.asarray(logits), jnp.asarray(y)))
    grad = np.asarray(jax.grad(lambda z: jnp.sum(fn(z, y) * weights))(logits))
    valid = (y >= 0) & (y < 7)
    z = logits.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    one_hot = np.eye(7)[np.where(valid, y, 0)] * valid[:, None]
    expected = np.where(valid, _np_token_ce(np.where(valid, y, 0), logits),
                        np.where(y == -100, 0.0, np.nan))
    np.testing.assert_allclose(losses, expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(grad, weights[:, None] * valid[:, None] * (p - one_hot),
                               rtol=1e-5, atol=1e-7)
    assert np.all(grad[~valid] == 0)


def test_tensorflow_function_in_graphs_and_out_of_range_targets():
    """The TensorFlow path's function (pure TensorFlow, so checked under every backend), in a
    graph as `fit` runs it: the loss and its gradient against NumPy, large logits and a
    target whose probability underflows float32 included;
    a target outside the vocabulary gives that row a NaN loss (0 for -100) and a zero
    gradient, the others exact, in a graph and in a function compiled whole with XLA alike."""
    import tensorflow as tf

    from kzoo.losses import _tf_cross_entropy

    fn = _tf_cross_entropy()
    r = np.random.default_rng(5)
    logits = (5 * r.normal(size=(6, 7))).astype("float32")
    logits[2, 3] = 90.0
    logits[5] = 100.0
    logits[5, 6] = -250.0  # the target's probability underflows: loss ~352
    y = np.array([1, 0, 3, 6, 2, 6], "int32")
    weights = r.uniform(size=6).astype("float32")

    @tf.function
    def loss_and_grad(z, labels):
        with tf.GradientTape() as tape:
            tape.watch(z)
            losses = fn(z, labels)
            total = tf.reduce_sum(losses * weights)
        return losses, tape.gradient(total, z)

    losses, grad = (t.numpy() for t in loss_and_grad(tf.constant(logits), tf.constant(y)))
    z = logits.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(losses, _np_token_ce(y, logits), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(grad, weights[:, None] * (p - np.eye(7)[y]), rtol=1e-5,
                               atol=1e-7)
    keep = np.arange(6) != 4
    for bad in (7, -1, -100):
        wrong = y.copy()
        wrong[4] = bad
        for function in (loss_and_grad, tf.function(loss_and_grad.python_function,
                                                    jit_compile=True)):
            got, grad = (t.numpy() for t in function(tf.constant(logits), tf.constant(wrong)))
            assert got[4] == 0.0 if bad == -100 else np.isnan(got[4])
            assert np.all(grad[4] == 0)
            np.testing.assert_allclose(got[keep], _np_token_ce(y, logits)[keep], rtol=1e-6,
                                       atol=1e-5)


@pytest.mark.parametrize("bad", [7, 9, -1, -101, 2.5])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "none"])
def test_out_of_range_targets_are_refused_eagerly(bad, reduction):
    """Called with targets that hold values, a target that is not a token id of the logits
    (nor -100) is refused on every backend with its value, its index and the range allowed
    (before, JAX gave it a zero loss in silence, torch raised gather's IndexError or took
    -100, TensorFlow raised its kernel's error and refused -100)."""
    logits = np.random.default_rng(1).normal(size=(2, 3, 7)).astype("float32")
    y = np.array([[1, 2, 3], [0, 6, 4]], "float32")
    y[1, 2] = bad
    for targets in (y, keras.ops.convert_to_tensor(y)):
        with pytest.raises(ValueError, match=rf"holds {bad!r} at index \(1, 2\).*"
                                             r"\[0, 7\).*or -100"):
            TokenCrossentropy(reduction=reduction)(targets, logits)


def test_ignored_targets_count_as_zero_weight_tokens_on_every_backend():
    """-100 gives that token a zero loss and gradient; the mean still counts it (the same as
    a zero sample weight), against NumPy."""
    r = np.random.default_rng(4)
    logits = (3 * r.normal(size=(3, 4, 6))).astype("float32")
    y = r.integers(0, 6, (3, 4)).astype("int32")
    y[0, 1] = y[2, 3] = -100
    keep = y != -100
    per_token = np.where(keep, _np_token_ce(np.where(keep, y, 0), logits), 0.0)
    np.testing.assert_allclose(to_numpy(TokenCrossentropy(reduction="none")(y, logits)),
                               per_token, rtol=1e-5, atol=1e-6)
    value, (grad,) = value_and_grads(lambda z: TokenCrossentropy()(y, z), logits)
    z = logits.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = keep[..., None] * (p - np.eye(6)[np.where(keep, y, 0)]) / y.size
    np.testing.assert_allclose(value, per_token.sum() / y.size, rtol=1e-5)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_fit_and_evaluate_take_ignored_targets():
    """A token model's `evaluate` and `train_on_batch` take -100 targets (their input check
    refused them while a direct call took them on JAX and torch): the loss is the NumPy mean
    over every token with those counted as zero, from the model's own logits."""
    keras.utils.set_random_seed(1)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=13, num_layers=1, num_heads=2, hidden_dim=8,
                                 intermediate_dim=16, max_sequence_length=8, dropout=0.0))
    lm.compile(optimizer=keras.optimizers.SGD(0.0))
    tokens = np.random.default_rng(2).integers(0, 13, (3, 6))
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens, dtype=bool)}
    y = np.roll(tokens, -1, axis=1).astype("int32")
    y[:, -1] = -100
    y[1, 2] = -100
    logits = to_numpy(lm.predict(x, verbose=0))
    keep = y != -100
    expected = np.where(keep, _np_token_ce(np.where(keep, y, 0), logits), 0.0).mean()
    np.testing.assert_allclose(lm.evaluate(x, y, verbose=0), expected, rtol=1e-5)
    np.testing.assert_allclose(lm.train_on_batch(x, y), expected, rtol=1e-5)


def _traced_loss_and_grad(y, logits):
    """`TokenCrossentropy(reduction="none")` and the gradient of its sum, with the targets
    traced: inside `jax.jit`, a `tf.function`, or `torch.compile` (dynamo, eager backend)."""
    loss = TokenCrossentropy(reduction="none")
    b = keras.backend.backend()
    if b == "jax":
        import jax

        def both(z, t):
            return jax.value_and_grad(lambda v: loss(t, v).sum(), has_aux=False)(z), loss(t, z)

        (_, grad), losses = jax.jit(both)(logits, y)
        return np.asarray(losses), np.asarray(grad)
    if b == "tensorflow":
        import tensorflow as tf

        @tf.function
        def both(z, t):
            with tf.GradientTape() as tape:
                tape.watch(z)
                losses = loss(t, z)
                total = tf.reduce_sum(tf.where(tf.math.is_nan(losses), 0.0, losses))
            return losses, tape.gradient(total, z)

        return tuple(v.numpy() for v in both(tf.constant(logits), tf.constant(y)))
    import torch

    z = torch.tensor(logits, requires_grad=True)
    losses = torch.compile(lambda v, t: loss(t, v), backend="eager")(z, torch.tensor(y))
    torch.nan_to_num(losses, nan=0.0).sum().backward()
    return losses.detach().numpy(), z.grad.numpy()


def test_traced_out_of_range_targets_give_a_nan_loss_and_no_gradient():
    """Where the targets are traced (no values to check), a target outside the vocabulary
    other than -100 gives that token a NaN loss and a zero gradient, the same on every
    backend; the other tokens exact, against NumPy."""
    r = np.random.default_rng(8)
    logits = (2 * r.normal(size=(2, 4, 5))).astype("float32")
    y = r.integers(0, 5, (2, 4)).astype("int32")
    y[0, 0], y[0, 3], y[1, 1] = 5, -1, -100
    losses, grad = _traced_loss_and_grad(y, logits)
    valid = (y >= 0) & (y < 5)
    assert np.isnan(losses[0, 0]) and np.isnan(losses[0, 3]) and losses[1, 1] == 0.0
    reference = _np_token_ce(np.where(valid, y, 0), logits)
    np.testing.assert_allclose(losses[valid], reference[valid], rtol=1e-5, atol=1e-6)
    z = logits.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = valid[..., None] * (p - np.eye(5)[np.where(valid, y, 0)])
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_targets_with_a_trailing_axis_and_half_logits():
    r = np.random.default_rng(9)
    logits = r.normal(size=(2, 3, 5)).astype("float16")
    y = r.integers(0, 5, (2, 3, 1)).astype("int64")
    got = to_numpy(TokenCrossentropy(reduction="none")(y, logits))
    np.testing.assert_allclose(got, _np_token_ce(y[..., 0], logits.astype("float32")),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.spread
def test_token_models_default_to_it_and_it_serialises(tmp_path):
    keras.utils.set_random_seed(0)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=31, num_layers=1, num_heads=2, hidden_dim=8,
                                 intermediate_dim=16, max_sequence_length=12))
    lm.compile(optimizer="adam")
    assert isinstance(lm.loss, TokenCrossentropy)
    x, y, w = GPTCausalLM.lm_batch(np.random.default_rng(0).integers(0, 31, (4, 9)))
    first = lm.evaluate(x, y, sample_weight=w, verbose=0)
    lm.fit(x, y, sample_weight=w, epochs=8, verbose=0)
    assert lm.evaluate(x, y, sample_weight=w, verbose=0) < first
    lm.save(tmp_path / "lm.keras")
    again = keras.saving.load_model(tmp_path / "lm.keras")
    assert isinstance(again.loss, TokenCrossentropy)
    fresh = GPTCausalLM.from_config(lm.get_config())
    fresh.compile(optimizer="adam", loss=None)  # an explicit None stays None
    assert fresh.loss is None


def test_released_logits_losses_with_large_values_and_ignored_targets():
    """Inside `logits_released` with logits a matmul made (their memory turned into
    exp(logits - row max) in the forward pass, the gradient in the backward): losses and
    gradients equal `F.cross_entropy`'s (logits up to ~500 in size, a row of -100). Pure
    torch, so checked under every backend."""
    import torch
    import torch.nn.functional as F

    from kzoo.losses import _torch_cross_entropy, logits_released

    data = (150 * np.random.default_rng(9).normal(size=(5, 7))).astype("float32")
    y = torch.tensor([3, -100, 0, 6, 2])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5])
    theirs = torch.tensor(data, requires_grad=True)
    reference = F.cross_entropy(theirs, y, reduction="none")
    (reference * weights).sum().backward()
    ours = torch.tensor(data, requires_grad=True)
    logits = ours @ torch.eye(7)  # (a matmul keeps no copy of its output: overwritten)
    with logits_released():
        losses = _torch_cross_entropy().apply(logits, y)
    assert not torch.equal(logits.detach(), torch.tensor(data))
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=1e-5)
    (losses * weights).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    assert float(losses[1].detach()) == 0.0 and float(ours.grad[1].abs().sum()) == 0.0


@pytest.mark.parametrize("made_by", ["matmul", "tanh"])
def test_released_logits_give_the_same_gradients(made_by):
    """Inside `logits_released` (the torch train step's), the torch function writes the
    gradient into the logits' memory when the op that made them keeps no copy of its output
    (a matmul) and leaves them alone when it does (tanh keeps its output for its backward):
    either way the gradients of the inputs equal NumPy's. Pure torch, so checked under
    every backend."""
    import torch

    from kzoo.losses import _torch_cross_entropy, logits_released

    def loss_of(targets, values):  # the torch path of TokenCrossentropy, mean over tokens
        return _torch_cross_entropy().apply(values, targets).mean()

    r = np.random.default_rng(5)
    h = r.normal(size=(6, 4)).astype("float32")
    table = (2 * r.normal(size=(9, 4))).astype("float32")
    y = r.integers(0, 9, (6,))
    hidden = torch.tensor(h, requires_grad=True)
    weights = torch.tensor(table, requires_grad=True)
    logits = hidden @ weights.T
    if made_by == "tanh":
        logits = torch.tanh(logits)
    with logits_released():
        loss = loss_of(torch.tensor(y), logits)
    before = logits.detach().clone()
    loss.backward()
    z = h.astype("float64") @ table.T.astype("float64")
    if made_by == "tanh":
        z = np.tanh(z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = (p - np.eye(9)[y]) / y.size
    if made_by == "tanh":
        d = d * (1 - z ** 2)
    np.testing.assert_allclose(hidden.grad.numpy(), d @ table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights.grad.numpy(), d.T @ h, rtol=1e-5, atol=1e-6)
    overwritten = not torch.equal(logits.detach(), before)
    assert overwritten == (made_by == "matmul")
    outside = hidden @ weights.T  # outside the context the logits stay as they are
    kept = outside.detach().clone()
    loss_of(torch.tensor(y), outside).backward()
    assert torch.equal(outside.detach(), kept)


@pytest.mark.parametrize("onednn", [True, False])
def test_tied_logits_table_gradient_is_row_major(monkeypatch, onednn):
    """The tied product's backward hands autograd the table's gradient `g^T @ h` (NumPy's)
    row-major like the table, through oneDNN's product and through MKL's: a transposed one
    made autograd's sum with the embedding lookup's gradient and the accumulation into
    `.grad` strided passes over the whole table. Pure torch: every backend."""
    import torch

    from kzoo.losses import logits_released, tied_logits_into

    if not onednn:
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    r = np.random.default_rng(12)
    h = r.normal(size=(3, 5, 4)).astype("float32")
    table = r.normal(size=(11, 4)).astype("float32")
    g = r.normal(size=(3, 5, 11)).astype("float32")
    hidden = torch.tensor(h, requires_grad=True)
    weights = torch.tensor(table, requires_grad=True)

    class Owner:
        pass

    with logits_released():
        logits = tied_logits_into(Owner(), hidden, weights, None)
        (raw,) = torch.autograd.grad(logits, weights, torch.tensor(g))
    np.testing.assert_allclose(raw.numpy(), g.reshape(15, 11).T.astype(np.float64)
                               @ h.reshape(15, 4), rtol=1e-5, atol=1e-5)
    assert raw.is_contiguous() and raw.shape == (11, 4)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_tied_logits_into_a_kept_buffer(monkeypatch, bias, onednn):
    """`tied_logits_into` inside `logits_released`: the logits `h @ E^T + b` (NumPy's), written
    into a buffer its owner keeps, which the loss then turns into their gradient; the
    gradients of `h`, `E` and `b` equal NumPy's, their two products taken by oneDNN
    (`g @ E` and `h^T @ g`). The next released step writes the same memory; a second
    product in one step (oneDNN's product, new memory, its gradients NumPy's too), a call
    outside the context, or another dtype take new memory. With `torch.backends.mkldnn`
    off, all of it takes MKL's products, the same values. Pure torch, so checked under
    every backend."""
    import torch

    from kzoo.layers import utils
    from kzoo.losses import _torch_cross_entropy, logits_released, tied_logits_into

    op = utils._onednn_linear_op()
    assert op is not None  # torch 2.13's CPU build has it
    taken = []
    monkeypatch.setattr(utils, "_ONEDNN_LINEAR",
                        [lambda *a: taken.append(tuple(a[0].shape)) or op(*a)])
    if not onednn:
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)

    def by_onednn(*shapes):
        return list(shapes) if onednn else []

    class Owner:
        pass

    r = np.random.default_rng(8)
    h = r.normal(size=(2, 3, 4)).astype("float32")
    table = (2 * r.normal(size=(9, 4))).astype("float32")
    b = r.normal(size=(9,)).astype("float32") if bias else None
    y = r.integers(0, 9, (6,))
    z = (h.reshape(6, 4).astype("float64") @ table.T.astype("float64")
         + (0 if b is None else b))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = (p - np.eye(9)[y]) / y.size

    def operands():
        return (torch.tensor(h, requires_grad=True), torch.tensor(table, requires_grad=True),
                None if b is None else torch.tensor(b, requires_grad=True))

    def check_gradients(hidden, weights, offset):
        np.testing.assert_allclose(hidden.grad.numpy().reshape(6, 4), d @ table, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(weights.grad.numpy(), d.T @ h.reshape(6, 4), rtol=1e-5,
                                   atol=1e-6)
        if bias:
            np.testing.assert_allclose(offset.grad.numpy(), d.sum(0), rtol=1e-5, atol=1e-6)

    owner, pointers = Owner(), []
    for step in range(2):
        hidden, weights, offset = operands()
        taken.clear()
        with logits_released():
            logits = tied_logits_into(owner, hidden, weights, offset)
            assert taken == []  # (MKL's product into the buffer)
            second = tied_logits_into(owner, hidden, weights, offset)
            assert taken == by_onednn((6, 4))  # (oneDNN's product, a new output)
            np.testing.assert_allclose(logits.detach().numpy().reshape(6, 9), z, rtol=1e-5,
                                       atol=1e-5)
            np.testing.assert_allclose(second.detach().numpy().reshape(6, 9), z, rtol=1e-5,
                                       atol=1e-5)
            before = logits.detach().clone()
            loss = _torch_cross_entropy().apply(logits.reshape(6, 9), torch.tensor(y)).mean()
        loss.backward()
        # the backward products: g (6, 9) @ E, and (h^T (4, 6) @ g)^T
        assert taken == by_onednn((6, 4), (6, 9), (4, 6))
        assert not torch.equal(logits.detach(), before)  # (the memory became the gradient)
        pointers.append(logits.data_ptr())
        assert second.data_ptr() != logits.data_ptr()
        assert owner._logits_buffer.data_ptr() == logits.data_ptr()
        check_gradients(hidden, weights, offset)
    assert pointers[0] == pointers[1]
    hidden, weights, offset = operands()
    taken.clear()
    second = tied_logits_into(owner, hidden, weights, offset)  # outside: oneDNN, new memory
    loss = _torch_cross_entropy().apply(second.reshape(6, 9), torch.tensor(y)).mean()
    loss.backward()
    assert taken == by_onednn((6, 4), (6, 9), (4, 6))
    assert second.data_ptr() != pointers[0]
    np.testing.assert_allclose(second.detach().numpy().reshape(6, 9), z, rtol=1e-5, atol=1e-5)
    check_gradients(hidden, weights, offset)
    outside = tied_logits_into(owner, torch.tensor(h), torch.tensor(table))
    assert outside.data_ptr() != pointers[0]
    with logits_released():
        double = tied_logits_into(owner, torch.tensor(h, dtype=torch.float64),
                                  torch.tensor(table, dtype=torch.float64))
    assert double.dtype == torch.float64 and double.data_ptr() != pointers[0]


def test_train_steps_with_the_kept_logits_buffer_equal_plain_ones(monkeypatch):
    """Three SGD steps of a GPT with its default loss (on torch, the tied logits written into
    the buffer kept between steps and turned into their gradient) give the weights of the
    same steps with a plain `F.linear` head."""
    import kzoo.losses

    keras.utils.set_random_seed(6)

    def build():
        lm = GPTCausalLM(GPTBackbone(vocabulary_size=37, num_layers=1, num_heads=2,
                                     hidden_dim=8, intermediate_dim=16,
                                     max_sequence_length=12, dropout=0.0))
        lm.compile(optimizer=keras.optimizers.SGD(0.5))
        return lm

    ours, plain = build(), build()
    plain.set_weights(ours.get_weights())
    batches = [GPTCausalLM.lm_batch(np.random.default_rng(i).integers(0, 37, (3, 10)))
               for i in range(3)]
    for x, y, w in batches:
        ours.train_on_batch(x, y, sample_weight=w)
    if keras.backend.backend() == "torch":
        assert ours.backbone.token_embedding._logits_buffer.shape == (3, 9, 37)
        import torch.nn.functional as F

        monkeypatch.setattr(kzoo.losses, "tied_logits_into",
                            lambda owner, h, table, bias=None: F.linear(h, table, bias))
    for x, y, w in batches:
        plain.train_on_batch(x, y, sample_weight=w)
    assert not hasattr(plain.backbone.token_embedding, "_logits_buffer")
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # `fit` gives the memory back when its loop ends.
    x, y, w = batches[0]
    ours.fit(x, y, sample_weight=w, epochs=2, verbose=0)
    assert not hasattr(ours.backbone.token_embedding, "_logits_buffer")


@pytest.mark.spread
@pytest.mark.parametrize("metrics", [None, ["accuracy"]])
def test_train_step_matches_keras_loss_with_and_without_metrics(metrics):
    """One SGD step of a GPT with its default loss (on torch: the logits released to the loss
    when no metric reads them) gives the weights and the loss of the same step with Keras'
    `SparseCategoricalCrossentropy`; with a compiled accuracy, its value equals NumPy's
    accuracy of the logits before the step."""
    keras.utils.set_random_seed(4)

    def build():
        return GPTCausalLM(GPTBackbone(vocabulary_size=37, num_layers=1, num_heads=2,
                                       hidden_dim=8, intermediate_dim=16,
                                       max_sequence_length=12, dropout=0.0))

    ours, theirs = build(), build()
    theirs.set_weights(ours.get_weights())
    x, y, w = GPTCausalLM.lm_batch(np.random.default_rng(1).integers(0, 37, (3, 10)))
    logits = to_numpy(ours(x))
    ours.compile(optimizer=keras.optimizers.SGD(0.5), metrics=metrics)
    theirs.compile(optimizer=keras.optimizers.SGD(0.5),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=metrics)
    got = ours.train_on_batch(x, y, sample_weight=w, return_dict=True)
    expected = theirs.train_on_batch(x, y, sample_weight=w, return_dict=True)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if metrics:
        hits = (logits.argmax(-1) == y) * w
        np.testing.assert_allclose(got["accuracy"], hits.sum() / w.sum(), rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 7), (2, 4, 11), (0, 3, 5)])
def test_unweighted_mean_counts_tokens_on_the_host(shape, monkeypatch):
    """The default reduction without weights: the mean over every token (NumPy's formula;
    no tokens: 0, as Keras' `divide_no_nan`), equal to Keras' own loss. On torch the count
    never becomes a tensor copied from the host (Keras' `reduce_values` is not reached:
    on a GPU that copy waited for the whole forward pass); elsewhere Keras' reduction runs."""
    from keras.src.losses import loss as keras_loss_module

    r = np.random.default_rng(sum(shape))
    logits = (3 * r.normal(size=shape)).astype("float32")
    y = r.integers(0, shape[-1], shape[:-1]).astype("int32")
    reduced = []
    keras_reduce = keras_loss_module.reduce_values
    monkeypatch.setattr(keras_loss_module, "reduce_values",
                        lambda *a, **k: reduced.append(1) or keras_reduce(*a, **k))
    got = to_numpy(TokenCrossentropy()(y, logits))
    assert reduced == ([] if keras.backend.backend() == "torch" else [1])
    per_token = _np_token_ce(y, logits)
    expected = per_token.sum() / per_token.size if per_token.size else 0.0
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)
    monkeypatch.undo()
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    np.testing.assert_allclose(got, to_numpy(keras_loss(y, logits)), rtol=2e-6, atol=2e-6)
    assert got.shape == ()
