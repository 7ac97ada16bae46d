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

The data sets, tokenizers and BERT masking come from `kzoo.data`; what is here adapts
them to the recipes: a common text-tokenizer interface (special ids, `save` next to the
model), the model-specific batch layouts (GPT, BERT, T5), the word vocabulary of
`t5_numbers` and the image augmentation of `vit_digits`.
"""

import os

import numpy as np

import kzoo.data


class UsageError(ValueError):
    """A flag value that only the loaded data or model can refuse (`--batch-size` larger
    than the training set, a `--lora-rank` larger than the kernels): the CLI prints it
    without a traceback."""

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
        transform: optional `transform(x_batch, y_batch, w_batch, rng) -> (x, y,
            sample_weight)` applied to training batches after `augment` (e.g. BERT's
            masking of packed rows, drawn anew at every step).

    Example:
    >>> task = ArrayTask((x, y, None), batch_size=32, seed=0)
    >>> xb, yb, wb = task.train_batch(17)   # the same arrays in every run with seed 0
    """

    def __init__(self, train, batch_size, seed, validation=None, test=None, augment=None,
                 transform=None):
        super().__init__()
        self.train = train
        self.num_examples = _length(train[0])
        if batch_size > self.num_examples:
            raise UsageError(
                f"--batch-size={batch_size} is larger than the training set "
                f"({self.num_examples} examples)."
            )
        self.batch_size = int(batch_size)
        self.steps_per_epoch = self.num_examples // self.batch_size
        self.seed = int(seed)
        self.validation = validation
        self.test = test
        self.augment = augment
        self.transform = transform
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
        if self.transform is not None:
            x, y, w = self.transform(x, y, w, step_rng(self.seed, 5, step))
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


# === Text tokenizers ===


class ByteTokenizer(kzoo.data.ByteTokenizer):
    """`kzoo.data.ByteTokenizer` (ids 0-255 bytes, 256 `[EOS]`/`[SEP]`, 257 `[PAD]`, 258
    `[BOS]`/`[CLS]`, 259 `[MASK]`) with what a run needs: `kind`, `save` and a `decode`
    that drops ids outside the vocabulary (a model with a larger one may sample them)."""

    kind = "byte"

    def decode(self, ids):
        ids = np.asarray(ids, np.int64).reshape(-1)
        return super().decode(ids[(ids >= 0) & (ids < self.vocabulary_size)])

    def save(self, directory):
        path = os.path.join(directory, "tokenizer.txt")
        _atomic_write_text(path, "byte-level: ids 0-255 = UTF-8 bytes; 256 [EOS], 257 [PAD], "
                                 "258 [BOS]/[CLS], 259 [MASK]\n")
        return path


class BPETokenizer:
    """A byte-level BPE trained on the training text with `kzoo.data.train_bpe_tokenizer`.

    Special tokens take ids 0-3: `[PAD]`, `[BOS]`, `[EOS]`, `[MASK]`. Every pair that
    occurs is a merge candidate (`min_frequency=1`), until `vocabulary_size` is reached.
    """

    kind = "bpe"
    SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[MASK]")

    def __init__(self, text, vocabulary_size=1024):
        try:
            import tokenizers  # noqa: F401
        except ImportError:  # pragma: no cover - tokenizers is in kzoo[hf]
            raise ValueError("--tokenizer=bpe needs the `tokenizers` package "
                             "(pip install 'kzoo[hf]').") from None
        self.tokenizer = kzoo.data.train_bpe_tokenizer(
            text, int(vocabulary_size), special_tokens=self.SPECIAL_TOKENS, min_frequency=1)
        self.special_ids = tuple(self.tokenizer.token_to_id(t) for t in self.SPECIAL_TOKENS)
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = self.special_ids

    @property
    def vocabulary_size(self):
        return self.tokenizer.get_vocab_size()

    def encode(self, text):
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in self.special_ids])

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


def masked_lm_batch(windows, rng, tokenizer, rate=0.15):
    """BERT inputs/targets from `(batch, seq)` windows: `[CLS]` + the first `seq - 2`
    tokens + `[SEP]`, corrupted by `kzoo.data.mask_tokens` (`rate` of the text tokens
    picked, 80% `[MASK]`, 10% random, 10% kept; every row predicts at least one token).
    Targets are the original ids; the sample weight is 1 on the picked positions only.
    """
    windows = np.asarray(windows, dtype=np.int32)
    body = windows[:, : windows.shape[1] - 2]
    ids = np.concatenate(
        [np.full((len(body), 1), tokenizer.bos_id, np.int32), body,
         np.full((len(body), 1), tokenizer.eos_id, np.int32)], axis=1)
    inputs, labels, weights = kzoo.data.mask_tokens(
        ids, tokenizer.mask_id, tokenizer.vocabulary_size, rate=rate, rng=rng,
        special_ids=tokenizer.special_ids, at_least_one=True)
    x = {
        "token_ids": inputs,
        "segment_ids": np.zeros_like(inputs),
        "padding_mask": np.ones_like(inputs),
    }
    return x, labels, weights


# === Whole documents: one a row (padded) or packed several a row ===


def document_lm_batch(rows, packed):
    """GPT `(x, y, sample_weight)` of document rows (`kzoo.data.pack`'s dict): the next
    token of the same document is the target, the last token of each document and padding
    weigh 0 (`kzoo.data.next_token_targets`). `x` keeps `document_ids` only when `packed`
    (a model with `packed_inputs=True`); one document a row needs the padding mask only."""
    x, y, w = kzoo.data.next_token_targets(rows)
    if not packed:
        x = {k: v for k, v in x.items() if k != "document_ids"}
    return x, y, w


def bert_documents(documents, seq_len, tokenizer):
    """BERT examples of documents: `[CLS] + piece + [SEP]` for each piece of at most
    `seq_len - 2` tokens of each document."""
    body = seq_len - 2
    out = []
    for doc in documents:
        for start in range(0, len(doc), body):
            piece = np.asarray(doc[start:start + body], np.int32)
            out.append(np.concatenate([[tokenizer.bos_id], piece, [tokenizer.eos_id]])
                       .astype(np.int32))
    return out


def document_masked_lm_batch(rows, rng, tokenizer, packed, rate=0.15):
    """BERT inputs/targets of document rows (`kzoo.data.pack`'s dict of `bert_documents`):
    the text tokens masked by `kzoo.data.mask_tokens` as in `masked_lm_batch` (padding and
    the special tokens never picked); `document_ids` kept only when `packed`."""
    token_ids = np.asarray(rows["token_ids"], np.int32)
    inputs, labels, weights = kzoo.data.mask_tokens(
        token_ids, tokenizer.mask_id, tokenizer.vocabulary_size, rate=rate, rng=rng,
        special_ids=tokenizer.special_ids, at_least_one=True)
    x = {"token_ids": inputs, "segment_ids": np.zeros_like(inputs),
         "padding_mask": np.asarray(rows["padding_mask"], np.int32)}
    if packed:
        x["document_ids"] = np.asarray(rows["document_ids"], np.int32)
    return x, labels, weights


# === Number words (English -> French) ===


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
