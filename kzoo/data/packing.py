"""Sequence packing: several documents a row, for GPT and BERT training without padding.

`pack(documents, sequence_length)` places token lists into rows of `sequence_length`
tokens, best-fit decreasing (each document, longest first, goes into the row with the least
room that still holds it; a new row when none does), and returns the arrays a model built
with `packed_inputs=True` takes: `token_ids`, `padding_mask` and `document_ids` (the
documents of a row numbered 1, 2, 3, ... in the order they sit in the row, 0 for padding).
The model keeps each document to itself (a block-diagonal attention mask) and restarts its
positions at 0, so a packed document gives the same outputs as the document alone.

`next_token_targets(packed)` turns packed rows into GPT's `(x, y, sample_weight)`: the
target of a token is the next token of the same document; the last token of each document
(and padding) has weight 0, so no target crosses a document boundary. Each document of
`n` tokens contributes its `n - 1` targets, exactly as when it is trained alone.

`padding_fraction(packed)` is the share of padding slots.

Example:
>>> packed = pack([[5, 6, 7], [8, 9], [10, 11, 12, 13]], sequence_length=5)
>>> packed["document_ids"]
array([[1, 1, 1, 1, 0],
       [1, 1, 1, 2, 2]], dtype=int32)
>>> x, y, w = next_token_targets(packed)      # GPTCausalLM(packed_inputs=True).fit(x, y, ...)
"""

import bisect

import numpy as np

LONG_DOCUMENTS = ("split", "truncate", "error")
# Token ids (and `pad_id`) must fit the int32 rows `pack` returns: a negative id was packed
# as is (an embedding lookup then fails or reads garbage) and one >= 2**31 wrapped around.
_ID_LIMIT = 2 ** 31


def _check_sequence_length(sequence_length):
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, (int, np.integer)) \
            or sequence_length < 1:
        raise ValueError(
            f"`sequence_length` must be a positive integer; got "
            f"sequence_length={sequence_length!r}."
        )
    return int(sequence_length)


def _as_documents(documents):
    """Each document as a 1-D int64 array (non-integers and ids outside [0, 2**31) refused)."""
    if isinstance(documents, np.ndarray) and documents.ndim == 2:
        documents = list(documents)
    if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
        raise TypeError(
            "`documents` must be a sequence of token id lists (one a document); got "
            f"{type(documents).__name__}."
        )
    out = []
    for i, doc in enumerate(documents):
        array = np.asarray(doc)
        if array.ndim != 1:
            raise ValueError(
                f"`documents` must be a sequence of 1-D token id lists; document {i} has "
                f"shape {array.shape}."
            )
        if array.size and (array.dtype == object or array.dtype == np.bool_
                           or not np.issubdtype(array.dtype, np.integer)):
            raise TypeError(
                f"`documents` must hold integer token ids; document {i} has dtype "
                f"{array.dtype}."
            )
        if array.size and (array.min() < 0 or array.max() >= _ID_LIMIT):
            j = int(np.argmax((array < 0) | (array >= _ID_LIMIT)))
            raise ValueError(
                f"`documents` must hold token ids in [0, 2**31); document {i} has id "
                f"{int(array[j])} at position {j}."
            )
        out.append(array.astype(np.int64))
    return out


def pack(documents, sequence_length, *, pad_id=0, long_documents="split",
         max_documents_per_row=None):
    """Pack token lists into rows of `sequence_length` tokens (best-fit decreasing).

    Args:
        documents: a sequence of 1-D integer token id lists / arrays, one a document
            (already with whatever `[CLS]`, `[SEP]`, end-of-text tokens the model needs),
            the ids in [0, 2**31) (int32). Empty documents are skipped.
        sequence_length: tokens a row.
        pad_id: the token id of the padding slots, in [0, 2**31).
        long_documents: what to do with a document longer than `sequence_length`:
            "split" (default) cuts it into pieces of `sequence_length` tokens (and a shorter
            last piece), each packed as a document of its own; "truncate" keeps its first
            `sequence_length` tokens; "error" raises.
        max_documents_per_row: at most this many documents a row (None: no limit). `1`
            gives the unpacked baseline (one document a row, padded) in the same format.

    Returns:
        A dict of int32 arrays `(rows, sequence_length)`: `token_ids`, `padding_mask`
        (1 = real token) and `document_ids` (1, 2, ... the documents of a row in their
        order there, 0 padding). Rows are in the order they were opened; a document keeps
        its token order. The result depends only on the inputs (ties keep the documents'
        order).

    Raises:
        TypeError: `documents` is not a sequence of integer lists.
        ValueError: a bad `sequence_length`, `long_documents`, `max_documents_per_row` or
            `pad_id`, a token id outside [0, 2**31), or a long document with
            `long_documents="error"`.

    Example:
    >>> pack([[1, 2, 3], [4, 5], [6]], 4)["token_ids"]
    array([[1, 2, 3, 6],
           [4, 5, 0, 0]], dtype=int32)
    """
    sequence_length = _check_sequence_length(sequence_length)
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(
            f"`long_documents` must be one of {LONG_DOCUMENTS}; got "
            f"long_documents={long_documents!r}."
        )
    if max_documents_per_row is not None and (
            isinstance(max_documents_per_row, bool)
            or not isinstance(max_documents_per_row, (int, np.integer))
            or max_documents_per_row < 1):
        raise ValueError(
            "`max_documents_per_row` must be None or a positive integer; got "
            f"max_documents_per_row={max_documents_per_row!r}."
        )
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) \
            or not 0 <= pad_id < _ID_LIMIT:
        raise ValueError(f"`pad_id` must be an integer in [0, 2**31); got pad_id={pad_id!r}.")
    pieces = []
    for i, doc in enumerate(_as_documents(documents)):
        if len(doc) > sequence_length:
            if long_documents == "error":
                raise ValueError(
                    f"Document {i} has {len(doc)} tokens, more than sequence_length="
                    f"{sequence_length}; pass long_documents='split' or 'truncate'."
                )
            if long_documents == "truncate":
                doc = doc[:sequence_length]
            else:
                pieces.extend(doc[s:s + sequence_length]
                              for s in range(0, len(doc), sequence_length))
                continue
        if len(doc):
            pieces.append(doc)

    # Best-fit decreasing: `free` holds (room left, row) of the rows that may take more,
    # sorted; the best fit of a piece is the first entry with room >= its length.
    order = sorted(range(len(pieces)), key=lambda k: -len(pieces[k]))
    rows, free = [], []
    for k in order:
        length = len(pieces[k])
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            row = len(rows)
            rows.append([])
            room = sequence_length
        else:
            room, row = free.pop(at)
        rows[row].append(k)
        room -= length
        if room > 0 and (max_documents_per_row is None
                         or len(rows[row]) < max_documents_per_row):
            bisect.insort(free, (room, row))

    token_ids = np.full((len(rows), sequence_length), pad_id, np.int32)
    document_ids = np.zeros((len(rows), sequence_length), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for d, k in enumerate(members):
            piece = pieces[k]
            token_ids[r, start:start + len(piece)] = piece
            document_ids[r, start:start + len(piece)] = d + 1
            start += len(piece)
    return {
        "token_ids": token_ids,
        "padding_mask": (document_ids != 0).astype(np.int32),
        "document_ids": document_ids,
    }


def _packed_arrays(packed):
    if not isinstance(packed, dict) or "token_ids" not in packed or \
            "document_ids" not in packed:
        raise ValueError(
            "`packed` must be the dict `pack` returns, with `token_ids` and `document_ids`; "
            f"got {type(packed).__name__}"
            + (f" with keys {sorted(packed)}" if isinstance(packed, dict) else "") + "."
        )
    token_ids = np.asarray(packed["token_ids"])
    document_ids = np.asarray(packed["document_ids"])
    if token_ids.ndim != 2 or token_ids.shape != document_ids.shape:
        raise ValueError(
            "`token_ids` and `document_ids` of `packed` must be 2-D arrays of one shape; got "
            f"{token_ids.shape} and {document_ids.shape}."
        )
    # (float ids were truncated, ids past int32 wrapped around and negative document ids
    # counted as documents, in silence; text failed in NumPy's type promotion)
    for key, array in (("token_ids", token_ids), ("document_ids", document_ids)):
        if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype,
                                                                         np.integer)):
            raise ValueError(
                f"`{key}` of `packed` must hold integers; got an array of dtype "
                f"{array.dtype}."
            )
        if array.size and (array.min() < 0 or array.max() >= _ID_LIMIT):
            bad = tuple(int(i) for i in np.argwhere((array < 0) | (array >= _ID_LIMIT))[0])
            raise ValueError(
                f"`{key}` of `packed` must hold integers in [0, 2**31); got "
                f"{int(array[bad])} at {bad}."
            )
    return token_ids, document_ids


def next_token_targets(packed):
    """GPT's `(x, y, sample_weight)` from packed rows: next-token targets inside documents.

    `y[:, i]` is the token after position `i` when it belongs to the same document
    (weight 1), else 0 with weight 0: the last token of each document, padding and the
    last slot of a row predict nothing. The inputs `x` are the packed arrays themselves
    (`token_ids`, `padding_mask`, `document_ids`), all `sequence_length` long.

    Example:
    >>> x, y, w = next_token_targets(pack([[1, 2, 3], [4, 5]], 6))
    >>> y, w
    (array([[2, 3, 0, 5, 0, 0]], dtype=int32),
     array([[1., 1., 0., 1., 0., 0.]], dtype=float32))
    """
    token_ids, document_ids = _packed_arrays(packed)
    same = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] != 0)
    weight = np.zeros(token_ids.shape, np.float32)
    weight[:, :-1] = same
    target = np.zeros(token_ids.shape, np.int32)
    target[:, :-1] = np.where(same, token_ids[:, 1:], 0)
    x = {}
    for key, value in packed.items():
        array = np.asarray(value)
        if array.shape != token_ids.shape or not (
                array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer)) or (
                array.size and (array.min() < -_ID_LIMIT or array.max() >= _ID_LIMIT)):
            raise ValueError(
                f"`packed[{key!r}]` must be an int32 array of the shape of `token_ids` "
                f"{token_ids.shape}; got an array of shape {array.shape} and dtype "
                f"{array.dtype}."
            )
        x[key] = array.astype(np.int32)
    return x, target, weight


def padding_fraction(packed):
    """The share of padding slots of packed (or padded) rows, in [0, 1].

    Example:
    >>> padding_fraction(pack([[1, 2, 3], [4, 5]], 4))
    0.375
    """
    _, document_ids = _packed_arrays(packed)
    if document_ids.size == 0:
        return 0.0
    return float(np.mean(document_ids == 0))
