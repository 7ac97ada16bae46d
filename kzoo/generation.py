"""The one decode loop of kzoo: key/value-cached generation, samplers and beam search.

Every generative model (GPT in both styles, T5) decodes through `decode(...)` here. A model
takes part by exposing two methods, the *decoding interface*:

- `generation_prefill(inputs, max_new_tokens) -> (logits, state, constants)`: runs the prompt
  (GPT: the left-padded prompt on a fresh key/value cache; T5: the encoder, the
  cross-attention keys/values and the decoder start token) and returns the float32 logits
  `(batch, vocab)` of the first new token, the `state` that each step updates (a dict of
  tensors, or of lists of tensors, with the batch first: the key/value caches, best one
  tensor a layer so that each is written in place and never re-stacked) and the
  `constants` that every step reads (the same: padding masks, position offsets, the
  cross-attention keys/values).
- `generation_step(token_ids, state, constants, index) -> (logits, state)`: feeds the new
  tokens `(batch, 1)` chosen at step `index` (0 = the first new token) and returns the
  logits of the next one with the updated state.

The loop (`decode`) is written once with `keras.ops` and compiled whole:

- JAX: one `jax.jit` around the prefill and a `jax.lax.while_loop` over the steps, the
  model variables passed in statelessly (`keras.StatelessScope`). The cache is created inside
  the jitted function and is a loop carry, so XLA updates it in place (nothing to donate).
- TensorFlow: one `tf.function(jit_compile=True)` around the prefill and a `tf.while_loop`
  (sampling runs the same graph without XLA: XLA's random kernels draw other numbers than
  TensorFlow's, and a seed must give the same tokens compiled or not).
- PyTorch: the same body in a Python loop under `torch.no_grad()` on a static cache; the
  only host read is the "has every row finished?" test, done once every
  `TORCH_DONE_CHECK_EVERY` (8) steps (extra steps after the end change nothing: finished rows
  keep emitting padding, closed beams accept nothing). Inside this loop the models' blocks
  step through `kzoo.layers.fast_decode` (plain torch calls on the same variables, the
  keys/values written into the cache in place): Keras' per-layer Python overhead was 3/4 of
  a step there (`KZOO_FAST_DECODE=0` turns it off). The samplers' carry updates (and the
  greedy argmax) are torch calls there too, the step a Python int. On a CUDA device the
  model's step is captured once per call as a CUDA graph (`StepGraph`) and replayed at every
  step, its new tokens and step index written into tensors the graph reads: a step's few
  hundred kernels are then one launch from Python (GPT-2 small, bfloat16, batch 4 on an H100:
  481 -> 3,412 new tokens/s, the same tokens). `KZOO_CUDA_GRAPHS=0` turns it off; a step
  that cannot be captured warns once a call and runs eagerly.
- `compile=False`: the same body in a Python loop, eagerly, testing the end at every step
  (for debugging; on PyTorch under `torch.no_grad()` too).

No per-token host round-trip: the tokens are read back once, at the end.

Scores (`decode(return_scores=True)`, `generate(return_scores=True)`): greedy and sampled rows
also carry each chosen token's log-probability under the distribution it was chosen from
(the log-softmax of the processed logits: transformers' `compute_transition_scores(...,
normalize_logits=True)`), written into a `(rows, max_new_tokens)` float32 carry entry next to
the tokens; beam search returns its finished hypotheses' scores (transformers'
`sequences_scores`). Without it the loop neither computes nor carries any of it.

Samplers (small classes; `make_sampler` builds one from `generate`'s arguments):

- `GreedySampler`: argmax.
- `RandomSampler(temperature, top_k, top_p)`: draws from `softmax(filter_logits(...))`.
- `BeamSampler(num_beams, length_penalty, early_stopping)`: beam search with the semantics of
  Hugging Face transformers 4.57 (`GenerationMixin._beam_search`, see the class).

Logits processors (`LogitsProcessors`, on every sampler; `make_sampler` adds them only when
one is on, so the loop is unchanged otherwise), transformers 4.57's, in its order:

- `repetition_penalty` (1.0: off; a finite number > 0): the score of a token already in the
  row is divided by it where positive, multiplied where negative (`repetition_penalty`);
- `no_repeat_ngram_size` (0: off; an int >= 0): a token that would repeat an n-gram of the
  row gets -inf (`no_repeat_ngram`);
- `min_new_tokens` (0: off; an int >= 0): the stop tokens get -inf before that many new
  tokens (`min_new_tokens_mask`).

Greedy and sampling apply them to the logits (before temperature / top-k / top-p), beam
search to the log-softmax (before adding the beams' sums), as transformers does. The row
("history") is what `decode` is given (GPT: the prompt's real tokens; T5: the decoder start
token) followed by the new tokens; it lives in the carry (`"history"`, static shape), reordered
with the beams.

A row that produces one of `stop_token_ids` ends there: greedy and sampled rows keep emitting
padding afterwards and their result is cut after the stop token; the loop ends early once
every row (every beam search) has ended.

Example:
>>> lm.generate([[464, 2068], [464]], max_new_tokens=10, strategy="beam", num_beams=4)
>>> lm.generate([[464, 2068]], repetition_penalty=1.3, no_repeat_ngram_size=3)
>>> logits = keras.random.normal((2, 100))
>>> select_next_token(logits, strategy="sample", top_p=0.9, seed=0)
"""

import os
import warnings

import keras
import numpy as np
from keras import ops

from kzoo.inputs import (  # noqa: F401
    check_mask_values, check_token_ids, integer_array, integer_rows, prompt_dict, prompt_rows,
    to_host)
from kzoo.layers.utils import check_positive_int

STRATEGIES = ("greedy", "sample", "beam")
EARLY_STOPPING = (False, True, "never")
DEFAULT_NUM_BEAMS = 4
TORCH_DONE_CHECK_EVERY = 8

# Masked logits. A finite, very negative value rather than -inf keeps every backend's
# categorical sampler well defined (softmax of the kept tokens is unaffected: exp underflows
# to exactly 0 in float32).
_MASKED = -1e30
# The score offset beam search adds to a candidate that may not be chosen (transformers'
# -1e9), e.g. a hypothesis that has just produced a stop token when picking running beams.
_EXCLUDED = -1.0e9


# === Argument checks ===


def _is_number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer,
                                                              np.floating))


def check_sampling_args(strategy, temperature, top_k, top_p, strategies=STRATEGIES):
    """Raise `ValueError` naming the argument if a sampling argument is not allowed."""
    if strategy not in strategies:
        raise ValueError(
            f"`strategy` must be one of {list(strategies)}; got strategy={strategy!r}."
        )
    # (inf was accepted: logits / inf are all 0, a tie that top-k keeps whole, and
    # -inf / inf is NaN)
    if not _is_number(temperature) or not 0 < temperature < float("inf"):
        raise ValueError(
            f"`temperature` must be a positive finite number; got temperature={temperature!r}."
        )
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1
    ):
        raise ValueError(f"`top_k` must be None or a positive integer; got top_k={top_k!r}.")
    if top_p is not None and (not _is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"`top_p` must be None or a number in (0, 1]; got top_p={top_p!r}.")


def _memory_bytes():
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


# Float32 arrays of `(rows, vocab)` a decode step holds at once (the model's logits, their
# float32 copy, beam search's log-softmax and its scored candidates): the step's share of
# `check_cache_size`'s estimate.
_LOGITS_COPIES = 4


def check_cache_size(max_new_tokens, slots, bytes_per_slot, *, prompts=1, num_beams=1,
                     vocabulary_size=0, num_return_sequences=1):
    """Refuse a decode that could never run: positions past int32 (the step index is an
    int32 tensor), `num_beams * vocabulary_size` beam candidates past int32 (beam search
    ranks them with int32 indices), or a key/value cache of `slots * bytes_per_slot` bytes
    plus the step's logits (`prompts * num_beams` rows of `vocabulary_size` float32 scores,
    `prompts * num_return_sequences` when sampling, a few copies) larger than this
    machine's memory: a clear error naming the arguments instead of minutes of allocation,
    an allocator's failure or an overflow deep inside a compiled function.

    Example:
    >>> check_cache_size(20, 52, 2 * 6 * 8 * 64 * 4 * 4, prompts=2, num_beams=4,
    ...                  vocabulary_size=50257)
    """
    if num_beams > 1 and num_beams * vocabulary_size >= 2 ** 31:
        raise ValueError(
            f"`num_beams` is too large: num_beams={num_beams} beams x vocabulary_size="
            f"{vocabulary_size} tokens is {num_beams * vocabulary_size:,} candidates a step, "
            "and beam search ranks them with int32 indices (fewer than 2**31); give at most "
            f"num_beams={(2 ** 31 - 1) // vocabulary_size}.")
    if slots >= 2 ** 31:
        raise ValueError(
            f"`max_new_tokens` is too large: max_new_tokens={max_new_tokens} needs {slots} "
            "cache positions; positions are int32 (at most 2**31 - 1).")
    cache = slots * bytes_per_slot
    rows = prompts * max(num_beams, num_return_sequences)  # (beam search: n <= num_beams)
    logits = _LOGITS_COPIES * rows * vocabulary_size * 4
    need, have = cache + logits, _memory_bytes()
    if have is not None and need > have:
        beams = f" and num_beams={num_beams}" if num_beams > 1 else ""
        names = "`max_new_tokens` / `num_beams` are" if num_beams > 1 else \
            "`max_new_tokens` is"
        if num_return_sequences > 1 and num_beams == 1:  # (sampling: n rows a prompt)
            beams = f" and num_return_sequences={num_return_sequences}"
            names = "`max_new_tokens` / `num_return_sequences` are"
        raise ValueError(
            f"{names} too large for this batch: max_new_tokens={max_new_tokens}{beams} for "
            f"{prompts} prompt(s) need {_size(need)} (a key/value cache of {_size(cache)} "
            f"for {slots} positions x {rows} rows, and {_size(logits)} of "
            f"step logits), more than this machine's memory ({_size(have)}). Generate fewer "
            "tokens, use fewer beams or sequences, or fewer prompts at a time.")


def _size(num_bytes):
    """`num_bytes` for a message: "1.5 GiB", "3.2 MiB"."""
    unit = "GiB" if num_bytes >= 2 ** 30 else "MiB"
    return f"{num_bytes / 2 ** (30 if unit == 'GiB' else 20):,.1f} {unit}"


def _scalar_id(value):
    """A 0-D integer array or tensor in a list of stop ids as its int (else unchanged)."""
    if (hasattr(value, "shape") and hasattr(value, "dtype") and len(value.shape) == 0
            and not isinstance(value, np.generic)):
        try:
            array = to_host(value)
        except Exception:  # (symbolic: refused below)
            return value
        if array.dtype != bool and np.issubdtype(array.dtype, np.integer):
            return array.item()
    return value


def stop_ids(stop_token_ids):
    """`stop_token_ids` (None, an int or a 1-D sequence of ints: a list, a NumPy array or
    integer, a torch / TensorFlow / JAX tensor of one or more ids) -> a tuple of ints."""
    if stop_token_ids is None:
        return ()
    values = None
    if isinstance(stop_token_ids, (int, np.integer)) and not isinstance(stop_token_ids, bool):
        values = (stop_token_ids,)
    elif hasattr(stop_token_ids, "shape") and hasattr(stop_token_ids, "dtype"):
        # (an array or a backend tensor, of any integer dtype, 0-D or 1-D: iterating one
        # gave 0-D arrays / tensors, which were refused, and `np.array(2)` was refused too)
        try:
            array = to_host(stop_token_ids)
        except Exception:  # (a symbolic tensor: no values to read)
            array = None
        if (array is not None and array.ndim <= 1 and array.dtype != bool
                and np.issubdtype(array.dtype, np.integer)):
            values = tuple(array.reshape(-1).tolist())
    else:
        try:
            values = tuple(_scalar_id(s) for s in stop_token_ids)
        except TypeError:
            values = None
    # (int32 at most: the loop compares them with int32 ids; larger ones failed on JAX and
    # wrapped around on torch)
    if values is None or any(
        isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2 ** 31
        for s in values
    ):
        raise ValueError(
            "`stop_token_ids` must be None, an int in [0, 2**31) or a 1-D list, array or "
            f"tensor of them (integer dtype); got stop_token_ids={stop_token_ids!r}."
        )
    return tuple(int(s) for s in values)


# === Next-token selection (also usable on its own, eagerly) ===


def _check_logits(logits):
    """`logits` as a `(batch, vocab)` array or tensor, or a ValueError naming its shape.

    A nested list (or anything else without a `.shape`) is converted with NumPy first. Only
    the static rank is read: no host round-trip inside a compiled decode loop."""
    if not hasattr(logits, "shape"):
        try:
            logits = np.asarray(logits, dtype="float32")
        except (TypeError, ValueError) as error:  # ragged rows, strings, None
            raise ValueError(
                "`logits` must be a (batch, vocab) tensor, array or nested list of numbers; "
                f"got {type(logits).__name__} {str(logits)[:80]}."
            ) from error
    try:
        rank = len(logits.shape)
    except (TypeError, ValueError):  # a TensorFlow graph tensor of unknown rank: not checked
        return logits
    if rank != 2:
        hint = " (one row of shape (vocab,): pass `logits[None]`)" if rank == 1 else ""
        raise ValueError(
            f"`logits` must have shape (batch, vocab){hint}; got shape "
            f"{tuple(logits.shape)}."
        )
    return logits


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
        logits: `(batch, vocab)` floats (computed in float32): a tensor, a NumPy array or
            a nested list (converted). Any other rank raises `ValueError` (for one row of
            shape `(vocab,)` pass `logits[None]`).
        temperature: positive finite number.
        top_k: None or a positive int (values above `vocab` keep everything).
        top_p: None or a number in (0, 1].

    Returns:
        float32 `(batch, vocab)`.

    Example:
    >>> filter_logits(keras.ops.array([[1.0, 3.0, 2.0]]), top_k=2)   # [[-1e30, 3, 2]]
    """
    check_sampling_args("sample", temperature, top_k, top_p)
    # (a 1-D or 3-D `logits` failed deep inside top-k, or was silently filtered along
    # its last axis, depending on the backend and the arguments)
    logits = ops.cast(_check_logits(logits), "float32")
    if float(temperature) != 1.0:
        # Below 1e-30 the temperature is no longer a normal float32 (flushed to 0 by some
        # kernels) and only the largest logits keep any probability: it divides as 1e-30.
        divisor = max(float(temperature), 1e-30)
        scaled = logits / divisor
        # A row that overflowed (a tiny temperature: inf, whose softmax is NaN; TensorFlow
        # then drew the id `vocab`, one past the table) has its largest logit taken out
        # first: the same probabilities, finite.
        shifted = ops.maximum((logits - ops.max(logits, axis=-1, keepdims=True)) / divisor,
                              _MASKED)
        finite = ops.all(ops.isfinite(scaled), axis=-1, keepdims=True)
        logits = ops.where(finite, scaled, shifted)
    # A row whose largest logit is at or below the mask value (-2 / 1e-30) would leave the
    # masked tokens the most likely ones (top-k / top-p sampled only what they removed): it
    # is shifted to a maximum of 0 first (the same probabilities).
    top = ops.max(logits, axis=-1, keepdims=True)
    logits = ops.where(top > _MASKED, logits, ops.maximum(logits - top, _MASKED))
    masked = ops.full_like(logits, _MASKED)
    vocab = logits.shape[-1]
    if top_k is not None and (vocab is None or top_k < vocab):
        kth = ops.top_k(logits, int(top_k), sorted=True)[0][:, -1:]
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
    """Pick the next token of every row from its logits (one step, outside the loop).

    `strategy="greedy"` takes the argmax (temperature, top-k and top-p do not change it).
    `strategy="sample"` draws from `softmax(filter_logits(logits, temperature, top_k,
    top_p))` with `keras.random.categorical`.

    Args:
        logits: `(batch, vocab)` (any float dtype; computed in float32): a tensor, a NumPy
            array or a nested list (converted). Any other rank raises `ValueError`.
        strategy: "greedy" or "sample".
        temperature: positive finite number dividing the logits before sampling.
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
    check_sampling_args(strategy, temperature, top_k, top_p, strategies=("greedy", "sample"))
    logits = ops.cast(_check_logits(logits), "float32")
    if strategy == "greedy":
        return ops.cast(ops.argmax(logits, axis=-1), "int32")
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    ids = keras.random.categorical(filtered, 1, dtype="int32", seed=seed)
    return ops.cast(ids[:, 0], "int32")


def _stop_hits(ids, stops):
    """Boolean: which of the int tensor `ids` are one of the Python ints `stops`."""
    hit = ops.zeros(ops.shape(ids), "bool")
    for stop in stops:
        hit = ops.logical_or(hit, ops.equal(ids, stop))
    return hit


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
    stops = stop_ids(stop_token_ids)
    if not stops:
        return finished
    return ops.logical_or(finished, _stop_hits(ops.cast(next_ids, "int32"), stops))


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


# === Logits processors (transformers' repetition penalty, n-gram ban, minimum length) ===


def check_processor_args(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0):
    """Raise `ValueError` naming the argument if a logits processor option is not allowed."""
    if (not _is_number(repetition_penalty) or not np.isfinite(repetition_penalty)
            or not repetition_penalty > 0):
        raise ValueError(
            "`repetition_penalty` must be a finite number > 0 (1.0: off); got "
            f"repetition_penalty={repetition_penalty!r}.")
    for name, value in (("no_repeat_ngram_size", no_repeat_ngram_size),
                        ("min_new_tokens", min_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"`{name}` must be an int >= 0 (0: off); got {name}={value!r}.")


def _mark(index, vocab):
    """bool `(rows, vocab)`: True at `[r, index[r, i]]` for `index (rows, n)` ints in
    `[0, vocab]` (`vocab`: nothing to mark).

    One scatter of ones into a `(rows, vocab + 1)` table whose last column takes the
    unmarked entries: every write is a 1, so repeated indices give the same table whether a
    backend adds them (`ops.scatter`) or lets one write win (`scatter_update`). (Keras'
    `ops.scatter` is a Python loop over the indices on PyTorch; `scatter_update` is one
    `index_put`.)"""
    rows, width = index.shape
    row = ops.broadcast_to(ops.arange(rows, dtype="int32")[:, None], (rows, width))
    indices = ops.stack([ops.reshape(row, (-1,)), ops.reshape(ops.cast(index, "int32"), (-1,))],
                        axis=1)
    table = ops.scatter_update(ops.zeros((rows, vocab + 1), "int32"), indices,
                               ops.ones((rows * width,), "int32"))
    return table[:, :vocab] > 0


def repetition_penalty(scores, history, penalty):
    """transformers' `RepetitionPenaltyLogitsProcessor` (CTRL, Keskar et al. 2019): the score
    of every token that occurs in `history` is divided by `penalty` where positive and
    multiplied by it where negative (`penalty > 1` makes repeats less likely).

    Args:
        scores: float32 `(rows, vocab)` (logits; beam search: log-probabilities).
        history: int `(rows, length)` token ids so far, -1 where a row has no token (its
            left padding, the steps to come).
        penalty: a number > 0.

    Returns:
        float32 `(rows, vocab)`.

    Example:
    >>> repetition_penalty(keras.ops.array([[2.0, -1.0, 1.0]]), keras.ops.array([[0, 1]]), 2.0)
    ... # [[1.0, -2.0, 1.0]]
    """
    vocab = scores.shape[-1]
    seen = _mark(ops.where(history >= 0, history, vocab), vocab)
    penalized = ops.where(scores < 0, scores * penalty, scores / penalty)
    return ops.where(seen, penalized, scores)


def no_repeat_ngram(scores, history, ngram_size, end=None):
    """transformers' `NoRepeatNGramLogitsProcessor` (fairseq's): a token that would repeat
    an n-gram of `history` gets -inf, i.e. every token that followed an earlier occurrence of
    the last `ngram_size - 1` tokens (`ngram_size=1`: every token of `history`).

    Args:
        scores: float32 `(rows, vocab)`.
        history: int `(rows, length)` token ids, -1 where a row has no token; a row's tokens
            are contiguous and end before column `end`.
        ngram_size: int >= 1.
        end: the column after the last token (a Python int or a scalar tensor; None: the
            full width).

    Returns:
        float32 `(rows, vocab)`.

    Example:
    >>> no_repeat_ngram(keras.ops.zeros((1, 4)), keras.ops.array([[1, 2, 3, 1]]), 2)
    ... # [[0, 0, -inf, 0]]: (1, 2) was seen
    """
    vocab = scores.shape[-1]
    rows, width = history.shape
    end = width if end is None else end
    windows = width - ngram_size + 1  # every n-gram's start column
    first = end - (ngram_size - 1)  # the column of the prefix to match
    if windows < 1 or (isinstance(first, int) and first < 0):
        return scores  # (fewer than n - 1 tokens: nothing to ban, as transformers)
    match = None
    for j in range(ngram_size):
        part = history[:, j:j + windows]
        here = part >= 0  # (a window over a missing token is no n-gram)
        if j < ngram_size - 1:
            column = first + j
            token = _column(history, column)
            if not isinstance(column, int):  # (a traced column before 0 reads as no token)
                token = ops.where(column >= 0, token, -1)
            here = ops.logical_and(here, ops.equal(part, token[:, None]))
        match = here if match is None else ops.logical_and(match, here)
    banned = _mark(ops.where(match, history[:, ngram_size - 1:], vocab), vocab)
    return ops.where(banned, float("-inf"), scores)


def min_new_tokens_mask(scores, new_tokens, min_new_tokens, stops):
    """transformers' `MinNewTokensLengthLogitsProcessor`: the stop tokens get -inf while
    fewer than `min_new_tokens` new tokens exist (`new_tokens`: a Python int or a scalar
    tensor).

    Example:
    >>> min_new_tokens_mask(keras.ops.zeros((1, 3)), 0, 2, (2,))   # [[0, 0, -inf]]
    """
    vocab = scores.shape[-1]
    ids = [s for s in stops if s < vocab]
    if not ids or not min_new_tokens:
        return scores
    if isinstance(new_tokens, int) and new_tokens >= min_new_tokens:
        return scores
    is_stop = np.zeros((vocab,), bool)
    is_stop[ids] = True
    ban = ops.convert_to_tensor(is_stop)
    if not isinstance(new_tokens, int):
        ban = ops.logical_and(ban, ops.less(ops.cast(new_tokens, "int32"), min_new_tokens))
    return ops.where(ban, float("-inf"), scores)


class LogitsProcessors:
    """The options of transformers' logits processors that `generate` takes, applied in
    transformers' order (`GenerationMixin._get_logits_processor`): repetition penalty,
    n-gram ban, then the stop tokens' ban before `min_new_tokens`.

    A sampler applies them to each step's scores before choosing (greedy and sampling: to the
    logits, before temperature / top-k / top-p; beam search: to the log-softmax, before the
    beams' sums are added, as transformers does). The token history lives in the loop's carry
    as `"history"` `(rows, history_length + max_new_tokens)` (-1 = no token), each step's
    tokens written into their column, reordered with the beams: static shapes, so the loop
    still compiles whole. Made only when an option is on (`make_sampler`): nothing is added
    to the loop otherwise.

    Args:
        repetition_penalty: a finite number > 0 (1.0: off).
        no_repeat_ngram_size: an int >= 0 (0: off).
        min_new_tokens: an int >= 0 (0: off; no effect without stop tokens).

    Example:
    >>> LogitsProcessors(repetition_penalty=1.3, no_repeat_ngram_size=3)
    """

    def __init__(self, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0):
        check_processor_args(repetition_penalty, no_repeat_ngram_size, min_new_tokens)
        self.repetition_penalty = float(repetition_penalty)
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)
        self.min_new_tokens = int(min_new_tokens)
        self.stops = ()
        self.first = 0

    @property
    def key(self):
        return (self.repetition_penalty, self.no_repeat_ngram_size, self.min_new_tokens)

    @property
    def active(self):
        return self.key != (1.0, 0, 0)

    @property
    def uses_history(self):
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    def start(self, carry, history, max_new_tokens, stops):
        """Add the history `(rows, length)` (int, -1 = no token; rows = batch *
        rows_per_prompt) and room for the new tokens to the initial carry."""
        self.stops = tuple(stops)
        if not self.uses_history:
            return carry
        history = ops.cast(history, "int32")
        self.first = int(history.shape[1])  # the column of step 0's token
        carry = dict(carry)
        carry["history"] = ops.concatenate(
            [history, ops.full((history.shape[0], max_new_tokens), -1, "int32")], axis=1)
        return carry

    def apply(self, scores, carry, t):
        """Step `t`'s processed scores (`t` new tokens exist)."""
        if self.repetition_penalty != 1.0:
            scores = repetition_penalty(scores, carry["history"], self.repetition_penalty)
        if self.no_repeat_ngram_size:
            scores = no_repeat_ngram(scores, carry["history"], self.no_repeat_ngram_size,
                                     self.first + t)
        if self.min_new_tokens:
            scores = min_new_tokens_mask(scores, t, self.min_new_tokens, self.stops)
        return scores

    def update(self, before, carry, tokens, rows, t):
        """`carry` with the history of `before` (reordered by `rows` where beam search
        reorders) plus step `t`'s `tokens` `(rows,)`."""
        if not self.uses_history:
            return carry
        history = before["history"]
        if rows is not None:
            history = ops.take(history, rows, axis=0)
        carry = dict(carry)
        carry["history"] = _set_column(history, self.first + t, tokens)
        return carry


def history_rows(token_ids, mask=None):
    """`decode`'s `history` from padded prompts: int32 `(batch, length)`, -1 where `mask`
    is 0 (padding is no token of the prompt)."""
    token_ids = np.asarray(token_ids, "int32")
    if mask is None:
        return token_ids
    return np.where(np.asarray(mask, bool), token_ids, -1).astype("int32")


# === Samplers ===


def _eager_torch(t):
    """Whether step `t` runs in PyTorch's Python loop (a Python int step on the torch
    backend): there the samplers use torch calls (a `keras.ops` call costs some
    microseconds of dispatch each, a tenth of a small model's step in all)."""
    return isinstance(t, int) and keras.backend.backend() == "torch"


def _set_column(tokens, column, values):
    """`tokens[..., column] = values` for a (possibly traced) scalar `column`."""
    if _eager_torch(column):
        tokens = tokens.clone()
        tokens[..., column] = values.to(tokens.dtype)
        return tokens
    width = tokens.shape[-1]
    here = ops.equal(ops.arange(width, dtype="int32"), ops.cast(column, "int32"))
    return ops.where(here, ops.expand_dims(ops.cast(values, tokens.dtype), -1), tokens)


def _column(tokens, column):
    """`tokens[..., column]` for a (possibly traced) scalar `column`."""
    if isinstance(column, int):
        return tokens[..., column]
    width = tokens.shape[-1]
    here = ops.equal(ops.arange(width, dtype="int32"), ops.cast(column, "int32"))
    return ops.sum(ops.where(here, tokens, ops.zeros_like(tokens)), axis=-1)


class Sampler:
    """How the loop turns each step's logits into tokens; one subclass a strategy.

    The loop calls `start` once, then `select` at every step `t` (0 = the first new token)
    with that step's float32 logits `(rows, vocab)` (`rows = batch * rows_per_prompt`), and
    `last_tokens` to get what to feed the model next. Everything a sampler keeps lives in
    its `carry` (a dict of tensors), so that the loop can be compiled whole.

    Subclasses set `num_beams` and implement `select`; `key` (a tuple of the settings)
    names the compiled loop a sampler needs.
    """

    num_beams = 1
    # Outputs per prompt (`make_sampler` sets it): greedy 1; sampling draws that many rows
    # of each prompt, beam search returns that many of its best finished hypotheses.
    num_return_sequences = 1
    uses_seed = False
    # The `LogitsProcessors` applied before choosing (`make_sampler` sets them when an
    # option is on; None: the loop has no processing at all).
    processors = None
    # Whether the loop keeps scores (`decode(return_scores=True)` sets it): each chosen
    # token's log-probability (greedy, sampling: `"token_scores"` in the carry), beam
    # search's final scores. Off: nothing of it is computed or carried.
    return_scores = False

    @property
    def key(self):
        return (type(self).__name__,)

    @property
    def rows_per_prompt(self):
        """Rows of the model state a prompt takes in the loop (its prefill is repeated for
        them): the samples of a prompt; beam search: its beams."""
        return self.num_return_sequences

    def process(self, scores, carry, t):
        """Step `t`'s scores after the logits processors (unchanged without them)."""
        if self.processors is None:
            return scores
        scores = self.processors.apply(scores, carry, t)
        if self.uses_seed:  # (-inf -> the finite mask value every categorical sampler takes)
            scores = ops.maximum(scores, _MASKED)
        return scores

    def track(self, before, carry, rows, t):
        """`carry` with the processors' history of `before` followed by step `t`'s tokens
        (reordered by `rows` in beam search)."""
        if self.processors is None:
            return carry
        return self.processors.update(before, carry, self.last_tokens(carry, t), rows, t)

    def start(self, batch_size, max_new_tokens, stops, pad_token_id):
        """The initial carry for `batch_size` prompts: every row (`rows_per_prompt` a
        prompt) unfinished, its tokens all padding."""
        self.stops = stops
        self.pad_token_id = pad_token_id
        batch_size = batch_size * self.rows_per_prompt
        carry = {
            "tokens": ops.full((batch_size, max_new_tokens), pad_token_id, "int32"),
            "finished": ops.zeros((batch_size,), "bool"),
            "lengths": ops.full((batch_size,), max_new_tokens, "int32"),
        }
        if self.return_scores:
            carry["token_scores"] = ops.zeros((batch_size, max_new_tokens), "float32")
        return carry

    def next_ids(self, logits, carry):
        """`(rows,)` int32 tokens for the logits (and the carry, e.g. a new seed)."""
        raise NotImplementedError

    def choose(self, logits, carry):
        """`(ids, carry, source)`: `next_ids`' tokens and carry, and the logits `(rows,
        vocab)` of the distribution they were chosen from (their log-softmax gives the
        tokens' scores)."""
        ids, carry = self.next_ids(logits, carry)
        return ids, carry, logits

    def select(self, logits, carry, t):
        """Choose step `t`'s tokens: `(carry, rows_to_keep)`; `rows_to_keep` (None here)
        says which rows of the model state each row continues (beam search reorders)."""
        before = carry
        ids, carry, source = self.choose(self.process(logits, carry, t), carry)
        if self.return_scores:
            carry = _record_score(carry, source, ids, t)
        finished = carry["finished"]
        if _eager_torch(t):
            return self.track(before, self._select_torch(ids, carry, t), None, t), None
        ids = mask_finished(ids, finished, self.pad_token_id)
        finished_now = update_finished(finished, ids, self.stops)
        ended = ops.logical_and(finished_now, ops.logical_not(finished))
        carry = dict(carry)
        carry["tokens"] = _set_column(carry["tokens"], t, ids)
        carry["lengths"] = ops.where(ended, ops.cast(t + 1, "int32"), carry["lengths"])
        carry["finished"] = finished_now
        return self.track(before, carry, None, t), None

    def _select_torch(self, ids, carry, t):
        """`select`'s carry update in torch calls (the same integers)."""
        import torch

        finished = carry["finished"]
        ids = torch.where(finished, self.pad_token_id, ids.to(torch.int32))
        finished_now = finished
        for stop in self.stops:
            finished_now = finished_now | (ids == stop)
        carry = dict(carry)
        carry["tokens"] = _set_column(carry["tokens"], t, ids)
        carry["lengths"] = torch.where(finished_now & ~finished, t + 1, carry["lengths"])
        carry["finished"] = finished_now
        return carry

    def last_tokens(self, carry, t):
        """The tokens chosen at step `t`, `(rows,)`: the model's next input."""
        return _column(carry["tokens"], t)

    def done(self, carry):
        """Scalar bool: nothing can change any more (every row has ended)."""
        return ops.all(carry["finished"])

    def can_end_early(self):
        return bool(self.stops)

    def result(self, carry):
        """`(tokens (rows, max_new_tokens), lengths (rows,))`: row `b`'s output is
        `tokens[b, :lengths[b]]` (`num_return_sequences` rows a prompt, prompt by prompt)."""
        return carry["tokens"], carry["lengths"]

    def scores(self, carry):
        """float32 `(rows, max_new_tokens)` (with `return_scores`): the log-probability of
        each chosen token (row `b`'s are `[b, :lengths[b]]`, as its tokens)."""
        return carry["token_scores"]


def _record_score(carry, source, ids, t):
    """`carry` with column `t` of `"token_scores"` set to `log_softmax(source)[r, ids[r]]`
    (`source`: float32 `(rows, vocab)`, `ids`: `(rows,)` tokens in `[0, vocab)`)."""
    if _eager_torch(t):
        import torch

        chosen = source.gather(1, ids.long()[:, None])[:, 0]
        score = chosen - torch.logsumexp(source, dim=-1)
    else:
        chosen = ops.take_along_axis(source, ops.cast(ids, "int32")[:, None], axis=1)[:, 0]
        score = chosen - ops.logsumexp(source, axis=-1)
    carry = dict(carry)
    carry["token_scores"] = _set_column(carry["token_scores"], t, score)
    return carry


class GreedySampler(Sampler):
    """The most likely next token (argmax of the logits).

    Example:
    >>> lm.generate(prompts, strategy="greedy")
    """

    def next_ids(self, logits, carry):
        if keras.backend.backend() == "torch":
            import torch

            if isinstance(logits, torch.Tensor) and logits.dtype != torch.bool:
                # (`max(...).indices`: the first maximal index, like `argmax`, in 2/3 of
                # its time on CPU)
                return logits.max(dim=-1).indices.to(torch.int32), carry
        return first_max_index(logits), carry


def first_max_index(logits):
    """int32 `argmax(logits, axis=-1)` of `(batch, vocab)` logits as two plain reductions:
    the row maximum, then the smallest index holding it (or holding a NaN: `argmax` takes
    the first NaN of a row that has one). XLA on CPU runs `argmax` as one reduction of
    (value, index) pairs it does not vectorise: 93 against 37 us for 4 x 8192 float32 logits
    in a `while_loop` (JAX, 2 cores), where it is a twentieth of a GPT decode step."""
    top = ops.max(logits, axis=-1, keepdims=True)
    vocab = logits.shape[-1] if logits.shape[-1] is not None else ops.shape(logits)[-1]
    index = ops.arange(vocab, dtype="int32")
    hit = ops.logical_or(ops.equal(logits, top), ops.isnan(logits))
    return ops.min(ops.where(hit, index, vocab), axis=-1)


class RandomSampler(Sampler):
    """A draw from `softmax(filter_logits(logits, temperature, top_k, top_p))`.

    The random stream is part of the loop's carry: `start` takes a seed (int,
    `keras.random.SeedGenerator` or None) and the draw of step `t` depends only on it and on
    the logits, so a seed gives the same tokens compiled or not. JAX and TensorFlow thread a
    `keras.random` seed state through the loop; PyTorch draws with a `torch.Generator` seeded
    once per call (`keras.random` would read its seed on the host at every step).

    Args:
        temperature: positive finite number dividing the logits.
        top_k: None or a positive int: sample among the `top_k` most likely tokens (a
            `top_k` at or above the vocabulary size keeps them all, as transformers does).
        top_p: None or a number in (0, 1]: nucleus sampling.

    Example:
    >>> lm.generate(prompts, strategy="sample", temperature=0.7, top_p=0.9, seed=0)
    """

    uses_seed = True
    _placeholder = None

    def __init__(self, temperature=1.0, top_k=None, top_p=None):
        check_sampling_args("sample", temperature, top_k, top_p)
        self.temperature = float(temperature)
        self.top_k = None if top_k is None else int(top_k)
        self.top_p = None if top_p is None else float(top_p)

    @property
    def key(self):
        return (type(self).__name__, self.temperature, self.top_k, self.top_p)

    @classmethod
    def seed_variable(cls):
        """One `SeedGenerator` whose state variable stands in for the carried seed inside
        the loop (its own value is never read there). Created outside any trace."""
        if cls._placeholder is None:
            cls._placeholder = keras.random.SeedGenerator(0, name="generation_seed")
        return cls._placeholder

    def next_ids(self, logits, carry):
        ids, carry, _ = self.choose(logits, carry)
        return ids, carry

    def choose(self, logits, carry):
        # (the tokens are drawn from the filtered logits: their scores too)
        filtered = filter_logits(logits, self.temperature, self.top_k, self.top_p)
        if keras.backend.backend() == "torch":
            import torch

            probs = torch.softmax(filtered, dim=-1)
            ids = torch.multinomial(probs, 1, generator=self._torch_generator)
            return ops.cast(ids[:, 0], "int32"), carry, filtered
        carry = dict(carry)
        generator = self.seed_variable()
        with keras.StatelessScope(state_mapping=[(generator.state, carry["seed"])]) as scope:
            ids = keras.random.categorical(filtered, 1, dtype="int32", seed=generator)
            carry["seed"] = scope.get_current_value(generator.state)
        return ops.cast(ids[:, 0], "int32"), carry, filtered

    def start_seed(self, carry, seed):
        """Add the random stream to the initial carry (torch: a generator on the sampler)."""
        carry = dict(carry)
        if keras.backend.backend() == "torch":
            import torch

            from keras.src.backend.torch.core import get_device

            first, second = (int(v) for v in ops.convert_to_numpy(seed))
            self._torch_generator = torch.Generator(device=get_device())
            self._torch_generator.manual_seed(first * 1_000_003 + second)
        else:
            carry["seed"] = seed
        return carry


def _check_beam_args(length_penalty, early_stopping):
    if not _is_number(length_penalty) or not np.isfinite(length_penalty):
        raise ValueError(
            f"`length_penalty` must be a finite number; got length_penalty="
            f"{length_penalty!r}."
        )
    if not any(early_stopping is e or (isinstance(e, str) and early_stopping == e)
               for e in EARLY_STOPPING):
        raise ValueError(
            f"`early_stopping` must be one of {list(EARLY_STOPPING)}; got "
            f"early_stopping={early_stopping!r}."
        )


class BeamSampler(Sampler):
    """Beam search, reproducing Hugging Face transformers 4.57 (`_beam_search`) token for token.

    Per prompt, `num_beams` running hypotheses (rows `b * num_beams + k` of the model
    state) and up to `num_beams` finished ones are kept. At step `t`:

    1. every running hypothesis is extended by every token: score = its summed log-softmax
       + the token's log-probability (at step 0 only beam 0 competes: the others start at
       -1e9);
    2. the best `max(2, 1 + len(stop_token_ids)) * num_beams` candidates are kept (so that
       at least `num_beams` of them continue even if stop tokens rank high);
    3. a candidate "hits" when its token is a stop token, or at the last step
       (`max_new_tokens` reached); the `num_beams` best candidates that did not hit become
       the running hypotheses (the model state is reordered to follow them);
    4. a candidate that hits *and* ranks among the first `num_beams` candidates is a
       finished hypothesis with score `sum_logprobs / length ** length_penalty` (`length` =
       new tokens including the stop token); it replaces the worst finished one if better.
       Nothing is added to a prompt that is closed, or whose `num_beams` finished slots are
       full when `early_stopping=True`;
    5. a prompt closes when all its finished slots are full and no running hypothesis can
       still beat the worst finished score: the best running sum divided by
       `length ** length_penalty`, with `length` the tokens generated so far
       (`early_stopping=False`), or `max_new_tokens` when `early_stopping="never"` and
       `length_penalty > 0`;
    6. the loop ends when every prompt is closed, or (`early_stopping=True`) every prompt
       has `num_beams` finished hypotheses, or at `max_new_tokens`.

    The result of a prompt is its best finished hypothesis (ending with its stop token,
    if it has one), or its `num_return_sequences` best, best first (as transformers'
    `generate(num_beams=..., num_return_sequences=...)`). `length_penalty > 0` favours
    longer outputs, `< 0` shorter ones.

    Args:
        num_beams: hypotheses kept per prompt (>= 1).
        length_penalty: exponent of the length normalisation (transformers' default 1.0).
        early_stopping: False (default: stop when no running beam can improve, by the
            heuristic of step 5), True (stop as soon as `num_beams` hypotheses are finished)
            or "never" (the canonical bound with `max_new_tokens`).

    Example:
    >>> lm.generate(prompts, strategy="beam", num_beams=4, length_penalty=0.6)
    """

    def __init__(self, num_beams=DEFAULT_NUM_BEAMS, length_penalty=1.0, early_stopping=False):
        check_positive_int("num_beams", num_beams)
        _check_beam_args(length_penalty, early_stopping)
        self.num_beams = int(num_beams)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping

    @property
    def key(self):
        return (type(self).__name__, self.num_beams, self.length_penalty,
                str(self.early_stopping))

    def start(self, batch_size, max_new_tokens, stops, pad_token_id):
        self.stops = stops
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        k = self.num_beams
        # (distinct stop ids: a repeated one takes no candidate of its own)
        self.candidates = max(2, 1 + len(set(stops))) * k
        tokens = ops.full((batch_size, k, max_new_tokens), pad_token_id, "int32")
        first = ops.convert_to_tensor(np.array([0.0] + [_EXCLUDED] * (k - 1), "float32"))
        return {
            "running_tokens": tokens,
            "running_scores": ops.tile(first[None, :], (batch_size, 1)),
            "tokens": tokens,
            "scores": ops.full((batch_size, k), _EXCLUDED, "float32"),
            "lengths": ops.full((batch_size, k), max_new_tokens, "int32"),
            "finished": ops.zeros((batch_size, k), "bool"),
            "open": ops.ones((batch_size, 1), "bool"),
            "done": ops.zeros((), "bool"),
        }

    @staticmethod
    def _gather(x, index):
        """`x[b, index[b, j], ...]` for `x (batch, n, ...)` and `index (batch, m)`."""
        while len(index.shape) < len(x.shape):
            index = ops.expand_dims(index, -1)
        return ops.take_along_axis(x, ops.cast(index, "int32"), axis=1)

    def select(self, logits, carry, t):
        batch, k, n = self.batch_size, self.num_beams, self.max_new_tokens
        vocab = logits.shape[-1]
        # (at most every token of every beam: with a stop id for nearly every token, more
        # candidates than that were asked of each backend's top_k, which failed)
        n_candidates = min(self.candidates, k * vocab)
        length = ops.cast(t + 1, "float32")  # new tokens after this step
        # 1-2. Extend every running beam by every token; keep the best candidates.
        # (the processors see log-probabilities here, as transformers' beam search applies
        # them)
        log_probs = self.process(ops.log_softmax(logits, axis=-1), carry, t)
        log_probs = ops.reshape(log_probs, (batch, k, vocab))
        log_probs = log_probs + carry["running_scores"][:, :, None]
        top_scores, top_index = ops.top_k(
            ops.reshape(log_probs, (batch, k * vocab)), n_candidates
        )
        top_index = ops.cast(top_index, "int32")
        source_beam = top_index // vocab
        token = top_index % vocab
        candidates = _set_column(self._gather(carry["running_tokens"], source_beam), t, token)
        # 3. Hits: a stop token, or the last step.
        hits = ops.logical_or(_stop_hits(token, self.stops),
                              ops.equal(ops.cast(t, "int32"), n - 1))
        running_scores = top_scores + ops.cast(hits, "float32") * _EXCLUDED
        keep = ops.cast(ops.top_k(running_scores, k)[1], "int32")
        running_tokens = self._gather(candidates, keep)
        running_scores = self._gather(running_scores, keep)
        kept_source = self._gather(source_beam, keep)
        # 4. New finished hypotheses (only among the first num_beams candidates).
        first_k = ops.arange(n_candidates, dtype="int32")[None, :] < k
        just_finished = ops.logical_and(hits, first_k)
        scores = top_scores / ops.power(length, self.length_penalty)
        full = ops.all(carry["finished"], axis=-1, keepdims=True)
        if self.early_stopping is True:
            scores = scores + ops.cast(full, "float32") * _EXCLUDED
        scores = scores + ops.cast(ops.logical_not(carry["open"]), "float32") * _EXCLUDED
        scores = scores + ops.cast(ops.logical_not(just_finished), "float32") * _EXCLUDED
        merged_scores = ops.concatenate([carry["scores"], scores], axis=1)
        best = ops.cast(ops.top_k(merged_scores, k)[1], "int32")
        new_lengths = ops.full((batch, n_candidates), 1, "int32") * ops.cast(t + 1, "int32")
        finished_tokens = self._gather(ops.concatenate([carry["tokens"], candidates], 1), best)
        finished_scores = self._gather(merged_scores, best)
        lengths = self._gather(ops.concatenate([carry["lengths"], new_lengths], 1), best)
        finished = self._gather(ops.concatenate([carry["finished"], just_finished], 1), best)
        # 5. Can a running beam still beat the worst finished hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = ops.convert_to_tensor(float(n), "float32")
        else:
            best_length = length
        best_possible = running_scores[:, :1] / ops.power(best_length, self.length_penalty)
        worst = ops.where(finished, ops.min(finished_scores, axis=1, keepdims=True),
                          ops.full_like(finished_scores, _EXCLUDED))
        still_open = ops.logical_and(
            carry["open"], ops.any(best_possible > worst, axis=-1, keepdims=True)
        )
        # 6. The end of the whole search.
        done = ops.logical_or(ops.logical_not(ops.any(still_open)), ops.all(hits))
        if self.early_stopping is True:
            done = ops.logical_or(done, ops.all(finished))
        rows = ops.reshape(
            ops.arange(batch, dtype="int32")[:, None] * k + kept_source, (batch * k,)
        )
        new_carry = {
            "running_tokens": running_tokens,
            "running_scores": running_scores,
            "tokens": finished_tokens,
            "scores": finished_scores,
            "lengths": lengths,
            "finished": finished,
            "open": still_open,
            "done": done,
        }
        return self.track(carry, new_carry, rows, t), rows

    def last_tokens(self, carry, t):
        return ops.reshape(_column(carry["running_tokens"], t), (-1,))

    def done(self, carry):
        return carry["done"]

    def can_end_early(self):
        return True

    @property
    def rows_per_prompt(self):
        return self.num_beams

    def result(self, carry):
        # (the finished hypotheses are kept sorted by score, best first)
        n = self.num_return_sequences
        if n == 1:
            return carry["tokens"][:, 0], carry["lengths"][:, 0]
        return (ops.reshape(carry["tokens"][:, :n], (-1, self.max_new_tokens)),
                ops.reshape(carry["lengths"][:, :n], (-1,)))

    def scores(self, carry):
        """float32 `(rows,)`: the score of each returned hypothesis, `sum of its
        log-probabilities / length ** length_penalty` (transformers' `sequences_scores`)."""
        return ops.reshape(carry["scores"][:, :self.num_return_sequences], (-1,))


def make_sampler(strategy="greedy", temperature=1.0, top_k=None, top_p=None, num_beams=None,
                 length_penalty=1.0, early_stopping=False, repetition_penalty=1.0,
                 no_repeat_ngram_size=0, min_new_tokens=0, num_return_sequences=1):
    """The sampler for `generate`'s arguments.

    `strategy="beam"`, or `num_beams > 1` with `strategy="greedy"`, is beam search
    (`num_beams` defaults to 4 there); `strategy="sample"` takes no `num_beams > 1`.
    Temperature, top-k and top-p only apply to sampling. `repetition_penalty`,
    `no_repeat_ngram_size` and `min_new_tokens` (see `LogitsProcessors`) apply to every
    strategy; the sampler gets `processors` only when one of them is on.

    `num_return_sequences` (transformers' name and meaning): outputs per prompt, grouped
    prompt by prompt; sampling draws that many per prompt, beam search returns that many
    of its best finished hypotheses (at most `num_beams`); greedy decoding takes only 1.

    Example:
    >>> make_sampler("beam", num_beams=3)
    >>> make_sampler("beam", num_beams=4, num_return_sequences=2)
    """
    check_sampling_args(strategy, temperature, top_k, top_p)
    check_processor_args(repetition_penalty, no_repeat_ngram_size, min_new_tokens)
    if num_beams is not None:
        check_positive_int("num_beams", num_beams)
    if (isinstance(num_return_sequences, bool)
            or not isinstance(num_return_sequences, (int, np.integer))
            or num_return_sequences < 1):
        raise ValueError(
            "`num_return_sequences` must be a positive int (outputs per prompt); got "
            f"num_return_sequences={num_return_sequences!r}.")
    num_return_sequences = int(num_return_sequences)
    # (checked for every strategy: a NaN length_penalty passed with sampling or greedy
    # decoding was ignored in silence)
    _check_beam_args(length_penalty, early_stopping)
    ignored = {name: value for name, value, default in (
        ("temperature", temperature, 1.0), ("top_k", top_k, None), ("top_p", top_p, None))
        if value != default}
    if strategy != "sample" and ignored:
        # (they were ignored in silence; transformers warns the same way)
        warnings.warn(
            f"{', '.join(f'{k}={v!r}' for k, v in ignored.items())}: temperature, top_k and "
            f"top_p apply only to strategy='sample'; strategy={strategy!r} ignores them.",
            UserWarning, stacklevel=3)
    if strategy == "sample":
        if num_beams not in (None, 1):
            raise ValueError(
                "`num_beams` must be 1 (or None) with strategy='sample' (beam sampling is not "
                f"supported); got num_beams={num_beams!r}."
            )
        sampler = RandomSampler(temperature, top_k, top_p)
    elif strategy == "beam" or (num_beams is not None and num_beams > 1):
        sampler = BeamSampler(
            DEFAULT_NUM_BEAMS if num_beams is None else num_beams, length_penalty,
            early_stopping,
        )
    else:
        sampler = GreedySampler()
    if num_return_sequences > 1 and isinstance(sampler, GreedySampler):
        raise ValueError(
            f"`num_return_sequences` must be 1 with greedy decoding (every output of a prompt "
            f"would be the same); got num_return_sequences={num_return_sequences}. Use "
            "strategy='sample', or beam search with num_beams >= num_return_sequences.")
    if isinstance(sampler, BeamSampler) and num_return_sequences > sampler.num_beams:
        raise ValueError(
            f"`num_return_sequences` must be at most num_beams={sampler.num_beams} with beam "
            f"search (it returns the best finished hypotheses); got num_return_sequences="
            f"{num_return_sequences}.")
    sampler.num_return_sequences = num_return_sequences
    processors = LogitsProcessors(repetition_penalty, no_repeat_ngram_size, min_new_tokens)
    if processors.active:
        sampler.processors = processors
    return sampler


# === The loop ===


def _map(fn, tree):
    return keras.tree.map_structure(fn, tree)


def _loop_body(model, sampler, max_new_tokens):
    """`(start, step)`: the prefill + first selection, and one decoding step."""
    beams = sampler.rows_per_prompt

    def start(inputs, carry):
        logits, state, constants = model.generation_prefill(inputs, max_new_tokens)
        if beams > 1:  # every prompt's row repeated for each beam (or sample): b * beams + k
            logits = ops.repeat(logits, beams, axis=0)
            # (a gather, which copies: Keras' torch `repeat` of a batch of one is a view
            # whose rows share memory, and the steps write the caches in place)
            copies = np.repeat(np.arange(logits.shape[0] // beams, dtype="int32"), beams)
            state = _map(lambda x: ops.take(x, copies, axis=0), state)
            constants = _map(lambda x: ops.repeat(x, beams, axis=0), constants)
        carry, rows = sampler.select(ops.cast(logits, "float32"), carry, 0)
        if rows is not None:
            state = _map(lambda x: ops.take(x, rows, axis=0), state)
        return carry, state, constants

    def step(t, carry, state, constants):
        tokens = ops.expand_dims(sampler.last_tokens(carry, t - 1), 1)
        logits, state = model.generation_step(tokens, state, constants, t - 1)
        carry, rows = sampler.select(ops.cast(logits, "float32"), carry, t)
        if rows is not None:
            state = _map(lambda x: ops.take(x, rows, axis=0), state)
        return carry, state

    return start, step


def _python_loop(model, sampler, max_new_tokens, inputs, carry, check_every, graphs=False,
                 compiled=False):
    """The loop in Python (PyTorch, and every backend with `compile=False`). `graphs`: the
    model's steps replay one CUDA graph (`_graphed_step`) where it can be captured;
    `compiled`: else one `torch.compile`d step where the model has one
    (`kzoo.layers.compiled_decode`)."""
    start, step = _loop_body(model, sampler, max_new_tokens)
    carry, state, constants = start(inputs, carry)
    early = sampler.can_end_early()
    model_step = None
    if graphs and max_new_tokens > 1:
        model_step = _graphed_step(model, sampler, carry, state, constants)
    if model_step is None and compiled and max_new_tokens > 1:
        from kzoo.layers import compiled_decode

        model_step = compiled_decode.model_step(model, state, constants)
    for t in range(1, max_new_tokens):
        if early and (t - 1) % check_every == 0 and bool(
            ops.convert_to_numpy(sampler.done(carry))
        ):
            break
        logits = None if model_step is None else model_step(sampler.last_tokens(carry, t - 1),
                                                            t - 1)
        if logits is None:  # (eager, or a compiled step that could not compile: eager)
            model_step = None
            carry, state = step(t, carry, state, constants)
            continue
        carry, rows = sampler.select(logits, carry, t)
        if rows is not None:  # (beam search) the graph reads these tensors: reorder in place
            for x in keras.tree.flatten(state):
                x.copy_(x.index_select(0, rows.long()))
    return carry


# === CUDA graphs (PyTorch on CUDA) ===

# Set `KZOO_CUDA_GRAPHS=0` to decode without them.
GRAPHS_ENV = "KZOO_CUDA_GRAPHS"


class NotStatic(Exception):
    """The model's step returned other state tensors than it was given (no graph then)."""


class StepGraph:
    """A model step `run() -> (float32 logits, state)` captured once as a CUDA graph and
    replayed at each step: the step's few hundred kernels are launched by one call, not one
    by one from Python (a decode step on a GPU is bound by those launches).

    `run` reads its inputs from tensors the loop overwrites before each `replay()` (the new
    tokens, the step index) and writes the key/value caches in place, so a replay is exactly
    the step it was captured from with the new inputs. It is run twice first on a side
    stream (PyTorch's rule before a capture); both runs compute the loop's first step, which
    writes the same keys/values as the replay of that step will. If the state that comes
    back is not the very tensors passed in (a model that copies its caches), `NotStatic`.
    """

    def __init__(self, run, state):
        _, new_state = self._warm_up(run)
        if not _same_tensors(new_state, state):
            raise NotStatic()
        self.logits = self._capture(run)

    def _warm_up(self, run):
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                out = run()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, run):
        import torch

        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            logits, _ = run()
        return logits

    def replay(self):
        """Run the captured step again; the logits tensor is the same object every time."""
        self.graph.replay()
        return self.logits


# The class `_graphed_step` captures with (tests on a CPU put a stand-in here).
GRAPH_CLASS = StepGraph


def _same_tensors(a, b):
    a, b = keras.tree.flatten(a), keras.tree.flatten(b)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _on_cuda(tensors):
    import torch

    return all(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in tensors)


def _cuda_available():
    import torch

    return torch.cuda.is_available()


def graphs_apply():
    """Whether the PyTorch decode loop tries CUDA graphs: CUDA present, the fast decode path
    on (`kzoo.layers.fast_decode.enabled`: no attention tap, `KZOO_FAST_DECODE` not "0") and
    `KZOO_CUDA_GRAPHS` not "0". Asked inside the loop's `fast_steps()` block."""
    import os

    from kzoo.layers import fast_decode

    return (os.environ.get(GRAPHS_ENV, "1") != "0" and fast_decode.enabled()
            and _cuda_available())


def _graphed_step(model, sampler, carry, state, constants):
    """`step(last_tokens, index) -> logits`: the model's step as a replayed graph, or None
    where none can be made (state not all on CUDA, a model that copies its state, or a
    capture that fails: then a warning, and the loop steps eagerly)."""
    import warnings

    import torch

    tensors = keras.tree.flatten(state)
    if not tensors or not _on_cuda(tensors):
        return None
    first = sampler.last_tokens(carry, 0)
    tokens = first.to(torch.int32).reshape(-1, 1).clone()
    index = torch.zeros((), dtype=torch.int32, device=first.device)

    def run():
        logits, new_state = model.generation_step(tokens, state, constants, index)
        return ops.cast(logits, "float32"), new_state

    try:
        graph = GRAPH_CLASS(run, state)
    except NotStatic:
        return None
    except Exception as error:  # an op that cannot be captured: the eager loop still works
        warnings.warn(f"kzoo decode: no CUDA graph for {type(model).__name__}'s step "
                      f"({type(error).__name__}: {error}); decoding without one "
                      f"(set {GRAPHS_ENV}=0 to skip the attempt).", stacklevel=3)
        return None

    def step(last_tokens, t):
        tokens.copy_(last_tokens.reshape(tokens.shape))
        index.fill_(t)
        return graph.replay()

    return step


def _compiled_loop(model, sampler, max_new_tokens, inputs, carry):
    """The loop as one `while_loop` (JAX / TensorFlow), to be traced inside jit/tf.function.
    Values the steps derive from the weights alone are made once before the loop
    (`fast_decode.loop_constant`)."""
    from kzoo.layers import fast_decode

    with fast_decode.compiled_loop():
        return _traced_loop(model, sampler, max_new_tokens, inputs, carry)


def _traced_loop(model, sampler, max_new_tokens, inputs, carry):
    from kzoo.layers import fast_decode

    start, step = _loop_body(model, sampler, max_new_tokens)
    carry, state, constants = start(inputs, carry)
    early = sampler.can_end_early()

    def cond(t, carry, state):
        more = t < max_new_tokens
        if early:
            more = ops.logical_and(more, ops.logical_not(sampler.done(carry)))
        return more

    def body(t, carry, state):
        with fast_decode.loop_body():
            carry, state = step(t, carry, state, constants)
        return t + 1, carry, state

    t = ops.convert_to_tensor(1, "int32")
    if keras.backend.backend() == "jax":
        import jax

        _, carry, _ = jax.lax.while_loop(lambda v: cond(*v), lambda v: body(*v),
                                         (t, carry, state))
    else:
        import tensorflow as tf

        _, carry, _ = tf.while_loop(cond, body, (t, carry, state))
    return carry


def _cache_for(model):
    """The model's compiled loops, emptied when its variables are no longer those they were
    traced with: `enable_lora`, `merge_lora`, `quantize` (or Keras' own on a layer) change
    the layers' variables and calls, and a trace made before kept the old computation
    (JAX and TensorFlow: a GPT that had generated once then ignored the adapters that
    `enable_lora` added, and its int8 kernels after `quantize`: other tokens than
    `compile=False`), and when the active taps are not those the loops were traced under
    (`kzoo.layers.taps.same_taps`: a loop traced before a tap that alters the pass, such as a
    `Tap` subclass scaling heads, ignored it; one traced inside kept its effect after it)."""
    from kzoo.layers.taps import same_taps, tap_stamp

    variables = model.variables
    cache = model.__dict__.get("_generation_fns")
    traced = model.__dict__.get("_generation_variables", ())
    if cache is None or len(traced) != len(variables) or any(
            a is not b for a, b in zip(traced, variables)) or not same_taps(
            model.__dict__.get("_generation_taps", ())):
        cache = {}
        object.__setattr__(model, "_generation_fns", cache)
        object.__setattr__(model, "_generation_variables", list(variables))
        object.__setattr__(model, "_generation_taps", tap_stamp())
    if len(cache) > 32:  # many different settings: start afresh rather than grow forever
        cache.clear()
    return cache


def _compiled_function(model, sampler, max_new_tokens, stops, pad_token_id):
    """`run(inputs, seed, history) -> (tokens, lengths, seed, scores)`, compiled whole,
    cached on the model (`history`: the logits processors', or None; `scores`: None unless
    `sampler.return_scores`)."""
    backend = keras.backend.backend()
    processors = None if sampler.processors is None else sampler.processors.key
    key = (backend, sampler.key, sampler.num_return_sequences, max_new_tokens, stops,
           pad_token_id, processors, sampler.return_scores)
    cache = _cache_for(model)
    if key in cache:
        return cache[key]

    def run(inputs, seed, history=None):
        batch = next(iter(inputs.values())).shape[0]  # static: one trace per shape
        carry = sampler.start(batch, max_new_tokens, stops, pad_token_id)
        if sampler.processors is not None:
            carry = sampler.processors.start(carry, history, max_new_tokens, stops)
        if sampler.uses_seed:
            carry = sampler.start_seed(carry, seed)
        carry = _compiled_loop(model, sampler, max_new_tokens, inputs, carry)
        tokens, lengths = sampler.result(carry)
        scores = sampler.scores(carry) if sampler.return_scores else None
        return tokens, lengths, carry.get("seed", seed), scores

    if backend == "jax":
        import jax

        variables = list(model.variables)

        @jax.jit
        def stateless_run(values, inputs, seed, history):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return run(inputs, seed, history)

        def compiled(inputs, seed, history=None):
            return stateless_run([v.value for v in variables], inputs, seed, history)

    elif backend == "tensorflow":
        import tensorflow as tf

        # XLA draws other random numbers than TensorFlow's own kernels: sampling stays
        # off XLA so that a seed gives the same tokens compiled or not.
        compiled = tf.function(run, jit_compile=not sampler.uses_seed)
    else:
        raise ValueError(f"No compiled decode loop for backend {backend!r}.")
    cache[key] = compiled
    return compiled


def check_return_scores(return_scores):
    """`return_scores` (True or False), or a ValueError naming it."""
    if not isinstance(return_scores, bool):
        raise ValueError(
            f"`return_scores` must be True or False; got return_scores={return_scores!r}.")
    return return_scores


def decode(model, inputs, *, sampler, max_new_tokens, stop_token_ids=None, pad_token_id=0,
           seed=None, compile=True, history=None, return_scores=False):
    """Run the decode loop of `model` (see the module docstring for its interface).

    Args:
        model: a model with `generation_prefill` and `generation_step`.
        inputs: dict of NumPy arrays / tensors with the batch first, passed to
            `generation_prefill` (each model documents its own).
        sampler: a `Sampler` (see `make_sampler`).
        max_new_tokens: the most tokens added to each prompt.
        stop_token_ids: None, an int or a sequence of ints ending a row.
        pad_token_id: what finished rows emit (never part of a result).
        seed: int, `keras.random.SeedGenerator` or None (sampling only; a generator is
            advanced once per call).
        compile: compile the whole loop (JAX / TensorFlow; PyTorch always runs eagerly).
        history: what the sampler's logits processors count as each prompt's tokens so far
            (`history_rows`: int `(batch, length)`, -1 = no token; repeated here for the
            beams); needed when `sampler.processors` use a history (repetition penalty,
            n-gram ban), else ignored.
        return_scores: also return scores (see Returns). Off (the default), the loop
            neither computes nor carries them.

    Returns:
        A list, one per prompt (`sampler.num_return_sequences` per prompt, prompt by
        prompt), of the new token ids (Python ints), ending with the stop token if one was
        produced. With `return_scores=True`, `(that list, scores)`, `scores` a list of the
        same length: greedy and sampling, for each output a list of floats, one per new
        token, the log-probability of the chosen token under the distribution it was chosen
        from (the log-softmax of the processed logits, after the logits processors and
        temperature / top-k / top-p: transformers' `compute_transition_scores(...,
        normalize_logits=True)`); beam search, for each output one float, its final score
        (transformers' `sequences_scores`).

    Example:
    >>> decode(lm, inputs, sampler=GreedySampler(), max_new_tokens=8, stop_token_ids=[2])
    """
    check_positive_int("max_new_tokens", max_new_tokens)
    stops = stop_ids(stop_token_ids)
    sampler.return_scores = check_return_scores(return_scores)
    if not isinstance(compile, bool):
        raise ValueError(f"`compile` must be True or False; got compile={compile!r}.")
    if seed is not None and not isinstance(seed, keras.random.SeedGenerator) and (
            isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < 2 ** 32):
        raise ValueError(
            "`seed` must be None, an int in [0, 2**32) or a `keras.random.SeedGenerator`; "
            f"got seed={seed!r}."
        )
    backend = keras.backend.backend()
    inputs = {name: ops.convert_to_tensor(value) for name, value in inputs.items()}
    batch = int(next(iter(inputs.values())).shape[0])
    if sampler.processors is not None:
        history = _check_history(history, batch, sampler)
    else:
        history = None
    seed_value = generator = None
    if sampler.uses_seed:
        generator = (seed if isinstance(seed, keras.random.SeedGenerator)
                     else keras.random.SeedGenerator(None if seed is None else int(seed)))
        seed_value = generator.state.value
        RandomSampler.seed_variable()
    if compile and backend in ("jax", "tensorflow"):
        run = _compiled_function(model, sampler, max_new_tokens, stops, pad_token_id)
        tokens, lengths, seed_out, scores = run(inputs, seed_value, history)
    else:
        carry = sampler.start(batch, max_new_tokens, stops, pad_token_id)
        if sampler.processors is not None:
            carry = sampler.processors.start(carry, history, max_new_tokens, stops)
        if sampler.uses_seed:
            carry = sampler.start_seed(carry, seed_value)
        check_every = TORCH_DONE_CHECK_EVERY if compile else 1
        if backend == "torch":
            import torch

            from kzoo.layers import fast_decode

            with torch.no_grad(), fast_decode.fast_steps():
                carry = _python_loop(model, sampler, max_new_tokens, inputs, carry,
                                     check_every, graphs=compile and graphs_apply(),
                                     compiled=compile and fast_decode.enabled())
        else:
            carry = _python_loop(model, sampler, max_new_tokens, inputs, carry, check_every)
        tokens, lengths = sampler.result(carry)
        scores = sampler.scores(carry) if return_scores else None
        seed_out = carry.get("seed")
    if generator is not None:
        # The stream advanced inside the loop (torch: by one per call).
        if seed_out is None:
            seed_out = ops.convert_to_numpy(seed_value) + np.array([0, 1])
        generator.state.assign(ops.cast(seed_out, generator.state.dtype))
    tokens = np.asarray(ops.convert_to_numpy(tokens))
    lengths = np.asarray(ops.convert_to_numpy(lengths))
    outputs = [tokens[b, : int(lengths[b])].tolist() for b in range(tokens.shape[0])]
    if not return_scores:
        return outputs
    scores = np.asarray(ops.convert_to_numpy(scores), "float64")
    if scores.ndim == 1:  # (beam search: one score an output)
        return outputs, scores.tolist()
    return outputs, [scores[b, : int(lengths[b])].tolist() for b in range(scores.shape[0])]


def _check_history(history, batch, sampler):
    """`decode`'s `history` as an int32 tensor `(batch * rows_per_prompt, length)`, or a
    ValueError naming it."""
    if not sampler.processors.uses_history:
        return None
    if history is None:
        raise ValueError(
            "`history` is needed with repetition_penalty / no_repeat_ngram_size: give each "
            "prompt's tokens so far (`history_rows(token_ids, mask)`).")
    history = np.asarray(ops.convert_to_numpy(history))
    if history.ndim != 2 or history.shape[0] != batch or history.shape[1] < 1 or \
            not np.issubdtype(history.dtype, np.integer):
        raise ValueError(
            f"`history` must be an int array (batch={batch}, length >= 1); got shape "
            f"{history.shape} and dtype {history.dtype}.")
    return ops.convert_to_tensor(np.repeat(history.astype("int32"), sampler.rows_per_prompt,
                                           0))


__all__ = [
    "STRATEGIES",
    "EARLY_STOPPING",
    "Sampler",
    "GreedySampler",
    "RandomSampler",
    "BeamSampler",
    "make_sampler",
    "LogitsProcessors",
    "check_processor_args",
    "repetition_penalty",
    "no_repeat_ngram",
    "min_new_tokens_mask",
    "history_rows",
    "decode",
    "filter_logits",
    "select_next_token",
    "update_finished",
    "mask_finished",
    "check_sampling_args",
    "check_token_ids",
    "check_cache_size",
    "check_return_scores",
    "integer_array",
    "integer_rows",
    "prompt_dict",
    "prompt_rows",
    "stop_ids",
]
