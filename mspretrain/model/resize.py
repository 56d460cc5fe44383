"""Grow the embedding and lm_head to an extended tokenizer's vocabulary (issue 20 item 3).

A tokenizer extended in the Chinese-LLaMA way keeps every base piece at its id and appends new
ones, so the base rows keep their meaning: they are copied bit for bit. A new piece's row starts
at the mean of the base rows of the pieces the BASE tokenizer splits the piece's text into (its
best guess at what the new piece means, and on the scale of the trained rows), falling back to
the mean of all base rows when the split holds nothing usable (an empty decode, only special or
unknown ids). The lm_head's new rows are built the same way from the lm_head's own rows.

Means are taken in float64 and rounded once to float32, so the result does not depend on the
order of a BLAS reduction. The split is an input (a list of base ids per new piece): this module
knows no tokenizer; the caller (checkpoint/init_source.py) asks the base tokenizer.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mspretrain.errors import UserError
from mspretrain.model.params import ROWS, Role

# the parameters indexed by the vocabulary (model/params.py's vocab role): the embedding, then the lm_head
VOCAB_ROWS = tuple(r.name for r in ROWS if r.role is Role.VOCAB)
EMBED = VOCAB_ROWS[0]


def new_row(base: np.ndarray, ids: Sequence[int], overall: np.ndarray) -> tuple[np.ndarray, bool]:
    """(row, True) from the mean of base[ids], or (overall, False) when `ids` is empty."""
    if len(ids) == 0:
        return overall, False
    return base[np.asarray(ids, dtype=np.int64)].astype(np.float64).mean(axis=0).astype(np.float32), True


def resize_vocab(tensors: dict[str, np.ndarray], vocab: int, splits: Sequence[Sequence[int]],
                 unusable: set[int] | frozenset[int] = frozenset()) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`tensors` (our names) with embed.weight and lm_head.weight (if present: untied) grown to
    `vocab` rows. `splits[k]`: the base ids the base tokenizer encodes new piece `base_vocab + k`
    into; ids outside the base vocabulary or in `unusable` (unk, bos, eos, pad) are ignored.

    Returns (tensors, record): the other tensors are the same objects; the record says how each
    new row began: {"base_vocab", "vocab", "split_mean", "overall_mean", "overall_mean_ids"}.
    """
    base_vocab = int(tensors[EMBED].shape[0])
    if vocab < base_vocab:
        raise UserError(f"the data dir's tokenizer has {vocab} pieces, fewer than the init model's {base_vocab}: shrinking the vocabulary is refused",
                        "prepare the data with the init model's tokenizer or an extension of it (mspretrain tokenizer extend)")
    if len(splits) != vocab - base_vocab:
        raise ValueError(f"{len(splits)} splits given for {vocab - base_vocab} new pieces")
    record: dict[str, Any] = {"base_vocab": base_vocab, "vocab": vocab, "split_mean": 0, "overall_mean": 0, "overall_mean_ids": []}
    if vocab == base_vocab:
        return tensors, record
    usable = [[int(i) for i in ids if 0 <= int(i) < base_vocab and int(i) not in unusable] for ids in splits]
    out = dict(tensors)
    for name in VOCAB_ROWS:
        if name not in tensors:  # tied: the embedding is the lm_head
            continue
        base = np.asarray(tensors[name], dtype=np.float32)
        overall = base.astype(np.float64).mean(axis=0).astype(np.float32)
        rows = np.empty((vocab - base_vocab, base.shape[1]), np.float32)
        for k, ids in enumerate(usable):
            rows[k], _ = new_row(base, ids, overall)
        out[name] = np.concatenate([base, rows])
    fallback = [base_vocab + k for k, ids in enumerate(usable) if not ids]
    record.update(split_mean=len(usable) - len(fallback), overall_mean=len(fallback), overall_mean_ids=fallback)
    return out, record


def check_extends(base_pieces: Sequence[str], new_pieces: Sequence[str]) -> None:
    """The data dir's tokenizer must keep every base piece at its id (a superset, in order)."""
    for i, piece in enumerate(base_pieces):
        if i >= len(new_pieces) or new_pieces[i] != piece:
            what = (f"id {i} is {new_pieces[i]!r} there, {piece!r} in the init model's" if i < len(new_pieces)
                    else f"it has only {len(new_pieces)} pieces")
            raise UserError(f"the data dir's tokenizer does not extend the init model's tokenizer ({what})",
                            "prepare the data with the init model's tokenizer or one made by `mspretrain tokenizer extend` from it")
