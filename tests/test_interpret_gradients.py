"""kzoo.interpret gradients: attention x gradient and head importance against central finite
differences, integrated gradients' completeness, the logit lens against the model's logits
and a NumPy norm + head.

The finite differences perturb the model through taps written here (`kzoo.layers.taps.Tap`
subclasses adding to one attention probability or scaling heads), evaluated by forward passes
only; the losses they difference are NumPy formulas written here.
"""

import keras
import numpy as np
import pytest

from kzoo.interpret import (
    attention_gradient,
    attention_maps,
    head_importance,
    integrated_gradients,
    logit_lens,
)
from kzoo.interpret._backend import run
from kzoo.layers.taps import Tap
from kzoo.models.bert import BertBackbone, BertClassifier
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.vit import ViTBackbone, ViTClassifier
from tests.harness import backend, ref

VOCAB = 40


def _randomize(model, seed, scale=0.3):
    """Weights of scale `scale` (norm scales ~1, biases ~0.1): sharp attention and heads that
    matter, unlike the small initialisers (a ViT head even starts at zero)."""
    r = np.random.default_rng(seed)
    values = []
    for w in model.weights:
        shape = tuple(w.shape)
        if "gamma" in w.path or w.path.endswith("scale"):
            values.append(1.0 + 0.1 * r.normal(size=shape))
        elif len(shape) == 1:
            values.append(0.1 * r.normal(size=shape))
        else:
            values.append(scale * r.normal(size=shape))
    model.set_weights([v.astype("float32") for v in values])
    return model


@pytest.fixture(scope="module")
def gpt():
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                 hidden_dim=16, intermediate_dim=24, max_sequence_length=16,
                                 dropout=0.0))
    _randomize(lm, 0)
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, 6)).astype("int32")
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[mask == 0] = 0
    return lm, {"token_ids": ids, "padding_mask": mask}


def _logits(model, x):
    return plain_pass(model, x)[0]


def plain_pass(model, x):
    """`(output, attention probabilities, block outputs)` of a forward pass recorded by a
    plain `Tap` (one compiled function on JAX for all three)."""
    _, (out, maps, blocks) = run(model, _recording_body, x, [], static=None)
    return out.astype(np.float64), maps, blocks


def _recording_body(model, call, inputs, tensors, static):
    with Tap(record_blocks=True) as tap:
        out = call(inputs)
    return None, [out, [r.weights for r in tap.attention_records],
                  [r.output for r in tap.block_records]]


# === Taps written here, evaluated by forward passes only ===


class _AddToAttention(Tap):
    """Adds `deltas[i]` (batch, heads, query, key) to attention call `i`'s probabilities."""

    def __init__(self, deltas):
        super().__init__(record_attention=False)
        self.deltas = deltas

    def attention(self, layer, index, weights):
        return weights + keras.ops.cast(self.deltas[index], weights.dtype)


class _ScaleHeads(Tap):
    """Scales head `h` of attention call `i` by `scales[0][i, h]`."""

    def __init__(self, scales):
        super().__init__(record_attention=False)
        self.scales = scales[0]

    def head_scale(self, layer, index):
        return self.scales[index]


def _tapped_body(model, call, inputs, tensors, static):
    with static(tensors):
        return None, [call(inputs)]


def tapped_logits(model, x, tap_class, arrays):
    """The model's output under `tap_class(tensors of arrays)`: a forward pass (on JAX one
    compiled function per tap class, whatever the arrays hold)."""
    _, (out,) = run(model, _tapped_body, x, arrays, static=tap_class)
    return out.astype(np.float64)


def _next_token_targets(logits, mask):
    """Last real position of each row and the predicted token there (NumPy)."""
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
    rows = np.arange(len(last))
    return last, np.argmax(logits[rows, last], axis=-1)


# === Attention x gradient ===


def test_attention_gradient_matches_finite_differences(gpt):
    lm, x = gpt
    mask = x["padding_mask"]
    logits, probabilities, _ = plain_pass(lm, x)
    last, token = _next_token_targets(logits, mask)
    rows = np.arange(2)
    scores = attention_gradient(lm, x)["self"]
    assert [s.shape for s in scores] == [(2, 2, 6, 6)] * 2
    assert all(np.all(s >= 0) for s in scores)

    # |dL/dA| at the highest-scoring entries of each layer (example 0 and 1), by central
    # differences of the target logit with A perturbed through a tap.
    eps = 1e-3
    zeros = [np.zeros_like(s) for s in scores]
    checked = 0
    for layer in range(2):
        for b in range(2):
            entry = (b,) + np.unravel_index(np.argmax(scores[layer][b]), scores[layer][b].shape)
            values = []
            for sign in (1.0, -1.0):
                deltas = [z.copy() for z in zeros]
                deltas[layer][entry] = sign * eps
                out = tapped_logits(lm, x, _AddToAttention, deltas)
                values.append(out[rows, last, token])
            fd = (values[0] - values[1]) / (2 * eps)
            # scores = A * |dL/dA|, so |dL/dA| = score / A
            got = scores[layer][entry] / probabilities[layer][entry]
            print(f"[{backend()}] layer {layer} entry {entry}: |dL/dA| {got:.5f}, "
                  f"finite difference {abs(fd[b]):.5f}")
            assert abs(got - abs(fd[b])) <= 2e-3 + 2e-2 * abs(fd[b])
            assert abs(fd[b]) > 1e-2  # a gradient that matters
            checked += 1
    assert checked == 4




@pytest.mark.spread
def test_t5_attention_gradient_logit_lens_and_head_importance():
    """T5: A * |dL/dA| of the encoder, decoder and cross attention against central
    differences (L: the predicted token at the last decoder position), the lens' last layer
    against the logits, and head importance shapes."""
    lm, x = _t5_lm()
    logits, probabilities, _ = plain_pass(lm, x)
    probabilities = [np.asarray(p, np.float64) for p in probabilities]
    token = np.argmax(logits[:, -1], axis=-1)
    rows = np.arange(2)
    scores = attention_gradient(lm, x)
    assert sorted(scores) == ["cross", "decoder", "encoder"]
    eps, largest = 1e-3, 0.0
    for stack in ("encoder", "decoder", "cross"):
        layer_scores = scores[stack][0]
        # the attention calls' shapes differ: (5, 5), (3, 3), (3, 5) queries x keys
        index = [p.shape for p in probabilities].index(layer_scores.shape)
        for b in range(2):
            entry = (b,) + np.unravel_index(np.argmax(layer_scores[b]), layer_scores[b].shape)
            values = []
            for sign in (1.0, -1.0):
                deltas = [np.zeros_like(p, dtype=np.float32) for p in probabilities]
                deltas[index][entry] = sign * eps
                values.append(tapped_logits(lm, x, _AddToAttention, deltas)[rows, -1, token])
            fd = (values[0] - values[1]) / (2 * eps)
            got = layer_scores[entry] / probabilities[index][entry]
            assert abs(got - abs(fd[b])) <= 2e-3 + 2e-2 * abs(fd[b]), (stack, got, fd[b])
            largest = max(largest, abs(fd[b]))
    assert largest > 1e-2  # gradients that matter were checked
    lens = np.asarray(logit_lens(lm, x))
    assert lens.shape == (1, 2, 3, VOCAB)
    np.testing.assert_allclose(lens[-1], logits, atol=1e-4)
    importance = head_importance(lm, [(x, x["decoder_token_ids"])])
    assert {k: np.shape(v) for k, v in importance.items()} == {
        "encoder": (1, 2), "decoder": (1, 2), "cross": (1, 2)}
    assert all(np.all(np.isfinite(v)) and np.all(np.asarray(v) >= 0)
               for v in importance.values())


# === Integrated gradients ===


def _bert_classifier():
    model = BertClassifier(BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                        hidden_dim=16, intermediate_dim=24,
                                        max_sequence_length=16, dropout=0.0),
                           num_classes=3, dropout=0.0)
    _randomize(model, 2)
    ids = np.random.default_rng(3).integers(1, VOCAB, (2, 7)).astype("int32")
    mask = np.ones_like(ids)
    mask[0, 5:] = 0
    ids[mask == 0] = 0
    return model, {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}


def _vit_classifier():
    model = ViTClassifier(ViTBackbone(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                      hidden_dim=16, intermediate_dim=24, dropout=0.0,
                                      attention_dropout=0.0), num_classes=3)
    _randomize(model, 4, scale=0.2)
    images = 0.3 * np.random.default_rng(5).normal(size=(2, 16, 16, 3))  # a smooth path
    return model, images.astype("float32")


def _t5_lm():
    from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM

    model = T5Seq2SeqLM(T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                                   hidden_dim=16, key_value_dim=8, intermediate_dim=24,
                                   dropout=0.0, feedforward="gated-gelu"))  # smooth: no
    # ReLU kinks for the finite differences and the quadrature (T5 v1.1's feed-forward)
    _randomize(model, 6)
    ids = np.random.default_rng(7).integers(2, VOCAB, (2, 5)).astype("int32")
    decoder = np.random.default_rng(8).integers(2, VOCAB, (2, 3)).astype("int32")
    decoder[:, 0] = 0
    return model, {"encoder_token_ids": ids, "encoder_padding_mask": np.ones_like(ids),
                   "decoder_token_ids": decoder, "decoder_padding_mask": np.ones_like(decoder)}


def _graphormer_predictor():
    from kzoo import graphs
    from kzoo.models.graphormer import GraphormerBackbone, GraphormerPredictor

    model = GraphormerPredictor(GraphormerBackbone(  # test_graphormer's TINY
        num_layers=2, hidden_dim=16, intermediate_dim=24, num_heads=4, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))
    _randomize(model, 9)
    x = graphs.batch([graphs.from_smiles(s) for s in ["CCO", "C=CC(N)C"]])
    x.pop("labels", None)
    return model, x


@pytest.mark.spread
@pytest.mark.parametrize("family", ["gpt", "bert", "vit", "t5", "graphormer"])
def test_integrated_gradients_completeness(family, gpt):
    if family == "gpt":
        model, x = gpt
    else:
        model, x = {"bert": _bert_classifier, "vit": _vit_classifier, "t5": _t5_lm,
                    "graphormer": _graphormer_predictor}[family]()
    # Graphormer's and T5's paths bend more: more quadrature points. T5's RMS norm has a
    # gradient of about 1/sqrt(eps) at zero embeddings (a gap over 1000x with a zero
    # baseline), so its baseline is the pad token's embedding.
    baseline = None
    if family == "t5":
        baseline = keras.ops.convert_to_numpy(
            model.backbone.get_layer("token_embedding").embeddings)[0]
    steps = {"graphormer": 128, "t5": 256}.get(family, 32)
    ig = integrated_gradients(model, x, steps=steps, baseline=baseline)
    # tokens, tokens, 2x2 patches, encoder tokens, graph nodes (padded to the larger graph)
    positions = {"gpt": 6, "bert": 7, "vit": 4, "t5": 5, "graphormer": 5}[family]
    assert ig.attributions.shape == (2, positions)
    assert ig.raw.shape == (2, positions, 16)
    np.testing.assert_allclose(ig.attributions, ig.raw.sum(-1), rtol=1e-5, atol=1e-6)
    if family == "gpt":  # the target: the predicted next token (plain pass, NumPy)
        logits = _logits(model, x)
        last, token = _next_token_targets(logits, x["padding_mask"])
        np.testing.assert_array_equal(ig.positions, last)
        np.testing.assert_array_equal(ig.targets, token)
        np.testing.assert_allclose(ig.output, logits[np.arange(2), last, token], atol=1e-4)
    delta = ig.output - ig.baseline_output
    print(f"[{backend()}] {family}: f(x) - f(baseline) {delta}, sum(IG) "
          f"{ig.raw.sum(axis=(1, 2))}, relative gap {ig.relative_gap}")
    assert np.all(np.abs(delta) > 1e-2)
    assert np.all(ig.relative_gap < 0.01), ig.relative_gap
    if family == "gpt":  # padded tokens do not matter to the next-token logit
        assert np.all(ig.raw[1, 4:] == 0.0)


# === Logit lens ===


def test_logit_lens_is_norm_and_head_of_each_block(gpt):
    lm, x = gpt
    lens = logit_lens(lm, x)
    assert lens.shape == (2, 2, 6, VOCAB)
    logits, _, blocks = plain_pass(lm, x)
    np.testing.assert_allclose(lens[-1], logits, atol=1e-5)
    # Layer 0: NumPy layer norm (the final norm's weights) and tied head on block 0's output
    # (recorded by a plain tap).
    backbone = lm.backbone
    hidden = blocks[0]
    norm = backbone.final_norm
    expected = ref.layer_norm(hidden, ref.w(norm.gamma), ref.w(norm.beta), norm.epsilon) @ \
        ref.w(backbone.token_embedding.embeddings).T
    np.testing.assert_allclose(lens[0], expected, atol=1e-4)
    assert np.abs(lens[0] - lens[1]).max() > 1e-2
    log_probs = logit_lens(lm, x, log_probs=True)
    shifted = lens - lens.max(-1, keepdims=True)
    np.testing.assert_allclose(
        log_probs, shifted - np.log(np.exp(shifted).sum(-1, keepdims=True)), atol=1e-5)


# === Head importance ===


def _next_token_loss(logits, x):
    """Mean cross-entropy of the real next tokens (NumPy)."""
    ids, mask = x["token_ids"], x["padding_mask"]
    z = logits[:, :-1]
    log_probs = z - z.max(-1, keepdims=True)
    log_probs = log_probs - np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, ids[:, 1:, None].astype(int), -1)[..., 0]
    weight = (mask[:, :-1] > 0) & (mask[:, 1:] > 0)  # a real token predicting a real one
    return (nll * weight).sum() / weight.sum()


def test_head_importance_matches_finite_differences(gpt):
    lm, x = gpt
    other = {"token_ids": x["token_ids"][:, ::-1].copy(), "padding_mask": np.ones((2, 6),
                                                                                   "int32")}
    data = [x, other]
    importance = head_importance(lm, data)   # next-token loss of batches without labels
    assert importance.shape == (2, 2)
    eps = 1e-3
    expected = np.zeros((2, 2))
    for batch in data:
        for layer in range(2):
            for head in range(2):
                losses = []
                for sign in (1.0, -1.0):
                    scales = np.ones((1, 2, 2), "float32")
                    scales[0, layer, head] += sign * eps
                    losses.append(_next_token_loss(
                        tapped_logits(lm, batch, _ScaleHeads, scales), batch))
                expected[layer, head] += abs(losses[0] - losses[1]) / (2 * eps)
    print(f"[{backend()}] head importance {importance.ravel()}, finite differences "
          f"{expected.ravel()}")
    np.testing.assert_allclose(importance, expected, atol=2e-3, rtol=2e-2)
    assert expected.max() > 5e-2


def test_head_importance_of_padded_batches_is_that_of_the_sequence_alone():
    # (the default next-token loss weighted position t by token t + 1 alone: a left-padded
    # row also counted its last pad, a query that sees only padding, predicting its first
    # real token, and its importance was not that of the sequence)
    lm = GPTCausalLM(GPTBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                 hidden_dim=16, intermediate_dim=24, max_sequence_length=16,
                                 position="rotary", dropout=0.0))  # relative positions:
    _randomize(lm, 3)                                               # a shift changes nothing
    sequence = np.random.default_rng(4).integers(1, VOCAB, 5)

    def batch(*pads):
        """One row a (left, right) padding of `sequence`; the padding holds id 7."""
        ids = [np.concatenate([np.full(a, 7), sequence, np.full(b, 7)]) for a, b in pads]
        mask = [np.concatenate([np.zeros(a), np.ones(5), np.zeros(b)]) for a, b in pads]
        return {"token_ids": np.stack(ids).astype("int32"),
                "padding_mask": np.stack(mask).astype("int32")}

    alone = head_importance(lm, [batch((0, 0))])  # the reference: no padding at all
    padded = {"left": head_importance(lm, [batch((2, 0))]),
              "right": head_importance(lm, [batch((0, 2))]),
              # one mean over both rows' real pairs: the same mean as the sequence alone
              "left and right rows": head_importance(lm, [batch((3, 0), (0, 3))])}
    diffs = {name: float(np.abs(value - alone).max()) for name, value in padded.items()}
    print(f"[{backend()}] head importance alone {alone.ravel()}; padded vs alone {diffs}")
    assert alone.max() > 5e-2
    for name, value in padded.items():
        np.testing.assert_allclose(value, alone, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_row_of_padding_has_no_default_position(gpt):
    # (the last real position of a row without one fell back to seq - 1: a padding
    # position's logit was explained without a word)
    lm, x = gpt
    empty = {"token_ids": x["token_ids"].copy(), "padding_mask": x["padding_mask"].copy()}
    empty["padding_mask"][1] = 0
    for explain in (attention_gradient, lambda *a, **k: integrated_gradients(*a, steps=2,
                                                                             **k)):
        with pytest.raises(ValueError, match=r"`inputs\['padding_mask'\]` marks no real "
                                             r"token in row\(s\) \[1\].*pass `position`"):
            explain(lm, empty)
    # an explicit position is the caller's choice, taken as given
    scores = attention_gradient(lm, empty, position=[5, 0])
    assert scores["self"][0].shape == (2, 2, 6, 6)


def test_a_left_out_padding_mask_is_all_ones_as_in_the_model(gpt):
    """GPT fills in a left-out `padding_mask` as ones (every token real); the interpret
    functions took only inputs with one ("`inputs` must have the keys ['padding_mask',
    'token_ids'] ... missing ['padding_mask']"). Without it they give what an all-ones
    mask gives, for the causal LM and for its backbone."""
    lm, x = gpt
    ids = x["token_ids"]
    bare, ones = {"token_ids": ids}, {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    for model in (lm, lm.backbone):
        for name, value in attention_maps(model, ones).items():
            for got, expected in zip(attention_maps(model, bare)[name], value):
                np.testing.assert_array_equal(got, expected)
    for got, expected in zip(attention_gradient(lm, bare)["self"],
                             attention_gradient(lm, ones)["self"]):
        np.testing.assert_array_equal(got, expected)
    bare_ig, ones_ig = (integrated_gradients(lm, v, steps=2) for v in (bare, ones))
    np.testing.assert_array_equal(bare_ig.positions, [5, 5])  # the last position of a row
    np.testing.assert_array_equal(bare_ig.raw, ones_ig.raw)
    np.testing.assert_array_equal(logit_lens(lm, bare), logit_lens(lm, ones))
    np.testing.assert_array_equal(head_importance(lm, [bare]), head_importance(lm, [ones]))


# === Errors ===


def test_errors_name_the_argument(gpt):
    lm, x = gpt
    with pytest.raises(ValueError, match="`model` of logit_lens must be a decoder"):
        logit_lens(lm.backbone.transformer_layers[0], x)
    with pytest.raises(ValueError, match=r"`steps` must be an int >= 2.*steps=1"):
        integrated_gradients(lm, x, steps=1)
    with pytest.raises(ValueError, match=r"`method` must be one of"):
        integrated_gradients(lm, x, method="simpson")
    with pytest.raises(ValueError, match=r"`target` must be in \[0, 40\); got target=40"):
        attention_gradient(lm, x, target=40)
    with pytest.raises(ValueError, match=r"`position` must be an int or 2 ints"):
        attention_gradient(lm, x, position=[1, 2, 3])
    with pytest.raises(ValueError, match=r"`baseline` must broadcast to .*\(2, 6, 16\)"):
        integrated_gradients(lm, x, baseline=np.zeros((3, 16)))
    with pytest.raises(ValueError, match="pass `target` as a callable"):
        attention_gradient(lm.backbone, x)
    with pytest.raises(ValueError, match="`data` must hold at least one batch"):
        head_importance(lm, [])
    with pytest.raises(ValueError, match=r"batch 0 is a tuple of length 4"):
        head_importance(lm, [(x, 1, 2, 3)])


def test_hostile_data_and_baselines_are_refused_by_name(gpt):
    lm, x = gpt
    # (a dict was iterated as its keys: "`inputs` must be a dict ...; got str")
    with pytest.raises(ValueError, match=r"`data` must be an iterable of batches .*got dict "
                                         r"\(one batch\? pass \[batch\]\)"):
        head_importance(lm, x)
    # (was TypeError: 'int' object is not iterable)
    with pytest.raises(ValueError, match=r"`data` must be an iterable .*got int data=5"):
        head_importance(lm, 5)
    # (a batch of length-1 rows has no next token: its mean loss over no tokens was 0 and
    # every score 0, silently)
    short = {"token_ids": x["token_ids"][:, :1], "padding_mask": x["padding_mask"][:, :1]}
    with pytest.raises(ValueError, match=r"`data` batch 1 has no next token to predict.*"
                                         r"shape \(2, 1\) with \[1, 1\] real tokens"):
        head_importance(lm, [x, short])
    # (a NaN baseline gave NaN attributions without a word)
    baseline = np.zeros((16,), "float32")
    baseline[3] = np.nan
    with pytest.raises(ValueError, match=r"`baseline` must hold finite numbers; got 1 "
                                         r"non-finite values in baseline of shape \(16,\)"):
        integrated_gradients(lm, x, baseline=baseline)


# Every public function of kzoo.interpret that runs a model, called the way a user would.
_ENTRY_POINTS = {
    "attention_maps": lambda model, x: attention_maps(model, x),
    "attention_maps(backbone)": lambda model, x: attention_maps(model.backbone, x),
    "logit_lens": lambda model, x: logit_lens(model, x),
    "attention_gradient": lambda model, x: attention_gradient(model, x),
    "integrated_gradients": lambda model, x: integrated_gradients(model, x, steps=2),
    "head_importance": lambda model, x: head_importance(model, [x]),
}


@pytest.mark.spread
@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
def test_token_ids_are_checked_as_the_model_checks_them(entry, gpt):
    """Out-of-range, negative and float ids raise the model's own ValueError on every
    backend (on JAX the model runs on traced values inside one jit, where its `__call__`
    cannot check them, so an embedding silently clipped 999 to VOCAB - 1), and valid ids,
    padding included, still run."""
    lm, x = gpt
    function = _ENTRY_POINTS[entry]
    for bad, message in [(VOCAB, rf"holds id {VOCAB} at batch row 0, token 2; ids must lie "
                                 rf"in \[0, {VOCAB}\)"),
                         (-2, rf"holds id -2 at batch row 0, token 2; ids must lie in "
                              rf"\[0, {VOCAB}\)")]:
        ids = x["token_ids"].copy()
        ids[0, 2] = bad
        with pytest.raises(ValueError, match=r"`token_ids` \(input of .*\) " + message):
            function(lm, {**x, "token_ids": ids})
    with pytest.raises(ValueError, match=r"`token_ids` \(input of .*\) must hold integer ids"):
        function(lm, {**x, "token_ids": x["token_ids"].astype("float32")})
    # An id under padding is not looked at (as by the model; head_importance's next-token
    # labels give it weight 0 and label 0); valid ids run and give finite numbers.
    ids = x["token_ids"].copy()
    ids[1, 5] = VOCAB + 7
    padded = [{**x, "token_ids": ids}]
    for valid in [x] + padded:
        result = function(lm, valid)
        if isinstance(result, dict):
            result = result["self"]
        values = [result.raw] if hasattr(result, "raw") else result
        assert all(np.isfinite(np.asarray(v)).all() for v in values)
