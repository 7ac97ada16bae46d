"""Number words, English -> French, as a small sequence-to-sequence task (`num2words`).

`load_number_pairs` gives pairs such as `("twenty-one", "vingt et un")` with train and
test numbers drawn from disjoint sets of integers, so a model is evaluated on numbers
it never saw. `CharTokenizer` turns the strings into padded int32 arrays.
"""

import numpy as np

__all__ = ["number_words", "load_number_pairs", "CharTokenizer"]

_LANGS = ("en", "fr")


def number_words(number, lang="en"):
    """Write `number` in words with `num2words` (e.g. `80, "fr"` -> `"quatre-vingts"`).

    Args:
        number: non-negative int.
        lang: any language code `num2words` knows (e.g. `"en"`, `"fr"`, `"de"`).

    Returns:
        A `str`.

    Example:

    ```python
    kzoo.data.number_words(21, "fr")  # "vingt et un"
    ```
    """
    if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number < 0:
        raise ValueError(f"`number` must be a non-negative integer; got number={number!r}.")
    from num2words import CONVERTER_CLASSES
    from num2words import num2words

    if lang not in CONVERTER_CLASSES:
        raise ValueError(
            f"`lang` must be a language of num2words, e.g. {list(_LANGS)}; got lang={lang!r}."
        )
    return num2words(int(number), lang=lang)


def load_number_pairs(
    num_train,
    num_test,
    max_number=9999,
    seed=0,
    source_lang="en",
    target_lang="fr",
    return_numbers=False,
):
    """Pairs `(source words, target words)` of random integers, train and test disjoint.

    `num_train + num_test` distinct integers are drawn without replacement from
    `0..max_number` (inclusive) with `numpy.random.default_rng(seed)`; the first
    `num_train` form the training set and the rest the test set, so no test number (and
    hence no test sentence) is ever seen in training.

    Args:
        num_train: positive int, number of training pairs.
        num_test: positive int, number of test pairs.
        max_number: positive int, the largest number that may be drawn. Defaults to 9999.
        seed: int, the seed of the draw (same seed, same pairs).
        source_lang, target_lang: `num2words` language codes; English -> French by default.
        return_numbers: also return the integers (int64 arrays, in pair order).

    Returns:
        `(train_pairs, test_pairs)` lists of `(source, target)` strings, or
        `(train_pairs, test_pairs, train_numbers, test_numbers)` with `return_numbers`.

    Example:

    ```python
    train, test = kzoo.data.load_number_pairs(2000, 200, max_number=9999, seed=0)
    train[0]  # e.g. ("four thousand, one hundred and seven", "quatre mille cent sept")
    ```
    """
    for name, value in (("num_train", num_train), ("num_test", num_test),
                        ("max_number", max_number)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer; got {name}={value!r}.")
    if num_train + num_test > max_number + 1:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} distinct numbers cannot be drawn "
            f"from 0..max_number={max_number}; lower them or raise max_number."
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be a non-negative integer; got seed={seed!r}.")
    numbers = np.random.default_rng(int(seed)).choice(
        int(max_number) + 1, size=int(num_train + num_test), replace=False
    ).astype(np.int64)
    train_numbers, test_numbers = numbers[:num_train], numbers[num_train:]

    def pairs(values):
        return [
            (number_words(int(n), source_lang), number_words(int(n), target_lang))
            for n in values
        ]

    train, test = pairs(train_numbers), pairs(test_numbers)
    if return_numbers:
        return train, test, train_numbers, test_numbers
    return train, test


class CharTokenizer:
    """A character-level vocabulary with padding, begin, end and unknown tokens.

    Ids: `pad_id = 0`, `bos_id = 1`, `eos_id = 2`, `unk_id = 3`, then the characters in
    sorted order from id 4. A character outside the vocabulary raises `ValueError` with
    `unknown="error"` (the default) or becomes `unk_id` with `unknown="unk"`.

    Args:
        characters: the characters of the vocabulary (a string or an iterable of
            one-character strings; duplicates are merged).
        unknown: `"error"` or `"unk"`, what `encode` does with an unknown character.

    Example:

    ```python
    train, test = kzoo.data.load_number_pairs(1000, 100)
    tok = kzoo.data.CharTokenizer.from_texts([s for pair in train for s in pair])
    ids, mask = tok.batch_encode([fr for _, fr in train], max_len=64, add_eos=True)
    tok.decode(ids[0])  # the first French string
    ```
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3
    num_special = 4
    special_ids = (0, 1, 2, 3)

    def __init__(self, characters, unknown="error"):
        if isinstance(characters, str):
            characters = list(characters)
        if not hasattr(characters, "__iter__"):  # (was "'int' object is not iterable")
            raise ValueError(
                "`characters` must be a non-empty string or iterable of one-character "
                f"strings; got characters={characters!r}."
            )
        characters = list(characters)
        bad = [c for c in characters if not (isinstance(c, str) and len(c) == 1)]
        if bad or not characters:
            raise ValueError(
                "`characters` must be a non-empty string or iterable of one-character "
                f"strings; got invalid entries {bad[:5]!r}."
            )
        if unknown not in ("error", "unk"):
            raise ValueError(f"`unknown` must be one of ['error', 'unk']; got unknown={unknown!r}.")
        self.characters = "".join(sorted(set(characters)))
        self.unknown = unknown
        self._ids = {c: i + self.num_special for i, c in enumerate(self.characters)}

    @classmethod
    def from_texts(cls, texts, unknown="error"):
        """Build the vocabulary from the union of the characters of `texts`."""
        characters = set()
        for text in texts:
            if not isinstance(text, str):
                raise ValueError(f"`texts` must hold strings; got {type(text).__name__}.")
            characters.update(text)
        return cls(sorted(characters), unknown=unknown)

    @property
    def vocabulary_size(self):
        return self.num_special + len(self.characters)

    def get_config(self):
        return {"characters": self.characters, "unknown": self.unknown}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def encode(self, text, add_bos=False, add_eos=False):
        """`str` -> `list[int]`, optionally wrapped in `bos_id` / `eos_id`."""
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a str; got {type(text).__name__}.")
        ids = []
        for char in text:
            index = self._ids.get(char)
            if index is None:
                if self.unknown == "error":
                    raise ValueError(
                        f"Character {char!r} of text {text!r} is not in the vocabulary; build "
                        "the tokenizer from all texts or pass unknown='unk'."
                    )
                index = self.unk_id
            ids.append(index)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids):
        """Ids -> `str`: stops at the first `eos_id`, drops pad and bos, unk -> U+FFFD."""
        # (text failed in a comparison with a TypeError; float ids were "outside" the
        # vocabulary; booleans were read as the ids 0 and 1)
        array = np.asarray(ids)
        if isinstance(ids, (str, bytes)) or (array.size and (
                array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer))):
            raise ValueError(
                f"`ids` must be integer token ids in [0, {self.vocabulary_size}); got "
                + (f"a {type(ids).__name__}, {ids[:40]!r} (`encode` turns text into ids)."
                   if isinstance(ids, (str, bytes)) else f"an array of dtype {array.dtype}.")
            )
        out = []
        for i in array.reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if i == self.unk_id:
                out.append("\ufffd")
            elif self.num_special <= i < self.vocabulary_size:
                out.append(self.characters[i - self.num_special])
            else:
                raise ValueError(f"Id {i} is outside [0, {self.vocabulary_size}).")
        return "".join(out)

    def batch_encode(self, texts, max_len, add_bos=False, add_eos=False, truncate=False):
        """Encode and right-pad many texts.

        Args:
            texts: sequence of `str`.
            max_len: positive int, the length of every row.
            add_bos, add_eos: wrap each text in `bos_id` / `eos_id`.
            truncate: cut longer texts so that each row fits `max_len`, keeping the
                `bos_id` / `eos_id` asked for (the text is cut, as keras-hub's
                `StartEndPacker` and Hugging Face tokenizers truncate); default: raise
                ValueError.

        Returns:
            `(ids, padding_mask)`: int32 `(len(texts), max_len)` ids padded with `pad_id`,
            and a bool array that is True on real tokens and False on padding.
        """
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
            raise ValueError(f"`max_len` must be a positive integer; got max_len={max_len!r}.")
        if isinstance(texts, str):  # (was encoded as one text a character, in silence)
            raise ValueError(
                f"`texts` must be a sequence of strings; got the string {texts[:40]!r} (use "
                "`encode` for one text, or pass [text])."
            )
        texts = list(texts)
        ids = np.full((len(texts), max_len), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(texts), max_len), dtype=bool)
        for row, text in enumerate(texts):
            encoded = self.encode(text, add_bos=add_bos, add_eos=add_eos)
            if len(encoded) > max_len:
                if not truncate:
                    raise ValueError(
                        f"Text {row} encodes to {len(encoded)} ids, more than max_len={max_len}; "
                        "raise max_len or pass truncate=True."
                    )
                # Cut the text, not the end token (it was cut off with the text's tail).
                specials = int(bool(add_bos)) + int(bool(add_eos))
                if max_len < specials:
                    raise ValueError(
                        f"max_len={max_len} cannot hold bos_id and eos_id of a truncated "
                        f"text (text {row}); use max_len >= {specials}."
                    )
                body = encoded[int(bool(add_bos)):len(encoded) - int(bool(add_eos))]
                encoded = (encoded[:int(bool(add_bos))] + body[:max_len - specials]
                           + encoded[len(encoded) - int(bool(add_eos)):])
            ids[row, : len(encoded)] = encoded
            mask[row, : len(encoded)] = True
        return ids, mask

    def __repr__(self):
        return f"CharTokenizer(vocabulary_size={self.vocabulary_size}, unknown={self.unknown!r})"
