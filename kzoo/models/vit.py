"""Vision Transformer (Dosovitskiy et al., 2021, "An Image is Worth 16x16 Words",
https://arxiv.org/abs/2010.11929): backbone and image classifier.

An image `(batch, height, width, channels)` is cut into non-overlapping patches, each patch
is linearly embedded, a learned class token is prepended, learned position embeddings are
added, and a stack of pre-LN transformer encoder layers with a final LayerNorm follows.

Image sizes. `image_size` fixes the size of the learned position table (one row per patch of
an `image_size` image, plus one for the class token). The model accepts images of any size
that is a multiple of the patch size: when the patch grid of the input differs from the
table's grid, the patch rows of the table are resampled with bicubic interpolation
(torch's `interpolate(mode="bicubic", align_corners=False)`, a = -0.75), exactly as
transformers' `ViTEmbeddings.interpolate_pos_encoding` does. Loading weights whose table has
another grid (e.g. a 224 checkpoint into a model built with `image_size=384`) resamples the
table once at load time with the same interpolation, as the paper does for fine-tuning at a
higher resolution.
"""

import dataclasses
import math
from typing import Optional, Tuple, Union

import keras
import numpy as np
from keras import ops

from kzoo.layers.blocks import TransformerBlock
from kzoo.layers.embedding import PatchEmbedding
from kzoo.layers.feedforward import ACTIVATION_NAMES
from kzoo.layers.taps import active_tap
from kzoo.layers.utils import FieldError
from kzoo.layers.utils import check_bool
from kzoo.layers.utils import check_choice
from kzoo.layers.utils import check_divides
from kzoo.layers.utils import check_instance
from kzoo.layers.utils import check_int_or_pair
from kzoo.layers.utils import check_int_pair
from kzoo.layers.norm import LayerNorm
from kzoo.layers.utils import check_positive_float
from kzoo.layers.utils import check_positive_int
from kzoo.layers.utils import check_rate
from kzoo.models.base import Backbone, FamilyConfig, FloatInput, TaskModel, class_loss

FAMILY = "vit"
POOLINGS = ("token", "mean")


# === Helpers ===


def _as_config(value):
    """Ints stay ints; pairs become lists (what a JSON round trip gives back)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def bicubic_resize_matrix(in_size, out_size):
    """The `(out_size, in_size)` matrix of torch's 1-D bicubic resize (align_corners=False).

    Row `o` holds the four cubic-convolution weights (Keys' kernel with a = -0.75) that
    torch's `upsample_bicubic2d` gives output `o`: source coordinate
    `(o + 0.5) * in_size / out_size - 0.5`, taps at `floor(src) - 1 .. floor(src) + 2`
    clamped to the border. The arithmetic is done in float32 like torch's CPU kernel. Since
    torch's 2-D bicubic resize is separable, `Wh @ grid @ Ww.T` (per channel) reproduces
    `torch.nn.functional.interpolate(grid, size=(oh, ow), mode="bicubic",
    align_corners=False)`.

    Example:
    >>> bicubic_resize_matrix(4, 6).shape
    (6, 4)
    """
    f32 = np.float32
    a = f32(-0.75)
    scale = f32(in_size) / f32(out_size)
    dst = np.arange(out_size, dtype=f32)
    src = scale * (dst + f32(0.5)) - f32(0.5)
    index = np.floor(src)
    t = (src - index).astype(f32)

    def near(x):  # |x| <= 1
        return ((a + f32(2)) * x - (a + f32(3))) * x * x + f32(1)

    def far(x):  # 1 < |x| < 2
        return ((a * x - f32(5) * a) * x + f32(8) * a) * x - f32(4) * a

    weights = np.stack(
        [far(t + f32(1)), near(t), near(f32(1) - t), far(f32(2) - t)], axis=1
    ).astype(f32)
    matrix = np.zeros((out_size, in_size), dtype=f32)
    rows = np.arange(out_size)
    for k in range(4):
        cols = np.clip(index.astype(np.int64) - 1 + k, 0, in_size - 1)
        np.add.at(matrix, (rows, cols), weights[:, k])
    return matrix


def resample_position_grid(grid, new_grid):
    """Bicubically resample a NumPy position grid `(gh, gw, dim)` to `(nh, nw, dim)`.

    Example:
    >>> resample_position_grid(np.zeros((14, 14, 8), "float32"), (24, 24)).shape
    (24, 24, 8)
    """
    grid = np.asarray(grid, dtype=np.float32)
    wh = bicubic_resize_matrix(grid.shape[0], new_grid[0])
    ww = bicubic_resize_matrix(grid.shape[1], new_grid[1])
    return np.einsum("ah,hwd,bw->abd", wh, grid, ww).astype(np.float32)


# === Layers ===


@keras.saving.register_keras_serializable(package="kzoo")
class ViTEmbedding(keras.layers.Layer):
    """Patch embedding + class token + learned (bicubically resampled) position embedding.

    `PatchEmbedding` (kernel = stride = patch, LeCun-normal kernel as in the reference JAX
    code) turns images into `(batch, num_patches, hidden_dim)`; a learned class token
    (zero-initialised) is prepended when `use_class_token`; learned position embeddings
    (normal, stddev 0.02) are added and dropout applied. The position table has
    `num_prefix + grid_h * grid_w` rows for the grid of an `image_size` image; inputs with
    another patch grid use the table resampled bicubically (see `bicubic_resize_matrix`).

    Args:
        image_size: int or `(height, width)`; the size the position table is learned for.
        patch_size: int or `(patch_h, patch_w)`; must divide `image_size`.
        hidden_dim: embedding width.
        num_channels: input channels.
        use_class_token: prepend a learned class token.
        dropout: dropout after adding the positions.
        **kwargs: base `keras.layers.Layer` arguments.

    Call args:
        images: `(batch, height, width, num_channels)`; height and width must be static
            multiples of the patch size.
        training: enables dropout.

    Returns:
        `(batch, num_prefix + num_patches, hidden_dim)`.

    Example:

    ```python
    embed = ViTEmbedding(image_size=32, patch_size=8, hidden_dim=64)
    tokens = embed(keras.random.normal((2, 32, 32, 3)))  # (2, 17, 64)
    tokens = embed(keras.random.normal((2, 48, 48, 3)))  # (2, 37, 64), interpolated
    ```
    """

    def __init__(
        self,
        image_size,
        patch_size,
        hidden_dim,
        num_channels=3,
        use_class_token=True,
        dropout=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._image = check_int_pair("image_size", image_size)
        self._patch = check_int_pair("patch_size", patch_size)
        for axis, size, patch in zip(("height", "width"), self._image, self._patch):
            if size % patch:
                raise ValueError(
                    f"`patch_size`={patch_size!r} must divide `image_size`={image_size!r} "
                    f"(image {axis} {size} is not a multiple of patch {axis} {patch})."
                )
        self.image_size = _as_config(image_size)
        self.patch_size = _as_config(patch_size)
        self.hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        self.num_channels = check_positive_int("num_channels", num_channels)
        self.use_class_token = check_bool("use_class_token", use_class_token)
        self.dropout = check_rate("dropout", dropout)
        self.grid = (self._image[0] // self._patch[0], self._image[1] // self._patch[1])
        self.num_prefix = 1 if use_class_token else 0
        self.num_positions = self.num_prefix + self.grid[0] * self.grid[1]

        self.patch_embedding = PatchEmbedding(
            patch_size=self.patch_size,
            hidden_dim=hidden_dim,
            num_channels=num_channels,
            kernel_initializer="lecun_normal",
            dtype=self.dtype_policy,
            name="patch_embedding",
        )
        self.dropout_layer = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, input_shape=None):
        shape = (None, None, None, self.num_channels)
        self.patch_embedding.build(shape)
        if self.use_class_token:
            self.class_token = self.add_weight(
                name="class_token",
                shape=(1, 1, self.hidden_dim),
                initializer="zeros",
            )
        # Read in full precision so that the interpolation runs in float32.
        self.position_embedding = self.add_weight(
            name="position_embedding",
            shape=(self.num_positions, self.hidden_dim),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            autocast=False,
        )
        self.built = True

    def _input_grid(self, shape):
        if len(shape) != 4:
            raise ValueError(
                "ViT expects images of shape (batch, height, width, channels); got shape "
                f"{tuple(shape)}."
            )
        height, width = shape[1], shape[2]
        if height is None or width is None:
            raise ValueError(
                "ViT needs the image height and width to be known when the model is traced "
                f"(to size the position embeddings); got shape {tuple(shape)}. Call it on "
                "fixed-size batches (e.g. a tf.function input_signature with static sizes)."
            )
        return (height // self._patch[0], width // self._patch[1])

    def position_table(self, grid):
        """The float32 position table `(num_prefix + gh * gw, hidden_dim)` for a patch grid."""
        table = ops.convert_to_tensor(self.position_embedding)
        if tuple(grid) == self.grid:
            return table
        wh = bicubic_resize_matrix(self.grid[0], grid[0])
        ww = bicubic_resize_matrix(self.grid[1], grid[1])
        patches = ops.reshape(
            table[self.num_prefix:], (self.grid[0], self.grid[1] * self.hidden_dim)
        )
        patches = ops.matmul(ops.convert_to_tensor(wh), patches)  # (nh, gw * d)
        patches = ops.reshape(patches, (grid[0], self.grid[1], self.hidden_dim))
        patches = ops.einsum("bw,awd->abd", ops.convert_to_tensor(ww), patches)
        patches = ops.reshape(patches, (grid[0] * grid[1], self.hidden_dim))
        if self.num_prefix:
            return ops.concatenate([table[: self.num_prefix], patches], axis=0)
        return patches

    def call(self, images, training=None):
        grid = self._input_grid(tuple(images.shape))
        x = self.patch_embedding(images)
        tap = active_tap()  # interpretation (kzoo.layers.taps): None in a plain pass
        if tap is not None:
            x = tap._on_embedding(self, x)
        if self.use_class_token:
            token = ops.cast(self.class_token, x.dtype)
            token = ops.broadcast_to(token, (ops.shape(x)[0], 1, self.hidden_dim))
            x = ops.concatenate([token, x], axis=1)
        x = x + ops.cast(self.position_table(grid), x.dtype)[None]
        return self.dropout_layer(x, training=training)

    def compute_output_shape(self, input_shape):
        height, width = input_shape[1], input_shape[2]
        if height is None or width is None:
            return (input_shape[0], None, self.hidden_dim)
        n = (height // self._patch[0]) * (width // self._patch[1])
        return (input_shape[0], self.num_prefix + n, self.hidden_dim)

    # === Loading a table learned for another grid ===

    def resample_table(self, table):
        """A NumPy table of another (square) grid resampled to this layer's grid."""
        table = np.asarray(table, dtype=np.float32)
        if table.shape == (self.num_positions, self.hidden_dim):
            return table
        n = table.shape[0] - self.num_prefix
        side = int(round(math.sqrt(max(n, 0))))
        if table.ndim != 2 or table.shape[1] != self.hidden_dim or side * side != n:
            raise ValueError(
                f"Cannot resample a position table of shape {tuple(table.shape)} to "
                f"({self.num_positions}, {self.hidden_dim}): the table must have "
                f"{self.num_prefix} prefix row(s) + a square number of patch rows of width "
                f"{self.hidden_dim}."
            )
        patches = resample_position_grid(
            table[self.num_prefix:].reshape(side, side, self.hidden_dim), self.grid
        )
        return np.concatenate(
            [table[: self.num_prefix], patches.reshape(-1, self.hidden_dim)], axis=0
        )

    def load_own_variables(self, store):
        own = self._trainable_variables + self._non_trainable_variables
        if len(store.keys()) != len(own):
            return super().load_own_variables(store)  # Keras' own error message
        for i, variable in enumerate(own):
            value = np.asarray(store[f"{i}"])
            if variable is self.position_embedding:
                value = self.resample_table(value)
            variable.assign(value)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "image_size": self.image_size,
                "patch_size": self.patch_size,
                "hidden_dim": self.hidden_dim,
                "num_channels": self.num_channels,
                "use_class_token": self.use_class_token,
                "dropout": self.dropout,
            }
        )
        return config


# === Config ===


@dataclasses.dataclass(frozen=True)
class ViTConfig(FamilyConfig):
    """The configuration of a `ViTBackbone`, validated once on construction.

    Its fields are `ViTBackbone`'s arguments (see there for their meaning), with the same
    defaults (ViT-B/16 at 224). `image_size` and `patch_size` are each an int or a pair
    `(height, width)` (kept as given; a list becomes a tuple); the patch size must divide
    the image size along both axes and `num_heads` must divide `hidden_dim`.

    Example:
    >>> config = ViTConfig(image_size=32, patch_size=8, num_layers=2, num_heads=4,
    ...                    hidden_dim=64, intermediate_dim=128)
    >>> backbone = config.build()             # the same as ViTBackbone(**config.to_dict())
    """

    image_size: Union[int, Tuple[int, int]] = 224
    patch_size: Union[int, Tuple[int, int]] = 16
    num_channels: int = 3
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_epsilon: float = 1e-6
    activation: str = "gelu"
    use_class_token: bool = True
    qkv_bias: bool = True
    attention: str = "full"
    attention_options: Optional[dict] = None
    remat: bool = False
    layerdrop: float = 0.0

    def __post_init__(self):
        check = self._check
        check("remat", check_bool)
        check("layerdrop", check_rate)
        check("image_size", check_int_or_pair)
        check("patch_size", check_int_or_pair)
        image = check_int_pair("image_size", self.image_size)
        patch = check_int_pair("patch_size", self.patch_size)
        for axis, size, step in zip(("height", "width"), image, patch):
            if size % step:
                raise FieldError(
                    f"`patch_size`={self.patch_size!r} must divide "
                    f"`image_size`={self.image_size!r} (image {axis} {size} is not a "
                    f"multiple of patch {axis} {step}).",
                    "patch_size",
                )
        check("num_channels", check_positive_int)
        check("num_layers", check_positive_int)
        check("num_heads", check_positive_int)
        check("hidden_dim", check_positive_int)
        check("num_heads", check_divides, "hidden_dim", self.hidden_dim)
        check("intermediate_dim", check_positive_int)
        check("dropout", check_rate)
        check("attention_dropout", check_rate)
        check("layer_norm_epsilon", check_positive_float)
        check("activation", check_choice, ACTIVATION_NAMES)
        check("use_class_token", check_bool)
        check("qkv_bias", check_bool)
        self._check_attention_fields()


# === Functional Model ===


@keras.saving.register_keras_serializable(package="kzoo")
class ViTBackbone(Backbone):
    """Vision Transformer encoder (Dosovitskiy et al., 2021, arXiv:2010.11929).

    images -> `ViTEmbedding` (patches, class token, learned positions) -> `num_layers`
    pre-LN `TransformerBlock`s (`x + MHA(LN(x))`, `x + MLP(LN(x))`, GELU MLP) -> LayerNorm.
    Initialisation follows the reference JAX code: LeCun-normal patch kernel, zero class
    token, normal(0.02) positions, Xavier-uniform attention/MLP kernels, zero biases.

    The input spec is `(batch, None, None, num_channels)`: images of any size that is a
    multiple of the patch size work; the position table (learned for `image_size`) is
    bicubically interpolated when the patch grid differs (as transformers'
    `interpolate_pos_encoding=True`).

    Args:
        image_size: int or `(height, width)`; the resolution the position table is for.
        patch_size: int or `(patch_h, patch_w)`, dividing `image_size`.
        num_channels: image channels (any positive number).
        num_layers: encoder layers.
        num_heads: attention heads; must divide `hidden_dim`.
        hidden_dim: token width.
        intermediate_dim: MLP hidden width.
        dropout: dropout after the embeddings, inside the MLP and on each residual branch.
        attention_dropout: dropout on attention probabilities.
        layer_norm_epsilon: epsilon of every LayerNorm (1e-6 in the reference code;
            Hugging Face ViT checkpoints use 1e-12).
        activation: MLP activation name (see `kzoo.layers.feedforward.get_activation`).
        use_class_token: prepend a learned class token.
        qkv_bias: biases in the query/key/value projections.
        attention: the self-attention type: "full", or an efficient variant
            ("sliding_window", "strided", "longformer", "block_sparse", "bigbird", "linear",
            "performer"; see `kzoo.layers.efficient_attention`).
        attention_options: the options of `attention` (e.g. `{"window": 128}`).
        remat: recompute each block's activations in the backward pass instead of
            keeping them (gradient checkpointing per block: less memory, one more forward
            pass of compute; the gradients are the same).
        layerdrop: LayerDrop rate (Fan et al. 2019): in training, each block is skipped
            (is the identity) with this probability, one draw per block and batch; in
            inference every block runs.
        dtype: dtype policy of every layer.

    The arguments (all but `dtype` and Keras' own) are the fields of `ViTConfig`, which
    validates them: `ViTBackbone(**fields)` and `ViTConfig(**fields).build()` are the same
    model, and `backbone.config` is that `ViTConfig`.

    Call args:
        images: float `(batch, height, width, num_channels)`, channels last.

    Returns:
        `(batch, 1 + num_patches, hidden_dim)` (without the 1 when `use_class_token=False`).

    Example:

    ```python
    backbone = ViTBackbone(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                           hidden_dim=64, intermediate_dim=128)
    features = backbone(np.zeros((2, 32, 32, 3), "float32"))  # (2, 17, 64)
    ```
    """

    _needs_static_shapes = True  # (the patch grid: see FunctionalModel)

    family = FAMILY
    config_class = ViTConfig

    def __init__(
        self,
        image_size=224,
        patch_size=16,
        num_channels=3,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        dropout=0.0,
        attention_dropout=0.0,
        layer_norm_epsilon=1e-6,
        activation="gelu",
        use_class_token=True,
        qkv_bias=True,
        attention="full",
        attention_options=None,
        remat=False,
        layerdrop=0.0,
        dtype=None,
        **kwargs,
    ):
        # === Config ===
        config = ViTConfig(
            image_size=image_size,
            patch_size=patch_size,
            num_channels=num_channels,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            dropout=dropout,
            attention_dropout=attention_dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            activation=activation,
            use_class_token=use_class_token,
            qkv_bias=qkv_bias,
            attention=attention,
            attention_options=attention_options,
            remat=remat,
            layerdrop=layerdrop,
        )

        # === Layers ===
        embedding = ViTEmbedding(
            image_size=image_size,
            patch_size=patch_size,
            hidden_dim=hidden_dim,
            num_channels=num_channels,
            use_class_token=use_class_token,
            dropout=dropout,
            dtype=dtype,
            name="embedding",
        )
        encoder_layers = [
            TransformerBlock(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                norm_first=True,
                layer_norm_epsilon=layer_norm_epsilon,
                activation=activation,
                qkv_bias=qkv_bias,
                dropout=dropout,
                attention_dropout=attention_dropout,
                activation_dropout=dropout,
                attention=config.attention,
                attention_options=config.attention_options,
                kernel_initializer="glorot_uniform",
                dtype=dtype,
                remat=config.remat,
                layerdrop=config.layerdrop,
                name=f"transformer_layer_{i}",
            )
            for i in range(num_layers)
        ]
        final_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=dtype, name="final_norm"
        )

        # === Functional Model ===
        images = keras.Input(shape=(None, None, num_channels), name="images")
        x = embedding(images)
        for layer in encoder_layers:
            x = layer(x)
        outputs = final_norm(x)
        kwargs.setdefault("name", "vit_backbone")
        super().__init__(inputs=images, outputs=outputs, **kwargs)
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)

        self._store_config(config)
        self.embedding = embedding
        self.encoder_layers = encoder_layers
        self.final_norm = final_norm

    def id_inputs(self):
        """The checks of the model's input at every entry point (`kzoo.inputs`): `images`
        of real numbers, `(batch, height, width, channels)`, every pixel finite."""
        return (FloatInput("images", axes=("image", "row", "column", "channel")),)


@keras.saving.register_keras_serializable(package="kzoo")
class ViTClassifier(TaskModel):
    """Image classifier on a `ViTBackbone`: pooled features -> dropout -> Dense logits.

    `pooling="token"` takes the class token's final state (the paper); `pooling="mean"` the
    mean of the patch tokens (class token excluded). The head kernel and bias start at zero
    as in the reference code. Returns logits `(batch, num_classes)`.

    Args:
        backbone: a `ViTBackbone`.
        num_classes: number of classes.
        pooling: "token" (needs `use_class_token=True`) or "mean".
        dropout: dropout on the pooled features.
        dtype: dtype policy of the head (defaults to the backbone's).

    Example:

    ```python
    backbone = ViTBackbone(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                           hidden_dim=64, intermediate_dim=128)
    model = ViTClassifier(backbone, num_classes=10)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logits = model(np.zeros((2, 32, 32, 3), "float32"))  # (2, 10)
    ```
    """

    _needs_static_shapes = True  # (the patch grid: see FunctionalModel)

    family = FAMILY
    task_name = "classifier"

    def default_loss(self):
        """`compile`'s loss when given none: `kzoo.models.base.class_loss` (sparse
        categorical cross-entropy on the logits; mean squared error with one output)."""
        return class_loss(self.num_classes)

    def __init__(self, backbone, num_classes=1000, pooling="token", dropout=0.0, dtype=None,
                 **kwargs):
        check_instance("backbone", backbone, ViTBackbone)
        num_classes = check_positive_int("num_classes", num_classes)
        pooling = check_choice("pooling", pooling, POOLINGS)
        dropout = check_rate("dropout", dropout)
        if pooling == "token" and not backbone.use_class_token:
            raise ValueError(
                "`pooling`='token' needs a backbone with use_class_token=True; got "
                "pooling='token' with use_class_token=False (use pooling='mean')."
            )
        dtype = dtype if dtype is not None else backbone.dtype_policy

        # === Layers ===
        dropout_layer = keras.layers.Dropout(dropout, dtype=dtype, name="head_dropout")
        head = keras.layers.Dense(
            num_classes,
            kernel_initializer="zeros",
            bias_initializer="zeros",
            dtype=dtype,
            name="logits",
        )

        # === Functional Model ===
        images = backbone.input
        x = backbone(images)
        if pooling == "token":
            x = x[:, 0, :]
        else:
            x = ops.mean(x[:, backbone.embedding.num_prefix:, :], axis=1)
        outputs = head(dropout_layer(x))
        kwargs.setdefault("name", "vit_classifier")
        super().__init__(inputs=images, outputs=outputs, dtype=dtype, **kwargs)

        # === Config ===
        self.backbone = backbone
        self.num_classes = num_classes
        self.pooling = pooling
        self.dropout = dropout
        self.head = head

    def _task_config(self):
        return {
            "num_classes": self.num_classes,
            "pooling": self.pooling,
            "dropout": self.dropout,
        }


ViTConfig.backbone_class = ViTBackbone

