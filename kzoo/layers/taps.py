"""Taps: observe or alter a forward pass from outside, for interpretation tools.

A `Tap` is a context manager. While one is active, every `MultiHeadAttention` call computes
its attention with the exact formula (probabilities materialised, whatever kernel was
selected) and hands the probabilities to `Tap.attention`, every `TransformerBlock`
hands its output to `Tap.block`, and each family hands its input embeddings (token
embeddings of `TokenEmbedding`, ViT's patch embeddings, Graphormer's node features, before
positions, class or graph tokens are added) to `Tap.embedding`. What the tap returns replaces the tensor in the forward
pass, so a tap can record tensors, add a (zero) perturbation to make them differentiable
inputs of a gradient, or scale heads (head masking). When no tap is active the layers run
exactly as before: the check is one Python test at call time, outside any compiled graph,
so a forward pass that does not ask for taps costs nothing extra.

Taps see the tensors of the current call, so they work in eager calls and inside one traced
function (a `jax.grad`, a `tf.GradientTape`, a Keras train step): the recorded tensors must
be used inside the same trace. A traced function sees the taps that were active when it was
traced: kzoo models (and `kzoo.interpret.AttentionDistiller`) make their compiled `predict`
/ `evaluate` / `fit` functions again when the active taps are not those they were traced
under (`tap_stamp`, `same_taps`), so a tap entered after an earlier `predict` sees the next
one, and one left no longer alters it.

Nested taps: a tap entered while another is active hands every tensor to the enclosing tap
first and sees what that one passes on (its head scales multiply the inner tap's), so an
outer tap that alters the pass, such as `kzoo.interpret.masked_heads`, keeps applying inside
an inner `Tap`, which records the probabilities the model really uses. An enclosing tap
bound to one model (`masked_heads`) takes only that model's attention layers (`_covers`):
another model run under the inner tap passes through it alone. A subclass that handles an
enclosing tap itself sets `chains_enclosing = False` (the enclosing tap then sees nothing
while it is active).

Example:
>>> with Tap() as tap:
...     model(inputs)
>>> [record.weights.shape for record in tap.attention_records]
"""

import dataclasses
import weakref

from keras import ops

_ACTIVE = []


@dataclasses.dataclass
class AttentionRecord:
    """One attention call seen by a tap: the layer, its position among the tap's attention
    calls, and the probabilities `(batch, heads, query, key)` it used."""

    layer: object
    index: int
    weights: object


@dataclasses.dataclass
class EmbeddingRecord:
    """One input-embedding call seen by a tap: the layer, its position, its output
    `(batch, positions, dim)`."""

    layer: object
    index: int
    output: object


@dataclasses.dataclass
class BlockRecord:
    """One `TransformerBlock` call seen by a tap: the block, its position, its output."""

    layer: object
    index: int
    output: object


class Tap:
    """Base tap: records every attention probability tensor and block output it sees.

    Subclass and override `attention` / `block` / `head_scale` to alter the pass.

    Args:
        record_attention: keep the attention probabilities in `attention_records`.
        record_blocks: keep block outputs in `block_records`.
        record_embeddings: keep input embeddings in `embedding_records`.

    Entered inside another active tap, this one passes each tensor through the enclosing tap
    before its own hooks (see the module docstring), unless `chains_enclosing` is False.
    """

    # Whether the tap active when this one is entered still sees (first) every tensor.
    chains_enclosing = True

    def __init__(self, record_attention=True, record_blocks=False, record_embeddings=False):
        self.record_attention = record_attention
        self.record_blocks = record_blocks
        self.record_embeddings = record_embeddings
        self.attention_records = []
        self.block_records = []
        self.embedding_records = []
        self._attention_calls = 0
        self._block_calls = 0
        self._embedding_calls = 0
        self._enclosing = None  # the tap this one passes tensors through (while entered)

    # Hooks called by the layers ------------------------------------------------------------
    def attention(self, layer, index, weights):
        """Called with the post-softmax probabilities of attention call number `index`;
        returns the probabilities the layer goes on with. While decoding with a cache, the
        keys are the cache's slots: a "sliding_window" layer's one-token steps hand them in
        its rolling cache's slot order (slot `s` holds position `t - ((t - s) mod slots)`
        for the query at position `t`; see `MultiHeadAttention`'s `return_attention_weights`)."""
        return weights

    def head_scale(self, layer, index):
        """A per-head multiplier `(heads,)` for attention call `index`, or None."""
        return None

    def block(self, layer, index, output):
        """Called with the output of block call number `index`; returns the output the
        model goes on with."""
        return output

    def embedding(self, layer, index, output):
        """Called with the input embeddings `(batch, positions, dim)` of embedding call
        number `index` (T5 embeds its encoder tokens first, then its decoder tokens);
        returns the embeddings the model goes on with."""
        return output

    # Plumbing --------------------------------------------------------------------------------
    def _passes_through(self, layer):
        """Whether the tensors of `layer` go through the enclosing tap (see `_covers`)."""
        return self._enclosing is not None and self._enclosing._covers(layer)

    def _covers(self, layer):
        """Whether this tap, as an enclosing one, takes the tensors of attention `layer`
        from an inner tap (a tap bound to one model leaves other models' layers alone)."""
        return True

    def _on_attention(self, layer, weights):
        if self._passes_through(layer):
            weights = self._enclosing._on_attention(layer, weights)
        index = self._attention_calls
        self._attention_calls += 1
        weights = self.attention(layer, index, weights)
        if self.record_attention:
            self.attention_records.append(AttentionRecord(layer, index, weights))
        return weights

    def _head_scale(self, layer):
        scale = self.head_scale(layer, self._attention_calls - 1)
        outer = self._enclosing._head_scale(layer) if self._passes_through(layer) else None
        if outer is None or scale is None:
            return scale if outer is None else outer
        return ops.cast(outer, "float32") * ops.cast(scale, "float32")

    def _on_block(self, layer, output):
        if self._enclosing is not None:
            output = self._enclosing._on_block(layer, output)
        index = self._block_calls
        self._block_calls += 1
        output = self.block(layer, index, output)
        if self.record_blocks:
            self.block_records.append(BlockRecord(layer, index, output))
        return output

    def _on_embedding(self, layer, output):
        if self._enclosing is not None:
            output = self._enclosing._on_embedding(layer, output)
        index = self._embedding_calls
        self._embedding_calls += 1
        output = self.embedding(layer, index, output)
        if self.record_embeddings:
            self.embedding_records.append(EmbeddingRecord(layer, index, output))
        return output

    def __enter__(self):
        self._enclosing = active_tap() if self.chains_enclosing else None
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._enclosing = None
        return False


def active_tap():
    """The innermost active `Tap`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def tap_stamp():
    """The active taps, innermost last, as weak references: what a function traced now sees
    (compare with `same_taps`; a weak reference keeps no tap, nor what it recorded, alive)."""
    return tuple(weakref.ref(tap) for tap in _ACTIVE)


def same_taps(stamp):
    """Whether the active taps are exactly those of `stamp` (`tap_stamp`): the same objects
    in the same order. A function traced under other taps (or none) must be traced again:
    it would alter the pass as they did and hand nothing to the taps active now (a `Tap`
    around a JAX `predict` compiled earlier, e.g. inside `kzoo.interpret.masked_heads`,
    recorded nothing)."""
    return len(stamp) == len(_ACTIVE) and all(ref() is tap for ref, tap in zip(stamp, _ACTIVE))


class RetracesUnderTaps:
    """A `keras.Model` mixin: `make_predict_function` / `make_test_function` /
    `make_train_function` make the function again when the active taps are not those it
    was traced under (see `same_taps`). Outside any tap nothing changes: a function traced
    outside taps is reused outside taps."""

    def _traced_under_other_taps(self, name):
        if getattr(self, name, None) is None:
            return False
        return not same_taps(self.__dict__.get("_tap_stamps", {}).get(name, ()))

    def _made_under_taps(self, name, function):
        self.__dict__.setdefault("_tap_stamps", {})[name] = tap_stamp()
        return function

    def make_predict_function(self, force=False):
        force = force or self._traced_under_other_taps("predict_function")
        return self._made_under_taps("predict_function",
                                     super().make_predict_function(force))

    def make_test_function(self, force=False):
        force = force or self._traced_under_other_taps("test_function")
        return self._made_under_taps("test_function", super().make_test_function(force))

    def make_train_function(self, force=False):
        force = force or self._traced_under_other_taps("train_function")
        return self._made_under_taps("train_function", super().make_train_function(force))
