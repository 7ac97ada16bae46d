"""The shared test harness: a family's or a layer's test file states cases, this file holds
the plumbing.

- `ref`: a NumPy (float64) reference library written once, from the papers' formulas and never
  from kzoo's code: norms, activations, dense, softmax, attention (mask, bias, causal, GQA),
  rotary embeddings.
- `forward(model, inputs)`: a model's output on this backend (compiled predict step on JAX).
- `check_layer(...)`: one harness every layer test can call (build, call, shape, dtype,
  optional NumPy reference, get_config / from_config / serialization round trip, dtype policy).
- `check_model_round_trips(model, inputs, tmp_path)`: `.keras` file, `from_config(get_config())`
  and `kzoo.presets.save` / `load`, each compared on outputs.
- `hf_checkpoint(path, hf_model)` and `assert_matches_transformers(...)`: parity with a tiny
  transformers model saved with save_pretrained.
- `check_fit_lowers_loss(model, x, y, ...)`.
"""

import math
import os

import keras
import numpy as np

from tests.helpers import assert_close, backend, rng, roundtrip_layer, to_numpy  # noqa: F401

__all__ = [
    "ref", "forward", "outputs_of", "assert_same_outputs", "strip_names", "real_mask",
    "max_real_diff", "check_layer", "check_model_round_trips", "check_keras_file_round_trip",
    "check_config_round_trip", "check_preset_round_trip", "hf_checkpoint", "hf_state",
    "torch_forward", "assert_same_hf_tensors", "assert_matches_transformers", "check_fit_lowers_loss",
    "assert_close", "backend", "rng", "roundtrip_layer", "to_numpy", "QUICKER_LOOP",
]


# === NumPy reference library ===


class ref:
    """Float64 NumPy formulas. Functions taking a keras layer read only its weights."""

    @staticmethod
    def w(value):
        """A weight or tensor as a float64 NumPy array."""
        return np.asarray(keras.ops.convert_to_numpy(value), dtype=np.float64)

    # --- norms ---

    @staticmethod
    def layer_norm(x, gamma=None, beta=None, eps=1e-5):
        x = np.asarray(x, np.float64)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        y = (x - mean) / np.sqrt(var + eps)
        if gamma is not None:
            y = y * gamma
        if beta is not None:
            y = y + beta
        return y

    @staticmethod
    def rms_norm(x, scale=None, eps=1e-6):
        x = np.asarray(x, np.float64)
        y = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        return y if scale is None else y * scale

    @staticmethod
    def norm(layer, x, eps=None):
        """LayerNorm (gamma/beta) or RMSNorm (scale) from a keras layer's weights."""
        eps = layer.epsilon if eps is None else eps
        if hasattr(layer, "gamma"):
            gamma = ref.w(layer.gamma) if layer.gamma is not None else None
            beta = ref.w(layer.beta) if getattr(layer, "beta", None) is not None else None
            return ref.layer_norm(x, gamma, beta, eps)
        scale = getattr(layer, "scale", None)
        return ref.rms_norm(x, None if scale is None else ref.w(scale), eps)

    # --- activations ---

    @staticmethod
    def gelu(x):
        """Exact GELU, x * Phi(x)."""
        erf = np.vectorize(math.erf)
        return 0.5 * x * (1.0 + erf(np.asarray(x, np.float64) / math.sqrt(2.0)))

    @staticmethod
    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    @staticmethod
    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    @staticmethod
    def quick_gelu(x):
        return x * ref.sigmoid(1.702 * x)

    @staticmethod
    def silu(x):
        return x / (1 + np.exp(-x))

    @staticmethod
    def relu(x):
        return np.maximum(x, 0.0)

    @staticmethod
    def activation(name):
        return {"gelu": ref.gelu, "gelu_tanh": ref.gelu_tanh, "gelu_new": ref.gelu_tanh,
                "gelu_pytorch_tanh": ref.gelu_tanh, "quick_gelu": ref.quick_gelu,
                "silu": ref.silu, "swish": ref.silu, "relu": ref.relu, "tanh": np.tanh,
                "sigmoid": ref.sigmoid, "linear": lambda x: x}[name]

    # --- dense / softmax ---

    @staticmethod
    def dense(x, kernel, bias=None):
        y = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
        return y if bias is None else y + bias

    @staticmethod
    def apply_dense(layer, x):
        """A keras Dense (kernel, optional bias) applied in float64."""
        bias = ref.w(layer.bias) if getattr(layer, "use_bias", True) and \
            getattr(layer, "bias", None) is not None else None
        return ref.dense(x, ref.w(layer.kernel), bias)

    @staticmethod
    def softmax(z, axis=-1):
        z = np.asarray(z, np.float64)
        e = np.exp(z - z.max(axis, keepdims=True))
        return e / e.sum(axis, keepdims=True)

    # --- attention ---

    @staticmethod
    def attention(q, k, v, mask=None, bias=None, causal=False, scale=None):
        """softmax(q k^T * scale + bias) v in float64, layout (batch, seq, heads, dim).
        `mask` (True = may attend) broadcasts to (batch, heads, query, key); `causal` aligns
        queries to the last keys (bottom-right); fewer kv heads than query heads (GQA/MQA):
        query head i uses kv head i // (heads / kv_heads). Rows with no allowed key -> 0."""
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        b, t, h, d = q.shape
        s_len, hk = k.shape[1], k.shape[2]
        k = np.repeat(k, h // hk, axis=2)
        v = np.repeat(v, h // hk, axis=2)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        scores = np.einsum("bthd,bshd->bhts", q, k) * scale
        if bias is not None:
            scores = scores + bias
        allowed = np.ones(scores.shape, bool)
        if mask is not None:
            allowed &= np.broadcast_to(np.asarray(mask, bool), scores.shape)
        if causal:
            i = np.arange(t)[:, None] + (s_len - t)
            allowed &= np.arange(s_len)[None, :] <= i
        scores = np.where(allowed, scores, -np.inf)
        top = scores.max(-1, keepdims=True)
        e = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
        total = e.sum(-1, keepdims=True)
        p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
        return np.einsum("bhts,bshd->bthd", p, v)

    # --- positions ---

    @staticmethod
    def rope(x, positions=None, base=10000.0, scale=1.0, interleaved=False):
        """Rotary embedding of x (batch, seq, heads, dim). Rotate-half pairs (i, i + d/2);
        interleaved pairs (2i, 2i + 1). Positions default to 0..seq-1."""
        x = np.asarray(x, np.float64)
        d = x.shape[-1]
        if positions is None:
            positions = np.arange(x.shape[1])
        inv_freq = 1.0 / base ** (np.arange(0, d, 2) / d)
        angles = (np.asarray(positions, np.float64) / scale)[:, None] * inv_freq[None, :]
        if interleaved:
            cos = np.repeat(np.cos(angles), 2, axis=-1)[None, :, None, :]
            sin = np.repeat(np.sin(angles), 2, axis=-1)[None, :, None, :]
            rotated = np.empty_like(x)
            rotated[..., 0::2] = -x[..., 1::2]
            rotated[..., 1::2] = x[..., 0::2]
        else:
            cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[None, :, None, :]
            sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[None, :, None, :]
            rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
        return x * cos + rotated * sin


# === Running models ===

# `generate(..., compile=QUICKER_LOOP)`: the decode loop that finishes first on this backend,
# for tests about what the loop produces (a prompt alone equals it in a batch, NumPy counts,
# greedy equals recomputing), not about compiled versus eager (those name both). JAX compiles
# every eager op once per new shape, so a step-by-step beam search of 5 tokens took 18.6 s
# eagerly and 3.7 s compiled whole; TensorFlow compiles the whole loop with XLA, 8.9 s against
# 1.7 s eagerly. PyTorch always runs the loop eagerly.
QUICKER_LOOP = keras.backend.backend() == "jax"


def forward(model, inputs):
    """The model's output for `inputs`. On JAX a compiled predict step (op-by-op eager
    dispatch compiles every op for every new shape and dominates the test time); elsewhere
    a plain call."""
    if backend() == "jax":
        return model.predict_on_batch(inputs)
    return model(inputs)


def outputs_of(out):
    """A model output (tensor, dict or list) as a list of NumPy arrays in a fixed order."""
    if isinstance(out, dict):
        return [to_numpy(out[key]) for key in sorted(out)]
    if isinstance(out, (list, tuple)):
        return [to_numpy(o) for o in out]
    return [to_numpy(out)]


def assert_same_outputs(a, b, inputs, atol=0.0, call=None):
    """Two models give the same outputs (bit-identical by default) for `inputs`."""
    call = call or (lambda model, x: model(x))
    got_a, got_b = outputs_of(call(a, inputs)), outputs_of(call(b, inputs))
    assert len(got_a) == len(got_b)
    for x, y in zip(got_a, got_b):
        if atol:
            np.testing.assert_allclose(x, y, atol=atol)
        else:
            np.testing.assert_array_equal(x, y)


def strip_names(config):
    """A config without its (auto-numbered) layer names, recursively."""
    if isinstance(config, dict):
        return {k: strip_names(v) for k, v in config.items() if k != "name"}
    if isinstance(config, list):
        return [strip_names(v) for v in config]
    return config


def real_mask(mask):
    return np.asarray(mask).astype(bool)


def max_real_diff(a, b, mask=None):
    """max |a - b| over the real (unpadded) positions when `mask` fits a's leading axes."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if mask is not None:
        m = real_mask(mask)
        if a.shape[: m.ndim] == m.shape:
            return float(np.abs(a[m] - b[m]).max())
    return float(np.abs(a - b).max())


# === Layers ===


def check_layer(layer_cls, init_kwargs=None, inputs=None, input_shape=None,
                expected_output_shape=None, expected_output_dtype="float32", reference=None,
                call_kwargs=None, atol=1e-5, rtol=1e-5, seed=0, mixed_policy="mixed_bfloat16"):
    """Builds `layer_cls(**init_kwargs)`, calls it and checks, in the spirit of keras'
    `run_layer_test`:
    - the output shape (`expected_output_shape`) and dtype;
    - the output against `reference(layer, inputs)` (NumPy, after the call built the layer);
    - `get_config()` holds each init argument under its own name; `from_config(get_config())`
      and `serialize` / `deserialize` give the same config, and the rebuilt layer with the same
      weights gives the same output;
    - under `mixed_policy` the layer computes in the low precision and keeps float32 weights.
    Returns (layer, output as NumPy)."""
    init_kwargs = dict(init_kwargs or {})
    call_kwargs = dict(call_kwargs or {})
    if inputs is None:
        inputs = rng(seed).normal(size=input_shape).astype("float32")
    layer = layer_cls(**init_kwargs)
    out = layer(inputs, **call_kwargs)
    if expected_output_shape is not None:
        assert tuple(out.shape) == tuple(expected_output_shape), (out.shape,
                                                                   expected_output_shape)
    if expected_output_dtype is not None:
        assert keras.backend.standardize_dtype(out.dtype) == expected_output_dtype
    got = to_numpy(out)
    if reference is not None:
        assert_close(got, reference(layer, inputs), atol=atol, rtol=rtol)
    config = layer.get_config()
    for key, value in init_kwargs.items():
        if key != "dtype":
            assert key in config, f"get_config() lacks {key!r}"
    clone = roundtrip_layer(layer)
    clone(inputs, **call_kwargs)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(clone(inputs, **call_kwargs)), got, atol=1e-6)
    if mixed_policy:
        low = layer_cls(**{**init_kwargs, "dtype": mixed_policy})
        low_out = low(inputs, **call_kwargs)
        assert keras.backend.standardize_dtype(low_out.dtype) == mixed_policy.split("_")[1]
        assert all(keras.backend.standardize_dtype(v.dtype) == "float32"
                   for v in low.weights), [v.path for v in low.weights]
    return layer, got


# === Models: save / load round trips ===


def check_keras_file_round_trip(model, inputs, tmp_path, call=None, atol=0.0):
    """`.keras` file: same class, same config (up to auto names), same outputs (bit-identical
    unless `atol`)."""
    os.makedirs(tmp_path, exist_ok=True)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored) is type(model)
    assert strip_names(restored.get_config()) == strip_names(model.get_config())
    assert_same_outputs(model, restored, inputs, atol=atol, call=call)
    return restored


def check_config_round_trip(model, inputs=None, call=None, atol=0.0):
    """`from_config(get_config())` gives an equal config; with the weights copied over, the
    same outputs."""
    config = model.get_config()
    clone = model.__class__.from_config(config)
    assert strip_names(clone.get_config()) == strip_names(config)
    if inputs is not None:
        (call or (lambda m, x: m(x)))(clone, inputs)  # build
        clone.set_weights(model.get_weights())
        assert_same_outputs(model, clone, inputs, atol=atol, call=call)
    return clone


def check_preset_round_trip(model, inputs, tmp_path, call=None, atol=0.0, **load_kwargs):
    """`kzoo.presets.save` to a directory and `kzoo.presets.load` back."""
    import kzoo.presets

    kzoo.presets.save(model, tmp_path)
    restored = kzoo.presets.load(tmp_path, **load_kwargs)
    assert type(restored) is type(model)
    assert strip_names(restored.get_config()) == strip_names(model.get_config())
    assert_same_outputs(model, restored, inputs, atol=atol, call=call)
    return restored


def check_model_round_trips(model, inputs, tmp_path, keras_file=True, config=True,
                            preset=True, call=None, atol=0.0):
    """`.keras` save/load, `from_config(get_config())` and `kzoo.presets.save` / `load`, each
    compared to the original on outputs."""
    if keras_file:
        check_keras_file_round_trip(model, inputs, os.path.join(tmp_path, "keras"), call, atol)
    if config:
        check_config_round_trip(model, inputs, call, atol)
    if preset:
        check_preset_round_trip(model, inputs, os.path.join(tmp_path, "preset"), call, atol)


# === Hugging Face transformers parity ===


def hf_checkpoint(path, hf_model):
    """Saves a (tiny) transformers model to `path` as a safetensors checkpoint directory."""
    os.makedirs(path, exist_ok=True)
    hf_model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_state(path):
    """The tensors of `path/model.safetensors` by name."""
    from safetensors.numpy import load_file

    return dict(load_file(os.path.join(path, "model.safetensors")))


def assert_same_hf_tensors(path_a, path_b):
    """Two checkpoint directories hold identical tensors under identical names."""
    a, b = hf_state(path_a), hf_state(path_b)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def torch_forward(hf_model, **inputs):
    """transformers model called under no_grad; NumPy arrays become torch tensors (integer
    arrays as int64)."""
    import torch

    kwargs = {}
    for key, value in inputs.items():
        if isinstance(value, np.ndarray):
            value = torch.tensor(value, dtype=torch.long if value.dtype.kind in "iub"
                                 else torch.float32)
        kwargs[key] = value
    with torch.no_grad():
        return hf_model(**kwargs)


def _default_hf_select(out):
    for name in ("logits", "prediction_logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out


def assert_matches_transformers(kzoo_model, hf_model, kzoo_inputs, hf_inputs, atol=1e-5,
                                select=None, kzoo_select=None, mask=None, label=""):
    """kzoo's output equals transformers' on this backend within `atol` (max |diff| over the
    real positions named by `mask`). `hf_inputs`: keyword arguments of the transformers call;
    `select(hf_out)` picks its tensor (default: logits / last_hidden_state); `kzoo_select`
    picks from kzoo's output. Returns the max |diff|."""
    ours = forward(kzoo_model, kzoo_inputs)
    if kzoo_select is not None:
        ours = kzoo_select(ours)
    ours = to_numpy(ours)
    theirs = (select or _default_hf_select)(torch_forward(hf_model, **hf_inputs))
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = max_real_diff(ours, theirs, mask)
    print(f"[{backend()}] {label or type(kzoo_model).__name__} vs transformers: "
          f"max |diff| {diff:.2e} (scale {np.abs(theirs).max():.2f})")
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"
    return diff


# === Training ===


def check_fit_lowers_loss(model, x, y, loss=None, optimizer=None, epochs=6, batch_size=8,
                          min_drop=0.05, max_ratio=None, metrics=None, sample_weight=None,
                          evaluate=False, **compile_kwargs):
    """`fit` runs, every loss is finite and the last loss is at least `min_drop` below the
    first. The losses compared are the first and last epochs' training losses, or with
    `evaluate=True` `model.evaluate` before and after fitting. With `max_ratio` the last loss
    must also be below `max_ratio` times the first (`min_drop=None`: only that). Returns the
    losses."""
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics, **compile_kwargs,
    )

    def evaluated():
        return model.evaluate(x, y, sample_weight=sample_weight, verbose=0,
                              return_dict=True)["loss"]

    before = evaluated() if evaluate else None
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
                        epochs=epochs, verbose=0)
    losses = history.history["loss"]
    if evaluate:
        losses = [before, evaluated()]
    print(f"{type(model).__name__} losses: {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert np.all(np.isfinite(losses))
    if min_drop is not None:
        assert losses[-1] < losses[0] - min_drop, losses
    if max_ratio is not None:
        assert losses[-1] < max_ratio * losses[0], losses
    return losses
