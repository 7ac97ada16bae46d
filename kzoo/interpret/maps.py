"""Attention maps and head masking for every kzoo family, on every backend.

- `attention_maps(model, inputs)`: the post-softmax attention probabilities of every layer,
  `{"self": [...]}` (BERT, GPT, ViT, Graphormer) or `{"encoder", "decoder", "cross"}` (T5),
  each `(batch, heads, query, key)` NumPy.
- `masked_heads(model, head_mask)`: a context manager under which the model runs with chosen
  heads scaled (0 removes a head), as transformers' `head_mask`.

Both work through `kzoo.layers.taps`: while a tap is active, attention is computed with the
exact formula (whatever kernel is selected, `set_attention_kernel("fused")` included) and
its probabilities pass through the tap. A forward pass outside them runs the selected
kernel exactly as before. The private helpers here (`_Layout`, `_InterpretTap`,
`_check_inputs`) are shared with `kzoo.interpret.gradients`.

Example:
>>> model = kzoo.presets.load("gpt_mini")
>>> inputs = {"token_ids": np.array([[5, 6, 7]]), "padding_mask": np.ones((1, 3), "int32")}
>>> maps = kzoo.interpret.attention_maps(model, inputs)
>>> len(maps["self"]), maps["self"][0].shape          # layers, (batch, heads, query, key)
>>> mask = np.ones((model.backbone.num_layers, model.backbone.num_heads))
>>> mask[0, 1] = 0.0                                  # remove head 1 of layer 0
>>> with kzoo.interpret.masked_heads(model, mask):
...     logits = model(inputs)
"""

from collections.abc import Mapping

import keras
import numpy as np

from kzoo import inputs as input_checks
from kzoo.inputs import is_optional_input
from kzoo.layers.taps import Tap, active_tap

T5_KEYS = ("encoder", "decoder", "cross")


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


# === Where each attention layer and block sits ===


def _backbone_of(model):
    """The backbone of a kzoo backbone or task model; ValueError for anything else."""
    from kzoo.models.base import Backbone, TaskModel

    if isinstance(model, TaskModel) and isinstance(getattr(model, "backbone", None), Backbone):
        return model.backbone
    if isinstance(model, Backbone):
        return model
    raise ValueError(
        "`model` must be a kzoo model (a backbone or task model of BERT, GPT, T5, ViT or "
        "Graphormer, e.g. from `kzoo.presets.load`); got "
        f"model={type(model).__module__}.{type(model).__name__}."
    )


class _Layout:
    """The attention layers and blocks of a kzoo model, by key and depth.

    `attention[key]` lists the `MultiHeadAttention` layers of a key in depth order ("self";
    T5: "encoder", "decoder", "cross"), `blocks[key]` the `TransformerBlock`s ("self"; T5:
    "encoder", "decoder"). Taps find a layer's key and depth by its identity, so the order in
    which a functional model happens to call its layers does not matter.
    """

    def __init__(self, model):
        self.model = model
        self.backbone = backbone = _backbone_of(model)
        if hasattr(backbone, "decoder_layers"):  # encoder-decoder (T5)
            encoder, decoder = list(backbone.encoder_layers), list(backbone.decoder_layers)
            self.blocks = {"encoder": encoder, "decoder": decoder}
            self.attention = {
                "encoder": [block.self_attention for block in encoder],
                "decoder": [block.self_attention for block in decoder],
                "cross": [block.cross_attention_layer for block in decoder],
            }
        else:
            blocks = getattr(backbone, "transformer_layers", None)
            if blocks is None:
                blocks = backbone.encoder_layers
            self.blocks = {"self": list(blocks)}
            self.attention = {"self": [block.self_attention for block in blocks]}
        self._attention_slot = {
            id(layer): (key, i) for key, layers in self.attention.items()
            for i, layer in enumerate(layers)
        }
        self._block_slot = {
            id(block): (key, i) for key, blocks in self.blocks.items()
            for i, block in enumerate(blocks)
        }

    @property
    def is_seq2seq(self):
        return "cross" in self.attention

    def heads(self, key):
        return self.attention[key][0].num_heads

    def mask_shapes(self):
        """key -> the `(layers, heads)` shape of its head mask."""
        return {key: (len(layers), layers[0].num_heads)
                for key, layers in self.attention.items()}

    def attention_slot(self, layer):
        slot = self._attention_slot.get(id(layer))
        if slot is None:
            raise RuntimeError(
                f"kzoo.interpret: attention layer {layer.path!r} does not belong to the model "
                f"being interpreted ({self.model.name!r}); call one model at a time inside "
                "an interpretation tap."
            )
        return slot

    def block_slot(self, layer):
        return self._block_slot.get(id(layer))


# === The tap every interpretation function uses ===


class _InterpretTap(Tap):
    """A tap that scales heads, perturbs attention probabilities, replaces input embeddings
    and keeps what it sees by key and depth (see `_Layout`).

    Args:
        layout: the model's `_Layout`.
        head_mask: None or key -> `(layers, heads)` array or tensor; head `h` of layer `i`
            is multiplied by `head_mask[key][i, h]` (keys left out: unscaled).
        perturb: None or key -> list of tensors `(batch, heads, query, key)` added to the
            (scaled) probabilities of each layer (zeros make them differentiable inputs).
        embedding_fn: None or `fn(index, embeddings) -> embeddings` for the embedding calls.
        keep_blocks: keep block outputs in `blocks[key][i]`.
        record_embeddings: keep the input embeddings (`Tap.embedding_records`).
        forget_compiled: on entering and leaving, drop the Keras functions the model
            compiled for `predict` / `evaluate` / `fit` (see `masked_heads`).
        nest: on entering, multiply `head_mask` by that of an enclosing `masked_heads` of
            the same model (which is already combined with those around it), and restore
            it on leaving; refuse to enter inside any other active tap (`masked_heads`).

    The scaled (and perturbed) probabilities are what the layer goes on with, and what
    `maps[key][i]` holds: a masked head reads as zeros, as transformers' attentions do.
    A plain `Tap` entered inside this one passes every tensor through it first (it sees
    the masked model); this tap does not pass tensors through an enclosing one: it
    combines an enclosing `masked_heads` of its model through `nest`, and the
    `kzoo.interpret` functions take that mask explicitly (`_prepare_mask`).
    """

    chains_enclosing = False

    def __init__(self, layout, head_mask=None, perturb=None, embedding_fn=None,
                 keep_blocks=False, record_embeddings=False, forget_compiled=False,
                 nest=False):
        super().__init__(record_attention=False, record_blocks=False,
                         record_embeddings=record_embeddings)
        self.forget_compiled = forget_compiled
        self.nest = nest
        self._own_masks = []  # (the tap's own head mask, while entered with `nest`)
        self.layout = layout
        self.head_mask = head_mask
        self.perturb = perturb
        self.embedding_fn = embedding_fn
        self.keep_blocks = keep_blocks
        self.maps = {key: [None] * len(layers) for key, layers in layout.attention.items()}
        self.blocks = {key: [None] * len(blocks) for key, blocks in layout.blocks.items()}

    def _covers(self, layer):
        # (a `Tap` inside `masked_heads` may run another model too, e.g. a distillation
        # student: its layers pass through the inner tap alone)
        return id(layer) in self.layout._attention_slot

    def attention(self, layer, index, weights):
        key, i = self.layout.attention_slot(layer)
        if self.head_mask is not None and self.head_mask.get(key) is not None:
            scale = keras.ops.cast(self.head_mask[key][i], weights.dtype)
            weights = weights * keras.ops.reshape(scale, (1, -1, 1, 1))
        if self.perturb is not None and self.perturb.get(key) is not None:
            weights = weights + keras.ops.cast(self.perturb[key][i], weights.dtype)
        self.maps[key][i] = weights
        return weights

    def block(self, layer, index, output):
        if self.keep_blocks:
            slot = self.layout.block_slot(layer)
            if slot is not None:
                self.blocks[slot[0]][slot[1]] = output
        return output

    def embedding(self, layer, index, output):
        return output if self.embedding_fn is None else self.embedding_fn(index, output)

    def __enter__(self):
        if self.nest:
            # Combine with an enclosing `masked_heads` of the same model: only the innermost
            # tap is active, so without this the inner mask would replace the outer one.
            enclosing = _enclosing_head_mask(self.layout, nesting=True)
            self._own_masks.append(self.head_mask)
            self.head_mask = _combine_masks(enclosing, self.head_mask)
        if self.forget_compiled:
            _forget_compiled(self.layout)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            if self.forget_compiled:
                _forget_compiled(self.layout)
            return super().__exit__(*exc)
        finally:
            if self.nest:
                self.head_mask = self._own_masks.pop()

    def checked_maps(self):
        """`maps`, after checking that every layer was seen (key -> list of tensors)."""
        for key, maps in self.maps.items():
            missing = [i for i, m in enumerate(maps) if m is None]
            if missing:
                raise RuntimeError(
                    f"kzoo.interpret: the forward pass of {self.layout.model.name!r} did not "
                    f"run attention layers {missing} of {key!r} through the tap."
                )
        return self.maps


def _forget_compiled(layout):
    """Drop the compiled `predict` / `evaluate` / `fit` functions of the model, its
    backbone and the task models built on that backbone, and the decode loops `generate` compiled for it (JAX, TensorFlow): each is
    traced once and reused, so one traced inside a tap would keep the tap's effect after
    it, and one traced before would ignore it (`generate` inside `masked_heads` gave the
    unmasked model's tokens)."""
    from kzoo.models.base import task_models_of

    # (a mask on a backbone reaches the task models built on it: their compiled functions
    # call it inside, and would keep the unmasked trace)
    models = (layout.model, layout.backbone, *task_models_of(layout.backbone))
    for model in {id(m): m for m in models}.values():
        for name in ("predict_function", "test_function", "train_function"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
        # (`kzoo.generation._cache_for` starts a new cache when the model has none)
        model.__dict__.pop("_generation_fns", None)


def _enclosing_head_mask(layout, nesting=False):
    """The head mask of an enclosing `masked_heads` of the same model (None if no tap is
    active); a different active tap cannot be combined with this one. `nesting`: asked by
    a `masked_heads` being entered (for the error message)."""
    tap = active_tap()
    if tap is None:
        return None
    if isinstance(tap, _InterpretTap) and tap.layout.backbone is layout.backbone:
        return tap.head_mask
    if isinstance(tap, _InterpretTap):
        other = f"`masked_heads` of another model ({tap.layout.model.name!r})"
    else:
        other = f"another active tap ({type(tap).__name__})"
    what = ("`masked_heads` cannot be entered" if nesting
            else "kzoo.interpret functions run their own tap and cannot run")
    raise RuntimeError(
        f"{what} inside {other}: only one tap is active at a time, so the outer one would "
        f"stop seeing {layout.model.name!r}'s calls; only `masked_heads` of the same model "
        "may enclose it."
    )


def _combine_masks(outer, inner):
    """Two head masks (key -> `(layers, heads)`, None: all ones) multiplied key by key: a
    head runs only if both keep it (a key missing from one is ones there)."""
    if outer is None:
        return inner
    if inner is None:
        return outer
    combined = dict(outer)
    for key, value in inner.items():
        combined[key] = value if key not in combined else combined[key] * value
    return combined


# === Input checks ===


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _check_array(name, value, spec, model):
    if not hasattr(value, "shape"):
        value = np.asarray(value)
    shape, expected = _shape(value), tuple(spec.shape)
    fits = len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape[1:], expected[1:])
    )
    if not fits:
        wanted = "(" + ", ".join("batch" if i == 0 else ("any" if e is None else str(e))
                                 for i, e in enumerate(expected)) + ")"
        raise ValueError(
            f"`{name}` must have shape {wanted} for {model.name}; got shape {shape}."
        )
    return value


def _check_ids(model, inputs):
    """`inputs` after the model's own id checks (integer dtype, ids in range), the ones
    `model(inputs)` runs (`kzoo.inputs.check_inputs` on `model.id_inputs()`), with the same
    messages. Run here, once at the entry of every `kzoo.interpret` function, because the
    JAX path (`_backend.run`) calls the model on traced values, which the model's own check
    cannot read; `_backend.run` suspends the model's re-check on the other backends."""
    if not input_checks.checks_suspended():
        input_checks.check_inputs(inputs, model.id_inputs(), f"input of {model.name}")
    return inputs


def _check_inputs(model, inputs):
    """`inputs` checked against the model's inputs (keys, ranks, fixed sizes, one batch
    size, and the model's id checks: integer ids in range); lists become arrays. An input
    the model fills in itself when it is left out is filled in the same way (see
    `_filled_inputs`). Raises ValueError naming `inputs`."""
    return _check_ids(model, _check_structure(model, _filled_inputs(model, inputs)))


def _filled_inputs(model, inputs):
    """`inputs` with the inputs that `model` fills in itself when they are left out
    (`kzoo.models.base.FilledInputs`: GPT's, BERT's and T5's padding masks as ones, BERT's
    segment ids as zeros) filled in as the model does, so that the functions here run
    wherever `model(inputs)` runs and read the padding mask the model used (they required
    GPT's `padding_mask`, which the model does not)."""
    fill = getattr(model, "_filled", None)
    if fill is None or not isinstance(inputs, Mapping):
        return inputs
    return fill(dict(inputs))


def _check_structure(model, inputs):
    """`inputs` checked against the keys, ranks, fixed sizes and batch size of the model's
    inputs; lists become arrays."""
    expected = model.input
    if isinstance(expected, Mapping):
        if not isinstance(inputs, Mapping):
            raise ValueError(
                f"`inputs` must be a dict with keys {sorted(expected)} for {model.name}; got "
                f"{type(inputs).__name__}."
            )
        fills = getattr(model, "_input_fills", {})
        optional = sorted(k for k, t in expected.items()
                          if is_optional_input(t) or k in fills)
        missing = sorted(set(expected) - set(inputs) - set(optional))
        unknown = sorted(set(inputs) - set(expected))
        if missing or unknown:
            required = sorted(set(expected) - set(optional))
            raise ValueError(
                f"`inputs` must have the keys {required}"
                + (f" (optional: {optional})" if optional else "")
                + f" for {model.name}; got keys {sorted(inputs)} (missing {missing}, "
                f"unknown {unknown})."
            )
        checked = {key: _check_array(f"inputs[{key!r}]", inputs[key], expected[key], model)
                   for key in expected if key in inputs
                   and not (key in optional and inputs[key] is None)}
        batches = {key: _shape(value)[0] for key, value in checked.items()}
        if len(set(batches.values())) > 1:
            raise ValueError(
                f"Every array of `inputs` must have the same batch size; got {batches}."
            )
        return checked
    if isinstance(inputs, Mapping):
        raise ValueError(
            f"`inputs` must be one array of shape {tuple(expected.shape)} for {model.name}; "
            f"got a dict with keys {sorted(inputs)}."
        )
    return _check_array("inputs", inputs, expected, model)


def _numpy_inputs(inputs):
    """Checked inputs as NumPy (they are small; the JAX functions take them as arguments)."""
    if isinstance(inputs, Mapping):
        return {key: _numpy(value) for key, value in inputs.items()}
    return _numpy(inputs)


# === One probing forward pass (maps, outputs, embeddings) ===


def _flat_mask(mask):
    """key -> array as (sorted keys, list of arrays) for `_backend.run`."""
    if not mask:
        return (), []
    keys = tuple(sorted(mask))
    return keys, [mask[key] for key in keys]


def _mask_of(keys, tensors):
    """The head mask dict of the first `len(keys)` tensors (None without keys)."""
    return dict(zip(keys, tensors)) if keys else None


def _output_list(outputs):
    if isinstance(outputs, Mapping):
        return [outputs[key] for key in sorted(outputs)]
    return [outputs]


def _flat_maps(layout, maps):
    return [m for key in layout.attention for m in maps[key]]


def _unflatten_maps(layout, flat):
    maps, start = {}, 0
    for key, layers in layout.attention.items():
        maps[key] = list(flat[start:start + len(layers)])
        start += len(layers)
    return maps


def _probe_body(model, call, inputs, tensors, static):
    layout = _Layout(model)
    tap = _InterpretTap(layout, head_mask=_mask_of(static, tensors), record_embeddings=True)
    with tap:
        outputs = call(inputs)
    maps = _flat_maps(layout, tap.checked_maps())
    return None, [_output_list(outputs), maps, [r.output for r in tap.embedding_records]]


def _probe(layout, inputs, mask):
    """One inference pass under a tap: `(outputs, maps, embeddings)` as NumPy; `outputs`
    is the model's output (a dict's values in sorted-key order), `maps` key -> list of
    `(batch, heads, query, key)`, `embeddings` the input embeddings of each embedding call."""
    from kzoo.interpret._backend import run

    keys, arrays = _flat_mask(mask)
    _, (outputs, flat, embeddings) = run(layout.model, _probe_body, inputs, arrays,
                                         static=keys)
    return outputs, _unflatten_maps(layout, flat), embeddings


# === Head masks ===


def _check_head_mask(layout, head_mask, name="head_mask"):
    """`head_mask` as key -> float32 `(layers, heads)` NumPy array (see `masked_heads`)."""
    shapes = layout.mask_shapes()
    if layout.is_seq2seq:
        if not isinstance(head_mask, Mapping):
            raise ValueError(
                f"`{name}` of a T5 model must be a dict with some of the keys "
                f"{list(T5_KEYS)}, each of shape (layers, heads) = "
                f"{ {k: shapes[k] for k in T5_KEYS} }; got {type(head_mask).__name__}."
            )
        unknown = sorted(set(head_mask) - set(T5_KEYS))
        if unknown:
            raise ValueError(
                f"`{name}` keys must be among {list(T5_KEYS)}; got unknown keys {unknown}."
            )
        items = {key: head_mask[key] for key in T5_KEYS if head_mask.get(key) is not None}
    else:
        if isinstance(head_mask, Mapping):
            raise ValueError(
                f"`{name}` must be one array of shape (layers, heads) = {shapes['self']} for "
                f"{layout.model.name}; got a dict with keys {sorted(head_mask)}."
            )
        items = {"self": head_mask}
    checked = {}
    for key, value in items.items():
        label = name if key == "self" else f"{name}[{key!r}]"
        array = np.asarray(keras.ops.convert_to_numpy(value)
                           if hasattr(value, "shape") else value)
        if array.shape != shapes[key]:
            got = (f"got {label}={value!r} (shape ())" if array.ndim == 0
                   else f"got shape {array.shape}")
            raise ValueError(
                f"`{label}` must have shape (layers, heads) = {shapes[key]} for "
                f"{layout.model.name}; {got}."
            )
        if array.dtype.kind not in "biuf" or not np.all(np.isfinite(array.astype("float64"))):
            raise ValueError(
                f"`{label}` must hold finite numbers (1 keeps a head, 0 removes it); got "
                f"dtype {array.dtype} with values {array.ravel()[:8].tolist()}..."
            )
        checked[key] = array.astype("float32")
    return checked


def masked_heads(model, head_mask):
    """A context manager under which `model` runs with its attention heads scaled.

    Head `h` of layer `i` has its attention probabilities multiplied by `head_mask[i, h]`
    (0 removes the head's contribution, 1 keeps it, as in transformers' `head_mask`, which
    multiplies the probabilities after the softmax). Inside it, `attention_maps` and the
    functions of `kzoo.interpret.gradients` on the same model use the mask too, and their
    maps show the scaled probabilities (zeros for a removed head), as transformers'
    `output_attentions` does.

    Args:
        model: a kzoo backbone or task model.
        head_mask: `(num_layers, num_heads)` finite numbers. For T5, a dict with any of the
            keys "encoder" `(encoder layers, heads)`, "decoder" (the decoder's
            self-attention, `(decoder layers, heads)`) and "cross" (the decoder's
            cross-attention, `(decoder layers, heads)`); a key left out is all ones.

    Nested `masked_heads` of the same model combine: inside both, head `h` of layer `i` is
    scaled by the product of their masks (a head runs only if every enclosing mask keeps
    it), and leaving the inner one (also by an exception) restores the outer mask. Entering
    one inside another active tap (`masked_heads` of a different model, a plain
    `kzoo.layers.taps.Tap`) raises RuntimeError: only the innermost tap is active, so the
    outer one would silently stop working. The other way round is fine: a plain `Tap` (or
    a subclass) entered inside `masked_heads` sees the masked model, so calls under it give
    the outputs of `masked_heads` alone and it records the scaled probabilities (zeros for
    a removed head), as `attention_maps` shows them.

    The mask applies to direct calls (`model(inputs)`), to `predict` / `evaluate` /
    `*_on_batch` and to `generate` called inside the context: the functions Keras (and
    `generate`) compiled for them are dropped on entering and leaving, so they are traced
    again with (then without) the mask.

    Returns:
        A `kzoo.layers.taps.Tap` to use in a `with` statement (attention runs with the
        exact formula while it is active).

    Raises:
        ValueError: `model` is not a kzoo model, or `head_mask` has the wrong shape, keys
            or values.
        RuntimeError: on entering, inside another active tap (see above).

    Example:
    >>> mask = np.ones((2, 4)); mask[1, 0] = 0          # remove head 0 of layer 1
    >>> with masked_heads(bert, mask):
    ...     logits = bert(inputs)
    >>> t5_mask = {"cross": np.zeros((2, 4))}           # T5 without cross-attention
    """
    layout = _Layout(model)
    return _InterpretTap(layout, head_mask=_check_head_mask(layout, head_mask),
                         forget_compiled=True, nest=True)


# === Attention maps ===


def attention_maps(model, inputs, head_mask=None):
    """The post-softmax attention probabilities of every layer of `model` on `inputs`.

    One forward pass in inference mode under a tap (`kzoo.layers.taps`): attention is
    computed with the exact formula whatever kernel is selected, so the maps are those of
    `softmax(q k^T * scale + bias)` with the model's masks. Padded keys get probability 0;
    rows of padded queries are whatever the model computes there (compare real rows only).

    Args:
        model: a kzoo backbone or task model (BERT, GPT, T5, ViT, Graphormer).
        inputs: what the model's `__call__` takes (the dict of ids and masks; ViT an image
            array `(batch, height, width, channels)`; Graphormer `kzoo.graphs.batch(...)`).
            An input the model fills in when it is left out may be left out here too, with
            the same meaning (GPT's, BERT's and T5's padding masks: every token real;
            BERT's `segment_ids`: zeros); so for every `kzoo.interpret` function.
        head_mask: optional head mask (see `masked_heads`); the maps show the scaled heads.
            Inside `with masked_heads(model, mask)` that mask applies too (multiplied with
            `head_mask` when both are given).

    Returns:
        `{"self": [layer 0, layer 1, ...]}` for BERT, GPT, ViT and Graphormer;
        `{"encoder": [...], "decoder": [...], "cross": [...]}` for T5 (decoder
        self-attention, and cross-attention with keys = encoder positions). Each entry is a
        float32 NumPy array `(batch, heads, query, key)`.

    Raises:
        ValueError: `model` is not a kzoo model, or `inputs` do not fit it (keys, ranks,
            sizes, batch), or `head_mask` is invalid.

    Example:
    >>> maps = attention_maps(gpt, {"token_ids": ids, "padding_mask": mask})
    >>> maps["self"][0][0, 2]          # layer 0, example 0, head 2: (query, key)
    >>> t5_maps = attention_maps(t5, t5_inputs)
    >>> t5_maps["cross"][-1].shape     # (batch, heads, decoder length, encoder length)
    """
    layout, inputs, mask = _prepare(model, inputs, head_mask)
    return _probe(layout, inputs, mask)[1]


def _prepare(model, inputs, head_mask=None):
    """`(layout, NumPy inputs, head mask)` after every check; the mask is `head_mask` times
    that of an enclosing `masked_heads` (either alone when the other is absent)."""
    layout = _Layout(model)
    inputs = _numpy_inputs(_check_inputs(model, inputs))
    return layout, inputs, _prepare_mask(layout, head_mask)


def _prepare_mask(layout, head_mask=None):
    """The head mask a function runs with: `head_mask` (checked) times that of an enclosing
    `masked_heads` (either alone when the other is absent; None when both are); raises
    RuntimeError inside another active tap."""
    enclosing = _enclosing_head_mask(layout)
    if head_mask is None:
        return enclosing
    return _combine_masks(enclosing, _check_head_mask(layout, head_mask))
