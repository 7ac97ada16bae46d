"""A deleted model is freed: nothing in kzoo (caches of compiled decode loops, taps,
registries) or in what kzoo asks of the backend keeps it or its traced graphs alive.

On TensorFlow the model itself was always collected, but its traced graphs were not:
`tf.custom_gradient` registers each trace's gradient function in TensorFlow's global
gradient registry for good, and that function holds the graph (`kzoo.layers.gradients`).
A loop that built, used and deleted a tiny GPT grew by 63 MiB an iteration.
"""

import gc
import weakref

import keras
import numpy as np
import pytest

from kzoo.layers import gradients
from kzoo.models.gpt import GPTBackbone, GPTCausalLM
from kzoo.models.t5 import T5Backbone, T5Seq2SeqLM

VOCAB = 61


def _gpt():
    return GPTCausalLM(GPTBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
        max_sequence_length=16, dropout=0.0))


def _t5():
    return T5Seq2SeqLM(T5Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_decoder_layers=1, num_heads=2, hidden_dim=16,
        key_value_dim=8, intermediate_dim=24, dropout=0.0, relative_attention_num_buckets=8,
        relative_attention_max_distance=16))


def _inputs(family):
    ids = np.random.default_rng(0).integers(2, VOCAB, (2, 6)).astype("int32")
    mask = np.ones_like(ids)
    if family == "gpt":
        return {"token_ids": ids, "padding_mask": mask}, ids
    return {"encoder_token_ids": ids, "encoder_padding_mask": mask,
            "decoder_token_ids": ids, "decoder_padding_mask": mask}, ids


def _used_and_dropped(family):
    """A weak reference to a model that ran predict, one fit step and generate, and is
    then no longer referenced here."""
    model = _gpt() if family == "gpt" else _t5()
    x, y = _inputs(family)
    model.predict(x, verbose=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    model.fit(x, y, epochs=1, batch_size=2, verbose=0)
    model.generate([[5, 6, 7], [3]], max_new_tokens=2)
    return weakref.ref(model)


def _registered():
    """The custom-gradient names in TensorFlow's gradient registry."""
    return {name for name in gradients._registry() if name.startswith(gradients._PREFIX)}


def _tensorflow_state():
    """TensorFlow: the custom-gradient names in its gradient registry and the functions
    registered in its eager context (what a traced graph of a model leaves there)."""
    if keras.backend.backend() != "tensorflow":
        return set(), set()
    from tensorflow.python.eager import context

    return (_registered(),
            {name for name in context.context().list_function_names()
             if not name.startswith("__wrapped__")})  # (eager ops' own, one a signature)


# (T5 is dealt to one backend a run, `spread`: its own decode loop, same layers as GPT's)
@pytest.mark.parametrize("family", ["gpt", pytest.param("t5", marks=pytest.mark.spread)])
def test_deleted_model_is_freed(family):
    registered, functions = _tensorflow_state()
    model = _used_and_dropped(family)
    gc.collect()
    assert model() is None, gc.get_referrers(model())
    registered_after, functions_after = _tensorflow_state()
    # the traced graphs are gone with the model: none of their gradient registrations or
    # functions is left (a module-level cache of kzoo that kept a graph would show here)
    assert registered_after - registered == set()
    assert len(functions_after - functions) == 0, sorted(functions_after - functions)[:5]


def test_tensorflow_gradients_still_work_while_the_graph_lives():
    """A custom gradient handed to its graph is found for as long as the graph lives (the
    gradient of a traced function is built lazily, after its trace). TensorFlow's gradient
    registry, so with TensorFlow's own functions on every backend (kzoo's TensorFlow code,
    the losses' function in tf.data, runs under JAX and torch too)."""
    import tensorflow as tf

    before = _registered()

    @gradients.tf_custom_gradient
    def scaled(x):
        return x * 2.0, lambda dy: dy * 10.0

    @tf.function
    def forward(x):
        return scaled(x)

    x = tf.constant([1.0, 2.0])
    forward(x)  # traced: the registration is the graph's now
    gc.collect()
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = forward(x)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [10.0, 10.0])

    traced = _registered() - before
    assert traced and all(isinstance(gradients._registry()[name]["type"],
                                     gradients._WeakGradient) for name in traced)
    del forward, y, tape
    gc.collect()
    assert _registered() - before == set()
