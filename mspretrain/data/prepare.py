"""`prepare`: raw text in, a verified data dir out (tokenizer, Megatron shards, manifest).

Pipeline: read (main process, streaming) -> clean + hash [+ MinHash] [+ tokenize] (worker
processes, chunks of ~256 K characters) -> dedup + split + write (main process, input order).
One-document-per-line files in UTF-8 / GB18030 reach the workers as undecoded blocks of whole
lines (`sources.RawLines`): the main process then only reads bytes, dedups and writes, and
stays off the critical path (it used to decode, split and pickle every document).

Design choices:
- Work is cut into chunks in input order and results are consumed in that order, with a
  bounded number in flight, so the output is byte-identical whatever `workers` is, and memory
  stays bounded whatever the corpus size (`multiprocessing.Pool.imap` would read ahead without
  limit).
- With a given tokenizer everything happens in one pass: workers clean and tokenize. When the
  tokenizer must be trained, pass 1 cleans and spools the kept documents to disk (and keeps a
  bounded, uniformly drawn sample for training), then pass 2 tokenizes the spool. Trade-off:
  a spool the size of the cleaned text on disk, instead of cleaning twice.
- The train/valid split is a pure function of (document, seed) (see `dedup.uniforms`). If
  the hash puts no document in one split, the last document of the other split moves there,
  so a small corpus still gets both splits; documents keep their input order.
- Everything is built in a hidden sibling directory `.NAME.partial/` and renamed to NAME only
  when complete (`manifest.json` is written last), so a crash never leaves a data dir that
  looks finished; an existing NAME is replaced only with `overwrite`, and then only the files
  an earlier prepare listed in its manifest (`outputs`): inputs inside NAME are refused, and
  other files in NAME are kept.
- The manifest holds no timestamps or absolute paths: same input + same seed -> same bytes.
"""
from __future__ import annotations

import ctypes
import errno
import heapq
import json
import multiprocessing as mp
import os
import shutil
import struct
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mspretrain import __version__
from mspretrain.config import Config, PrepareConfig, validate
from mspretrain.data import clean, dedup, sources
from mspretrain.data.clean import Cleaner
from mspretrain.data.shards import IndexedDataset, ShardWriter, data_fingerprint, token_dtype
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece
from mspretrain.errors import UserError
from mspretrain.fsutil import fsync_path

CHUNK_CHARS = 1 << 18  # characters per unit of work sent to a worker (~3,000 short documents)
CHUNK_DOCS = 4096
SPLITS = ("train", "valid")
_OUR_FILES = {"manifest.json", "tokenizer.model", "tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx"}
_W: dict = {}  # per-worker state, set by _init_worker
_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


# --------------------------------------------------------------------------- worker side

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


def _init_worker(cfg: PrepareConfig, tokenizer_path: str | None, dtype: str | None) -> None:
    if mp.parent_process() is not None:
        _die_with_parent()
        # HF tokenizers would start a thread per core in every worker process.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _keep_freed_memory()  # a worker process only: the caller's process keeps its settings
    _W.clear()
    _W.update(cfg=cfg, cleaner=Cleaner(cfg), dtype=dtype,
              tok=Tokenizer.load(tokenizer_path) if tokenizer_path else None)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids with EOS after each document, tokens per document incl. EOS)."""
    tok: Tokenizer = _W["tok"]
    return tok.encode_flat(texts, tok.eos_id, np.dtype(_W["dtype"]))


def _clean_chunk(docs: list[str] | sources.RawLines) -> dict:
    raw = None
    if isinstance(docs, sources.RawLines):  # decoded here, in parallel, not in the main process
        block = docs
        docs, dropped, split_long = sources.decode_raw(block)
        raw = (block.file, len(docs), dropped, split_long)
    cfg: PrepareConfig = _W["cfg"]
    cleaner: Cleaner = _W["cleaner"]
    cleaner.changed.clear()
    cleaner.dropped.clear()
    texts = [t for t in cleaner.clean_many(docs) if t is not None]
    keys = dedup.dedup_keys(texts)
    out = {"docs_in": len(docs), "chars_in": sum(map(len, docs)), "changed": dict(cleaner.changed),
           "dropped": dict(cleaner.dropped), "keys": keys,
           "chars": np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)),
           "u": dedup.split_numbers(keys, cfg.seed),
           "sigs": dedup.signatures(texts, cfg.seed) if cfg.near_dedup else None, "raw": raw}
    if _W["tok"] is not None:
        out["tokens"], out["lengths"] = _encode(texts)
    else:
        out["texts"] = texts
    return out


def _tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode(texts)


# --------------------------------------------------------------------------- main side helpers

def _chunks(batches: Iterable[list[str] | sources.RawLines]) -> Iterator[list[str] | sources.RawLines]:
    """Lists of documents of about CHUNK_CHARS characters (at most CHUNK_DOCS documents); a
    `RawLines` block is a chunk of its own (the documents before it go first)."""
    chunk: list[str] = []
    size = 0
    for batch in batches:
        if isinstance(batch, sources.RawLines):
            if chunk:
                yield chunk
                chunk, size = [], 0
            yield batch
            continue
        n = sum(map(len, batch))
        if size + n < CHUNK_CHARS and len(chunk) + len(batch) < CHUNK_DOCS:
            chunk.extend(batch)  # the common case: the whole batch fits
            size += n
            continue
        for item in batch:
            chunk.append(item)
            size += len(item)
            if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def _ordered(pool, fn: Callable, chunks: Iterable, in_flight: int) -> Iterator:
    """Results of fn over chunks, in order, with at most `in_flight` chunks queued."""
    if pool is None:
        yield from map(fn, chunks)
        return
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(fn, (chunk,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _pool(workers: int, *init_args):
    if workers <= 1:
        _init_worker(*init_args)
        return None
    # fork is fast; after MindSpore has started its threads in this process, forking is unsafe.
    method = "spawn" if "mindspore" in sys.modules else "fork"
    if method == "fork":  # build the cleaner's lookup tables once, for all workers to inherit
        clean.warm_up()
    ctx = mp.get_context(method)
    return ctx.Pool(workers, initializer=_init_worker, initargs=init_args)


def _batched(items: Iterable[str], n: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


class _Spool:
    """Length-prefixed UTF-8 documents on disk, between pass 1 and pass 2."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "wb")
        self.documents = 0

    def add_many(self, texts: list[str]) -> None:
        for t in texts:
            b = t.encode("utf-8")
            self._f.write(struct.pack("<I", len(b)) + b)
        self.documents += len(texts)

    def close(self) -> None:
        self._f.close()

    def read(self, progress: Callable[[int], None] | None) -> Iterator[str]:
        with open(self.path, "rb") as f:
            while head := f.read(4):
                (n,) = struct.unpack("<I", head)
                yield f.read(n).decode("utf-8")
                if progress:
                    progress(n + 4)


class _Sink:
    """Dedup, split and hand documents (token arrays or texts) to the two split writers."""

    def __init__(self, cfg: PrepareConfig, outs: dict, sample_chars: int) -> None:
        self.cfg, self.outs = cfg, outs
        self.exact = dedup.ExactDedup()
        self.near = dedup.NearDedup(cfg.near_dedup_threshold, cfg.seed) if cfg.near_dedup else None
        self.changed: Counter = Counter()
        self.dropped: Counter = Counter()
        self.docs_in = self.chars_in = 0
        self.docs = dict.fromkeys(SPLITS, 0)
        self.chars = dict.fromkeys(SPLITS, 0)
        # The latest document of each split is held back until the next one (see finish).
        self.held: dict = dict.fromkeys(SPLITS)
        self.sample: list = []  # bottom-k heap of (-u, order, text) for the tokenizer
        self.sample_chars, self.sample_budget, self.order = 0, sample_chars, 0

    def take(self, r: dict) -> None:
        self.docs_in += r["docs_in"]
        self.chars_in += r["chars_in"]
        self.changed.update(r["changed"])
        self.dropped.update(r["dropped"])
        fresh = self.exact.fresh(r["keys"])  # the one per-document step: the dedup indexes
        kept = np.flatnonzero(np.asarray(fresh, dtype=bool))
        if kept.size < len(fresh):  # (a Counter keeps zero entries, and the manifest would show them)
            self.dropped["exact_dup"] += len(fresh) - kept.size
        if self.near is not None:
            near = np.asarray([self.near.seen(r["sigs"][i]) for i in kept.tolist()], dtype=bool)
            if near.any():
                self.dropped["near_dup"] += int(near.sum())
            kept = kept[~near]
        kept = kept.astype(np.int64)
        in_valid = r["u"][kept, 0] < self.cfg.valid_fraction
        tokens = r.get("tokens")
        if tokens is not None:
            starts = np.cumsum(r["lengths"], dtype=np.int64) - r["lengths"]
        for split, sel in (("train", kept[~in_valid]), ("valid", kept[in_valid])):
            if not sel.size:
                continue
            self.docs[split] += int(sel.size)
            self.chars[split] += int(r["chars"][sel].sum())
            if tokens is None and split == "train" and self.sample_budget:
                for i in sel:
                    self._sample(float(r["u"][i, 1]), r["texts"][i])
            # Each split holds back its latest document, which can still move (see finish).
            if self.held[split] is not None:
                self.outs[split].add_many([self.held[split][0]])
            body, last = sel[:-1], int(sel[-1])
            if tokens is None:
                self.outs[split].add_many([r["texts"][i] for i in body])
                self.held[split] = (r["texts"][last], int(r["chars"][last]))
            else:
                # the tokens of the body documents, in order (`body` is ascending): a mask over
                # documents repeated per token is cheaper than computing every token's position
                in_body = np.zeros(len(r["lengths"]), dtype=bool)
                in_body[body] = True
                self.outs[split].add_flat(tokens[np.repeat(in_body, r["lengths"])], r["lengths"][body])
                self.held[split] = (tokens[starts[last]: starts[last] + r["lengths"][last]].copy(), int(r["chars"][last]))

    def _sample(self, u: float, text: str) -> None:
        heapq.heappush(self.sample, (-u, self.order, text))
        self.order += 1
        self.sample_chars += len(text)
        while self.sample_chars > self.sample_budget and len(self.sample) > 1:
            self.sample_chars -= len(heapq.heappop(self.sample)[2])

    def finish(self) -> list[str]:
        """Write the held documents, moving one across if a split would be empty."""
        notes = []
        moved = None
        if self.docs["valid"] == 0 and self.cfg.valid_fraction > 0 and self.docs["train"] >= 2:
            moved = ("train", "valid")
        elif self.docs["train"] == 0 and self.docs["valid"] >= 1:
            moved = ("valid", "train")
        for split in SPLITS:
            held = self.held[split]
            if held is not None:
                dest = moved[1] if moved and moved[0] == split else split
                self.outs[dest].add_many([held[0]])
        if moved:
            src, dst = moved
            self.docs[src] -= 1
            self.docs[dst] += 1
            self.chars[src] -= self.held[src][1]
            self.chars[dst] += self.held[src][1]
            notes.append(f"the hash split left {dst} empty: moved the last {src} document to {dst}")
        if self.docs["valid"] == 0 and self.cfg.valid_fraction > 0:
            notes.append("the valid split is empty (too few documents): eval will have nothing to measure")
        return notes

    def sample_texts(self) -> list[str]:
        """The tokenizer sample in input order, long documents cut into ≤ 4,096-character pieces."""
        return [p for _, _, t in sorted(self.sample, key=lambda e: e[1]) for p in sources.cut_text(t, 4096)]


# --------------------------------------------------------------------------- output dir

def _owned(out: Path) -> set[str]:
    """Names in `out` that a previous prepare wrote (its manifest's `outputs`; older manifests
    predate that key and get the fixed set prepare has always written). No manifest: none."""
    try:
        m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return set()
    listed = m.get("outputs") if isinstance(m, dict) else None
    if isinstance(listed, list) and all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in listed):
        return set(listed)
    return set(_OUR_FILES)


def _check_out(out: Path, overwrite: bool, inputs: list[Path]) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file", "give a directory path for the data dir")
    root = out.resolve()
    for p in inputs:  # `--overwrite` must never delete or replace what it is reading
        if p == root or root in p.parents:
            raise UserError(f"input {p} is inside --out {out}", "move the input out of the data dir, or choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"output dir {out} already exists and is not empty", "pass --overwrite to replace it, or choose another --out")
        if not (out / "manifest.json").is_file():
            raise UserError(f"output dir {out} holds files that prepare did not write (it has no manifest.json); refusing to replace it",
                            "choose a new --out directory (or empty this one yourself)")
        # Files prepare did not write stay where they are; one with the name of an output would
        # have to be replaced, so that is refused.
        clash = sorted(n for n in _OUR_FILES if (out / n).exists() and n not in _owned(out))
        if clash:
            raise UserError(f"output dir {out} holds {clash[0]}, which no earlier prepare wrote (no manifest lists it); refusing to replace it",
                            "move that file elsewhere, or choose a new --out directory")


def _fsync_all(paths: list[Path]) -> None:
    """fsync files and directories concurrently. On ext4 each fsync waits for a journal commit
    (0.2 s on the shared benchmark box, even for 1 KB), and concurrent fsyncs share commits:
    six one after the other were 0.8 s of serial time at the end of every run."""
    with ThreadPoolExecutor(max(1, len(paths))) as ex:
        list(ex.map(fsync_path, paths))


def _publish(work: Path, out: Path) -> None:
    """Make `work` the data dir `out`. Only files an earlier prepare listed in its manifest are
    removed or replaced; anything else in `out` stays (`_check_out` refused name clashes)."""
    if not out.is_dir():
        os.replace(work, out)
        return
    owned = _owned(out)
    if {p.name for p in out.iterdir()} <= owned:  # all ours: swap the whole dir at once
        old = out.with_name(f".{out.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    # Others' files live here too: replace ours file by file. The old manifest goes first and
    # the new one comes last, so a crash in between leaves a dir that is not a data dir (the
    # loader refuses it) rather than a mix that looks finished.
    (out / "manifest.json").unlink(missing_ok=True)
    fsync_path(out)
    new = {p.name for p in work.iterdir()}
    for name in sorted(owned - new):
        if (out / name).is_file():
            (out / name).unlink()
    for name in sorted(new - {"manifest.json"}):
        os.replace(work / name, out / name)
    fsync_path(out)
    os.replace(work / "manifest.json", out / "manifest.json")
    fsync_path(out)
    shutil.rmtree(work, ignore_errors=True)


def _check_config(cfg: PrepareConfig) -> None:
    # `validate` checks a whole Config and insists on a training budget; prepare needs neither.
    validate(Config(prepare=cfg, train=replace(Config().train, max_steps=1)))


def _progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- prepare

def prepare(inputs: list[str], out_dir: str | Path, cfg: PrepareConfig, *, tokenizer: str | None = None,
            overwrite: bool = False, workers: int | None = None, progress: bool = False,
            log: Callable[[str], None] = print, seq_len: int | None = None) -> dict:
    """Clean, dedup, tokenize `inputs` into the data dir `out_dir`; returns the manifest.

    `tokenizer`: an existing `tokenizer.model` / `tokenizer.json` (or a dir holding one);
    otherwise a SentencePiece BPE of `cfg.vocab_size` is trained on a sample. `seq_len` is only
    used to warn when a split is shorter than one training window.
    """
    t0 = time.time()
    _check_config(cfg)
    cores = len(os.sched_getaffinity(0))
    workers = max(1, int(workers if workers is not None else cores))
    if workers > cores:  # more processes than cores only adds memory and switching: never a fork bomb
        log(f"warning: --workers {workers} is more than the {cores} cores this process may use; using {cores}")
        workers = cores
    out = Path(out_dir).expanduser()
    stats = sources.SourceStats()
    paths = sources.discover(inputs, stats)
    _check_out(out, overwrite, paths)
    given = Tokenizer.load(tokenizer) if tokenizer else None
    if given is not None and given.eos_id < 0:
        raise UserError(f"tokenizer {tokenizer} has no end-of-sequence token", "use a tokenizer with an EOS token such as </s>")
    warnings: list[str] = []

    def warn(msg: str) -> None:
        if len(warnings) < 100:
            warnings.append(msg)
        log(f"warning: {msg}")

    work = out.with_name(f".{out.name}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)  # left over by a crashed run
        work.mkdir()
    except OSError as exc:
        raise UserError(f"cannot create {work}: {exc.strerror}", "choose an --out in a directory you can write to") from None
    try:
        manifest = _run(paths, work, cfg, given, workers, progress, log, warn, stats)
        manifest["inputs"] = [str(i) for i in inputs]
        manifest["warnings"] = warnings
        if seq_len:
            manifest["seq_len"] = seq_len
            for split in SPLITS:
                if manifest["tokens"][split] < seq_len + 1 and (split == "train" or cfg.valid_fraction > 0):
                    warn(f"the {split} split has {manifest['tokens'][split]} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
        # what this prepare wrote: the only files a later `--overwrite` may remove or replace
        manifest["outputs"] = sorted([p.name for p in work.iterdir()] + ["manifest.json"])
        path = work / "manifest.json"
        path.write_text(json.dumps(manifest, ensure_ascii=False, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        # Files and their directory at once: nothing in `work` is visible before `_publish`, so
        # only "all durable before the rename" matters, not the order among them.
        _fsync_all([*sorted(p for p in work.iterdir() if p.is_file()), work])
        _publish(work, out)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        if exc.errno in _WRITE_ERRNOS:  # disk full, file too large, quota, read-only, permission
            where = exc.filename or work
            fix = (f"free disk space where {out} goes (or choose another --out), then run the same command"
                   if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else
                   f"fix the permissions of {where} (or choose another --out)")
            raise UserError(f"prepare stopped: {exc.strerror} ({where}); nothing was published", fix) from None
        raise
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    tok = manifest["tokens"]
    log(f"wrote {out}: {manifest['documents']['train']:,} + {manifest['documents']['valid']:,} documents, "
        f"{tok['train']:,} train + {tok['valid']:,} valid tokens, {manifest['chars_per_token']:.2f} chars/token "
        f"({time.time() - t0:.1f} s)")
    return manifest


def _run(paths, work: Path, cfg: PrepareConfig, given: Tokenizer | None, workers: int, progress: bool,
         log: Callable[[str], None], warn: Callable[[str], None], stats: sources.SourceStats) -> dict:
    in_flight = 2 * workers + 1
    t0 = time.time()
    total_bytes = sum(p.stat().st_size for p in paths)
    log(f"reading {len(paths)} file{'s' * (len(paths) != 1)} ({total_bytes / 1e6:,.1f} MB) with {workers} worker{'s' * (workers != 1)}")
    if given is not None:
        tok_path = given.save_to(work)
        tok = replace(given, path=tok_path)  # the same model: no second parse (serial time before the workers start)
    dtype = token_dtype(given.vocab_size) if given is not None else token_dtype(cfg.vocab_size)
    writers = {s: ShardWriter(work / s, dtype) for s in SPLITS}
    spools = None if given is not None else {s: _Spool(work / f"{s}.spool") for s in SPLITS}
    sink = _Sink(cfg, writers if given is not None else spools, 0 if given is not None else cfg.tokenizer_sample_chars)
    bar = _progress_bar(progress, total_bytes, "clean" if given is None else "clean+tokenize")
    pool = _pool(workers, cfg, str(tok_path) if given is not None else None, dtype.name)
    try:
        docs = sources.iter_batches(paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field,
                                    stats=stats, warn=warn, progress=bar.update if bar else None, raw=True)
        for result in _ordered(pool, _clean_chunk, _chunks(docs), in_flight):
            if result["raw"] is not None:
                sources.count_raw(stats, *result["raw"])
            sink.take(result)
        sources.report_raw_files(stats, warn)
        warnings = sink.finish()
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    for w in warnings:
        warn(w)
    if sink.docs["train"] + sink.docs["valid"] == 0 and stats.files == 0:
        # nothing was read at all: the reason is in the skips, not in the fields or the filters
        why = ", ".join(f"{v} {k}" for k, v in sorted(stats.skipped.items()))
        raise UserError(f"no documents left: all {len(paths)} input file{'s' * (len(paths) != 1)} were skipped ({why})",
                        "the warnings above say why for each file; prepare reads UTF-8 / GB18030 text (.txt, .jsonl, optionally .gz / .zst)")
    if sink.docs["train"] + sink.docs["valid"] == 0:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(sink.dropped.items())) or "none"
        raise UserError(f"no documents left: {sink.docs_in} read, all dropped (dropped: {dropped})",
                        "check the inputs (--text-field for .jsonl, --doc-per-line for .txt), or relax prepare.min_chars and the filters")
    kept = sink.docs["train"] + sink.docs["valid"]
    log(f"kept {kept:,} of {sink.docs_in:,} documents ({sink.chars['train'] + sink.chars['valid']:,} characters, "
        f"{time.time() - t0:.1f} s)")

    tok_info: dict = {"trained": given is None}
    if given is None:
        for s in spools.values():
            s.close()
        sample = sink.sample_texts()
        n_chars = sum(map(len, sample))
        log(f"training a SentencePiece BPE tokenizer (vocab {cfg.vocab_size:,}) on {n_chars:,} characters")
        trained, tok_warnings = train_sentencepiece(sample, work, cfg.vocab_size, character_coverage=cfg.character_coverage,
                                                    num_threads=workers, seed=cfg.seed)
        del sample
        log(f"trained the tokenizer ({time.time() - t0:.1f} s)")
        for w in tok_warnings:
            warn(w)
        tok_path, tok = trained.path, trained
        tok_info.update(sample_characters=n_chars, character_coverage=cfg.character_coverage, warnings=tok_warnings)
        if token_dtype(tok.vocab_size) != dtype:
            raise AssertionError("trained vocab does not fit the planned token dtype")
        bar = _progress_bar(progress, sum(s.path.stat().st_size for s in spools.values()), "tokenize")
        pool = _pool(workers, cfg, str(tok_path), dtype.name)
        try:
            for split in SPLITS:
                texts = _batched(spools[split].read(bar.update if bar else None))
                for flat, lengths in _ordered(pool, _tokenize_chunk, _chunks(texts), in_flight):
                    writers[split].add_flat(flat, lengths)
        finally:
            if pool is not None:
                pool.terminate()
            if bar is not None:
                bar.close()
        for s in spools.values():
            s.path.unlink()
    else:
        tok_info["source"] = str(given.path)
    for w in writers.values():
        w.finalize(fsync=False)  # prepare fsyncs every file of the data dir at once, before publishing
    return _manifest(work, cfg, stats, sink, tok, tok_info, dtype)


def _manifest(work: Path, cfg: PrepareConfig, stats: sources.SourceStats, sink: _Sink, tok: Tokenizer,
              tok_info: dict, dtype: np.dtype) -> dict:
    tokens = {s: int(IndexedDataset(work / s).n_tokens) for s in SPLITS}
    docs = {s: len(IndexedDataset(work / s)) for s in SPLITS}
    if docs != sink.docs:
        raise AssertionError(f"shards hold {docs} documents, the sink counted {sink.docs}")
    characters = sink.chars["train"] + sink.chars["valid"]
    text_tokens = tokens["train"] + tokens["valid"] - docs["train"] - docs["valid"]  # without the EOS
    return {
        "format": "mspretrain-data/1",
        "created_by": f"mspretrain {__version__}",
        "files": stats.to_dict(),
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
        "eos_appended": True,
        "token_dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "special_ids": tok.special_ids(),
        "tokenizer": {"file": tok.path.name, **tok_info},
        "tokenizer_sha256": tok.sha256(),
        "split": {"valid_fraction": cfg.valid_fraction, "seed": cfg.seed,
                  "method": "valid if blake2b(document key, key=seed) / 2^64 < valid_fraction"},
        "fingerprint": data_fingerprint(work),
    }


# --------------------------------------------------------------------------- inspect

def inspect(data_dir: str | Path, n_docs: int = 3, max_chars: int = 200) -> str:
    """A readable summary of a data dir's manifest and the first documents, decoded."""
    d = Path(data_dir).expanduser()
    path = d / "manifest.json"
    if not path.is_file():
        raise UserError(f"{d} has no manifest.json, so it is not a prepared data dir", "run `mspretrain prepare INPUT... --out DATA_DIR` first")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON", "re-run `mspretrain prepare` for this data dir") from None
    if not isinstance(m, dict):
        raise UserError(f"{path} is a JSON {type(m).__name__}, not an object", "re-run `mspretrain prepare` for this data dir")
    tok = Tokenizer.load(d)

    def get(*keys: str) -> object:
        """m[k1][k2]... or "?" when a key is missing or a level is not an object (an old or edited manifest)."""
        v: object = m
        for k in keys:
            v = v.get(k, "?") if isinstance(v, dict) else "?"
        return v

    def num(*keys: str) -> str:
        v = get(*keys)
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

    cpt = get("chars_per_token")
    inputs = get("inputs")
    lines = [
        f"data dir     {d}",
        f"inputs       {', '.join(map(str, inputs)) if isinstance(inputs, list) else inputs}",
        f"files        {get('files', 'files')} read, by encoding {get('files', 'by_encoding')}, skipped {get('files', 'skipped')}, "
        f"{get('files', 'bytes_dropped')} undecodable bytes dropped",
        f"documents    {num('documents_in')} in -> train {num('documents', 'train')}, valid {num('documents', 'valid')}",
        f"characters   {num('characters_in')} in -> {num('characters')} kept",
        f"changed      {get('changed')}",
        f"dropped      {get('dropped')}",
        f"tokens       train {num('tokens', 'train')}, valid {num('tokens', 'valid')} ({get('token_dtype')}, "
        f"{f'{cpt:.2f}' if isinstance(cpt, (int, float)) else cpt} chars/token, EOS after each document)",
        f"tokenizer    {get('tokenizer', 'file')}, vocab {num('vocab_size')}, special ids {get('special_ids')}, "
        f"sha256 {str(get('tokenizer_sha256'))[:16]}",
        f"fingerprint  {get('fingerprint')}",
    ]
    missing = [k for k in ("documents", "tokens", "vocab_size", "fingerprint") if k not in m]
    if missing:
        lines.append(f"note         manifest.json lacks {', '.join(missing)}: not written by this version of prepare, or edited")
    if isinstance(m.get("warnings"), list) and m["warnings"]:
        lines.append(f"warnings     {len(m['warnings'])}: " + "; ".join(map(str, m["warnings"][:3])))
    eos = tok.eos_id
    for split in SPLITS:
        if not (d / f"{split}.idx").is_file():
            lines.append(f"\n[{split}: no {split}.idx]")
            continue
        ds = IndexedDataset(d / split)
        for i in range(min(n_docs if split == "train" else 1, len(ds))):
            ids = ds[i]
            ids = ids[:-1] if len(ids) and ids[-1] == eos else ids
            text = tok.decode(ids.tolist())
            text = text if len(text) <= max_chars else text[:max_chars] + "…"
            lines.append(f"\n[{split} #{i}, {len(ds[i])} tokens]\n{text}")
    return "\n".join(lines)
