"""Gradient-based interpretation for every kzoo family, on every backend.

- `attention_gradient(model, inputs, target=None)`: attention x gradient, `A * |dL/dA|`
  per layer and head (the layout of `attention_maps`).
- `integrated_gradients(model, inputs, target=None, steps=32, baseline=None)`: integrated
  gradients (Sundararajan et al. 2017) on the input embeddings (token embeddings for BERT,
  GPT and T5's encoder, patch embeddings for ViT, node features for Graphormer), with the
  completeness check.
- `logit_lens(model, inputs)`: each decoder layer's hidden state through the final norm and
  the language-model head (GPT, T5).
- `head_importance(model, data, loss=None)`: Michel et al. 2019, `|dL / d head_mask|`
  summed over a data set.

Everything runs the model itself under a `kzoo.layers.taps.Tap` (the attention probabilities,
head scales or embeddings become inputs of the gradient) and differentiates with the backend's
own autodiff (`kzoo.interpret._backend`): no second model, no finite differences.

The objective `L` ("the target logit"), for `attention_gradient` and
`integrated_gradients`, per example of the batch (the batch's `L` is their sum, so each
example's gradients are its own):
- a classifier (BERT, ViT, Graphormer task models; output `(batch, classes)`): the logit of
  class `target`, by default the predicted class (argmax); a Graphormer regression
  (`num_classes=1`) has the prediction itself;
- a token model (GPT's causal LM, BERT's masked LM, T5; output `(batch, seq, vocab)`): the
  logit of token `target` at position `position`. `position` defaults to the last real
  position (by the padding mask: `padding_mask`, T5's `decoder_padding_mask`), i.e. the
  next-token prediction of a causal LM and the last decoder step of T5; give the masked
  position of a masked LM. A row that is all padding has no such position: without
  `position` it is refused (ValueError naming the row), never read at a padding position.
  `target` defaults to the predicted token (argmax) there;
- anything else (a backbone, or another choice): `target` may be a callable
  `target(outputs) -> (batch,)` tensor.

Example:
>>> scores = attention_gradient(lm, inputs)              # {"self": [(batch, h, q, k), ...]}
>>> ig = integrated_gradients(lm, inputs, steps=64)
>>> ig.attributions.shape, ig.relative_gap               # (batch, seq), completeness gap
>>> lens = logit_lens(lm, inputs)                        # (layers, batch, seq, vocab)
>>> importance = head_importance(lm, [batch_1, batch_2]) # (layers, heads)
"""

import dataclasses
from collections.abc import Mapping

import keras
import numpy as np
from keras import ops

from kzoo.interpret._backend import run
from kzoo.interpret.maps import (
    _InterpretTap,
    _Layout,
    _check_inputs,
    _flat_maps,
    _flat_mask,
    _mask_of,
    _numpy_inputs,
    _output_list,
    _prepare,
    _prepare_mask,
    _probe,
    _unflatten_maps,
)

METHODS = ("trapezoid", "midpoint")


# === Targets ===


def _padding_mask_key(inputs):
    for key in ("decoder_padding_mask", "padding_mask"):
        if isinstance(inputs, Mapping) and key in inputs:
            return key
    return None


def _per_example(name, value, batch, low, high):
    """An int or `(batch,)` ints in `[low, high)` as a `(batch,)` int array."""
    array = np.asarray(value)
    if array.ndim == 0:
        array = np.full((batch,), array)
    if array.shape != (batch,) or array.dtype.kind not in "iu":
        raise ValueError(
            f"`{name}` must be an int or {batch} ints (one per example); got {name}={value!r}."
        )
    if array.min() < low or array.max() >= high:
        raise ValueError(
            f"`{name}` must be in [{low}, {high}); got {name}={value!r}."
        )
    return array.astype("int64")


def _selection(layout, inputs, outputs, target, position):
    """The target of each example as NumPy one-hot weights: `(token (batch, classes), place
    (batch, seq) or None, targets, positions)` for a `(batch, classes)` or `(batch, seq,
    vocab)` output, or None for a callable target."""
    if callable(target):
        return None
    if layout.model is layout.backbone or len(outputs) != 1:
        raise ValueError(
            f"{layout.model.name} is a backbone (hidden states, no logits): pass `target` as "
            "a callable `target(outputs) -> (batch,)` tensor choosing what to explain; got "
            f"target={target!r}."
        )
    logits = outputs[0].astype("float64")
    batch = logits.shape[0]
    place, positions = None, None
    if logits.ndim == 3:
        seq = logits.shape[1]
        if position is None:
            key = _padding_mask_key(inputs)
            if key is None:
                positions = np.full((batch,), seq - 1)
            else:
                real = np.asarray(inputs[key]) > 0
                empty = np.flatnonzero(~real.any(1))
                if empty.size:
                    # (such a row fell back to position seq - 1: a padding position's
                    # logit, explained without a word)
                    raise ValueError(
                        f"`inputs[{key!r}]` marks no real token in row(s) "
                        f"{empty.tolist()} (all padding), so they have no last real "
                        "position to explain by default; pass `position` (an int or one "
                        "per example) or leave those rows out."
                    )
                positions = seq - 1 - np.argmax(real[:, ::-1], 1)
        else:
            positions = _per_example("position", position, batch, -seq, seq) % seq
        place = np.zeros((batch, seq), "float32")
        place[np.arange(batch), positions] = 1.0
        logits = logits[np.arange(batch), positions]
    elif logits.ndim != 2:
        raise ValueError(
            f"The model's output has shape {logits.shape}; a default target needs "
            "(batch, classes) or (batch, seq, vocab): pass `target` as a callable "
            "`target(outputs) -> (batch,)` tensor."
        )
    elif position is not None:
        raise ValueError(
            f"`position` is for models with a (batch, seq, vocab) output; this model's output "
            f"is (batch, classes) = {logits.shape}; got position={position!r}."
        )
    classes = logits.shape[-1]
    targets = (np.argmax(logits, -1) if target is None
               else _per_example("target", target, batch, 0, classes))
    token = np.zeros((batch, classes), "float32")
    token[np.arange(batch), targets] = 1.0
    return token, place, targets, positions


def _objective(outputs, static_target, selection_tensors):
    """Per-example objective `(batch,)` from the model's outputs."""
    if static_target is not None:
        return static_target(outputs)
    token, place = selection_tensors
    logits = ops.cast(outputs, "float32")
    if place is not None:
        logits = ops.sum(logits * ops.expand_dims(ops.cast(place, "float32"), -1), axis=1)
    return ops.sum(logits * ops.cast(token, "float32"), axis=-1)


def _selection_arrays(selection, batch, repeat=1):
    """`(arrays, has_place)` passing a selection to a body (tiled `repeat` times)."""
    if selection is None:
        return [], False
    token, place = selection[0], selection[1]
    arrays = [np.tile(token, (repeat, 1))]
    if place is not None:
        arrays.append(np.tile(place, (repeat, 1)))
    return arrays, place is not None


def _take_selection(tensors, start, has_selection, has_place):
    """`(selection tensors (token, place) or None, next index)`."""
    if not has_selection:
        return None, start
    if has_place:
        return (tensors[start], tensors[start + 1]), start + 2
    return (tensors[start], None), start + 1


# === Attention x gradient ===


def _attention_grad_body(model, call, inputs, tensors, static):
    mask_keys, target, has_selection, has_place = static
    layout = _Layout(model)
    mask = _mask_of(mask_keys, tensors)
    selection, start = _take_selection(tensors, len(mask_keys), has_selection, has_place)
    zeros = _unflatten_maps(layout, tensors[start:])
    tap = _InterpretTap(layout, head_mask=mask, perturb=zeros)
    with tap:
        outputs = call(inputs)
    objective = _objective(outputs, target, selection)
    return ops.sum(objective), [_flat_maps(layout, tap.checked_maps()), objective]


def attention_gradient(model, inputs, target=None, position=None, head_mask=None):
    """Attention x gradient: `A * |dL/dA|` for every layer and head.

    `A` are the post-softmax probabilities of each layer (as `attention_maps` returns them)
    and `L` the target logit (see the module docstring); the gradient treats each layer's
    `A` as an input of the rest of the network (a tap adds a zeros tensor to it and the
    backend differentiates `L` with respect to those zeros), so `dL/dA_ij` is the effect of
    the probability of key `j` for query `i` on `L` with everything else fixed.

    Args:
        model: a kzoo backbone or task model.
        inputs: the model's inputs (see `attention_maps`).
        target: None (the predicted class / token), an int or one int per example (a class
            or token id), or a callable `target(outputs) -> (batch,)` tensor.
        position: for `(batch, seq, vocab)` outputs, the position explained: None (the last
            real position; a row that is all padding is refused), an int or one int per
            example (negative counts from the end).
        head_mask: optional head mask (see `masked_heads`; multiplied with the mask of an
            enclosing `masked_heads`).

    Returns:
        The layout of `attention_maps`: `{"self": [...]}` (T5: "encoder", "decoder",
        "cross"), each float32 `(batch, heads, query, key)`, `A * |dL/dA|` >= 0.

    Raises:
        ValueError: bad model, inputs, target, position or head mask; without `position`,
            a token model's row that is all padding (it has no real position to explain).

    Example:
    >>> scores = attention_gradient(classifier, inputs)          # explain the predicted class
    >>> per_head = [s.sum(axis=(2, 3)) for s in scores["self"]]  # (batch, heads) a layer
    >>> scores = attention_gradient(bert_mlm, inputs, position=3)  # the masked position 3
    """
    layout, inputs, mask = _prepare(model, inputs, head_mask)
    outputs, maps, _ = _probe(layout, inputs, mask)
    selection = _selection(layout, inputs, outputs, target, position)
    batch = outputs[0].shape[0]
    mask_keys, mask_arrays = _flat_mask(mask)
    selection_arrays, has_place = _selection_arrays(selection, batch)
    flat = _flat_maps(layout, maps)
    static = (mask_keys, target if callable(target) else None, selection is not None,
              has_place)
    arrays = mask_arrays + selection_arrays + [np.zeros_like(m) for m in flat]
    grads, _ = run(model, _attention_grad_body, inputs, arrays, static=static, grad=True)
    grads = grads[len(mask_arrays) + len(selection_arrays):]
    scores = [m * np.abs(g) for m, g in zip(flat, grads)]
    return _unflatten_maps(layout, scores)


# === Integrated gradients ===


@dataclasses.dataclass
class IntegratedGradients:
    """What `integrated_gradients` returns (NumPy arrays).

    Attributes:
        attributions: `(batch, positions)`, the raw attributions summed over the embedding
            axis: one score per token (BERT, GPT, T5 encoder), patch (ViT, row-major) or
            node (Graphormer).
        raw: `(batch, positions, dim)`, `(x - baseline) * mean gradient` per coordinate.
        output: `(batch,)` the objective `L` at the input, `f(x)`.
        baseline_output: `(batch,)` `L` at the baseline, `f(baseline)`.
        completeness_gap: `(batch,)` `sum(raw) - (f(x) - f(baseline))` (0 for the exact
            integral; the quadrature error of `steps` points otherwise).
        relative_gap: `(batch,)` `|completeness_gap| / |f(x) - f(baseline)|`.
        targets: `(batch,)` the class or token explained (None for a callable target).
        positions: `(batch,)` the output position explained (token models), else None.
    """

    attributions: np.ndarray
    raw: np.ndarray
    output: np.ndarray
    baseline_output: np.ndarray
    completeness_gap: np.ndarray
    relative_gap: np.ndarray
    targets: object = None
    positions: object = None


def _ig_body(model, call, inputs, tensors, static):
    mask_keys, target, has_selection, has_place, embedding_index = static
    layout = _Layout(model)
    mask = _mask_of(mask_keys, tensors)
    selection, start = _take_selection(tensors, len(mask_keys), has_selection, has_place)
    path = tensors[start]

    def replace(index, embeddings):
        if index != embedding_index:
            return embeddings
        return ops.cast(path, embeddings.dtype)

    with _InterpretTap(layout, head_mask=mask, embedding_fn=replace):
        outputs = call(inputs)
    objective = _objective(outputs, target, selection)
    return ops.sum(objective), [objective]


def _embedding_index(layout, inputs, embeddings):
    """Which embedding call is the one explained (T5: the encoder's, its first)."""
    if not embeddings:
        raise ValueError(
            f"{layout.model.name} embeds no inputs through a tap (kzoo.layers.taps); "
            "integrated gradients need a BERT, GPT, T5, ViT or Graphormer model."
        )
    if layout.is_seq2seq:
        expected = tuple(np.shape(inputs["encoder_token_ids"]))
        if tuple(embeddings[0].shape[:2]) != expected:
            raise RuntimeError(
                f"kzoo.interpret: T5's first embedding call has shape {embeddings[0].shape}, "
                f"not the encoder's {expected}."
            )
    return 0


def _tile(inputs, repeat):
    if isinstance(inputs, Mapping):
        return {key: _tile(value, repeat) for key, value in inputs.items()}
    return np.concatenate([inputs] * repeat, axis=0)


def _quadrature(method, steps):
    """`(alphas, weights)` of `method` with `steps` gradient points, plus alpha 0 and 1 with
    weight 0 where the rule lacks them (for f(baseline) and f(x))."""
    if method == "trapezoid":
        alphas = np.linspace(0.0, 1.0, steps)
        weights = np.full(steps, 1.0 / (steps - 1))
        weights[[0, -1]] *= 0.5
    else:
        alphas = (np.arange(steps) + 0.5) / steps
        weights = np.full(steps, 1.0 / steps)
        alphas = np.concatenate([[0.0], alphas, [1.0]])
        weights = np.concatenate([[0.0], weights, [0.0]])
    return alphas, weights


def _check_ig_memory(steps, internal_batch_size, x):
    """Refuse `steps` whose quadrature arrays and interpolation path (a pass's points times
    the embeddings) exceed this machine's memory: were allocated until the OS killed the
    process (steps=10**9 with the default internal_batch_size)."""
    from kzoo.generation import _memory_bytes

    points = steps + 2  # (the midpoint rule adds alpha 0 and 1)
    per_pass = points if internal_batch_size is None else min(int(internal_batch_size), points)
    # float64 alphas and weights (and their padded copies), float64 values (points, batch);
    # the float32 path of one pass and the model inputs tiled to it.
    need = points * (32 + 8 * x.shape[0]) + per_pass * x.size * 4 * 2
    have = _memory_bytes()
    if have is not None and need > have:
        raise ValueError(
            f"`steps` is too large: steps={steps} with internal_batch_size="
            f"{internal_batch_size} needs at least {need / 2 ** 30:,.1f} GiB for the "
            f"interpolation points alone, more than this machine's memory "
            f"({have / 2 ** 30:,.1f} GiB); use fewer steps, or a smaller "
            "`internal_batch_size` (points per pass)."
        )


def integrated_gradients(model, inputs, target=None, steps=32, baseline=None, position=None,
                         method="trapezoid", internal_batch_size=None, head_mask=None):
    """Integrated gradients of the target logit with respect to the input embeddings.

    `IG(x) = (x - x') * integral_0^1 dL(x' + a (x - x')) / dx da` over the input embeddings
    `x` (token embeddings for BERT, GPT and T5's encoder, patch embeddings for ViT, node
    features for Graphormer; before positions, segments, class or graph tokens are added,
    which stay as they are), baseline `x'`. The integral is a quadrature over `steps` points
    (`method="trapezoid"`: `steps` points from the baseline to the input, both included;
    `"midpoint"`: the Riemann midpoint rule), evaluated `internal_batch_size` points at a time
    as one batch. By completeness, `sum(IG) = L(x) - L(x')` up to the quadrature error, which
    the result reports (`completeness_gap`, `relative_gap`): raise `steps` when it is large.

    Args:
        model: a kzoo backbone or task model.
        inputs: the model's inputs (see `attention_maps`).
        target: as in `attention_gradient` (None: the predicted class / token).
        steps: gradient evaluations (>= 2 for the trapezoid rule, >= 1 for the midpoint).
        baseline: None (zero embeddings), or an array broadcastable to the embeddings
            `(batch, positions, dim)`.
        position: as in `attention_gradient` (token models: the output position explained).
        method: "trapezoid" or "midpoint".
        internal_batch_size: interpolation points per forward/backward pass (None: all).
        head_mask: optional head mask (see `masked_heads`; multiplied with the mask of an
            enclosing `masked_heads`).

    Returns:
        An `IntegratedGradients` (per-position `attributions`, `raw` ones, the outputs and
        the completeness gap).

    Raises:
        ValueError: bad model, inputs, target, position, steps, baseline or method; without
            `position`, a token model's row that is all padding (as `attention_gradient`).

    Example:
    >>> ig = integrated_gradients(vit_classifier, images, steps=64)
    >>> heat = ig.attributions[0].reshape(4, 4)                 # a 4x4 grid of patches
    >>> assert ig.relative_gap.max() < 0.01
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {list(METHODS)}; got method={method!r}.")
    least = 2 if method == "trapezoid" else 1
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < least:
        raise ValueError(
            f"`steps` must be an int >= {least} for method={method!r}; got steps={steps!r}."
        )
    if internal_batch_size is not None and (
            isinstance(internal_batch_size, bool)
            or not isinstance(internal_batch_size, (int, np.integer))
            or internal_batch_size < 1):
        raise ValueError(
            "`internal_batch_size` must be None or a positive int; got "
            f"internal_batch_size={internal_batch_size!r}."
        )
    layout, inputs, mask = _prepare(model, inputs, head_mask)
    outputs, _, embeddings = _probe(layout, inputs, mask)
    index = _embedding_index(layout, inputs, embeddings)
    x = embeddings[index].astype("float32")
    if baseline is None:
        base = np.zeros_like(x)
    else:
        try:
            base = np.broadcast_to(np.asarray(baseline, "float32"), x.shape).copy()
        except ValueError:
            raise ValueError(
                f"`baseline` must broadcast to the input embeddings' shape {x.shape} (batch, "
                f"positions, dim); got shape {np.shape(baseline)}."
            ) from None
        if not np.all(np.isfinite(base)):
            # (a NaN baseline gave NaN attributions and gaps, without a word)
            raise ValueError(
                "`baseline` must hold finite numbers; got "
                f"{np.size(baseline) - np.count_nonzero(np.isfinite(baseline))} non-finite "
                f"values in baseline of shape {np.shape(baseline)}."
            )
    selection = _selection(layout, inputs, outputs, target, position)
    batch = x.shape[0]
    _check_ig_memory(int(steps), internal_batch_size, x)
    alphas, weights = _quadrature(method, int(steps))
    per_pass = len(alphas) if internal_batch_size is None else int(internal_batch_size)
    passes = -(-len(alphas) // per_pass)
    padding = passes * per_pass - len(alphas)  # equal passes: one compiled function on JAX
    alphas = np.concatenate([alphas, np.zeros(padding)])
    weights = np.concatenate([weights, np.zeros(padding)])

    mask_keys, mask_arrays = _flat_mask(mask)
    selection_arrays, has_place = _selection_arrays(selection, batch, repeat=per_pass)
    static = (mask_keys, target if callable(target) else None, selection is not None,
              has_place, index)
    tiled = _tile(inputs, per_pass)
    mean_gradient = np.zeros(x.shape, "float64")
    values = np.zeros((len(alphas), batch), "float64")
    for p in range(passes):
        chunk = alphas[p * per_pass:(p + 1) * per_pass]
        path = base[None] + chunk[:, None, None, None] * (x - base)[None]
        arrays = mask_arrays + selection_arrays + [path.reshape((-1,) + x.shape[1:])]
        grads, (objective,) = run(model, _ig_body, tiled, arrays, static=static, grad=True)
        grad = grads[-1].reshape((per_pass,) + x.shape).astype("float64")
        chunk_weights = weights[p * per_pass:(p + 1) * per_pass]
        mean_gradient += np.tensordot(chunk_weights, grad, axes=1)
        values[p * per_pass:(p + 1) * per_pass] = objective.reshape(per_pass, batch)
    raw = (x - base).astype("float64") * mean_gradient
    first = int(np.argmax(alphas == 0.0))
    last = int(np.argmax(alphas == 1.0))
    output, baseline_output = values[last], values[first]
    delta = output - baseline_output
    gap = raw.sum(axis=(1, 2)) - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.abs(gap) / np.abs(delta)
    return IntegratedGradients(
        attributions=raw.sum(-1).astype("float32"),
        raw=raw.astype("float32"),
        output=output,
        baseline_output=baseline_output,
        completeness_gap=gap,
        relative_gap=relative,
        targets=None if selection is None else selection[2],
        positions=None if selection is None else selection[3],
    )


# === Logit lens ===


def _lens_parts(model):
    """`(block key, norm, head)` of a decoder: GPT (backbone or causal LM), T5's LM."""
    from kzoo.models.gpt import GPTBackbone, GPTCausalLM
    from kzoo.models.t5 import T5Seq2SeqLM

    if isinstance(model, (GPTBackbone, GPTCausalLM)):
        backbone = model if isinstance(model, GPTBackbone) else model.backbone
        return "self", backbone.final_norm, (
            lambda h: backbone.token_embedding(h, reverse=True))
    if isinstance(model, T5Seq2SeqLM):
        return "decoder", model.backbone.decoder_output_norm, model._logits
    raise ValueError(
        "`model` of logit_lens must be a decoder with a language-model head: a GPT backbone "
        f"or GPTCausalLM, or a T5Seq2SeqLM; got {type(model).__name__}."
    )


def _lens_body(model, call, inputs, tensors, static):
    key, norm, head = _lens_parts(model)
    tap = _InterpretTap(_Layout(model), head_mask=_mask_of(static, tensors), keep_blocks=True)
    with tap:
        call(inputs)
    return None, [ops.stack([ops.cast(head(norm(h)), "float32") for h in tap.blocks[key]])]


def logit_lens(model, inputs, log_probs=False, head_mask=None):
    """The logit lens (nostalgebraist 2020): each decoder layer's output through the final
    norm and the language-model head.

    Layer `i`'s lens is `head(final_norm(h_i))` with `h_i` the output of decoder block `i`
    (the residual stream after it): GPT's final norm and (tied or separate) head; T5's
    decoder output norm and its head (`d_model^-1/2`-scaled tied embedding, or `lm_head`).
    The last layer's lens is the model's own logits.

    Args:
        model: a `GPTCausalLM` (or `GPTBackbone`) or a `T5Seq2SeqLM`.
        inputs: the model's inputs (see `attention_maps`).
        log_probs: return log-probabilities (log-softmax over the vocabulary) instead of
            logits.
        head_mask: optional head mask (see `masked_heads`; multiplied with the mask of an
            enclosing `masked_heads`).

    Returns:
        float32 NumPy `(layers, batch, seq, vocabulary)` (T5: decoder layers and decoder
        positions): logits, or log-probabilities with `log_probs=True`.

    Raises:
        ValueError: the model is not a GPT or T5 language model, or bad inputs.

    Example:
    >>> lens = logit_lens(lm, inputs)
    >>> lens[:, 0, -1].argmax(-1)       # each layer's guess of the next token, example 0
    """
    if not isinstance(log_probs, (bool, np.bool_)):
        raise ValueError(f"`log_probs` must be True or False; got log_probs={log_probs!r}.")
    _lens_parts(model)
    layout, inputs, mask = _prepare(model, inputs, head_mask)
    mask_keys, mask_arrays = _flat_mask(mask)
    _, (lens,) = run(model, _lens_body, inputs, mask_arrays, static=mask_keys)
    if log_probs:
        lens = lens.astype("float64")
        top = lens.max(-1, keepdims=True)
        lens = lens - top - np.log(np.exp(lens - top).sum(-1, keepdims=True))
    return lens.astype("float32")


# === Head importance ===


def _default_loss(model, has_labels):
    """`(loss, mode)`: the loss a data set without `loss` uses (see `head_importance`)."""
    from kzoo.losses import TokenCrossentropy
    from kzoo.models.gpt import GPTCausalLM
    from kzoo.models.graphormer import GraphormerPredictor

    if not has_labels:
        if isinstance(model, GPTCausalLM):
            return TokenCrossentropy(reduction="mean_with_sample_weight"), "next_token"
        raise ValueError(
            f"`data` batches for {type(model).__name__} must be (inputs, labels) pairs when "
            "no `loss` is given (only a GPTCausalLM has a default without labels: the "
            "next-token loss of its inputs)."
        )
    default = getattr(model, "default_loss", lambda: None)()
    if default is not None:
        return default, "labels"
    if isinstance(model, GraphormerPredictor) and model.num_classes == 1:
        return keras.losses.MeanSquaredError(), "labels"
    if getattr(model, "task_name", None) in ("classifier", "predictor"):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True), "labels"
    raise ValueError(
        f"{type(model).__name__} has no default loss; pass `loss` (a Keras loss or a callable "
        "`loss(y_true, y_pred)`)."
    )


def _split_batch(batch, index):
    """`(inputs, labels, sample_weight)` of a data item: inputs, or a (inputs, labels[,
    sample_weight]) tuple."""
    if isinstance(batch, (tuple, list)):
        if len(batch) not in (2, 3):
            raise ValueError(
                f"Each `data` batch must be inputs, (inputs, labels) or (inputs, labels, "
                f"sample_weight); batch {index} is a {type(batch).__name__} of length "
                f"{len(batch)}."
            )
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    return batch, None, None


def _importance_body(model, call, inputs, tensors, static):
    mask_keys, loss, mode = static
    x, labels, sample_weight = inputs
    with _InterpretTap(_Layout(model), head_mask=_mask_of(mask_keys, tensors)):
        outputs = call(x)
    if mode == "next_token":
        outputs = outputs[:, :-1]
    if sample_weight is None:
        value = loss(labels, outputs)
    else:
        value = loss(labels, outputs, sample_weight=sample_weight)
    return ops.cast(value, "float32"), []


def head_importance(model, data, loss=None, head_mask=None):
    """Head importance scores (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better
    than One?"): `|dL / d xi_h|` summed over the batches of `data`.

    Every head's probabilities are multiplied by a mask variable `xi_h` (as `masked_heads`
    does) and the batch loss `L` is differentiated with respect to the masks at their
    current value: 1 for every head by default, so the score of a head is the first-order
    change of the loss when it is removed; as in the authors' code, each batch contributes
    the absolute gradient of its mean loss. Inside `masked_heads` (or with `head_mask`) the
    masks start at that mask instead, as the authors' iterative pruning does with the heads
    removed so far: the scores are those of the masked model.

    Args:
        model: a kzoo task model (or a backbone, with `loss`).
        data: an iterable of batches: inputs (see `attention_maps`), `(inputs, labels)` or
            `(inputs, labels, sample_weight)`.
        loss: None, a Keras loss or a callable `loss(y_true, y_pred)` (called with
            `sample_weight=` when batches carry weights). None: the model's default loss
            (token models: `kzoo.losses.TokenCrossentropy`), sparse categorical
            cross-entropy on logits for classifiers, mean squared error for a Graphormer
            regression; a `GPTCausalLM` given batches without labels uses the next-token
            loss of its inputs: the mean cross-entropy over the pairs (position t, token
            t + 1) where both are real tokens by `padding_mask`, so padding, left or right,
            is neither a query nor a target and a padded batch of one sequence scores as
            the sequence alone. (A left-padded row shifts the learned positions of a
            `position="learned"` model, as in its own forward pass; rotary positions are
            relative and see no shift.)
        head_mask: optional head mask at which to differentiate (see `masked_heads`;
            multiplied with the mask of an enclosing `masked_heads`).

    Returns:
        float32 NumPy `(layers, heads)`; for T5 a dict `{"encoder", "decoder", "cross"}` of
        `(layers, heads)` arrays.

    Raises:
        ValueError: bad model, `data` that is not an iterable of batches (or is empty), bad
            batches (a GPTCausalLM batch without labels needs a real next token to predict),
            no default loss, or a bad `head_mask`.

    Example:
    >>> importance = head_importance(classifier, [(inputs, labels)])
    >>> order = np.argsort(importance, axis=None)         # least important heads first
    """
    if loss is not None and not callable(loss):
        # (was "'str' object is not callable" from inside the first batch's gradient)
        raise ValueError(
            "`loss` must be None, a Keras loss or a callable loss(y_true, y_pred); got "
            f"loss={loss!r}" + (f" (for a Keras loss by name: keras.losses.get({loss!r}))"
                                if isinstance(loss, str) else "") + "."
        )
    layout = _Layout(model)
    if isinstance(data, Mapping) or hasattr(data, "shape") or not hasattr(data, "__iter__"):
        # (a dict iterated as its keys: "`inputs` must be a dict ...; got str"; a number:
        # "TypeError: 'int' object is not iterable")
        one_batch = isinstance(data, Mapping) or hasattr(data, "shape")
        raise ValueError(
            "`data` must be an iterable of batches (a list, a generator, a tf.data.Dataset), "
            "each inputs, (inputs, labels) or (inputs, labels, sample_weight); got "
            f"{type(data).__name__}"
            + (" (one batch? pass [batch])" if one_batch else f" data={data!r}") + "."
        )
    # The masks are differentiated at the enclosing `masked_heads` mask (times `head_mask`),
    # the heads removed so far (this ran its own all-ones tap inside the context, scoring
    # the unmasked model).
    start = _prepare_mask(layout, head_mask)
    keys = tuple(layout.attention)
    shapes = layout.mask_shapes()
    ones = [np.ones(shapes[key], "float32") if start is None or start.get(key) is None
            else np.asarray(start[key], "float32") for key in keys]
    totals = [np.zeros(shapes[key], "float64") for key in keys]
    seen, defaults = 0, {}
    for index, batch in enumerate(data):
        x, labels, sample_weight = _split_batch(batch, index)
        x = _numpy_inputs(_check_inputs(model, x))
        if loss is None:  # one loss object per kind of batch (a JAX cache key)
            if (labels is not None) not in defaults:
                defaults[labels is not None] = _default_loss(model, labels is not None)
            batch_loss, mode = defaults[labels is not None]
        else:
            batch_loss, mode = loss, "labels"
        if mode == "next_token":
            # Position t predicts token t + 1: it counts only when both are real. (With the
            # target alone, a left-padded row counted its last pad predicting its first
            # real token: the output of a query that sees nothing but padding.)
            real = np.asarray(x["padding_mask"]) > 0
            sample_weight = (real[:, :-1] & real[:, 1:]).astype("float32")
            if not sample_weight.any():
                # (a mean over no tokens is 0: every score of such a batch was 0, silently)
                raise ValueError(
                    f"`data` batch {index} has no next token to predict: the default loss of "
                    f"a {type(model).__name__} without labels needs a row with 2 adjacent "
                    f"real tokens; got token_ids of shape {np.shape(x['token_ids'])} with "
                    f"{real.sum(axis=1).tolist()} real tokens per row. Pass longer "
                    "sequences, or (inputs, labels) batches and a `loss`."
                )
            # (padding may hold any id, e.g. -1: its weight is 0, and a label 0 keeps the
            # loss' lookup in range on every backend)
            labels = np.where(sample_weight > 0, np.asarray(x["token_ids"])[:, 1:], 0)
        else:
            labels = None if labels is None else np.asarray(
                keras.ops.convert_to_numpy(labels))
            if sample_weight is not None:
                sample_weight = np.asarray(keras.ops.convert_to_numpy(sample_weight),
                                           "float32")
        grads, _ = run(model, _importance_body, (x, labels, sample_weight), ones,
                       static=(keys, batch_loss, mode), grad=True)
        for total, grad in zip(totals, grads):
            total += np.abs(grad)
        seen += 1
    if not seen:
        raise ValueError("`data` must hold at least one batch; got an empty iterable.")
    result = {key: total.astype("float32") for key, total in zip(keys, totals)}
    return result if layout.is_seq2seq else result["self"]
