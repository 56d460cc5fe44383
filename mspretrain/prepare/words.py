"""Word features for the quality classifier (issue 39: "character n-grams or jieba words"):
each document cut into words by jieba, and hashed word 1- and 2-grams.

jieba (pure Python; its dictionary ships inside the package, so nothing is downloaded at run
time) is deterministic: its default mode is a maximum-probability path over the dictionary's
word graph, with an HMM (Viterbi) for runs of characters the dictionary lacks. It is imported on
the first use in each process, its start-up notices silenced (they go to stderr through
`logging` otherwise). It is ~50 x slower than the character n-grams (docs/benchmarks.md,
"Quality filters"): the option is there for a corpus where words separate good from bad text
better than characters do, at that price.

A word's hash is CRC-32 of its UTF-8 bytes (deterministic, unlike Python's `hash`), mixed with
the n-gram's order; a bigram's from its two words'. 32 bits are plenty: the features are folded
into 2^20 buckets anyway.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from mspretrain.errors import UserError

ORDERS = (1, 2)  # word n-gram orders
_jieba = None


def require() -> None:
    """Refuse in one line, in the main process (before any work), when jieba is not installed."""
    try:
        import jieba  # noqa: F401
    except ImportError:
        raise UserError("word features need the jieba package", "pip install 'jieba==0.42.1' (or train with --features chars)") from None


def _cutter():
    global _jieba
    if _jieba is None:
        require()
        import logging

        import jieba

        jieba.setLogLevel(logging.WARNING)
        jieba.initialize()
        _jieba = jieba
    return _jieba


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(CRC-32 of each word as uint64, its document's number) over the texts, in order."""
    jieba = _cutter()
    crc, doc = [], []
    for i, t in enumerate(texts):
        words = [w for w in jieba.lcut(t) if not w.isspace()]
        crc += [zlib.crc32(w.encode("utf-8")) for w in words]
        doc += [i] * len(words)
    return np.array(crc, dtype=np.uint64), np.array(doc, dtype=np.int64)


def features(texts: Sequence[str], bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(feature index per word n-gram, its document, n-grams per document), as
    `quality.features` gives them for characters."""
    from mspretrain.prepare.hash64 import _MULT, _mix

    h, doc = word_hashes(texts)
    mask = np.uint64((1 << bits) - 1)
    with np.errstate(over="ignore"):
        uni = _mix(h * _MULT ^ np.uint64(1))
        same = doc[1:] == doc[:-1]  # a bigram inside one document
        bi = _mix((h[:-1] * _MULT ^ h[1:]) * _MULT ^ np.uint64(2))[same]
    ids = np.concatenate([(uni & mask), (bi & mask)]).astype(np.int64)
    docs = np.concatenate([doc, doc[1:][same]])
    counts = np.bincount(docs, minlength=len(texts)).astype(np.float64)
    return ids, docs, counts
