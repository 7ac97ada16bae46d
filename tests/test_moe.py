"""MixtureOfExperts against a per-token NumPy loop, capacity dropping, aux losses, fit."""

import math

import keras
import numpy as np
import pytest

from kzoo.layers.moe import MixtureOfExperts
from tests.harness import assert_close, backend, ref, rng, roundtrip_layer, to_numpy

def np_act(name, x):
    assert name in ("gelu", "silu", "relu"), name
    return ref.activation(name)(x)


np_softmax = ref.softmax


def weights_of(layer):
    """All variables of the layer as float64 NumPy arrays, by variable name."""
    return {v.name: to_numpy(v).astype(np.float64) for v in layer.weights}


def np_expert(w, e, x, expert_type, act):
    if expert_type == "gated":
        g = x @ w["gate_kernel"][e] + w.get("gate_bias", np.zeros((1, 1)))[e if "gate_bias" in w else 0]
        u = x @ w["up_kernel"][e] + w.get("up_bias", np.zeros((1, 1)))[e if "up_bias" in w else 0]
        h = np_act(act, g) * u
        y = h @ w["output_kernel"][e]
        return y + (w["output_bias"][e] if "output_bias" in w else 0.0)
    h = np_act(act, x @ w["intermediate_kernel"][e] + w["intermediate_bias"][e])
    return h @ w["output_kernel"][e] + w["output_bias"][e]


def np_moe(w, x, top_k, expert_type, act, normalize, capacity=None, valid=None):
    """Per-token reference: route, serve choice-major / token order up to `capacity`, mix."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    n, e_count = x.shape[0], w["kernel"].shape[1]
    valid = np.ones(n, bool) if valid is None else valid.reshape(-1)
    probs = np_softmax(x @ w["kernel"])
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    kept = np.zeros((n, top_k), bool)
    load = np.zeros(e_count, int)
    for j in range(top_k):  # top-1 choices of all tokens first, then top-2 choices, ...
        for t in range(n):
            if not valid[t]:
                continue
            e = chosen[t, j]
            if capacity is None or load[e] < capacity:
                kept[t, j] = True
                load[e] += 1
    out = np.zeros((n, w["output_kernel"].shape[-1]))
    for t in range(n):
        for j in range(top_k):
            if kept[t, j]:
                out[t] += gates[t, j] * np_expert(w, chosen[t, j], x[t], expert_type, act)
    return out, kept


def np_aux(w, x, valid=None):
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    valid = np.ones(x.shape[0], bool) if valid is None else valid.reshape(-1)
    logits = (x @ w["kernel"])[valid]
    probs = np_softmax(logits)
    e_count = probs.shape[-1]
    f = np.bincount(probs.argmax(-1), minlength=e_count) / len(probs)
    p = probs.mean(0)
    lb = e_count * np.sum(f * p)
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
    return lb, np.mean(lse**2)


def make_layer(x, randomize_biases=True, **kwargs):
    layer = MixtureOfExperts(**kwargs)
    layer.build(x.shape)
    if randomize_biases:
        r = rng(7)
        for v in layer.weights:
            if v.name.endswith("bias"):
                v.assign(r.normal(scale=0.5, size=v.shape).astype("float32"))
    return layer


def inputs(shape=(2, 12, 8), seed=1):
    return rng(seed).normal(size=shape).astype("float32")


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("expert_type", ["plain", "gated"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_numpy_per_token_loop(top_k, expert_type, normalize):
    x = inputs()
    layer = make_layer(
        x, num_experts=4, intermediate_dim=16, top_k=top_k, expert_type=expert_type,
        normalize_top_k=normalize, use_bias=True,
    )
    expected, kept = np_moe(weights_of(layer), x, top_k, expert_type,
                            "gelu" if expert_type == "plain" else "silu", normalize)
    assert kept.all()
    assert_close(layer(x), expected.reshape(2, 12, 8), atol=1e-4, rtol=1e-4)


def test_gated_without_bias_and_relu_activation():
    x = inputs(seed=3)
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2, expert_type="gated",
                       activation="relu")
    assert not any(v.name.endswith("bias") for v in layer.weights)
    expected, _ = np_moe(weights_of(layer), x, 2, "gated", "relu", True)
    assert_close(layer(x), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)


def test_collapsed_router_falls_back_to_full_capacity_and_stays_exact():
    # Every token prefers expert 0: the busiest expert holds all tokens, far above any
    # balanced-load capacity tier, and nothing may be dropped when capacity_factor is None.
    x = inputs(seed=4)
    x[..., 0] = 3.0 + np.abs(x[..., 0])
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2)
    kernel = rng(5).normal(scale=0.1, size=(8, 4)).astype("float32")
    kernel[0, 0] = 10.0
    layer.router.kernel.assign(kernel)
    w = weights_of(layer)
    expected, kept = np_moe(w, x, 2, "plain", "gelu", True)
    assert kept.all()
    assert (np_softmax(x.reshape(-1, 8) @ kernel).argmax(-1) == 0).all()
    assert_close(layer(x), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_k,factor", [(1, 1.0), (2, 0.5), (2, 1.25)])
def test_capacity_dropping_matches_numpy_priority_rule(top_k, factor):
    x = inputs((2, 12, 8), seed=6)
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=top_k,
                       capacity_factor=factor, normalize_top_k=False)
    # Skew the router so that some experts overflow.
    kernel = to_numpy(layer.router.kernel).copy()
    kernel[:, 0] += 0.8 * np.sign(x.reshape(-1, 8).mean(0))
    layer.router.kernel.assign(kernel)
    capacity = math.ceil(factor * 24 * top_k / 4)
    expected, kept = np_moe(weights_of(layer), x, top_k, "plain", "gelu", False, capacity)
    assert not kept.all(), "the test must exercise dropping"
    assert_close(layer(x), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)


def test_padding_mask_tokens_are_not_routed_and_take_no_capacity():
    x = inputs((2, 12, 8), seed=8)
    valid = np.ones((2, 12), bool)
    valid[0, 7:] = False
    valid[1, :3] = False
    for factor in (None, 0.75):
        layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2, capacity_factor=factor)
        capacity = None if factor is None else math.ceil(factor * 24 * 2 / 4)
        expected, kept = np_moe(weights_of(layer), x, 2, "plain", "gelu", True, capacity, valid)
        out = to_numpy(layer(x, padding_mask=valid))
        assert_close(out, expected.reshape(x.shape), atol=1e-4, rtol=1e-4)
        assert np.all(out[~valid] == 0.0)


@pytest.mark.parametrize("shape", [(12, 2), (2, 11), (2, 12, 1), (24,)])
def test_padding_mask_of_another_shape_is_refused(shape):
    """The mask is flattened beside the tokens: one of another shape with as many entries
    (the transpose) was read for other tokens in silence, others failed in a backend
    broadcast. It must be `inputs.shape[:-1]`."""
    x = inputs((2, 12, 8), seed=8)
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2)
    with pytest.raises(ValueError, match=r"padding_mask.*\(2, 12\)"):
        layer(x, padding_mask=np.ones(shape, bool))


@pytest.mark.parametrize("shape", [(2, 0, 8), (0, 5, 8)])
def test_no_tokens_give_an_empty_output_and_zero_losses(shape):
    """An empty batch or sequence (a Mixtral GPT given no rows) has nothing to route: the
    output is empty and both losses, means over max(valid tokens, 1), are 0 (the routing
    took maxima over no rows: IndexError on JAX, ValueError on torch, InvalidArgumentError
    on TensorFlow)."""
    x = np.zeros(shape, "float32")
    layer = make_layer(inputs(), num_experts=4, intermediate_dim=16, top_k=2)
    out, aux = layer(x, padding_mask=np.ones(shape[:-1], bool), return_aux_losses=True)
    assert tuple(out.shape) == shape
    assert float(to_numpy(aux["load_balance_loss"])) == 0.0
    assert float(to_numpy(aux["router_z_loss"])) == 0.0
    assert tuple(layer(x).shape) == shape


def test_aux_losses_match_numpy_and_are_added_in_training():
    x = inputs(seed=9)
    valid = rng(10).random((2, 12)) > 0.3
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2,
                       load_balance_loss_weight=0.1, router_z_loss_weight=0.01)
    w = weights_of(layer)
    lb, z = np_aux(w, x)
    _, aux = layer(x, return_aux_losses=True)
    assert_close(aux["load_balance_loss"], lb, atol=1e-5)
    assert_close(aux["router_z_loss"], z, atol=1e-5)
    assert layer.losses == []  # inference adds nothing

    lb_m, z_m = np_aux(w, x, valid)
    assert abs(lb_m - lb) > 1e-3  # the mask must matter for the check below to mean anything
    layer(x, padding_mask=valid, training=True)
    losses = sorted(float(to_numpy(v)) for v in layer.losses)
    np.testing.assert_allclose(losses, sorted([0.1 * lb_m, 0.01 * z_m]), rtol=1e-5)
    assert_close(layer.last_load_balance_loss, lb_m, atol=1e-5)
    assert_close(layer.last_router_z_loss, z_m, atol=1e-5)

    quiet = make_layer(x, num_experts=4, intermediate_dim=16, load_balance_loss_weight=0.0,
                       router_z_loss_weight=0.0)
    quiet(x, training=True)
    assert quiet.losses == []


def test_load_balance_loss_is_one_for_a_uniform_router():
    # All router logits equal -> P_e = 1/E and E * sum f_e / E = 1 whatever f is.
    x = inputs(seed=11)
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=1)
    layer.router.kernel.assign(np.zeros((8, 4), "float32"))
    _, aux = layer(x, return_aux_losses=True)
    assert_close(aux["load_balance_loss"], 1.0, atol=1e-6)
    assert_close(aux["router_z_loss"], math.log(4) ** 2, atol=1e-5)


@pytest.mark.parametrize("top_k,factor", [(1, None), (2, None), (2, 0.5)])
def test_tied_router_probabilities_pick_the_lowest_expert_ids(top_k, factor):
    """Equal router probabilities go to the lowest expert ids, as in the NumPy reference's
    stable sort, on every backend: torch's topk picked experts 6 and 5 of 8 for a zero router
    (outputs up to 1.4 from the reference) where JAX and TensorFlow picked 0 and 1."""
    x = inputs((2, 6, 8), seed=17)
    x[1, 2] = 0.0  # an all-zero token: every logit 0 whatever the kernel
    layer = make_layer(x, num_experts=8, intermediate_dim=16, top_k=top_k,
                       capacity_factor=factor, normalize_top_k=False)
    kernel = rng(18).normal(size=(8, 8)).astype("float32")
    kernel[:, 5:] = kernel[:, [1]]  # experts 1, 5, 6 and 7 tie on every token
    for router in (np.zeros((8, 8), "float32"), kernel):
        layer.router.kernel.assign(router)
        capacity = None if factor is None else math.ceil(factor * 12 * top_k / 8)
        expected, _ = np_moe(weights_of(layer), x, top_k, "plain", "gelu", False, capacity)
        assert_close(layer(x), expected.reshape(x.shape), atol=1e-5, rtol=1e-5)


def test_stacked_initializer_gives_each_expert_a_glorot_variance():
    # Without the per-expert correction Keras would count the expert axis as a receptive
    # field and shrink the std by sqrt(num_experts) = 2.
    layer = MixtureOfExperts(num_experts=4, intermediate_dim=16, top_k=2)
    layer.build((None, 8))
    kernel = to_numpy(layer.intermediate_kernel)
    assert kernel.shape == (4, 8, 16)
    target = math.sqrt(2.0 / (8 + 16))  # glorot_uniform std of one (8, 16) kernel
    assert abs(kernel.std() / target - 1.0) < 0.12
    assert np.abs(kernel).max() <= math.sqrt(6.0 / (8 + 16)) + 1e-6
    assert not np.allclose(kernel[0], kernel[1])
    assert to_numpy(layer.router.kernel).shape == (8, 4)
    assert layer.router.kernel.dtype == "float32"


def test_output_kernel_initializer_per_expert():
    layer = MixtureOfExperts(num_experts=4, intermediate_dim=64, top_k=2,
                             kernel_initializer=keras.initializers.Constant(0.1),
                             output_kernel_initializer="glorot_uniform")
    roundtrip_layer(layer)
    layer.build((None, 32))
    np.testing.assert_array_equal(to_numpy(layer.intermediate_kernel), np.float32(0.1))
    out = to_numpy(layer.output_kernel)
    target = math.sqrt(2.0 / (64 + 32))  # each expert a glorot (64, 32) kernel
    assert abs(out.std() / target - 1.0) < 0.1
    assert not np.allclose(out[0], out[1])


def test_dropout_only_in_training():
    x = inputs(seed=12)
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2, dropout=0.5, seed=3)
    expected, _ = np_moe(weights_of(layer), x, 2, "plain", "gelu", True)
    assert_close(layer(x, training=False), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)
    dropped = to_numpy(layer(x, training=True))
    assert np.isfinite(dropped).all()
    assert not np.allclose(dropped, expected.reshape(x.shape), atol=1e-3)


def test_mixed_bfloat16_router_in_float32():
    x = inputs(seed=13)
    ref = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2)
    w = weights_of(ref)
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = MixtureOfExperts(num_experts=4, intermediate_dim=16, top_k=2)
    layer.build(x.shape)
    layer.set_weights(ref.get_weights())
    out = layer(x)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert layer.router.compute_dtype == "float32"
    # Keras casts the inputs to bfloat16 before `call`; the router then works in float32
    # on those values, so the reference routes the same bf16-rounded inputs.
    x_bf16 = to_numpy(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32"))
    expected, _ = np_moe(w, x_bf16, 2, "plain", "gelu", True)
    assert_close(out, expected.reshape(x.shape), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(num_experts=4, intermediate_dim=8, top_k=5), "top_k"),
        (dict(num_experts=0, intermediate_dim=8, top_k=1), "num_experts"),
        (dict(num_experts=4, intermediate_dim=-1), "intermediate_dim"),
        (dict(num_experts=4, intermediate_dim=8, top_k=0), "top_k"),
        (dict(num_experts=4, intermediate_dim=8, expert_type="sparse"), "expert_type"),
        (dict(num_experts=4, intermediate_dim=8, activation="gelu_fast"), "activation"),
        (dict(num_experts=4, intermediate_dim=8, capacity_factor=0.0), "capacity_factor"),
        (dict(num_experts=4, intermediate_dim=8, capacity_factor=-1), "capacity_factor"),
        (dict(num_experts=4, intermediate_dim=8, load_balance_loss_weight=-0.1),
         "load_balance_loss_weight"),
        (dict(num_experts=4, intermediate_dim=8, router_z_loss_weight="0"), "router_z_loss_weight"),
        (dict(num_experts=4, intermediate_dim=8, dropout=1.0), "dropout"),
        (dict(num_experts=4, intermediate_dim=8, use_bias="yes"), "use_bias"),
        (dict(num_experts=4, intermediate_dim=8, normalize_top_k=None), "normalize_top_k"),
        (dict(num_experts=4, intermediate_dim=8, seed=1.5), "seed"),
    ],
)
def test_bad_arguments_raise(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MixtureOfExperts(**kwargs)


def test_serialization_roundtrip_and_keras_file(tmp_path):
    layer = MixtureOfExperts(num_experts=4, intermediate_dim=8, top_k=2, expert_type="gated",
                             capacity_factor=1.5, name="moe")
    clone = roundtrip_layer(layer)
    assert clone.capacity_factor == 1.5 and clone.expert_type == "gated"

    x = inputs(seed=14)
    inp = keras.Input((12, 8))
    model = keras.Model(inp, MixtureOfExperts(4, 16, top_k=2, name="moe")(inp))
    path = str(tmp_path / "moe.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert_close(restored(x), to_numpy(model(x)), atol=1e-6)
    assert [v.path for v in restored.weights] == [v.path for v in model.weights]


def _tiny_model():
    inp = keras.Input((6, 8))
    h = keras.layers.Dense(8)(inp)
    out = MixtureOfExperts(4, 16, top_k=2, name="moe")(h)
    return keras.Model(inp, keras.layers.Dense(1)(out))


def _fit_data():
    r = rng(15)
    x = r.normal(size=(64, 6, 8)).astype("float32")
    y = np.tanh(x.sum(-1, keepdims=True) / 3).astype("float32")
    return x, y


@pytest.mark.spread
def test_compiled_fit_lowers_the_loss_and_logs_router_metrics():
    # jit: jax.jit on JAX, XLA on TensorFlow; PyTorch runs Keras' default eager loop here
    # (torch.compile of a whole fit takes about a minute on CPU; see the slow test below).
    x, y = _fit_data()
    model = _tiny_model()
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=backend() != "torch")
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history
    assert history["loss"][-1] < 0.8 * history["loss"][0]
    if backend() == "jax":
        # Documented: Keras' JAX trainer cannot carry metric state out of the forward pass.
        assert "moe_load_balance_loss" not in history
    else:
        for name in ("moe_load_balance_loss", "moe_router_z_loss"):
            assert len(history[name]) == 5 and all(v > 0 for v in history[name])
        # balanced-ish router: the load-balancing loss stays close to its optimum of 1
        assert 0.9 < history["moe_load_balance_loss"][-1] < 1.5
        # evaluate (training=False) records them too
        logs = model.evaluate(x[:16], y[:16], verbose=0, return_dict=True)
        assert 0.9 < logs["moe_load_balance_loss"] < 1.5 and logs["moe_router_z_loss"] > 0


@pytest.mark.slow
def test_torch_compile_fit_lowers_the_loss():
    x, y = _fit_data()
    model = _tiny_model()
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history
    assert history["loss"][-1] < 0.8 * history["loss"][0]


def test_compiled_forward_matches_numpy():
    """Under each backend's compiler (TF with an unknown batch size) the static capacity
    tiers are chosen at run time: a balanced router (first tier) and a collapsed one (last
    tier, capacity = tokens) both stay exact."""
    x = inputs(seed=16)
    x[..., 0] = 3.0 + np.abs(x[..., 0])
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2)
    balanced = to_numpy(layer.router.kernel)
    collapsed = rng(5).normal(scale=0.1, size=(8, 4)).astype("float32")
    collapsed[0, 0] = 10.0
    if backend() == "jax":
        import jax

        fn = jax.jit(lambda a, b, t: layer.stateless_call(a, b, t)[0])

        def forward():
            tv = [v.value for v in layer.trainable_variables]
            ntv = [v.value for v in layer.non_trainable_variables]
            return fn(tv, ntv, x)
    elif backend() == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda t: layer(t),
                         input_signature=[tf.TensorSpec((None, 12, 8), tf.float32)])

        def forward():
            return fn(x)
    else:
        def forward():
            return layer(x)
    for kernel in (balanced, collapsed):
        layer.router.kernel.assign(kernel)
        expected, kept = np_moe(weights_of(layer), x, 2, "plain", "gelu", True)
        assert kept.all()
        assert_close(forward(), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)


def backend_grads(layer, x, probe, **call_kwargs):
    """d sum(layer(x) * probe) / d(x, output_kernel, router kernel) on the current backend."""
    kernels = [layer.output_kernel, layer.router.kernel]
    if backend() == "jax":
        import jax

        names = [v.path for v in layer.trainable_variables]
        idx = [names.index(k.path) for k in kernels]

        def loss(xv, tv):
            ntv = [v.value for v in layer.non_trainable_variables]
            out = layer.stateless_call(tv, ntv, xv, **call_kwargs)[0]
            return (out * probe).sum()

        grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
        gx, gtv = grad_fn(x, [v.value for v in layer.trainable_variables])
        return [gx] + [gtv[i] for i in idx]
    if backend() == "tensorflow":
        import tensorflow as tf

        xv = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xv)
            loss = tf.reduce_sum(layer(xv, **call_kwargs) * probe)
        return tape.gradient(loss, [xv] + [k.value for k in kernels])
    import torch

    xv = torch.tensor(x, requires_grad=True)
    loss = (layer(xv, **call_kwargs) * torch.tensor(probe)).sum()
    loss.backward()
    return [xv.grad] + [k.value.grad for k in kernels]


def numeric_grad(f, a, entries, eps=1e-5):
    """Central differences of f at a, for the flat indices `entries` of a."""
    a = a.astype(np.float64)
    g = np.zeros(len(entries))
    for n, flat in enumerate(entries):
        i = np.unravel_index(flat, a.shape)
        up, down = a.copy(), a.copy()
        up[i] += eps
        down[i] -= eps
        g[n] = (f(up) - f(down)) / (2 * eps)
    return g


@pytest.mark.parametrize("factor", [None, 0.75])
def test_gradients_match_numpy_finite_differences(factor):
    # Checks the hand-written gather-only gradients of dispatch/combine, through the
    # router gates as well, with and without capacity dropping.
    x = inputs((1, 12, 8), seed=17)
    valid = np.ones((1, 12), bool)
    valid[0, -2:] = False
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2, capacity_factor=factor)
    w = weights_of(layer)
    capacity = None if factor is None else math.ceil(factor * 12 * 2 / 4)
    probe = rng(18).normal(size=x.shape).astype("float32")
    if factor is not None:
        assert not np_moe(w, x, 2, "plain", "gelu", True, capacity, valid)[1][valid[0]].all()

    def loss_with(**override):
        def f(a):
            ww = dict(w)
            key = next(iter(override))
            if key == "x":
                xx = a
            else:
                xx = x
                ww[key] = a
            out, _ = np_moe(ww, xx, 2, "plain", "gelu", True, capacity, valid)
            return float((out.reshape(x.shape) * probe).sum())
        return f

    gx, g_out, g_router = backend_grads(layer, x, probe, padding_mask=valid)
    # every input entry and router entry; a random subset of the expert output kernel
    pick = rng(19).choice(w["output_kernel"].size, 48, replace=False)
    assert_close(gx, numeric_grad(loss_with(x=None), x, range(x.size)).reshape(x.shape),
                 atol=2e-4, rtol=1e-3)
    assert_close(to_numpy(g_out).reshape(-1)[pick],
                 numeric_grad(loss_with(output_kernel=None), w["output_kernel"], pick),
                 atol=2e-4, rtol=1e-3)
    assert_close(g_router, numeric_grad(loss_with(kernel=None), w["kernel"],
                                        range(w["kernel"].size)).reshape(w["kernel"].shape),
                 atol=2e-4, rtol=1e-3)


@pytest.mark.spread
@pytest.mark.parametrize("factor,shape", [(1.1, (4, 25, 8)), (1.2, (5, 5, 8))])
def test_decimal_capacity_factor_is_read_exactly_eager_and_compiled(factor, shape):
    """capacity = ceil(factor * tokens * top_k / num_experts) with the factor as written:
    1.1 with 100 tokens (top_k=2, 4 experts) is 55 and 1.2 with 25 tokens is 15, eagerly
    and in each backend's compiled graph (TensorFlow's with an unknown batch size). Before,
    eager calls computed it in float64 (1.1 * 100 * 2 / 4 = 55.000000000000007: 56) and
    TensorFlow graphs with a dynamic batch in float32 (1.2 with 25 tokens: 16), so an
    expert kept one assignment more than the formula, and an exported model (dynamic batch)
    dropped other assignments than the Keras model it came from."""
    from fractions import Fraction

    x = inputs(shape, seed=9)
    x[..., 0] = 3.0 + np.abs(x[..., 0])  # every token's top choice is expert 0
    layer = make_layer(x, num_experts=4, intermediate_dim=16, top_k=2,
                       capacity_factor=factor)
    kernel = rng(5).normal(scale=0.1, size=(8, 4)).astype("float32")
    kernel[0, 0] = 10.0
    layer.router.kernel.assign(kernel)
    tokens = shape[0] * shape[1]
    capacity = math.ceil(Fraction(str(factor)) * tokens * 2 / 4)
    assert capacity == {1.1: 55, 1.2: 15}[factor]
    expected, kept = np_moe(weights_of(layer), x, 2, "plain", "gelu", True, capacity)
    assert kept[:, 0].sum() == capacity < tokens  # expert 0 is full at `capacity`
    assert_close(layer(x), expected.reshape(x.shape), atol=1e-4, rtol=1e-4)
    if backend() == "jax":
        import jax

        fn = jax.jit(lambda a, b, t: layer.stateless_call(a, b, t)[0])
        compiled = fn([v.value for v in layer.trainable_variables],
                      [v.value for v in layer.non_trainable_variables], x)
    elif backend() == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(lambda t: layer(t), input_signature=[
            tf.TensorSpec((None,) + shape[1:], tf.float32)])(x)
    else:
        compiled = layer(x)  # (torch runs eagerly)
    assert_close(compiled, expected.reshape(x.shape), atol=1e-4, rtol=1e-4)
