"""Attention distillation (`kzoo.interpret.distill`, recipe `distill_gpt`).

The KL is checked against a NumPy formula written here (with padded query rows, masked keys,
a fully masked row, a depth and a head mapping); the gradient of the attention term against
a central finite difference, computed with each backend's own autograd; `fit` on every
backend: the attention term falls on a fixed batch, the teacher's weights stay what they
were, and the logged loss is the student's loss plus the weighted term. The recipe runs end
to end in its smallest setting.
"""

import math
import os
import re

import keras
import numpy as np
import pytest
from keras import ops

import kzoo.presets
from kzoo.interpret import AttentionDistillationLoss, AttentionDistiller
from kzoo.models.gpt import GPTCausalLM
from tests.helpers import backend, to_numpy

VOCAB, SEQ = 40, 8


# === The loss against NumPy ===


def _maps(rng, layers, heads, key_mask):
    """Random probability maps `(batch, heads, q, k)` that are 0 where `key_mask` is False
    (a row with no key is all zeros)."""
    out = []
    for _ in range(layers):
        logits = rng.normal(0.0, 2.0, (key_mask.shape[0], heads) + key_mask.shape[1:])
        p = np.exp(logits) * key_mask[:, None]
        total = p.sum(-1, keepdims=True)
        out.append(np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
                   .astype("float32"))
    return out


def _numpy_kl(student, teacher, query_mask, layer_map, head_map, eps):
    """mean over mapped layers of: mean over real query rows and student heads of
    sum_k T log(T / S), T the mean of the mapped teacher heads, logs of values clipped."""
    per_layer = []
    for i, j in enumerate(layer_map):
        s = student[i].astype("float64")
        t = np.stack([teacher[j][:, group].mean(1) for group in head_map], axis=1)
        kl = (t * (np.log(np.clip(t, eps, 1)) - np.log(np.clip(s, eps, 1)))).sum(-1)
        rows = kl.mean(1)                                        # (batch, q)
        per_layer.append((rows * query_mask).sum() / query_mask.sum())
    return float(np.mean(per_layer))


@pytest.fixture(scope="module")
def random_maps():
    rng = np.random.default_rng(1)
    batch, q = 3, 6
    causal = np.tril(np.ones((q, q), bool))
    padding = np.ones((batch, q), bool)
    padding[1, -2:] = False            # right padding: keys and query rows
    padding[2, :2] = False             # left padding: rows 0-1 of batch 2 have no key
    key_mask = causal[None] & padding[:, None, :]
    student = _maps(rng, 2, 2, key_mask)
    teacher = _maps(rng, 3, 4, key_mask)
    student[0][0, 1, 3, 0] = 0.0       # a student zero where the teacher has mass: clipped
    return student, teacher, padding.astype("int32"), key_mask


def test_loss_matches_numpy_kl_with_padding_and_default_mappings(random_maps):
    student, teacher, padding, _ = random_maps
    eps = 1e-6
    loss = AttentionDistillationLoss(epsilon=eps)
    got = float(to_numpy(loss([ops.convert_to_tensor(m) for m in student],
                              [ops.convert_to_tensor(m) for m in teacher], padding)))
    # The brief's default: student layer i <- teacher round((i + 1) * Lt / Ls) - 1, half up;
    # student head h <- mean of teacher heads 2h, 2h + 1.
    layer_map = [int(np.floor((i + 1) * 3 / 2 + 0.5)) - 1 for i in range(2)]
    expected = _numpy_kl(student, teacher, padding, layer_map, [[0, 1], [2, 3]], eps)
    assert math.isfinite(got) and got > 0
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    assert loss.layer_pairs(2, 3) == list(enumerate(layer_map))
    # Without a query mask every row counts (rows of padding included).
    everything = np.ones_like(padding)
    got_all = float(to_numpy(loss(student, teacher)))
    np.testing.assert_allclose(
        got_all, _numpy_kl(student, teacher, everything, layer_map, [[0, 1], [2, 3]], eps),
        rtol=2e-5)


def test_loss_matches_numpy_kl_with_given_mappings(random_maps):
    student, teacher, padding, key_mask = random_maps
    loss = AttentionDistillationLoss(layer_map=[0, 0], head_map=[3, [0, 2]], epsilon=1e-5)
    got = float(to_numpy(loss(student, teacher, padding)))
    expected = _numpy_kl(student, teacher, padding, [0, 0], [[3], [0, 2]], 1e-5)
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    # Masked keys contribute nothing: a student with anything on them gives the same loss.
    noisy = [np.where(key_mask[:, None], m, 0.3).astype("float32") for m in student]
    np.testing.assert_allclose(float(to_numpy(loss(noisy, teacher, padding))), got,
                               rtol=1e-6)
    # Identical maps: zero.
    same = AttentionDistillationLoss()
    assert abs(float(to_numpy(same(teacher, teacher, padding)))) < 1e-6


@pytest.mark.parametrize("kwargs, counts, name", [
    (dict(layer_map=[0, 3]), (2, 3, 2, 4), "layer_map"),        # index out of range
    (dict(layer_map=[0]), (2, 3, 2, 4), "layer_map"),           # one entry per student layer
    (dict(layer_map="0,1"), None, "layer_map"),
    (dict(layer_map=[0.5, 1]), None, "layer_map"),
    (dict(head_map=[0, 4]), (2, 3, 2, 4), "head_map"),          # teacher head out of range
    (dict(head_map=[[0, 1], []]), None, "head_map"),
    (dict(), (2, 3, 3, 4), "head_map"),                         # 3 vs 4 heads: no default
    (dict(), (4, 3, 2, 4), "layer_map"),                        # deeper student: no default
    (dict(epsilon=0.0), None, "epsilon"),
])
def test_loss_bad_arguments_name_the_argument(kwargs, counts, name):
    with pytest.raises(ValueError, match=name):
        loss = AttentionDistillationLoss(**kwargs)
        ls, lt, hs, ht = counts
        rng = np.random.default_rng(0)
        mask = np.ones((1, 3, 3), bool)
        loss(_maps(rng, ls, hs, mask), _maps(rng, lt, ht, mask))


# === The distiller on tiny GPTs ===


def _gpt(num_layers, hidden_dim, num_heads):
    return kzoo.presets.load("gpt_mini", num_layers=num_layers, hidden_dim=hidden_dim,
                             intermediate_dim=2 * hidden_dim, num_heads=num_heads,
                             vocabulary_size=VOCAB, max_sequence_length=SEQ, dropout=0.0)


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    teacher = _gpt(3, 32, 4)
    # Sharp, varied teacher attention (an untrained model attends almost uniformly).
    rng = np.random.default_rng(2)
    for v in teacher.weights:
        if re.search(r"self_attention/(query|key)", v.path) and v.path.endswith("kernel"):
            v.assign(rng.normal(0, 0.6, v.shape).astype("float32"))
    student = _gpt(2, 16, 2)
    ids = rng.integers(0, VOCAB, (4, SEQ + 1))
    mask = np.ones_like(ids)
    mask[1, -3:] = 0
    x, y, w = GPTCausalLM.lm_batch(ids, mask)
    return teacher, student, (x, y, w)


def _grads(distiller, variables, x):
    """d attention_loss / d variables with the backend's own autograd."""
    name = backend()
    if name == "torch":
        import torch

        loss, _ = distiller.attention_loss(x)
        grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
        return [np.zeros(v.shape) if g is None else to_numpy(g)  # None: not in the graph
                for g, v in zip(grads, variables)]
    if name == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch([v.value for v in variables])  # non-trainable ones too
            loss, _ = distiller.attention_loss(x)
        return [to_numpy(g) if g is not None else np.zeros(v.shape)
                for g, v in zip(tape.gradient(loss, [v.value for v in variables]), variables)]
    return [np.asarray(g) for g in _jax_term(distiller, variables, x)[1](
        [v.value for v in variables])]


def _jax_term(distiller, variables, x):
    """JAX: the attention term as a function of the values of `variables`, and its gradient,
    both jitted (eager JAX dispatches op by op: ~5x slower here)."""
    import jax

    def f(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return distiller.attention_loss(x)[0]

    return jax.jit(f), jax.jit(jax.grad(f))


def _term_function(distiller, variable, x):
    """`value -> the attention term with variable = value` (the variable is left as is)."""
    if backend() == "jax":
        term = _jax_term(distiller, [variable], x)[0]
        return lambda value: float(term([value]))

    def term(value):
        old = to_numpy(variable).copy()
        variable.assign(value)
        try:
            return float(to_numpy(distiller.attention_loss(x)[0]))
        finally:
            variable.assign(old)

    return term


@pytest.mark.spread
def test_attention_gradient_reaches_the_student_and_matches_finite_differences(models):
    teacher, student, (x, _, _) = models
    distiller = AttentionDistiller(student, teacher, attention_weight=1.0)
    first_query = next(v for v in student.weights
                       if "transformer_layer_0/self_attention/query" in v.path
                       and v.path.endswith("kernel"))
    # The last block's feed-forward comes after every attention map: no gradient from the KL.
    last_ffn = next(v for v in student.weights
                    if v.path == "transformer_layer_1/feedforward/output_dense/kernel")
    g_query, g_ffn = _grads(distiller, [first_query, last_ffn], x)
    assert np.abs(g_query).max() > 0
    assert np.abs(g_ffn).max() == 0
    # Central finite difference along a random direction.
    direction = np.random.default_rng(3).normal(size=first_query.shape).astype("float32")
    base, h = to_numpy(first_query).copy(), 1e-2
    term = _term_function(distiller, first_query, x)
    values = [term(base + sign * h * direction) for sign in (1, -1)]
    estimate = (values[0] - values[1]) / (2 * h)
    np.testing.assert_allclose(float((g_query * direction).sum()), estimate, rtol=2e-2)
    # The teacher: frozen, and its maps are under stop_gradient.
    assert not teacher.trainable and not distiller.teacher.trainable_weights
    if backend() != "torch":  # torch refuses grads of non-trainable parameters outright
        t_query = next(v for v in teacher.weights if "self_attention/query" in v.path)
        assert np.abs(_grads(distiller, [t_query], x)[0]).max() == 0


@pytest.mark.spread
def test_fit_lowers_the_attention_term_and_leaves_the_teacher_alone(models):
    teacher, student, (x, y, w) = models
    weight = 3.0
    distiller = AttentionDistiller(student, teacher, attention_weight=weight)
    distiller.compile(optimizer=keras.optimizers.Adam(3e-2))
    before = float(to_numpy(distiller.attention_loss(x)[0]))
    teacher_before = [to_numpy(v).copy() for v in teacher.weights]
    student_before = {v.path: to_numpy(v).copy() for v in student.weights}
    initial_logits = to_numpy(student(x))
    history = distiller.fit(x, y, sample_weight=w, batch_size=4, epochs=3, verbose=0).history
    after = float(to_numpy(distiller.attention_loss(x)[0]))
    # Each step lowers it: the terms logged before each step, then the final one.
    terms = list(history["attention_loss"]) + [after]
    assert all(b < a for a, b in zip(terms, terms[1:])), terms
    for a, v in zip(teacher_before, teacher.weights):
        np.testing.assert_array_equal(a, to_numpy(v))
    assert any(not np.array_equal(student_before[v.path], to_numpy(v))
               for v in student.weights if "self_attention/query" in v.path)
    # One step an epoch: the logged loss is the student's loss + weight x attention term,
    # and the first logged attention term is the one measured before training.
    np.testing.assert_allclose(history["loss"], np.add(history["student_loss"],
                               weight * np.asarray(history["attention_loss"])), rtol=1e-5)
    np.testing.assert_allclose(history["attention_loss"][0], before, rtol=1e-4)
    # The first logged student loss is the token cross-entropy of the initial student,
    # weighted as Keras weights it (sum over weighted tokens / number of tokens).
    logits = initial_logits.astype("float64")
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(y)[..., None], -1)[..., 0]
    np.testing.assert_allclose(history["student_loss"][0], (nll * w).sum() / w.size, rtol=1e-4)


def test_masked_heads_on_the_teacher_reaches_a_distiller_compiled_before(models):
    """`masked_heads(teacher, zeros)` around `fit`: the teacher's maps are all zero, so the
    KL term `sum T (log T - log S)` is exactly 0 (a fact of the formula, whatever the
    student). The distiller's train function compiled by an earlier `fit` (JAX,
    TensorFlow) kept the unmasked teacher inside the context, and one compiled inside kept
    the mask after it. (A learning rate of 0: the weights, and the term outside, stay.)"""
    from kzoo.interpret import masked_heads

    teacher, student, (x, y, w) = models
    distiller = AttentionDistiller(student, teacher, attention_weight=1.0)
    distiller.compile(optimizer=keras.optimizers.SGD(0.0))

    def term():
        history = distiller.fit(x, y, sample_weight=w, batch_size=4, epochs=1, verbose=0)
        return history.history["attention_loss"][0]

    before = term()
    with masked_heads(teacher, np.zeros((3, 4))):
        inside = term()
    after = term()
    assert before > 1e-3 and inside == 0.0
    np.testing.assert_allclose(after, before, rtol=1e-5)


def test_distiller_bad_arguments_name_the_argument(models):
    teacher, student, _ = models
    for kwargs, name in ((dict(attention_weight=-1.0), "attention_weight"),
                         (dict(attention_weight=float("nan")), "attention_weight"),
                         (dict(attention_weight=True), "attention_weight"),
                         (dict(layer_map=[0, 5]), "layer_map"),
                         (dict(head_map=[0, 1, 2]), "head_map")):
        with pytest.raises(ValueError, match=name):
            AttentionDistiller(student, teacher, **kwargs)
    with pytest.raises(ValueError, match="teacher"):
        AttentionDistiller(student, "not a model")
    with pytest.raises(ValueError, match="layer_map"):  # a 2-layer teacher for 3 layers
        AttentionDistiller(teacher, student)


# === The recipe ===

TINY = ["--teacher-steps", "2", "--steps", "2", "--seq-len", "16", "--max-chars", "20000",
        "--bpe-vocab", "300", "--batch-size", "4", "--override", "num_layers=2",
        "--override", "hidden_dim=16", "--override", "intermediate_dim=32",
        "--override", "num_heads=4", "--student-layers", "1", "--student-hidden-dim", "8",
        "--student-heads", "2", "--verbose", "0"]


def test_recipe_options_are_checked():
    from training.recipes import distill_gpt

    for options, flag in ((dict(attention_weight=0.0), "--attention-weight"),
                          (dict(student_layers=0), "--student-layers"),
                          (dict(student_hidden_dim=10, student_heads=3), "--student-heads"),
                          (dict(teacher="/nonexistent/dir"), "--teacher"),
                          (dict(seq_len=1), "--seq-len")):
        with pytest.raises(ValueError, match=flag):
            distill_gpt.check_options(options)


@pytest.mark.slow
def test_recipe_prints_the_table_of_the_teacher_and_both_students(tmp_path, capsys):
    from training.cli import main

    out = str(tmp_path / "distill")
    assert main(["distill_gpt", "--out", out] + TINY) == 0
    printed = capsys.readouterr().out
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(teacher|student, attention_weight=\S+)\s.*?\s(\d+\.\d{4})\s+\d+\.\d\d\s", printed,
        re.M)}
    assert set(rows) == {"teacher", "student, attention_weight=0",
                         "student, attention_weight=1"}
    for name in ("student_plain", "student_attention"):
        reloaded = kzoo.presets.load(os.path.join(out, name))
        assert reloaded.backbone.num_layers == 1
