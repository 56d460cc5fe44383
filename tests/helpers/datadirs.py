"""Data dirs written by hand for the loader: `SEQ`, `EOS`, `make_dir`, `counting_dir`, `raw_windows`,
`loader`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEQ = 8
EOS = 2


def make_dir(root: Path, name: str, docs: list[np.ndarray], *, vocab: int = 65000, fingerprint: str | None = None,
             extra: dict | None = None) -> Path:
    """A data dir with one `train` split of these documents and a hand-written manifest."""
    from mspretrain.data.shards import ShardWriter, token_dtype

    d = root / name
    d.mkdir()
    w = ShardWriter(d / "train", token_dtype(vocab))
    for doc in docs:
        w.add(doc)
    w.finalize()
    manifest = {"fingerprint": fingerprint or f"fp-{name}", "tokens": {"train": int(sum(len(x) for x in docs))},
                "vocab_size": vocab, "special_ids": {"bos": 1, "eos": EOS, "pad": 0, "unk": 3}, **(extra or {})}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def counting_dir(root: Path, name: str, n_tokens: int, offset: int = 0) -> Path:
    """Tokens offset, offset+1, ... split into uneven documents."""
    toks = np.arange(offset, offset + n_tokens, dtype=np.int64)
    cuts = np.arange(7, n_tokens, 13)
    return make_dir(root, name, np.split(toks, cuts))


def raw_windows(d: Path) -> np.ndarray:
    """Independent reference: every window of the split, sliced from the raw `.bin` bytes."""
    flat = np.fromfile(d / "train.bin", dtype=np.uint16).astype(np.int64)
    n = (flat.size - 1) // SEQ
    return np.stack([flat[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])


def loader(d: Path | None, *, sources: list | None = None, **kw):
    from mspretrain.data.loader import Loader

    args = dict(split="train", seq_len=SEQ, batch_size=4, seed=7, log=lambda m: None)
    args.update(kw)
    return Loader(sources if sources is not None else [(d, 1.0)], **args)
