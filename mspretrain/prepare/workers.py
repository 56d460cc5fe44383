"""What `prepare`'s worker processes run: clean, hash, [MinHash], [tokenize] one chunk of documents.

A worker's state (the config, the cleaner, the tokenizer) is built once by `init_worker`, in the
worker process itself (or in the caller's process when prepare runs without workers), and kept in
the module-level `_W`: a pool initializer has nowhere else to put it.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np

from mspretrain.config.schema import PrepareConfig
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import env_number
from mspretrain.prepare import dedup, scoring, sources
from mspretrain.prepare.clean import Cleaner
from mspretrain.prepare.dedup import LshSettings
from mspretrain.prepare.results import ChunkResult, ReplayResult, SplitPiece, UnitResult
from mspretrain.prepare.scoring import QualityStage
from mspretrain.prepare.tasks import PlacePiece, ReplayTask, SpillTask

_W: dict = {}  # per-worker state, set by init_worker


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the OS at once.

    A worker allocates and frees the same large numpy arrays for every chunk; by default glibc
    serves them from fresh mmaps or trims its heap after them, so each chunk paid ~2,800 page
    faults on zeroed memory (0.5-0.6 s of system time per 50 MB run, now ~0.1 s). A worker
    then keeps at most ~128 MB of freed memory. No-op where there is no `mallopt`."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: blocks up to 64 MB come from the heap
    mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: keep up to 128 MB free at the top of the heap


def _die_with_parent() -> None:
    """A worker is killed (SIGKILL) when prepare dies: orphans used to find their pipe gone and
    print a BrokenPipeError traceback each. Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
    except (OSError, AttributeError):
        return
    if mp.parent_process() is not None and os.getppid() != mp.parent_process().pid:
        os._exit(0)  # the parent died before prctl took effect


def init_worker(cfg: PrepareConfig, tokenizer_path: str | None, dtype: str | None, lsh: LshSettings | None = None,
                quality: QualityStage | None = None) -> None:
    """`lsh`: near dedup's settings (`dedup.LshSettings.of`), built by the main process (None:
    built here from `cfg` when first needed).
    `quality`: pass 1's quality stage (`scoring.QualityStage`, its models loaded by the main process)."""
    if mp.parent_process() is not None:
        _die_with_parent()
        # HF tokenizers would start a thread per core in every worker process.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _keep_freed_memory()  # a worker process only: the caller's process keeps its settings
    _W.clear()
    tok = Tokenizer.load(tokenizer_path) if tokenizer_path else None
    _W.update(cfg=cfg, cleaner=Cleaner(cfg), dtype=dtype, tok=tok, lsh=lsh, quality=quality,
              byte_pieces=byte_piece_table(tok) if tok is not None else None)


def byte_piece_table(tok: Tokenizer) -> np.ndarray:
    """bool per token id: a byte-fallback piece (`<0x..>`), what the tokenizer emits for a
    character its vocabulary lacks (3-4 of them per Chinese character)."""
    if tok._sp is not None:
        sp = tok._sp
        return np.fromiter((sp.IsByte(i) for i in range(tok.vocab_size)), dtype=bool, count=tok.vocab_size)
    table = np.zeros(tok.vocab_size, dtype=bool)
    for piece, i in tok._hf.get_vocab(with_added_tokens=True).items():
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and i < table.size:
            table[i] = all(c in "0123456789ABCDEFabcdef" for c in piece[3:5])
    return table


def byte_fallback_counts(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Byte-fallback tokens per document of `encode_flat`'s output (one gather and one sum per
    chunk: ~1 % of encoding)."""
    if not lengths.size:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(lengths, dtype=np.int64) - lengths
    return np.add.reduceat(_W["byte_pieces"][flat].astype(np.int64), starts)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids with EOS after each document, tokens per document incl. EOS)."""
    tok: Tokenizer = _W["tok"]
    return tok.encode_flat(texts, tok.eos_id, np.dtype(_W["dtype"]))


def clean_chunk(work: list[str] | tuple[list[str], np.ndarray] | sources.RawLines | scoring.Scored) -> ChunkResult:
    """Pass 1 over one chunk: the kept documents' texts (or tokens, when the tokenizer is given),
    their dedup keys and split numbers, their origins, and what the cleaner changed and dropped.

    `work`: a block of raw lines, or documents with their origin records (`origin.RECORD`), or
    bare documents; or one of those with the quality scores of its input range (`scoring.Scored`).
    The result is per chunk, its documents in input order; the main process (`sink.Sink`) drops
    duplicates and assigns splits. Per-document arrays (`chars`, `u`, `origin`, `lengths`,
    `fallback`) are aligned with `keys`."""
    given = None
    if isinstance(work, scoring.Scored):
        work, given = work.work, work.records
    docs, texts, origin, raw, changed, dropped = _clean(work)
    cfg: PrepareConfig = _W["cfg"]
    keys = dedup.dedup_keys(texts)  # before the quality stage: its sidecar keeps each scored document's key
    scores = None
    if _W.get("quality") is not None:  # the model-based filters, after the rules, before dedup (`scoring.py`)
        texts, origin, scores, keys = scoring.apply(_W["quality"], texts, origin, dropped, keys, given)
    out = ChunkResult(docs_in=len(docs), chars_in=sum(map(len, docs)), changed=changed, dropped=dropped, raw=raw, origin=origin,
                      keys=keys, scores=scores, chars=np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)),
                      u=dedup.split_numbers(keys, cfg.seed), bands=_bands(texts, cfg) if cfg.near_dedup else None)
    if _W["tok"] is not None:
        out.tokens, out.lengths = _encode(texts)
        out.fallback = byte_fallback_counts(out.tokens, out.lengths)
    else:
        out.texts = texts
    return out


def _clean(work: list[str] | tuple[list[str], np.ndarray] | sources.RawLines) -> tuple:
    """(the documents read, those the rules kept (cleaned), their origins, the block's counts
    (`sources.decode_raw`) or None, what the cleaner changed, what it dropped) of one chunk."""
    raw, origin = None, None
    if isinstance(work, sources.RawLines):  # decoded here, in parallel, not in the main process
        docs, found = sources.decode_raw(work)
        raw, origin = (work.file, len(docs), *found), docs.origin
    elif isinstance(work, tuple):
        docs, origin = work
    else:
        docs = work
    cleaner: Cleaner = _W["cleaner"]
    cleaner.changed.clear()
    cleaner.dropped.clear()
    cleaned = cleaner.clean_many(docs)
    texts = [t for t in cleaned if t is not None]
    if origin is not None and len(texts) < len(cleaned):
        origin = origin[np.fromiter((t is not None for t in cleaned), dtype=bool, count=len(cleaned))]
    return docs, texts, origin, raw, dict(cleaner.changed), dict(cleaner.dropped)


def score_chunk(work: list[str] | tuple[list[str], np.ndarray] | sources.RawLines) -> np.ndarray:
    """The quality scan (`stage_scan.ScoreScan`): one chunk cleaned as pass 1 cleans it, and the sidecar
    records (`scoring.RECORD`) of its cleaned documents, every score computed by the models."""
    _, texts, origin, _, _, dropped = _clean(work)
    return scoring.apply(_W["quality"], texts, origin, dropped, dedup.dedup_keys(texts))[2]


def _bands(texts: list[str], cfg: PrepareConfig) -> np.ndarray:
    """LSH band keys (n, bands) of the texts' MinHash signatures: 8 bytes per band go to the main
    process instead of the 512-byte signature (`diskdedup`)."""
    if _W.get("lsh") is None:
        _W["lsh"] = LshSettings.of(cfg)
    return _W["lsh"].band_keys(texts)


def tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pass 2 (after the tokenizer was trained on pass 1's sample): the spooled documents'
    tokens, tokens per document (EOS included) and byte-fallback tokens per document."""
    flat, lengths = _encode(texts)
    return flat, lengths, byte_fallback_counts(flat, lengths)


# --- Per-chunk files: the main process handles a chunk's metadata, never its documents' bytes ---
# With a given tokenizer, the tokens (~200 bytes per short document) were pickled by a worker,
# unpickled by the main process, pickled again into pass 1's spool, read back, masked and written
# to the shards: all serial, and the main process's ceiling (~4 workers' worth). Now a worker
# writes its chunk's per-document arrays to a file (`spill_chunk`), and after the dedup decisions
# a worker cuts that file into the chunk's shard and origin pieces (`replay_chunk`); the main
# process only reserves each piece's place in the output files, in input order, and a worker
# copies it there in the kernel (`place_piece`). Not with `--ray`: its tasks may run on nodes
# that do not share our disk.

# A piece file holds the small per-document arrays first (`SMALL`: the replay of a trained
# tokenizer's run reads them without the rest), then either the tokens (`TOKEN_ARRAYS`, a given
# tokenizer) or the cleaned texts (a tokenizer still to train): the byte offsets of each text
# (n + 1 int64) and then the texts' UTF-8 bytes back to back, read by slices (`read_texts`).
SMALL = ("chars", "u", "origin")
TOKEN_ARRAYS = ("tokens", "lengths", "fallback")


def spill_chunk(fn, item: SpillTask) -> ChunkResult:
    """`fn` (`clean_chunk`) over `work`: its per-document arrays (and its texts, when there is no
    tokenizer yet) written to `path`, its dedup records grouped by partition file
    (`diskdedup.chunk_records`) to `path`.dd; returns the rest (counts, the records per partition
    file), `n`, the number of cleaned documents, and `text_piece` (the piece holds texts)."""
    from mspretrain.prepare.diskdedup import chunk_records

    work, path, exact_parts, band_parts = item
    out = fn(work)
    out.n = len(out.keys) // 16
    exact, out.exact_counts, bands, out.band_counts = chunk_records(out.keys, out.bands, exact_parts, band_parts)
    out.keys = out.bands = None
    has_origin = out.origin is not None
    if not has_origin:
        out.origin = np.zeros(0, dtype=_origin_dtype())
    texts, out.texts = out.texts, None
    arrays = [_take(out, k) for k in SMALL]
    blob = b""
    if texts is None:
        arrays += [_take(out, k) for k in TOKEN_ARRAYS]
    else:
        encoded = [t.encode("utf-8") for t in texts]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
        arrays.append(offsets)
        blob = b"".join(encoded)
    for name, group, tail in ((path, arrays, blob), (path + ".dd", [exact] + ([bands] if bands is not None else []), b"")):
        with open(name, "wb") as f:
            for a in group:
                np.save(f, a)
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())  # durable before the main process commits its chunk (here, in parallel)
    out.has_origin = has_origin
    out.text_piece = texts is not None
    out.piece = os.path.basename(path)  # the replay finds the chunk's file by this name
    return out


def _take(r: ChunkResult, name: str) -> np.ndarray:
    """A per-document array of `r`, now in the chunk's file: left out of what is sent back."""
    a = getattr(r, name)
    setattr(r, name, None)
    return a


def spill_item(fn, item: SpillTask) -> ChunkResult | UnitResult:
    """`spill_chunk`, or `spill_unit` for a compressed file (`sources.FileUnit`).
    Test-only hook (like `resume.point`'s): MSPRETRAIN_PREPARE_TEST_WORKER_KILL=N makes the worker
    given work item N SIGKILL itself, as the out-of-memory killer would."""
    kill = os.environ.get("MSPRETRAIN_PREPARE_TEST_WORKER_KILL")
    if kill is not None and int(Path(item[1]).name) == env_number("MSPRETRAIN_PREPARE_TEST_WORKER_KILL", -1, kind=int, value=kill or "x"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return spill_unit(fn, item) if isinstance(item[0], sources.FileUnit) else spill_chunk(fn, item)


def spill_unit(fn, item: SpillTask) -> UnitResult:
    """A compressed file, whole: decompressed here as a stream (what prepare's main process used
    to read), cut into chunks (`pool.chunks_with_origin`, of UNIT_CHUNK_* size), each through
    `spill_chunk` to `path`.NNNN (each result's `piece` names its file). Memory: one chunk at a
    time, whatever the file's size."""
    from dataclasses import asdict

    from mspretrain.prepare import pool

    unit, path, exact_parts, band_parts = item
    counts = sources.FileCounts(unit.path, Path(unit.path))
    warnings: list[str] = []
    results = []
    sizes = {"chars": pool.UNIT_CHUNK_CHARS, "docs": pool.UNIT_CHUNK_DOCS, "blocks": pool.RAW_GROUP_BY_REFERENCE}
    for k, work in enumerate(pool.chunks_with_origin(unit.batches(counts, warnings.append), **sizes)):
        piece = f"{path}.{k:04d}"
        res = spill_chunk(fn, SpillTask(work, piece, exact_parts, band_parts))
        if res.raw is not None:  # a block's counts: the file's, here (the main process takes `counts`)
            sources.add_raw(counts, *res.raw[1:])
            res.raw = None
        results.append(res)
    if not counts.raw:  # what reading it lost, where the main process's reader would have warned (blocks: at the end)
        sources.warn_counts(counts, unit.text_field, warnings.append)
    fields = {k: v for k, v in asdict(counts).items() if k not in ("name", "path", "bytes_in", "encoding")}
    return UnitResult(unit.file, results, fields, warnings)


def read_small(path: str, n: int = len(SMALL)) -> dict[str, np.ndarray]:
    """A piece file's first `n` `SMALL` arrays (chars, u, origin), without its tokens or texts."""
    with open(path, "rb") as f:
        return {k: np.load(f) for k in SMALL[:n]}


def read_texts(path: str, index: np.ndarray | None = None) -> list[str]:
    """Texts of a piece file that holds texts: those numbered `index` (ascending), or all."""
    with open(path, "rb") as f:
        for _ in SMALL:
            np.load(f)
        offsets = np.load(f)
        at = f.tell()
        if index is None:
            index = np.arange(offsets.size - 1)
        starts, ends = offsets[index].tolist(), offsets[index + 1].tolist()
        if 16 * index.size >= offsets.size:  # many of them: one read, then slices
            blob = f.read()
            return [blob[a:b].decode("utf-8") for a, b in zip(starts, ends)]
        out = []
        for a, b in zip(starts, ends):
            f.seek(at + a)
            out.append(f.read(b - a).decode("utf-8"))
        return out


def _origin_dtype() -> np.dtype:
    from mspretrain.data.origin import RECORD

    return RECORD


def replay_chunk(item: ReplayTask) -> ReplayResult:
    """A spilled chunk (`spill_chunk`) with its dedup decisions: the kept documents of each split,
    in order, written to `dst` as [tokens | lengths (int32) | origin records] per split, and what
    `sink.Sink.take` counts for them. `drop`: bool per cleaned document (exact or near duplicate).
    A piece that holds texts (`text_piece`, a trained tokenizer's run) has its kept documents
    encoded here, with the tokenizer `init_worker` loaded."""
    src, dst, drop, valid_fraction, has_origin, dtype, text_piece = item
    kept = np.flatnonzero(~drop).astype(np.int64)
    if text_piece:
        a = read_small(src)
        flat, kept_lengths = _encode(read_texts(src, kept))
        # per document of the chunk (dropped ones: no tokens), as a given tokenizer's piece holds them
        a["tokens"] = flat
        a["lengths"] = np.zeros(drop.size, dtype=kept_lengths.dtype)
        a["lengths"][kept] = kept_lengths
        a["fallback"] = np.zeros(drop.size, dtype=np.int64)
        a["fallback"][kept] = byte_fallback_counts(flat, kept_lengths)
    else:
        with open(src, "rb") as f:
            a = {k: np.load(f) for k in SMALL + TOKEN_ARRAYS}
    in_valid = a["u"][kept, 0] < valid_fraction
    lengths = a["lengths"]
    out = ReplayResult()
    if has_origin:
        from mspretrain.prepare.sink import FileTally

        out.per_file = FileTally.sums_of(a["origin"]["file"][kept], characters=a["chars"][kept],
                                            tokens=lengths[kept].astype(np.int64) - 1, byte_fallback=a["fallback"][kept])
    pos = 0
    with open(dst, "wb") as f:
        for split, sel in (("train", kept[~in_valid]), ("valid", kept[in_valid])):
            if not sel.size:
                continue
            in_sel = np.zeros(lengths.size, dtype=bool)
            in_sel[sel] = True
            toks = np.ascontiguousarray(a["tokens"][np.repeat(in_sel, lengths)], dtype=dtype)
            lens = lengths[sel].astype(np.int32)
            org = a["origin"][sel] if has_origin else a["origin"][:0]
            parts = [toks.tobytes(), lens.tobytes(), np.ascontiguousarray(org).tobytes()]
            f.write(b"".join(parts))
            out.splits[split] = piece = SplitPiece(at=pos, sizes=(len(parts[0]), len(parts[1]), len(parts[2])), docs=int(sel.size),
                                                   chars=int(a["chars"][sel].sum()), tokens=int(toks.size),
                                                   max_token=int(toks.max()) if toks.size else -1, last_chars=int(a["chars"][sel[-1]]))
            pos += sum(piece.sizes)
    return out


def place_piece(item: PlacePiece) -> None:
    """Copy the sections of a piece file (`replay_chunk`) to the places the main process reserved
    in the output files, then remove the piece. `copies`: (output path, its offset, the piece's
    offset, bytes)."""
    from mspretrain.fsutil import copy_range

    piece, copies = item
    src = os.open(piece, os.O_RDONLY)
    try:
        for path, at, src_at, n in copies:
            if not n:
                continue
            dst = os.open(path, os.O_WRONLY)
            try:
                copy_range(src, src_at, dst, at, n)
            finally:
                os.close(dst)
    finally:
        os.close(src)
    os.unlink(piece)
