"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on kzoo models.

`enable_lora(model, rank, targets=("query", "value"), alpha=None)` (also
`model.enable_lora(...)` on every kzoo backbone and task model) adds to each targeted
`keras.layers.Dense` (Keras' own `Dense.enable_lora`) two float32 matrices
`A (in, rank)` (He-uniform) and `B (rank, out)` (zeros), so the layer computes
`x @ (W + (alpha / rank) A B) + b` and starts out unchanged; then it freezes every other
variable of the model, so `model.trainable_weights` is exactly the adapters.

Targets (the names of the sub-layers of every `TransformerBlock`, on every family):

- `"query"`, `"key"`, `"value"`, `"output"`: the attention projections `query_dense`,
  `key_dense`, `value_dense`, `output_dense` of every `MultiHeadAttention` (self- and
  cross-attention);
- `"feedforward_in"`: the input projections of the feed-forward (`intermediate_dense` of a
  `FeedForward`; `gate_dense` and `up_dense` of a `GatedFeedForward`);
- `"feedforward_out"`: the output projection `output_dense` of a `FeedForward` /
  `GatedFeedForward`;
- `"head"`: the `Dense` layers of a task model outside its backbone (ViT's and BERT's
  classifier, BERT's masked-LM transform, T5 v1.1's untied `lm_head`, Graphormer's head
  transform) and BERT's pooler.

Not adaptable: the mixture-of-experts experts (raw stacked kernels) and router, the token /
position / patch embeddings, norms and biases (they stay frozen).

`save_lora_weights(model, path)` writes the adapters (and rank, alpha, targets) to an
`.npz` file keyed by layer path; `load_lora_weights(model, path)` enables LoRA with the
stored settings when needed and assigns them. `merge_lora(model)` folds `(alpha/rank) A B`
into each kernel (float or int8/int4-quantized) and removes the adapters, leaving a plain
model whose weights are all trainable again.

`model.save` (`.keras`) and `kzoo.presets.save` of a float model with adapters store the
merged kernels `W + (alpha/rank) A B`, with a warning: the reloaded model gives the same
outputs but has no adapters (all its weights trainable), and `keras.saving.load_model` drops
the saved optimizer state (Keras warns "Skipping variable loading for optimizer": it was the
adapters'). To go on training the adapters later, keep them with `save_lora_weights` and put
them back with `load_lora_weights` on the model saved before `enable_lora` (the training CLI
writes both: the merged model and `adapters.lora.npz`; its checkpoints keep everything of a
LoRA run).

QLoRA: with adapters on int8/int4-quantized layers, `model.save`, `model.save_weights` and
`kzoo.presets.save` keep the adapters instead. Each adapted layer writes its integer kernel
and scales unchanged (in the order of Keras' quantized Dense) followed by `lora_kernel_a`
and `lora_kernel_b`, and the model's config (a preset directory's `kzoo_config.json`)
records `"lora": {"rank", "alpha", "targets"}`; `keras.saving.load_model` and
`kzoo.presets.load` rebuild the quantized model, enable LoRA with these settings and load
the variables: the outputs are the saved model's (bit for bit), the adapters are trainable
and the rest frozen as `enable_lora` left it, and a `.keras` file gives the optimizer its
state back, so `fit` continues where it stopped. (Keras' quantized Dense alone would save
the adapters merged into the integer kernel, requantized: the reloaded model had no adapters
and its outputs moved.) `merge_lora()` still folds the adapters in and requantizes, for a
deployable model without them. Two things stay refused (ValueError, before anything is
written): a backbone saved alone whose adapters `enable_lora` added on the task model holding
it (only that model's config records them), and `kzoo.presets.load` of such a directory with
another `task` than its own. The Hugging Face and keras-hub formats refuse quantized models
altogether (`kzoo.presets.save`, before anything is written).

Resuming the adapters' training with its optimizer state, as a `.keras` file does for a
model without adapters: `save_lora_weights` of a model whose optimizer has trained exactly
the adapters also writes that optimizer's state (its step count and every slot, e.g.
Adam's moments); `load_lora_weights` into a model compiled with an optimizer of the same
kind (built then, if it was not) puts it back, so that training continues step for step.
Loaded into a model not compiled yet, the adapters alone are loaded (e.g. for inference):
compile before `load_lora_weights` to resume training with the optimizer state.

A newly built classifier head (ViT's) is all zeros: frozen, it passes no gradient back, so
`enable_lora` warns unless "head" is among the targets.

Example:

```python
model = kzoo.presets.load("gpt_mini")
model.enable_lora(4, targets=("query", "value"))
model.compile(optimizer="adamw")
model.fit(...)                                  # trains the adapters only
model.save_lora_weights("adapters.lora.npz")    # adapters + the optimizer's state
model.merge_lora()                              # plain Dense kernels again

later = kzoo.presets.load("gpt_mini")
later.compile(optimizer="adamw")
later.load_lora_weights("adapters.lora.npz")    # adapters, optimizer state: fit resumes
```
"""

import json
import os
import types
import warnings

import keras
import numpy as np

from kzoo import checkpoints
from kzoo.layers.utils import check_keras_model

TARGETS = ("query", "key", "value", "output", "feedforward_in", "feedforward_out", "head")


def _block_targets(layer):
    """(target, Dense) pairs of one kzoo layer of a TransformerBlock."""
    from kzoo.layers.attention import MultiHeadAttention
    from kzoo.layers.feedforward import FeedForward, GatedFeedForward

    if isinstance(layer, MultiHeadAttention):
        return [("query", layer.query_dense), ("key", layer.key_dense),
                ("value", layer.value_dense), ("output", layer.output_dense)]
    if isinstance(layer, FeedForward):
        return [("feedforward_in", layer.intermediate_dense),
                ("feedforward_out", layer.output_dense)]
    if isinstance(layer, GatedFeedForward):
        return [("feedforward_in", layer.gate_dense), ("feedforward_in", layer.up_dense),
                ("feedforward_out", layer.output_dense)]
    return []


def target_layers(model):
    """`{target: [Dense, ...]}` of `model` for every name of `TARGETS` (lists may be empty).

    Example:
    >>> [layer.path for layer in kzoo.lora.target_layers(model)["value"]]
    ['transformer_layer_0/self_attention/value_dense', ...]
    """
    found = {name: [] for name in TARGETS}
    claimed = set()
    for layer in model._flatten_layers(include_self=False):
        for name, dense in _block_targets(layer):
            if dense is not None and id(dense) not in claimed:
                found[name].append(dense)
                claimed.add(id(dense))
    # Whatever Dense is left outside the blocks: heads, the pooler (not the MoE router).
    for layer in model._flatten_layers(include_self=False):
        if (isinstance(layer, keras.layers.Dense) and id(layer) not in claimed
                and layer.name != "router"):
            found["head"].append(layer)
            claimed.add(id(layer))
    return found


def check_targets(targets):
    """`targets` as a tuple of names of `TARGETS`; a ValueError names any other."""
    if isinstance(targets, str):
        targets = (targets,)
    try:
        targets = tuple(targets)
    except TypeError:
        raise ValueError(
            f"`targets` must be a sequence of names from {list(TARGETS)}; got "
            f"targets={targets!r}."
        ) from None
    unknown = [t for t in targets if not isinstance(t, str) or t not in TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"`targets` must name sub-layers from {list(TARGETS)}; got unknown "
            f"{unknown!r} in targets={targets!r}."
            if unknown else
            f"`targets` must name at least one of {list(TARGETS)}; got targets={targets!r}."
        )
    return tuple(dict.fromkeys(targets))


def _check_rank(rank):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank <= 0:
        raise ValueError(f"`rank` must be a positive integer; got rank={rank!r}.")
    return int(rank)


def _check_alpha(alpha, rank):
    if alpha is None:
        return float(rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.number)) or \
            not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"`alpha` must be None or a positive number; got alpha={alpha!r}.")
    return float(alpha)


def _dims(layer):
    """`(in, out)` of a Dense kernel, which give the shapes of its adapters `A (in, rank)`
    and `B (rank, out)`. Read from the stored `_kernel` (`kernel` adds the adapters when
    there are some: a computation); an int4 kernel is stored packed, and its input width is
    read where Keras' `Dense.enable_lora` reads it."""
    if layer.quantization_mode == "int4" and hasattr(layer, "_orig_input_dim"):
        return int(layer._orig_input_dim), int(layer.units)
    return int(layer._kernel.shape[0]), int(layer.units)


def _check_rank_fits(rank, layers):
    """Refuse a rank above `min(in, out)` of a targeted kernel: `A B` has rank at most
    that, so the extra columns only cost memory (Keras' and PEFT's `enable_lora` accept any
    rank; `enable_lora(10**6)` made adapters of a million columns)."""
    smallest = min(layers, key=lambda layer: min(_dims(layer)))
    limit = min(_dims(smallest))
    if rank > limit:
        raise ValueError(
            f"`rank` must be at most min(in, out) = {limit} of the smallest targeted kernel "
            f"({smallest.path}, {_dims(smallest)}); got rank={rank}."
        )


def lora_layers(model):
    """The Dense layers of `model` that carry adapters, in a stable order (by path)."""
    layers = [layer for layer in model._flatten_layers(include_self=False)
              if getattr(layer, "lora_enabled", False)]
    return sorted(layers, key=lambda layer: layer.path)


def enable_lora(model, rank, targets=("query", "value"), alpha=None):
    """Add rank-`rank` adapters to the `targets` of `model` and freeze everything else.

    Args:
        model: a built kzoo backbone or task model.
        rank: the adapters' rank (positive int, at most `min(in, out)` of every targeted
            kernel).
        targets: names from `TARGETS` (see the module docstring); default the attention
            query and value projections, as in the LoRA paper.
        alpha: the scale numerator: the update is `(alpha / rank) A B` (None: `rank`,
            i.e. a scale of 1).

    Returns:
        The list of paths of the adapted layers.

    Raises:
        ValueError: `rank` <= 0 or larger than `min(in, out)` of a targeted kernel (a
            product `A B` cannot have a larger rank), an unknown target (the message lists
            them), a target with no layer in this model, adapters already enabled, or a
            float8-quantized layer (Keras has no LoRA there).

    Example:
    >>> model.enable_lora(8, targets=("query", "key", "value", "output"), alpha=16)
    """
    return _enable_lora(model, rank, targets, alpha, warn_zero_heads=True)


def _enable_lora(model, rank, targets, alpha, warn_zero_heads):
    check_keras_model(model)
    rank = _check_rank(rank)
    targets = check_targets(targets)
    alpha = _check_alpha(alpha, rank)
    if not model.built:
        raise ValueError(f"Build {model.name!r} (call it once) before enabling LoRA.")
    if lora_layers(model):
        raise ValueError(
            f"LoRA is already enabled on {model.name!r}; merge_lora() first to add new "
            "adapters."
        )
    found = target_layers(model)
    empty = [t for t in targets if not found[t]]
    if empty:
        present = [t for t in TARGETS if found[t]]
        raise ValueError(
            f"`targets` {empty} match no layer of {model.name!r}; this model has "
            f"{present}."
        )
    layers = [layer for t in targets for layer in found[t]]
    for layer in layers:
        if layer.quantization_mode not in (None, *QUANTIZED):
            raise ValueError(
                f"LoRA on a {layer.quantization_mode!r}-quantized layer ({layer.path}) is not "
                "supported; use a float, int8 or int4 model."
            )
    _check_rank_fits(rank, layers)
    # With adapters on an int8/int4 layer, every adapter of the model is saved apart from
    # its kernel and the model's config records the settings (see `_watch_saves`).
    kept = any(layer.quantization_mode in QUANTIZED for layer in layers)
    if "head" not in targets and warn_zero_heads:
        _warn_zero_heads(model, found["head"])
    unfrozen = [v for v in model.weights if v.trainable]
    for variable in unfrozen:
        variable.trainable = False
    for layer in layers:
        layer.enable_lora(rank, lora_alpha=alpha)
        _watch_saves(layer, model.name, kept)
    # Plain attributes: Keras' tracker must not adopt these variables a second time.
    object.__setattr__(model, "_kzoo_lora",
                       {"rank": rank, "alpha": alpha, "targets": list(targets)})
    object.__setattr__(model, "_kzoo_lora_frozen", tuple(unfrozen))
    _after_change(model)
    return [layer.path for layer in layers]


# The quantization modes whose layers take adapters (Keras' `Dense.enable_lora`).
QUANTIZED = ("int8", "int4")

# The attributes `_watch_saves` gives an adapted layer (removed by `merge_lora`).
_SAVE_HOOKS = ("save_own_variables", "load_own_variables", "_kzoo_lora_model_name",
               "_kzoo_lora_kept")


def _watch_saves(layer, model_name, kept):
    """Give the adapted Dense `layer` a `save_own_variables` and a `load_own_variables` of
    its own (removed by `merge_lora`), which Keras' `.keras` saving and loading and
    `save_weights` / `load_weights` (hence `kzoo.presets.save` / `load`) call instead of
    Dense's:

    - `kept` (the model has adapters on an int8/int4 layer): the layer's own variables go
      to the file as they are (the integer kernel and its scales untouched, in the order of
      Dense's `variable_serialization_spec`), followed by `lora_kernel_a` and
      `lora_kernel_b`; loading reads them back in that order. Dense's own method wrote the
      adapters merged into the integer kernel, requantized (`_get_kernel_with_merged_lora`):
      the reloaded GPT had no adapters and its logits moved by up to 9e-2 (of ~4). The
      model's config records the LoRA settings (`config_entry`), so the reloaded model
      has the adapter variables to load them into (see `restore`).
    - otherwise (float layers): the save warns and writes Dense's merged kernel; the
      reloaded model has the same outputs but no adapters, and with them goes what the
      optimizer held for them.
    """
    # Methods bound to `layer` (a closure over it would, in a `copy.deepcopy` of the model,
    # still save the original's variables); plain attributes, no Keras tracking.
    object.__setattr__(layer, "_kzoo_lora_model_name", model_name)
    object.__setattr__(layer, "_kzoo_lora_kept", bool(kept))
    object.__setattr__(layer, "save_own_variables",
                       types.MethodType(_save_adapted_dense, layer))
    object.__setattr__(layer, "load_own_variables",
                       types.MethodType(_load_adapted_dense, layer))


def _kept(layer):
    return layer.lora_enabled and getattr(layer, "_kzoo_lora_kept", False)


def _stored_variables(layer):
    """The variables of `layer` that Keras' quantized Dense writes, in its order (the
    integer kernel, the bias if any, the scales; for int4 by blocks its zero points and
    group indices), without the adapters."""
    mode = layer.quantization_mode
    spec = layer.variable_serialization_spec
    if mode not in spec:
        raise ValueError(
            f"Cannot save the adapters of {layer.path!r}: its quantization mode {mode!r} "
            "has no known variable order.")
    variables = []
    for name in spec[mode]:
        variable = layer._kernel if name == "kernel" else getattr(layer, name, None)
        if variable is not None:  # (no bias; int4 per channel: no zero points, no g_idx)
            variables.append(variable)
    return variables


def _save_adapted_dense(layer, store):
    """The `save_own_variables` of `_watch_saves`."""
    if not layer.built:
        return None
    if _kept(layer):
        variables = _stored_variables(layer) + [layer.lora_kernel_a, layer.lora_kernel_b]
        for i, variable in enumerate(variables):
            store[str(i)] = variable
        return None
    if layer.lora_enabled:
        model_name = getattr(layer, "_kzoo_lora_model_name", "the model")
        warnings.warn(
            f"Saving {model_name!r} merges its LoRA adapters into the kernels: the "
            "reloaded model gives the same outputs but has no adapters, and the "
            "optimizer state of the adapters (Adam's moments, the step count) is not "
            "restored (Keras skips it on loading). To go on training the adapters, keep "
            "them and that state with `model.save_lora_weights(path)`.",
            stacklevel=2)
    return type(layer).save_own_variables(layer, store)


def _load_adapted_dense(layer, store):
    """The `load_own_variables` of `_watch_saves`: a file written by `_save_adapted_dense`
    gives the layer its kernel, scales and adapters back as saved. A file of the layer
    without adapters (the quantized model saved before `enable_lora`) loads its variables
    and zeroes the adapters, as Dense's own method does (the model then computes what the
    saved one did)."""
    if not layer.built or not _kept(layer):
        return type(layer).load_own_variables(layer, store)
    variables = _stored_variables(layer)
    adapters = [layer.lora_kernel_a, layer.lora_kernel_b]
    count = len(store.keys())
    if count not in (len(variables), len(variables) + 2):
        raise ValueError(
            f"Layer {layer.path!r} ({layer.quantization_mode}, with LoRA adapters) expected "
            f"{len(variables) + 2} variables ({len(variables)} without the adapters), but "
            f"the file holds {count}.")
    for i, variable in enumerate(variables):
        variable.assign(store[str(i)])
    if count == len(variables):
        for variable in adapters:
            variable.assign(keras.ops.zeros(variable.shape, variable.dtype))
        return None
    for i, variable in enumerate(adapters, start=len(variables)):
        value = store[str(i)]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"The saved adapter {variable.path!r} has shape {tuple(value.shape)}; the "
                f"layer's has shape {tuple(variable.shape)} (saved with another rank?).")
        variable.assign(value)
    return None


def config_entry(model):
    """The `"lora"` entry of `model`'s config (and of a preset directory's
    `kzoo_config.json`): `{"rank", "alpha", "targets"}` when `model` carries adapters that
    its saves keep apart (on int8/int4 layers; see `_watch_saves`), else None. `restore`
    puts them back on the model rebuilt from it, before its variables are loaded.

    Example:
    >>> kzoo.lora.config_entry(model)
    {'rank': 2, 'alpha': 2.0, 'targets': ['query', 'value']}
    """
    settings = getattr(model, "_kzoo_lora", None)
    if not settings or not any(_kept(layer) for layer in lora_layers(model)):
        return None
    return dict(settings)


def restore(model, entry, source="the saved config"):
    """Enable LoRA on `model` (rebuilt from a saved config, quantized, not loaded yet) with
    the settings of a config's `"lora"` entry (`config_entry`), so that loading gives the
    adapters back. Returns `model`."""
    if entry is None:
        return model
    try:
        rank, alpha, targets = entry["rank"], entry["alpha"], entry["targets"]
    except (KeyError, TypeError):
        raise ValueError(
            f"The `lora` entry of {source} must be a dict with rank, alpha and targets; "
            f"got {entry!r}.") from None
    # (no zero-head warning: the weights, the head's among them, are not loaded yet)
    _enable_lora(model, rank, targets, alpha, warn_zero_heads=False)
    return model


def _refusal(model_name, layer):
    """The ValueError refusing to save a model (a backbone) whose int8/int4 `layer` has
    adapters that `enable_lora` added on the model holding it: its own config cannot
    record them."""
    return ValueError(
        f"Cannot save {model_name!r} alone: its {layer.quantization_mode}-quantized layer "
        f"{layer.path!r} has LoRA adapters that `enable_lora` added on the model holding "
        f"{model_name!r}, and only that model's config records them. Save that model "
        "(its file keeps the adapters), keep the adapters with "
        "`model.save_lora_weights(path)`, or call `model.merge_lora()` first to save the "
        "merged, requantized model."
    )


def check_savable(model):
    """Raise a ValueError when a save of `model` could not be loaded back with its
    adapters: a model holding int8/int4 layers with adapters added by `enable_lora` on
    another model (a task model's backbone saved alone); nothing otherwise.

    kzoo's save entry points (`model.save`, `model.save_weights`, `kzoo.presets.save`)
    call it before they open or make anything.

    Example:
    >>> kzoo.lora.check_savable(model)  # ValueError if model.save would be refused
    """
    if not isinstance(model, keras.layers.Layer):
        return  # (not a model: the caller's own checks name it)
    if getattr(model, "_kzoo_lora", None):
        return
    for layer in lora_layers(model):
        if _kept(layer):
            raise _refusal(model.name, layer)


def _warn_zero_heads(model, heads):
    """Warn when a frozen head's kernel is all zeros (a new ViT classifier's is): nothing
    before it gets a gradient, so the adapters `enable_lora` adds never train (the loss of
    `python -m training vit_digits --lora-rank 2` stayed at ln 10, without a word)."""
    dead = [layer.path for layer in heads
            if layer.quantization_mode is None and layer.trainable
            and not np.any(keras.ops.convert_to_numpy(layer.kernel))]
    if dead:
        warnings.warn(
            f"The kernels of {dead} in {model.name!r} are all zeros (a newly built head) and "
            "`enable_lora` freezes them: no gradient reaches the adapters before them, so "
            "training changes nothing. Add \"head\" to `targets` (adapters on the head "
            "train from zero), or train the head before enabling LoRA.", stacklevel=3)


def _after_change(model):
    """Drop compiled step functions (their variable lists changed); on torch, track the new
    variables as parameters."""
    model.train_function = model.test_function = model.predict_function = None
    if hasattr(model, "_jax_state"):
        model._jax_state = None
    if keras.config.backend() == "torch":
        for layer in model._flatten_layers():
            layer._track_variables()


def lora_settings(model):
    """`{"rank", "alpha", "targets"}` of the adapters of `model` (None when none)."""
    if not lora_layers(model):
        return None
    return dict(getattr(model, "_kzoo_lora", None) or {})


def _check_path(path):
    # (was os.fspath's TypeError, naming no argument)
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"`path` must be a path to a .npz file; got path={path!r}.")
    return os.fspath(path)


def _optimizer_of(model):
    """The model's optimizer that holds the variable slots (a `LossScaleOptimizer`'s inner
    one holds them; its own scale variables are saved too), or None."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    return optimizer


def _optimizer_trains(optimizer):
    """The variables `optimizer` was built for, in its order ([] when not built)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(optimizer, "built", False):
        return []
    return list(getattr(inner, "_trainable_variables", []))


def _adapter_variables(model):
    return [v for layer in lora_layers(model)
            for v in (layer.lora_kernel_a, layer.lora_kernel_b)]


def _optimizer_state(model):
    """`(record, arrays)` of the optimizer state to save with the adapters, or None: only
    when the model's optimizer is built for exactly the adapters (it has trained them)."""
    optimizer = _optimizer_of(model)
    if optimizer is None:
        return None
    trains = _optimizer_trains(optimizer)
    adapters = {id(v) for v in _adapter_variables(model)}
    if not trains or {id(v) for v in trains} != adapters or len(trains) != len(adapters):
        return None
    arrays = {f"optimizer/{i}": np.asarray(keras.ops.convert_to_numpy(v.value))
              for i, v in enumerate(optimizer.variables)}
    record = {"class": type(optimizer).__name__,
              "variables": [v.path for v in trains],
              "count": len(optimizer.variables),
              "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations))}
    return record, arrays


def _restore_optimizer_state(model, path, record, arrays):
    """Put a saved optimizer state back into the compiled `model`'s optimizer (building it
    for the trainable variables, the adapters, when it is not built); `ValueError` naming
    what differs when it cannot be (nothing assigned then)."""
    optimizer = _optimizer_of(model)
    if type(optimizer).__name__ != record["class"]:
        raise ValueError(
            f"The LoRA weights in {path!r} hold the state of an optimizer of class "
            f"{record['class']}; "
            f"{model.name!r} is compiled with {type(optimizer).__name__}. Compile it with "
            f"a {record['class']} to resume, or load the adapters into a model not compiled "
            "yet (the optimizer state is then not loaded).")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    trains = [v.path for v in _optimizer_trains(optimizer)]
    if trains != record["variables"]:
        raise ValueError(
            f"The optimizer state in {path!r} was built for the adapters {record['variables']}"
            f"; the optimizer of {model.name!r} trains {trains}. Compile the model after "
            "enabling LoRA (or loading the adapters) so that it trains the adapters alone.")
    variables = optimizer.variables
    shapes = [tuple(arrays[f"optimizer/{i}"].shape) for i in range(record["count"])]
    if len(variables) != record["count"] or any(
            tuple(v.shape) != shape for v, shape in zip(variables, shapes)):
        raise ValueError(
            f"The optimizer state in {path!r} has {record['count']} variables of shapes "
            f"{shapes}; the {record['class']} of {model.name!r} has {len(variables)} of "
            f"shapes {[tuple(v.shape) for v in variables]} (another configuration: "
            "gradient accumulation, EMA?).")
    for i, v in enumerate(variables):
        v.assign(arrays[f"optimizer/{i}"].astype(v.dtype))


def save_lora_weights(model, path):
    """Write the adapters of `model` to `path` (`.npz`, NumPy arrays only; no pickle), and
    the state of the optimizer that trains them (its step count and slots) when the model
    has one built for exactly the adapters (see the module docstring).

    Example:
    >>> model.save_lora_weights("adapters.lora.npz")
    """
    check_keras_model(model)
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{model.name!r} has no LoRA adapters; call enable_lora() first.")
    path = _check_path(path)
    if not path.endswith(".npz"):
        raise ValueError(f"LoRA weights are written as .npz; got path={path!r}.")
    # (a directory, a missing one or one through a file failed in np.savez / os.replace,
    # the first leaving its temporary file behind)
    if os.path.isdir(path):
        raise ValueError(f"`path` must be a file path; {path!r} is a directory.")
    checkpoints.make_parent_directory(path, f"`path` cannot be written (path={path!r})")
    settings = lora_settings(model)
    arrays = {"__settings__": np.asarray(json.dumps(settings))}
    for i, layer in enumerate(layers):
        arrays[f"{i}/path"] = np.asarray(layer.path)
        arrays[f"{i}/a"] = keras.ops.convert_to_numpy(layer.lora_kernel_a)
        arrays[f"{i}/b"] = keras.ops.convert_to_numpy(layer.lora_kernel_b)
    state = _optimizer_state(model)
    if state is not None:
        arrays["__optimizer__"] = np.asarray(json.dumps(state[0]))
        arrays.update(state[1])
    tmp = path[:-len(".npz")] + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_lora_weights(model, path):
    """Load adapters written by `save_lora_weights` into `model`, enabling LoRA with the
    stored rank, alpha and targets first if it has none. When the file holds the state of
    the optimizer that trained them and `model` is compiled, that state goes into the
    model's optimizer too (built for the adapters if it was not): `fit` then resumes step
    for step. A model not compiled gets the adapters alone.

    Raises:
        ValueError: the file is unreadable, or its settings, layer paths or adapter shapes
            (a model of another width) differ from the model's adapters; the model is
            compiled with an optimizer of another kind or configuration than the saved
            state's. Everything but the optimizer's is checked before LoRA is enabled: a
            refused file leaves the model as it was.

    Example:
    >>> fresh = kzoo.presets.load("gpt_mini")
    >>> fresh.load_lora_weights("adapters.lora.npz")
    """
    check_keras_model(model)
    path = _check_path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        settings = json.loads(str(arrays.pop("__settings__")))
        rank, targets = int(settings["rank"]), check_targets(settings["targets"])
        count = len([key for key in arrays if key.endswith("/path")])
        stored = [str(arrays[f"{i}/path"]) for i in range(count)]
        adapters = [{part: arrays[f"{i}/{part}"] for part in ("a", "b")}
                    for i in range(count)]
        optimizer_record = (json.loads(str(arrays.pop("__optimizer__")))
                            if "__optimizer__" in arrays else None)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"The LoRA weights file {path!r} cannot be read: {error}") from error
    current = lora_settings(model)
    if current is not None and current != settings:
        raise ValueError(
            f"The LoRA weights in {path!r} were saved with {settings}; {model.name!r} has "
            f"adapters {current}."
        )
    if current is None:  # the layers `enable_lora` would adapt (it is called below)
        found = target_layers(model)
        layers = {layer.path: layer for t in targets for layer in found[t]}
    else:
        layers = {layer.path: layer for layer in lora_layers(model)}
    if sorted(stored) != sorted(layers):
        raise ValueError(
            f"The LoRA weights in {path!r} are for layers {sorted(stored)}; {model.name!r} "
            f"adapts {sorted(layers)}."
        )
    # A file saved from a model of another width has the same layer paths: without this
    # check Keras' `assign` failed on the first adapter, after LoRA had been enabled and the
    # rest of the model frozen.
    for i, name in enumerate(stored):
        d_in, d_out = _dims(layers[name])
        expected = {"a": (d_in, rank), "b": (rank, d_out)}
        for part in ("a", "b"):
            shape = tuple(adapters[i][part].shape)
            if shape != expected[part]:
                raise ValueError(
                    f"The LoRA weights in {path!r} do not fit {model.name!r}: layer {name} "
                    f"has a kernel of shape {(d_in, d_out)}, so its rank-{rank} adapter "
                    f"lora_kernel_{part} must have shape {expected[part]}; the file's has "
                    f"shape {shape} (saved from a model of another width?)."
                )
    if current is None:
        enable_lora(model, settings["rank"], settings["targets"], settings["alpha"])
    layers = {layer.path: layer for layer in lora_layers(model)}
    for i, name in enumerate(stored):
        layers[name].lora_kernel_a.assign(adapters[i]["a"])
        layers[name].lora_kernel_b.assign(adapters[i]["b"])
    if optimizer_record is not None and _optimizer_of(model) is not None:
        _restore_optimizer_state(model, path, optimizer_record, arrays)
    return model


def merge_lora(model):
    """Fold every adapter into its kernel (`W + (alpha / rank) A B`, requantized for an
    int8/int4 layer) and remove the adapters; every variable is trainable again.

    Example:
    >>> model.merge_lora()
    """
    check_keras_model(model)
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{model.name!r} has no LoRA adapters to merge.")
    for layer in layers:
        if layer.quantization_mode in ("int8", "int4"):
            kernel, scale, _ = layer._get_kernel_with_merged_lora()
            layer._kernel.assign(kernel)
            layer.kernel_scale.assign(scale)
        else:
            layer._kernel.assign(layer.kernel)  # the property adds (alpha / rank) A B
        for name in ("lora_kernel_a", "lora_kernel_b"):
            layer._untrack_variable(getattr(layer, name))
            # Not `del layer.<name>`: Keras' `__delattr__` runs a full `gc.collect()` per
            # variable (half a second each here).
            super(keras.layers.Layer, layer).__delattr__(name)
        layer.lora_enabled = False
        layer.lora_rank = None
        for name in _SAVE_HOOKS:  # `_watch_saves`'
            if name in vars(layer):
                super(keras.layers.Layer, layer).__delattr__(name)
    for variable in getattr(model, "_kzoo_lora_frozen", ()):
        variable.trainable = True
    object.__setattr__(model, "_kzoo_lora", None)
    object.__setattr__(model, "_kzoo_lora_frozen", ())
    _after_change(model)
    return model


def count_params(variables):
    """The number of scalars in `variables`."""
    return int(sum(np.prod(v.shape) for v in variables))


__all__ = ["TARGETS", "enable_lora", "save_lora_weights", "load_lora_weights", "merge_lora",
           "target_layers", "lora_layers", "lora_settings", "check_targets", "count_params"]
