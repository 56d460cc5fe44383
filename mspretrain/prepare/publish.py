"""A finished data dir: its manifest, and putting it where `--out` names without harming what is there.

Design choices:
- Everything is built in a hidden sibling directory `.NAME.partial/` and renamed to NAME only
  when complete (`manifest.json` is written last), so a crash never leaves a data dir that
  looks finished; an existing NAME is replaced only with `overwrite`, and then only the files
  an earlier prepare listed in its manifest (`outputs`): inputs inside NAME are refused, and
  other files in NAME are kept.
- The manifest holds no timestamps: same input + same seed -> same bytes.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mspretrain import __version__
from mspretrain.config.schema import PrepareConfig
from mspretrain.data.manifest import read_manifest
from mspretrain.data.origin import RECORD, origin_name, read_records
from mspretrain.data.shards import DTYPE_CODES, HEADER_SIZE, MAGIC, data_fingerprint
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, file_kind, fsync_path, read_json_file
from mspretrain.paths import SPLITS, DataPaths
from mspretrain.prepare import dedup
from mspretrain.prepare.clean import Cleaner
from mspretrain.prepare.quality import REFERENCE_LM
from mspretrain.prepare.scoring import SCORES
from mspretrain.prepare.sink import Sink
from mspretrain.prepare.sources import SourceStats

OUR_FILES = frozenset(p.name for p in DataPaths(Path()).files())
# Names prepare writes now that the fixed set of older prepares (`owned`'s fallback) lacks: an
# `--overwrite` must not replace a file of one of these names that no manifest lists either.
NEW_FILES = frozenset(origin_name(s) for s in SPLITS) | {SCORES, REFERENCE_LM, REFERENCE_LM + ".sha256"}  # + the quality stage's
WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def build_manifest(work: Path, cfg: PrepareConfig, stats: SourceStats, sink: Sink, tok: Tokenizer,
                   tok_info: dict, dtype: np.dtype) -> dict:
    """The manifest of the shards in `work`, checked against what the sink counted. `prepare`
    adds the keys that depend on its arguments (inputs, warnings, seq_len, outputs)."""
    counted = {s: _shard_counts(work / s) for s in SPLITS}
    tokens = {s: counted[s][1] for s in SPLITS}
    docs = {s: counted[s][0] for s in SPLITS}
    if docs != sink.docs:
        raise AssertionError(f"shards hold {docs} documents, the sink counted {sink.docs}")
    origins = {s: int(read_records(work / origin_name(s)).size) for s in SPLITS}
    if origins != docs:
        raise AssertionError(f"the origin index holds {origins} documents, the shards {docs}")
    characters = sink.chars["train"] + sink.chars["valid"]
    text_tokens = tokens["train"] + tokens["valid"] - docs["train"] - docs["valid"]  # without the EOS
    per_file = input_tokens(stats, sink)
    if sum(f["tokens"] for f in per_file) != text_tokens or sum(f["documents"] for f in per_file) != sum(docs.values()):
        raise AssertionError("the per-file token counts do not add up to the shards'")
    fallback = sum(f["byte_fallback_tokens"] for f in per_file)
    return {
        "format": "mspretrain-data/1",
        "created_by": f"mspretrain {__version__}",
        "files": stats.to_dict(),
        "input_files": stats.per_file_dicts(),  # the same counts, per input file, in reading order
        "rules": Cleaner(cfg).rules(),
        "changed": dict(sorted(sink.changed.items())),
        "dropped": dict(sorted(sink.dropped.items())),
        "documents_in": sink.docs_in,
        "characters_in": sink.chars_in,
        "documents": docs,
        "characters": characters,
        "characters_by_split": dict(sink.chars),
        "tokens": tokens,
        "chars_per_token": round(characters / max(text_tokens, 1), 4),
        "byte_fallback_rate": round(fallback / max(text_tokens, 1), 6),
        "input_tokens": per_file,  # per input file, aligned with input_files
        "origin": {"index": {s: origin_name(s) for s in SPLITS},
                   "record": f"{RECORD.itemsize} bytes per document in .idx order: <u4 file (index into input_files), <u8 offset",
                   "offsets": [f.offsets for f in stats.per_file]},  # per input file: "byte" or "row" ("" if not read)
        "eos_appended": True,
        "token_dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "special_ids": tok.special_ids(),
        "tokenizer": {"file": tok.path.name, **tok_info},
        "tokenizer_sha256": tok.sha256(),
        "dedup": dedup_info(cfg),
        "split": {"valid_fraction": cfg.valid_fraction, "seed": cfg.seed,
                  "method": "valid if blake2b(document key, key=seed) / 2^64 < valid_fraction"},
        "fingerprint": data_fingerprint(work),
    }


def _shard_counts(prefix: Path) -> tuple[int, int]:
    """(documents, tokens) of a shard pair, read from its index with plain reads in blocks: the
    check `IndexedDataset` makes, without mapping the whole index into this process's memory."""
    idx = Path(str(prefix) + ".idx")
    with open(idx, "rb") as f:
        head = f.read(HEADER_SIZE)
        n = struct.unpack_from("<Q", head, len(MAGIC) + 9)[0]
        left, tokens = n, 0
        while left:
            chunk = np.frombuffer(f.read(4 * min(left, 1 << 20)), dtype=np.int32)
            tokens += int(chunk.sum(dtype=np.int64))
            left -= chunk.size
    size = Path(str(prefix) + ".bin").stat().st_size
    if size != tokens * np.dtype(DTYPE_CODES[head[len(MAGIC) + 8]]).itemsize:
        raise AssertionError(f"{prefix}.bin holds {size} bytes for {tokens} tokens")
    return int(n), tokens


def dedup_info(cfg: PrepareConfig) -> dict:
    """How duplicates were found (`diskdedup`): near-duplicate candidates are LSH bucket
    collisions at the threshold, not re-checked with an exact Jaccard similarity."""
    near = None
    lsh = dedup.LshSettings.of(cfg)
    if lsh is not None:
        near = {"method": "MinHash LSH over character 5-grams, first kept document in input order wins",
                "threshold": lsh.threshold, "num_perm": lsh.num_perm, "bands": lsh.bands, "rows": lsh.rows,
                "jaccard_verified": False}
    return {"exact": "blake2b-128 of the cleaned text, first occurrence in input order kept", "near": near}


def input_tokens(stats: SourceStats, sink: Sink) -> list[dict]:
    """Per input file, what reached the shards: documents, characters, tokens (EOS excluded),
    chars per token and the byte-fallback rate (share of tokens that are `<0x..>` byte pieces)."""
    out = []
    for i, f in enumerate(stats.per_file):
        n = {k: sink.per_file.get(k, i) for k in sink.per_file.KEYS}
        out.append({"name": f.name, "documents": n["documents"], "characters": n["characters"], "tokens": n["tokens"],
                    "chars_per_token": round(n["characters"] / n["tokens"], 4) if n["tokens"] else None,
                    "byte_fallback_tokens": n["byte_fallback"],
                    "byte_fallback_rate": round(n["byte_fallback"] / n["tokens"], 6) if n["tokens"] else None})
    return out


FORMAT = "mspretrain-data/1"  # every prepare has written it: what tells its manifest from others'
# Written into `out` before a file-by-file publish starts, removed after it ends: the names the
# old and the new data dir own. A kill in between leaves it, and the rerun knows what it may replace.
JOURNAL = ".mspretrain-prepare-publish.json"
JOURNAL_FORMAT = "mspretrain-prepare-publish/1"  # inside JOURNAL: a file of that name without it is not ours
# Written into the old data dir just before the whole-dir swap moves it to `.NAME.old` (`publish`):
# a `.NAME.old` without it is not a data dir prepare moved aside, and is never removed.
OLD_MARK = ".mspretrain-prepare-old"


def old_dir(out: Path) -> Path:
    """Where the whole-dir swap moves the previous data dir while the new one takes its name."""
    return out.with_name(f".{out.name}.old")


def _is_our_old(old: Path) -> bool:
    """`.NAME.old` is the previous data dir a swap moved aside (it holds OLD_MARK), or what is left
    of one a kill interrupted the removal of (`_remove_old` removes the mark last)."""
    return old.is_dir() and not old.is_symlink() and (old / OLD_MARK).is_file()


def _remove_old(old: Path) -> None:
    """Remove a `.NAME.old` of ours: every entry but the mark, then the mark, then the dir, so a
    kill at any moment leaves either nothing or a dir that still says it is ours."""
    for p in old.iterdir():
        if p.name != OLD_MARK:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    (old / OLD_MARK).unlink(missing_ok=True)
    old.rmdir()


def _names(listed: object) -> set[str] | None:
    if isinstance(listed, list) and all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in listed):
        return set(listed)
    return None


def is_ours(manifest: object) -> bool:
    """A manifest that prepare wrote: a JSON object with prepare's `format`. A checkpoint's,
    an export's or a user's manifest.json is not (any manifest without `outputs` once was)."""
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _journal(out: Path) -> set[str] | None:
    """The names a killed file-by-file publish recorded (None: no journal of ours there). Read with
    the guards of every state file (a FIFO or /dev/zero of that name is refused in one line)."""
    p = out / JOURNAL
    if not os.path.lexists(p):
        return None
    d = read_json_file(p, "publish journal", f"move {p} away: prepare did not write it")
    if not isinstance(d, dict) or d.get("format") != JOURNAL_FORMAT:
        return None
    return _names(d.get("owned"))


def owned(out: Path) -> set[str]:
    """Names in `out` that a previous prepare wrote (its manifest's `outputs`; older manifests
    predate that key and get the fixed set prepare has always written), plus those of a publish
    a kill interrupted (`JOURNAL`). No manifest of prepare's and no journal: none."""
    names = set(_journal(out) or ())
    if names:
        names.add(JOURNAL)
    if (out / OLD_MARK).is_file():  # a kill between writing it and the swap
        names.add(OLD_MARK)
    try:
        m = read_manifest(out, required={})
    except UserError:
        return names
    if not is_ours(m):
        return names
    return names | (_names(m.get("outputs")) or set(OUR_FILES))


def check_out(out: Path, overwrite: bool, inputs: list[Path]) -> None:
    """Before any work: `out` may become the data dir (see the module's design choices)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is {file_kind(out)}, not a directory", "give a directory path for the data dir")
    old = old_dir(out)
    if os.path.lexists(old) and not _is_our_old(old):
        raise UserError(f"{old} exists and is not a data dir prepare moved aside (no {OLD_MARK} in it); prepare would "
                        "need its name to replace --out, and leaves it alone", f"move {old} away, or choose another --out")
    root = out.resolve()
    for p in inputs:  # `--overwrite` must never delete or replace what it is reading
        if p == root or root in p.parents:
            raise UserError(f"input {p} is inside --out {out}", "move the input out of the data dir, or choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"output dir {out} already exists and is not empty", "pass --overwrite to replace it, or choose another --out")
        interrupted = _journal(out) is not None  # a publish killed halfway: the rerun repairs it
        if not DataPaths(out).manifest.is_file() and not interrupted:
            raise UserError(f"output dir {out} holds files that prepare did not write (it has no manifest.json); refusing to replace it",
                            "choose a new --out directory (or empty this one yourself)")
        if DataPaths(out).manifest.is_file() and not interrupted and not is_ours(_read_json_or_none(DataPaths(out).manifest)):
            raise UserError(f"output dir {out} holds a manifest.json that prepare did not write (no \"format\": \"{FORMAT}\"); "
                            "refusing to replace it", "choose a new --out directory: --overwrite only replaces a data dir prepare wrote")
        # Files prepare did not write stay where they are; one with the name of an output would
        # have to be replaced, so that is refused.
        clash = sorted(n for n in OUR_FILES | NEW_FILES if (out / n).exists() and n not in owned(out))
        if clash:
            raise UserError(f"output dir {out} holds {clash[0]}, which no earlier prepare wrote (no manifest lists it); refusing to replace it",
                            "move that file elsewhere, or choose a new --out directory")


def _read_json_or_none(path: Path) -> object:
    try:
        return read_json_file(path, "manifest")
    except UserError:
        return None


def fsync_all(paths: list[Path]) -> None:
    """fsync files and directories concurrently. On ext4 each fsync waits for a journal commit
    (0.2 s on the shared benchmark box, even for 1 KB), and concurrent fsyncs share commits:
    six one after the other were 0.8 s of serial time at the end of every run."""
    with ThreadPoolExecutor(max(1, len(paths))) as ex:
        list(ex.map(fsync_path, paths))


def publish(work: Path, out: Path) -> None:
    """Make `work` the data dir `out`. Only files an earlier prepare listed in its manifest are
    removed or replaced; anything else in `out` stays (`check_out` refused name clashes)."""
    if not out.is_dir():
        os.replace(work, out)
        if _is_our_old(old_dir(out)):  # a swap's old dir left by a kill after its second rename: ours to remove
            _remove_old(old_dir(out))
        return
    ours = owned(out)
    if {p.name for p in out.iterdir()} <= ours:  # all ours: swap the whole dir at once
        old = old_dir(out)
        if os.path.lexists(old):
            if not _is_our_old(old):  # (check_out refused it; made since)
                raise UserError(f"{old} appeared while prepare ran and is not ours; nothing was published",
                                f"move {old} away and run the same command again")
            _remove_old(old)
        (out / OLD_MARK).write_bytes(b"")  # what makes `.NAME.old` ours (`_is_our_old`)
        fsync_path(out)
        os.replace(out, old)
        fsync_path(out.parent)
        os.replace(work, out)  # a kill between the two renames: `restore_old` puts the old dir back
        fsync_path(out.parent)
        try:
            _remove_old(old)
        except OSError:
            pass
        return
    # Others' files live here too: replace ours file by file. The old manifest goes first and
    # the new one comes last, so a crash in between leaves a dir that is not a data dir (the
    # loader refuses it) rather than a mix that looks finished. The journal, written first and
    # removed last, lets the same command rerun after such a crash (`check_out`, `owned`).
    manifest = DataPaths(out).manifest.name
    new = {p.name for p in work.iterdir()}
    journal = out / JOURNAL
    atomic_write(journal, json.dumps({"format": JOURNAL_FORMAT, "owned": sorted(ours | new)}) + "\n")
    (out / manifest).unlink(missing_ok=True)
    fsync_path(out)
    for name in sorted(ours - new - {JOURNAL}):
        if (out / name).is_file():
            (out / name).unlink()
    for name in sorted(new - {manifest}):
        os.replace(work / name, out / name)
    fsync_path(out)
    os.replace(work / manifest, out / manifest)
    fsync_path(out)
    journal.unlink()
    fsync_path(out)
    shutil.rmtree(work, ignore_errors=True)


def restore_old(out: Path) -> bool:
    """After a kill between the whole-dir swap's two renames (`publish`), `out` is gone and the
    previous data dir waits as `.NAME.old`: put it back, so the same command finds everything
    as it was before its publish began (a `--scores-from` of its own `--out` too) and publishes
    again. True when it did."""
    old = old_dir(out)
    if os.path.lexists(out) or not _is_our_old(old):
        return False
    os.replace(old, out)
    (out / OLD_MARK).unlink(missing_ok=True)
    fsync_path(out.parent)
    return True
