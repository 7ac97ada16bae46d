"""Post-training weight quantization of kzoo models (int8, int4, float8) with Keras' own
quantized layers, and how a quantized model survives `get_config` / `.keras` / presets.

`quantize(model, mode)` (also `model.quantize(mode)` on every kzoo backbone and task model)
quantizes, in place, the layers Keras knows how to quantize:

- every `keras.layers.Dense` (attention projections query/key/value/output, the
  feed-forward projections, pooler, heads): `"int8"`, `"int4"`, `"float8"`;
- every `keras.layers.Embedding` (BERT's segment embedding): `"int8"`, `"int4"`.

Kept in float, on purpose (what holds a large matrix and why):

- `TokenEmbedding` (the token table, and the tied output projection of BERT/GPT/T5 v1.0):
  a custom layer whose table is read both as a lookup and as the logits' kernel; keeping
  it in float keeps the logits exact to the hidden states. On a tiny vocabulary model it
  is the largest matrix, so the size saved there is smaller than the Dense share suggests.
- `PositionEmbedding`, T5's relative attention bias, ViT's class token / position table,
  Graphormer's node/edge/spatial tables and decoder head: raw variables, small.
- `PatchEmbedding`'s `Conv2D` (Keras has no quantized convolution).
- `MixtureOfExperts`: the expert kernels are raw `(experts, in, out)` variables, and the
  router is a float32 `Dense` kept in float32 so routing decisions do not change.
- LayerNorm / RMSNorm scales and every bias.

How a quantized model is saved: Keras stores a quantized layer's policy per layer
(`int8_from_float32`, ...). kzoo's sub-layers are created inside other layers' `__init__` /
`build` with `dtype=self.dtype_policy`, so their own config is never serialised; instead
`get_config()["dtype"]` of a quantized kzoo model is a `keras.dtype_policies.DTypePolicyMap`
(the convention keras-hub uses) whose default is the model's float policy and whose entries
are `layer.path -> quantized policy`. `from_config` builds the model in the float policy and
quantizes exactly the mapped layers (`apply_quantization`) before Keras loads the variables,
so `.keras` files round-trip. (The layers themselves are never given the map as their
policy: Keras 3.15's `Dense.save_own_variables` reads `self.dtype_policy.quantization_mode`,
which on a map is the default's, and would save a dequantized kernel.) A preset directory
(`kzoo.presets.save`) records the same mapping as `"quantization"` in `kzoo_config.json`.

Example:

```python
model = kzoo.presets.load("gpt_mini")
model.quantize("int8")
model.save("gpt_int8.keras")
same = kzoo.presets.load("gpt_int8.keras")
```
"""

import contextlib
import gc

import keras

from kzoo.layers.utils import check_keras_model

MODES = ("int8", "int4", "float8")

# Keras classes whose `quantize` supports a mode (exact class match: a subclass may not).
_QUANTIZABLE = {
    keras.layers.Dense: MODES,
    keras.layers.EinsumDense: MODES,
    keras.layers.Embedding: ("int8", "int4"),
}


def check_mode(mode):
    """`mode` if it is one of `MODES`; otherwise a ValueError naming it."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"`mode` must be one of {list(MODES)}; got mode={mode!r}."
        )
    return mode


def _policy(layer):
    """The layer's own policy (resolved when it holds a `DTypePolicyMap`)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path:
        return policy[layer.path]
    return policy


def quantizable(layer, mode):
    """Whether `quantize(model, mode)` quantizes `layer` (see the module docstring)."""
    modes = _QUANTIZABLE.get(type(layer))
    if modes is None or mode not in modes or not layer.built:
        return False
    if layer.quantization_mode is not None:
        return False
    if getattr(layer, "lora_enabled", False):
        return False
    # A layer kept in float32 under a mixed policy (the MoE router) stays in float.
    return layer.name != "router"


def quantize(model, mode):
    """Quantize `model`'s Dense/EinsumDense (and, for int8/int4, Embedding) layers in place.

    Args:
        model: a built kzoo model (backbone or task model).
        mode: "int8" (per-output-channel abs-max weights, activations quantized per row),
            "int4" (weights packed two per byte) or "float8" (e4m3 weights and
            activations with delayed scaling).

    Returns:
        The list of paths of the layers quantized.

    Raises:
        ValueError: unknown `mode`, an unbuilt model, or a model with LoRA adapters (merge
            them first with `merge_lora()`), nothing left to quantize, or int8 on a model
            that computes in float16 (`mixed_float16`).

    Example:
    >>> paths = kzoo.quantize.quantize(model, "int8")   # == model.quantize("int8")
    """
    check_mode(mode)
    check_keras_model(model)
    if not model.built:
        raise ValueError(f"Build {model.name!r} (call it once) before quantizing it.")
    if any(getattr(layer, "lora_enabled", False) for layer in model._flatten_layers()):
        raise ValueError(
            f"{model.name!r} has LoRA adapters; call `merge_lora()` before quantize('{mode}')."
        )
    done = [layer for layer in model._flatten_layers() if quantizable(layer, mode)]
    if not done:
        raise ValueError(
            f"{model.name!r} has no float Dense/Embedding layer left to quantize to "
            f"mode={mode!r} (already quantized?)."
        )
    if mode == "int8" and any(layer.compute_dtype == "float16" for layer in done):
        # (Keras refuses each such layer with "Consider ... 'mixed_float16'", the policy
        # the model already has)
        raise ValueError(
            f"quantize(mode='int8') does not run in float16, and {model.name!r} computes "
            f"in it (dtype policy {model.dtype_policy.name!r}): build or load it with "
            "dtype='mixed_bfloat16', 'bfloat16' or 'float32' first, or quantize it with "
            "mode='int4' or 'float8', which run in float16."
        )
    with _one_collection():
        for layer in done:
            layer.quantize(mode)
    _after_change(model)
    return [layer.path for layer in done]


@contextlib.contextmanager
def _one_collection():
    """One `gc.collect()` at the end instead of one per layer.

    Keras' `Layer.__delattr__` runs a full garbage collection each time a layer drops a
    variable (a quantized layer drops its float kernel); in a process holding many objects
    that is about half a second per layer, i.e. most of the time of quantizing a model."""
    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = collect
    gc.collect()


def _after_change(model):
    """What Keras' `Model.quantize` does after changing layers: drop the compiled step
    functions and, on torch, track the new variables as parameters."""
    model.train_function = model.test_function = model.predict_function = None
    if hasattr(model, "_jax_state"):
        model._jax_state = None
    if keras.config.backend() == "torch":
        for layer in model._flatten_layers():
            layer._track_variables()


def quantization_map(model):
    """`{layer.path: policy name}` of the quantized layers of `model` (empty when none).

    Example:
    >>> kzoo.quantize.quantization_map(model)
    {'transformer_layer_0/self_attention/query_dense': 'int8_from_float32', ...}
    """
    return {
        layer.path: _policy(layer).name
        for layer in model._flatten_layers(include_self=False)
        if layer.quantization_mode is not None and layer.path
    }


def policy_map(model):
    """The `DTypePolicyMap` of a quantized model for its `get_config()["dtype"]`, or None
    when nothing is quantized."""
    mapping = quantization_map(model)
    if not mapping:
        return None
    result = keras.dtype_policies.DTypePolicyMap(default_policy=_float_policy(model))
    for path, name in mapping.items():
        result[path] = keras.dtype_policies.get(name)
    return result


def _float_policy(model):
    policy = model.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy.default_policy
    return keras.dtype_policies.get(policy.name)


def split_dtype(dtype):
    """`(float dtype, {path: quantized policy name})` of a constructor's `dtype` argument:
    a `DTypePolicyMap` (or its serialised dict) splits into its default policy and its
    entries; anything else is returned with an empty mapping."""
    if isinstance(dtype, dict):
        dtype = keras.dtype_policies.deserialize(dtype)
    if isinstance(dtype, keras.dtype_policies.DTypePolicyMap):
        mapping = {path: policy.name for path, policy in dtype._policy_map.items()}
        return dtype.default_policy, mapping
    return dtype, {}


def apply_quantization(model, mapping, source="the saved config", strict=True):
    """Quantize the layers of `model` named in `mapping` (`{path: policy name}`, as from
    `quantization_map`) to their modes; a path the model lacks raises ValueError (is
    skipped with `strict=False`, e.g. the old head of a saved model given a new head).

    Example:
    >>> kzoo.quantize.apply_quantization(fresh, kzoo.quantize.quantization_map(model))
    """
    if not mapping:
        return model
    layers = {layer.path: layer for layer in model._flatten_layers(include_self=False)}
    missing = sorted(path for path in mapping if path not in layers)
    if missing and strict:
        raise ValueError(
            f"{source} quantizes layers {missing} that {model.name!r} does not have."
        )
    with _one_collection():
        for path, name in mapping.items():
            if path not in layers:
                continue
            mode = keras.dtype_policies.get(name).quantization_mode
            check_mode(mode)
            layer = layers[path]
            if layer.quantization_mode is None:
                layer.quantize(mode)
    _after_change(model)
    return model


__all__ = ["MODES", "quantize", "quantization_map", "policy_map", "apply_quantization",
           "split_dtype", "check_mode", "quantizable"]
