"""Base classes shared by every family: functional backbones and the task models on them.

`FunctionalModel` is a functional `keras.Model` whose subclasses may create their layers as
attributes before `super().__init__(inputs=..., outputs=...)`, on every backend, and whose
variables are registered as torch parameters on the torch backend (so `zero_grad`, and
with it `fit`, sees all of them). `TaskModel` adds the configuration plumbing of a task
model built on a backbone (`get_config` serialises the backbone; `from_config` rebuilds it).
"""

import keras

from kzoo.layers.feedforward import get_activation
from kzoo.layers.utils import check_positive_float, serialize_initializer


def _deserialize_dtype(config):
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = keras.dtype_policies.deserialize(config["dtype"])
    return config


class FunctionalModel(keras.Model):
    """A functional `keras.Model` that may set attributes before `super().__init__`.

    With the torch backend `torch.nn.Module.__setattr__` refuses sub-modules before
    `Module.__init__` has run. All state lives in the functional graph, so until the
    functional `__init__` has finished (and for properties) attributes are set as plain
    Python attributes there; afterwards Keras' own `__setattr__` (variable tracking, torch
    module registration) applies. The torch parameter dictionary that Keras may have built
    during `__init__` is registered again afterwards, so `model.parameters()`, and with it
    the `zero_grad` of every training step, covers every variable.

    Subclasses list their constructor arguments in `get_config`; `from_config` turns a
    serialised dtype policy back into a policy and calls the constructor.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._initialized = True
        if keras.config.backend() == "torch" and "_torch_params" in self.__dict__:
            # Built while `__setattr__` bypassed torch: a plain attribute that
            # `torch.nn.Module.parameters()` does not see. Register it properly.
            del self.__dict__["_torch_params"]
            self._track_variables()

    def __setattr__(self, name, value):
        is_property = isinstance(getattr(type(self), name, None), property)
        uninitialized = "_initialized" not in self.__dict__
        if keras.config.backend() == "torch" and (is_property or uninitialized):
            return object.__setattr__(self, name, value)
        return super().__setattr__(name, value)

    def _base_config(self):
        """The `name`, `trainable` and `dtype` entries every kzoo model config starts with."""
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
        }

    @classmethod
    def from_config(cls, config):
        return cls(**_deserialize_dtype(dict(config)))


class TaskModel(FunctionalModel):
    """A task model on a backbone: config = base entries, the backbone, `_task_config()`."""

    family = None
    task_name = None

    def _task_config(self):
        return {}

    def get_config(self):
        return {
            **self._base_config(),
            "backbone": keras.layers.serialize(self.backbone),
            **self._task_config(),
        }

    @classmethod
    def from_config(cls, config):
        config = _deserialize_dtype(dict(config))
        config["backbone"] = keras.layers.deserialize(config["backbone"])
        return cls(**config)


class HeadTransform(keras.layers.Layer):
    """`LayerNorm(act(Dense(x)))` at the input's width: the transform in front of an output
    head (BERT's masked-LM head, Graphormer's head). Sublayers `dense` and `layer_norm`.

    Args:
        activation: activation name (see `kzoo.layers.get_activation`).
        layer_norm_epsilon: epsilon of the layer norm.
        kernel_initializer: initialiser of the dense kernel.
    """

    def __init__(self, activation="gelu", layer_norm_epsilon=1e-5,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        get_activation(activation)
        self.activation = activation
        self.layer_norm_epsilon = check_positive_float("layer_norm_epsilon", layer_norm_epsilon)
        self.kernel_initializer = serialize_initializer(kernel_initializer)
        self._activation_fn = get_activation(activation)
        self.dense = None
        self.layer_norm = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
        )

    def build(self, input_shape):
        self.dense = keras.layers.Dense(
            input_shape[-1],
            kernel_initializer=keras.initializers.get(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="dense",
        )
        self.dense.build(input_shape)
        self.layer_norm.build(input_shape)
        self.built = True

    def call(self, inputs):
        return self.layer_norm(self._activation_fn(self.dense(inputs)))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "kernel_initializer": self.kernel_initializer,
            }
        )
        return config
