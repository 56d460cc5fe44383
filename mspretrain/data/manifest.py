"""The one reader of a data dir's `manifest.json`, and the check that the dir's files belong together.

Every command that takes a data dir (train, eval, plan, selftest, export) reads the manifest
here, so a missing, unreadable or foreign manifest is refused in one line, the same way everywhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.data.shards import IndexedDataset
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json
from mspretrain.paths import SPLITS, DataPaths

# the keys everything downstream relies on, with their JSON types
REQUIRED_MANIFEST_KEYS: dict[str, type] = {"fingerprint": str, "tokens": dict, "vocab_size": int, "special_ids": dict}


def read_manifest(data_dir: str | Path, *, required: dict[str, type] = REQUIRED_MANIFEST_KEYS) -> dict[str, Any]:
    """The data dir's manifest.json, checked for the `required` keys and their types (by default
    the ones the loader and trainer rely on; `prepare --inspect` asks for none, to show what an old
    or edited manifest still holds)."""
    paths = DataPaths(data_dir)
    d, path = paths.root, paths.manifest
    fix = f"run `mspretrain prepare INPUT... --out {d}` to create the data dir"
    again = f"re-run `mspretrain prepare ... --out {d}`"
    if not d.is_dir():
        if d.exists():  # e.g. --data train.bin, or the corpus file itself
            raise UserError(f"{d} is a file, not a data dir (the directory `mspretrain prepare --out` wrote)", fix)
        raise UserError(f"data dir {d} does not exist", fix)
    if not path.is_file():
        raise UserError(f"{d} has no manifest.json, so it is not a prepared data dir", fix)
    manifest = read_json(path, again)
    if not isinstance(manifest, dict):
        raise UserError(f"{path} is not a JSON object", again)
    for key, typ in required.items():
        # bool is an int in Python, but `"vocab_size": true` is not a vocabulary size
        value = manifest.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise UserError(f"{path} lacks `{key}` ({typ.__name__}), so it was not written by `mspretrain prepare`", again)
    _check_counts(manifest, required, path, again)
    return manifest


def _check_counts(manifest: dict[str, Any], required: dict[str, type], path: Path, again: str) -> None:
    """The numbers inside the required keys: token counts (plan, the budget and the loader turn them
    into int64 step counts; a NaN ended in `int(nan)`, a negative count planned a negative run)
    and a vocabulary size and special ids inside what a model can have."""
    def whole(v: Any, low: int, high: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and low <= v < high

    if "tokens" in required:
        for split, n in manifest["tokens"].items():
            if not whole(n, 0, 2**63):
                raise UserError(f"{path}: tokens.{split} = {n!r} is not a token count", again)
    if "vocab_size" in required and not whole(manifest["vocab_size"], 1, 1 << 22 + 1):
        raise UserError(f"{path}: vocab_size = {manifest['vocab_size']!r} is not a vocabulary size", again)
    if "special_ids" in required:
        for name, i in manifest["special_ids"].items():
            if not whole(i, -1, 1 << 22):  # against vocab_size: check_data_dir, which names both
                raise UserError(f"{path}: special_ids.{name} = {i!r} is not a token id", again)


_SCAN_TOKENS = 1 << 26  # tokens per chunk of the largest-id scan: 128 MB of uint16 at a time


def check_data_dir(data_dir: str | Path, manifest: dict[str, Any], *, scan: bool = True) -> None:
    """Before training: the tokenizer is the one prepare wrote, and no token id reaches past the
    vocabulary. A replaced tokenizer.model of the same size would otherwise train (and be copied
    into the run) without a word; an edited vocab_size crashes inside MindSpore's Gather.

    A data dir whose manifest records `max_token_id` per shard (written by `prepare` while it
    writes the shards) is checked without reading them: the recorded id against the vocabulary,
    and each shard's size (from its .idx, and the .bin's bytes) against the manifest's token count,
    so a shard replaced after prepare is caught. An older data dir without the key costs one pass
    over the shards (measured 3-4 GB/s on the 2-core box from the page cache: about 0.3 s per GB of
    tokens; 240 GB at 120 B uint16 tokens), skipped for uint16 shards when the vocabulary is
    >= 65,536 (no id can exceed it), and only where `scan` is true: `train` scans on rank 0 alone
    (the other ranks check the tokenizer and the recorded sizes, which cost nothing).
    """
    from mspretrain.data.tokenizer import Tokenizer, sha256_file  # sentencepiece: only when checking

    paths = DataPaths(data_dir)
    d = paths.root
    vocab = int(manifest["vocab_size"])
    again = f"re-run `mspretrain prepare ... --out {d}` (or restore the files prepare wrote)"
    tok_path = paths.tokenizer
    want = manifest.get("tokenizer_sha256")
    if tok_path is not None and isinstance(want, str):
        if sha256_file(tok_path) != want:
            raise UserError(f"{tok_path} is not the tokenizer the data was encoded with (its SHA-256 differs from manifest.json's)",
                            f"put back the tokenizer prepare wrote, or {again}")
        tok_vocab = Tokenizer.load(tok_path).vocab_size
        if tok_vocab != vocab:
            raise UserError(f"{d}/manifest.json says vocab_size {vocab} but {tok_path.name} has {tok_vocab} pieces", again)
    recorded = manifest.get("max_token_id")
    counts = manifest.get("tokens") if isinstance(manifest.get("tokens"), dict) else {}
    for split in SPLITS:
        if not paths.idx(split).is_file():
            continue
        tokens = IndexedDataset(paths.prefix(split)).tokens
        if isinstance(recorded, dict) and isinstance(recorded.get(split), int):
            size = int(tokens.size)
            if split in counts and size != counts[split] or paths.bin(split).stat().st_size != size * tokens.dtype.itemsize:
                raise UserError(f"{d}/{split}.bin holds {size:,} tokens ({paths.bin(split).stat().st_size:,} bytes), "
                                f"but manifest.json says {counts.get(split, 'another count')} ({tokens.dtype.name})",
                                f"the shards and the manifest do not belong together: {again}")
            if recorded[split] >= vocab:
                raise UserError(f"{d}/{split}.bin holds token id {recorded[split]} (manifest.json's max_token_id), "
                                f"but manifest.json says vocab_size {vocab}", f"the shards and the manifest do not belong together: {again}")
            continue
        if not scan or tokens.size == 0 or (tokens.dtype == np.uint16 and vocab >= 1 << 16):
            continue
        for i in range(0, tokens.size, _SCAN_TOKENS):
            chunk = tokens[i:i + _SCAN_TOKENS]
            top, low = int(chunk.max()), int(chunk.min()) if chunk.dtype.kind == "i" else 0
            if top >= vocab or low < 0:
                bad = top if top >= vocab else low
                raise UserError(f"{d}/{split}.bin holds token id {bad}, but manifest.json says vocab_size {vocab}",
                                f"the shards and the manifest do not belong together: {again}")
