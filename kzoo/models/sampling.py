"""Next-token selection for autoregressive decoding (greedy, temperature, top-k, top-p).

Shared by every decoder in the zoo (GPT's `generate`, T5's decoder). Everything is written
with `keras.ops` / `keras.random`, so it runs on JAX, PyTorch and TensorFlow.

- `select_next_token(logits, strategy=..., temperature=..., top_k=..., top_p=..., seed=...)`
  turns `(batch, vocab)` logits into `(batch,)` int32 token ids.
- `filter_logits(logits, temperature, top_k, top_p)` returns the logits that sampling draws
  from (tokens outside the top-k / top-p set at `-inf`), e.g. to inspect the distribution.
- `update_finished(finished, next_ids, stop_token_ids)` marks rows that produced a stop token.
- `mask_finished(next_ids, finished, pad_id)` replaces the tokens of finished rows by `pad_id`.

Example:
>>> logits = keras.random.normal((2, 100))
>>> select_next_token(logits)                                   # greedy: argmax
>>> gen = keras.random.SeedGenerator(0)
>>> select_next_token(logits, strategy="sample", top_p=0.9, temperature=0.7, seed=gen)
"""

import keras
from keras import ops

STRATEGIES = ("greedy", "sample")

# Masked logits. A finite, very negative value rather than -inf keeps every backend's
# categorical sampler well defined (softmax of the kept tokens is unaffected: exp underflows
# to exactly 0 in float32).
_MASKED = -1e30


def _check_sampling_args(strategy, temperature, top_k, top_p):
    if strategy not in STRATEGIES:
        raise ValueError(
            f"`strategy` must be one of {list(STRATEGIES)}; got strategy={strategy!r}."
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        temperature > 0
    ):
        raise ValueError(
            f"`temperature` must be a positive number; got temperature={temperature!r}."
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"`top_k` must be None or a positive integer; got top_k={top_k!r}.")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0
    ):
        raise ValueError(f"`top_p` must be None or a number in (0, 1]; got top_p={top_p!r}.")


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Temperature-scaled logits with the tokens outside the top-k / top-p set masked.

    1. `logits / temperature`;
    2. top-k (Fan et al. 2018): only the `top_k` largest logits stay (ties with the k-th
       value stay too);
    3. top-p, nucleus (Holtzman et al. 2020): of what is left, the smallest set of most
       probable tokens whose probability mass is `>= top_p` stays; the most probable token
       always stays.

    Masked entries are set to a very negative finite number (probability exactly 0).

    Args:
        logits: `(batch, vocab)` floats (computed in float32).
        temperature: positive number.
        top_k: None or a positive int (values above `vocab` keep everything).
        top_p: None or a number in (0, 1].

    Returns:
        float32 `(batch, vocab)`.

    Example:
    >>> filter_logits(keras.ops.array([[1.0, 3.0, 2.0]]), top_k=2)   # [[-1e30, 3, 2]]
    """
    _check_sampling_args("sample", temperature, top_k, top_p)
    logits = ops.cast(logits, "float32")
    if float(temperature) != 1.0:
        logits = logits / float(temperature)
    masked = ops.full_like(logits, _MASKED)
    vocab = logits.shape[-1]
    if top_k is not None and (vocab is None or top_k < vocab):
        kth = ops.top_k(logits, top_k, sorted=True)[0][:, -1:]
        logits = ops.where(logits >= kth, logits, masked)
    if top_p is not None and float(top_p) < 1.0:
        sorted_logits = ops.flip(ops.sort(logits, axis=-1), axis=-1)  # descending
        probs = ops.softmax(sorted_logits, axis=-1)
        mass_before = ops.cumsum(probs, axis=-1) - probs
        # Sorted position i is kept while the mass of the tokens before it is < top_p:
        # the smallest prefix whose mass reaches top_p; position 0 always (mass 0 < p).
        keep_sorted = mass_before < float(top_p)
        threshold = ops.min(
            ops.where(keep_sorted, sorted_logits, ops.full_like(sorted_logits, 3e38)),
            axis=-1,
            keepdims=True,
        )
        logits = ops.where(logits >= threshold, logits, masked)
    return logits


def select_next_token(
    logits, *, strategy="greedy", temperature=1.0, top_k=None, top_p=None, seed=None
):
    """Pick the next token of every row from its logits.

    `strategy="greedy"` takes the argmax (temperature, top-k and top-p do not change it).
    `strategy="sample"` draws from `softmax(filter_logits(logits, temperature, top_k,
    top_p))` with `keras.random.categorical`.

    Args:
        logits: `(batch, vocab)` (any float dtype; computed in float32).
        strategy: "greedy" or "sample".
        temperature: positive number dividing the logits before sampling.
        top_k: None or a positive int: sample among the `top_k` most likely tokens.
        top_p: None or a number in (0, 1]: nucleus sampling.
        seed: a `keras.random.SeedGenerator` (advances at each call: use it for a sequence
            of steps), an int (the same draw at every call with the same logits), None
            (Keras' global generator) or, on JAX, a PRNG key array (inside `jax.jit`).

    Returns:
        int32 `(batch,)` token ids.

    Example:
    >>> logits = keras.ops.array([[0.1, 2.0, 0.3], [1.0, 0.0, -1.0]])
    >>> select_next_token(logits)                       # [1, 0]
    >>> select_next_token(logits, strategy="sample", top_k=1, seed=0)   # [1, 0] too
    """
    _check_sampling_args(strategy, temperature, top_k, top_p)
    if len(logits.shape) != 2:
        raise ValueError(
            f"`logits` must have shape (batch, vocab); got shape {tuple(logits.shape)}."
        )
    logits = ops.cast(logits, "float32")
    if strategy == "greedy":
        return ops.cast(ops.argmax(logits, axis=-1), "int32")
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    ids = keras.random.categorical(filtered, 1, dtype="int32", seed=seed)
    return ops.cast(ids[:, 0], "int32")


def update_finished(finished, next_ids, stop_token_ids):
    """`finished | (next_ids in stop_token_ids)`: rows that have produced a stop token.

    Args:
        finished: boolean `(batch,)` (or None: nothing finished yet).
        next_ids: int `(batch,)`, the tokens just chosen.
        stop_token_ids: None, an int, or a sequence of ints.

    Returns:
        boolean `(batch,)`.

    Example:
    >>> update_finished(None, keras.ops.array([2, 7]), stop_token_ids=[7])  # [False, True]
    """
    next_ids = ops.convert_to_tensor(next_ids)
    if finished is None:
        finished = ops.zeros(ops.shape(next_ids), "bool")
    finished = ops.cast(finished, "bool")
    if stop_token_ids is None:
        return finished
    if isinstance(stop_token_ids, int):
        stop_token_ids = (stop_token_ids,)
    stop_token_ids = [int(s) for s in stop_token_ids]
    if not stop_token_ids:
        return finished
    ids = ops.cast(next_ids, "int32")
    hit = ops.zeros(ops.shape(ids), "bool")
    for stop in stop_token_ids:
        hit = ops.logical_or(hit, ops.equal(ids, stop))
    return ops.logical_or(finished, hit)


def mask_finished(next_ids, finished, pad_id=0):
    """Replace the tokens of rows that had already finished by `pad_id`.

    Call it with the `finished` flags from *before* the step (a row's own stop token is kept).

    Example:
    >>> mask_finished(keras.ops.array([5, 6]), keras.ops.array([False, True]), pad_id=0)  # [5, 0]
    """
    next_ids = ops.cast(next_ids, "int32")
    if finished is None:
        return next_ids
    return ops.where(ops.cast(finished, "bool"), ops.full_like(next_ids, int(pad_id)), next_ids)


__all__ = [
    "STRATEGIES",
    "filter_logits",
    "select_next_token",
    "update_finished",
    "mask_finished",
]
