"""kzoo.interpret gradients against transformers and torch autograd.

A tiny random BERT classifier and GPT-2 language model are imported with
`kzoo.presets.load`; the references are computed on the transformers models themselves with
torch autograd: `d loss / d head_mask` (transformers' `head_mask`, as Michel et al.'s code
does) for head importance, `d logit / d attentions` (the `output_attentions` tensors, which
the eager attention multiplies into the values) for attention x gradient, and integrated
gradients as a trapezoid sum over `inputs_embeds` written here.
"""

import numpy as np
import pytest

import kzoo.presets
from kzoo.interpret import attention_gradient, head_importance, integrated_gradients, masked_heads
from tests.harness import backend, hf_checkpoint

ATOL = 1e-5


def _long(array):
    import torch

    return torch.tensor(np.asarray(array), dtype=torch.long)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager")
    hf = transformers.BertForSequenceClassification(config)
    with torch.no_grad():  # weights that give heads of different weight
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf = hf.eval()
    model = kzoo.presets.load(hf_checkpoint(str(tmp_path_factory.mktemp("bert")), hf))
    ids = np.random.default_rng(1).integers(1, 61, (2, 9)).astype("int32")
    mask = (np.arange(9)[None] < np.array([[9], [6]])).astype("int32")  # a padded row
    ids[mask == 0] = 0
    segments = (np.arange(9)[None] >= 4).astype("int32") * mask
    x = {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}
    hf_x = dict(input_ids=_long(ids), token_type_ids=_long(segments),
                attention_mask=_long(mask))
    return model, hf, x, hf_x


def _hf_importance(hf, hf_x, labels, at):
    """|d cross-entropy / d head_mask| of transformers at head_mask = `at` (autograd)."""
    import torch

    head_mask = torch.tensor(at, dtype=torch.float32, requires_grad=True)
    logits = hf(**hf_x, head_mask=head_mask).logits
    loss = torch.nn.functional.cross_entropy(logits, _long(labels))
    (grad,) = torch.autograd.grad(loss, head_mask)
    return grad.abs().numpy()


def test_head_importance_inside_masked_heads_scores_the_masked_model(bert):
    # (inside masked_heads, head_importance ran its own all-ones tap and scored the unmasked
    # model: as Michel et al.'s iterative pruning, the gradient must be taken at the mask of
    # the heads removed so far)
    model, hf, x, hf_x = bert
    labels = np.array([0, 2])
    data = [(x, labels)]
    plain = head_importance(model, data)
    expected_plain = _hf_importance(hf, hf_x, labels, np.ones((2, 4)))
    pruned = np.ones((2, 4), "float32")
    pruned[0, 1] = pruned[1, 2] = 0.0
    pruned[1, 0] = 0.5
    with masked_heads(model, pruned):
        masked = head_importance(model, data)
    given = head_importance(model, data, head_mask=pruned)
    expected = _hf_importance(hf, hf_x, labels, pruned)
    print(f"[{backend()}] importance at ones {plain.ravel()}, transformers "
          f"{expected_plain.ravel()}; masked {masked.ravel()}, transformers {expected.ravel()}")
    np.testing.assert_allclose(plain, expected_plain, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(masked, expected, atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(given, expected, atol=ATOL, rtol=1e-4)
    assert np.abs(expected - expected_plain).max() > 1e-3  # the mask matters


def test_attention_gradient_matches_torch_autograd(bert):
    import torch

    model, hf, x, hf_x = bert
    out = hf(**hf_x, output_attentions=True)
    target = out.logits.argmax(-1)
    objective = out.logits[torch.arange(2), target].sum()
    grads = torch.autograd.grad(objective, out.attentions)
    scores = attention_gradient(model, x)["self"]
    real = x["padding_mask"].astype(bool)
    for layer, (ours, a, g) in enumerate(zip(scores, out.attentions, grads)):
        expected = (a * g.abs()).detach().numpy()
        diff = np.abs(ours - expected).transpose(0, 2, 1, 3)[real].max()
        print(f"[{backend()}] layer {layer}: A*|dL/dA| max |diff| {diff:.2e} "
              f"(largest {expected.max():.3f})")
        assert diff <= ATOL and expected.max() > 1e-2


def test_integrated_gradients_match_a_torch_trapezoid_sum(bert):
    import torch

    model, hf, x, hf_x = bert
    steps = 12
    ig = integrated_gradients(model, x, steps=steps)
    with torch.no_grad():
        target = hf(**hf_x).logits.argmax(-1)
        embeddings = hf.bert.embeddings.word_embeddings(hf_x["input_ids"])
    np.testing.assert_array_equal(ig.targets, target.numpy())
    kwargs = {k: v for k, v in hf_x.items() if k != "input_ids"}
    total = torch.zeros_like(embeddings)
    for k in range(steps):  # trapezoid rule from the zero baseline to the input
        weight = (0.5 if k in (0, steps - 1) else 1.0) / (steps - 1)
        point = (embeddings * (k / (steps - 1))).requires_grad_(True)
        logits = hf(inputs_embeds=point, **kwargs).logits
        (grad,) = torch.autograd.grad(logits[torch.arange(2), target].sum(), point)
        total += weight * grad
    expected = (embeddings * total).sum(-1).numpy()
    diff = np.abs(ig.attributions - expected).max()
    print(f"[{backend()}] IG max |diff| {diff:.2e} (largest {np.abs(expected).max():.3f})")
    assert diff <= ATOL and np.abs(expected).max() > 1e-2
