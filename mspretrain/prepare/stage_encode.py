"""The tokenizer and encode stages of a run that trains its tokenizer: `TrainTokenizer` (a
SentencePiece BPE on the replay's sample), then the kept documents encoded into the shards, from
pass 1's chunk files by workers (`EncodePieces`) or from the spools the replay wrote
(`EncodeSpools`, with Ray)."""
from __future__ import annotations

import time
from abc import abstractmethod
from pathlib import Path

import numpy as np

from mspretrain.data.origin import OriginWriter, origin_name, read_records
from mspretrain.data.shards import ShardWriter, token_dtype
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece
from mspretrain.paths import SPLITS
from mspretrain.prepare import clean, sources
from mspretrain.prepare.pool import batched, chunks, ordered, start_pool
from mspretrain.prepare.progress import progress_bar
from mspretrain.prepare.resume import point
from mspretrain.prepare.sink import RefSample, Sink
from mspretrain.prepare.spool import read_spool
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.stage_replay import Outputs, PieceReplay
from mspretrain.prepare.workdir import DEDUP, PIECES, split_spool
from mspretrain.prepare.workers import init_worker, read_texts, tokenize_chunk


class TrainTokenizer(Stage):
    """A SentencePiece BPE trained on the sample the replay kept (redone whole after a kill)."""

    name = "train"

    def run(self, r: Run, then: str | None) -> None:
        j, cfg = r.journal, r.cfg
        sink = r.load_state("train")["sink"]
        # the texts of the sample: from pass 1's chunk files, or held by the sink
        if isinstance(sink.sample, RefSample):
            sample = _gather_sample(r.files.path(PIECES), sink.sample.members(), _piece_names(r))
        else:
            sample = sink.sample_texts()
        n_chars = sum(map(len, sample))
        r.log(f"training a SentencePiece BPE tokenizer (vocab {cfg.vocab_size:,}) on {n_chars:,} characters")
        trained, tok_warnings = train_sentencepiece(sample, r.files.root, cfg.vocab_size,  # its `tokenizer.model` (`workdir.NAMES`)
                                                    character_coverage=cfg.character_coverage,
                                                    num_threads=r.local_workers(), seed=cfg.seed)
        del sample
        sink.sample = []  # not needed again: the later states stay small
        point("trained")
        r.log(f"trained the tokenizer ({time.time() - r.t0:.1f} s)")
        for w in tok_warnings:
            r.warn(w)
        if token_dtype(trained.vocab_size) != r.dtype:
            raise AssertionError("trained vocab does not fit the planned token dtype")
        tok_info = {"trained": True, "sample_characters": n_chars, "character_coverage": cfg.character_coverage,
                    "warnings": tok_warnings}
        r.save_state(then, sink=sink, tok_info=tok_info)
        j.commit(fsync=[trained.path, j.state_dir, r.files.root], stage=then, state=then, tokenizer_file=trained.path.name)


class Encode(Stage):
    """The kept documents encoded with the trained tokenizer into the shards; resumed from its
    last commit."""

    name = "encode"

    def run(self, r: Run, then: str | None) -> None:
        j = r.journal
        saved = r.load_state("encode")
        sink, tok_info = saved["sink"], saved["tok_info"]
        r.tok = Tokenizer.load(r.files.path(j.data["tokenizer_file"]))
        writers, fsync, records = self.encode(r, sink)
        r.save_state(then, sink=sink, tok_info=tok_info)
        j.commit(fsync=[*(f for w in writers.values() for f in w.files()), *fsync, j.state_dir],
                 stage=then, state=then, writers={s: w.state() for s, w in writers.items()}, **records)
        self.cleanup(r)
        for w in writers.values():
            w.close()
        for s in SPLITS:
            r.files.drop(split_spool(s))

    @abstractmethod
    def encode(self, r: Run, sink: Sink) -> tuple[dict[str, ShardWriter], list[Path], dict]:
        """(the shard writers, more files to fsync, more fields of the stage's commit): EncodePieces, EncodeSpools."""

    def cleanup(self, r: Run) -> None:
        pass


class EncodePieces(Encode):
    """Pass 1's chunk files hold the texts: encoded and placed per chunk by workers."""

    def encode(self, r: Run, sink: Sink) -> tuple[dict[str, ShardWriter], list[Path], dict]:
        writers, origins = _encode_pieces(r, sink)
        return writers, [r.files.path(origin_name(s)) for s in SPLITS], {"origin_records": {s: o.records for s, o in origins.items()}}

    def cleanup(self, r: Run) -> None:
        r.files.remove_later(PIECES)


class EncodeSpools(Encode):
    """The spools the replay wrote, tokenized by the workers (local or Ray) in order."""

    def encode(self, r: Run, sink: Sink) -> tuple[dict[str, ShardWriter], list[Path], dict]:
        return _encode(r, sink), [], {}


def _piece_names(r: Run) -> list[str]:
    """The file of each of pass 1's chunks in `PIECES`, in chunk order (named by work item: a
    compressed file's chunks are `ITEM.NNNN`), from the chunk spool."""
    return [meta.piece or f"{i:08d}" for i, meta in enumerate(r.chunk_spool().read())]


def _gather_sample(pieces: Path, members: np.ndarray, names: list[str]) -> list[str]:
    """The texts of the sample's members ((chunk, index) in input order) from pass 1's chunk
    files in `pieces` (`names`: `_piece_names`), as `Sink.sample_texts` gives them: long
    documents cut into ≤ 4,096-character pieces."""
    texts: list[str] = []
    if not members.size:
        return texts
    bounds = np.flatnonzero(np.diff(members[:, 0])) + 1  # runs of one chunk (input order: ascending)
    for run in np.split(members, bounds):
        texts += read_texts(str(pieces / names[int(run[0, 0])]), run[:, 1])
    return [p for t in texts for p in sources.cut_text(t, 4096)]


def _encode_pieces(r: Run, sink: Sink) -> tuple[dict[str, ShardWriter], dict[str, OriginWriter]]:
    """The encode stage when pass 1's chunk files hold the texts (a trained tokenizer, local
    workers): the replay's `PieceReplay` once more, its workers encoding each chunk's kept
    documents with the trained tokenizer, and the split move `_replay_sample` planned. Resumed
    from its last commit (the journal's "encode"); pass 1's chunk files and spool stay until the
    stage's end."""
    j, files = r.journal, r.files
    at = j.data.get("encode")
    dd = r.dedup()
    dd.load_decisions(j.state_path("decisions.npy"))
    files.drop(DEDUP)  # (its records: the decisions are in the state dir)
    spool = r.chunk_spool()
    writers = {s: ShardWriter(files.path(s), r.dtype, at and at["writers"][s]) for s in SPLITS}
    origins = {s: OriginWriter(files.path(origin_name(s)), at and at["origins"][s]) for s in SPLITS}
    pieces = files.path(PIECES)
    sizes = [f.stat().st_size if f.exists() else 0 for f in (pieces / name for name in _piece_names(r))]
    bar = progress_bar(r.progress, sum(sizes), "tokenize")
    if bar is not None and at is not None:
        bar.update(sum(sizes[: at["chunks"]]))
    try:
        PieceReplay(r, "encode", dd, spool, sink, Outputs(writers, None, origins),
                    done_chunk=(lambda i: bar.update(sizes[i])) if bar is not None else None).run()
    finally:
        if bar is not None:
            bar.close()
    for o in origins.values():
        o.close()
    return writers, origins


def _encode(r: Run, sink: Sink) -> dict[str, ShardWriter]:
    """Pass 2: the spools tokenized into the shard writers, from the last commit on."""
    j, files, cfg, tok, dtype, workers = r.journal, r.files, r.cfg, r.tok, r.dtype, r.workers
    at = j.data.get("pass2") or {"split": 0, "docs": 0, "writers": None, "per_file": None}
    writers = {s: ShardWriter(files.path(s), dtype, at["writers"][s] if at["writers"] else None) for s in SPLITS}
    if at["per_file"] is not None:
        sink.per_file.sums = {k: np.asarray(v, dtype=np.int64) for k, v in at["per_file"].items()}

    def commit(split: int, docs: int) -> None:
        states = {s: w.state() for s, w in writers.items()}
        j.commit(fsync=[f for w in writers.values() for f in w.files()], background=True,
                 pass2={"split": split, "docs": docs, "writers": states,
                        "per_file": {k: v.tolist() for k, v in sink.per_file.sums.items()}})

    in_flight = 2 * workers + 1
    spool_paths = {s: files.path(split_spool(s)) for s in SPLITS}
    bar = progress_bar(r.progress, sum(p.stat().st_size for p in spool_paths.values()), "tokenize")
    pool = start_pool(workers, init_worker, (cfg, str(tok.path), dtype.name), warm_up=clean.warm_up, ray=r.ray)
    try:
        for i, split in enumerate(SPLITS):
            if i < at["split"]:
                continue
            done = at["docs"] if i == at["split"] else 0
            texts = batched(read_spool(spool_paths[split], bar.update if bar else None, skip=done))
            in_files = read_records(files.path(origin_name(split)))["file"]  # the spooled documents' input files, in order
            for n, (flat, lengths, fallback) in enumerate(ordered(pool, tokenize_chunk, chunks(texts), in_flight), 1):
                writers[split].add_flat(flat, lengths)
                sink.per_file.add(in_files[done: done + lengths.size], documents=np.zeros(lengths.size),
                                  tokens=lengths.astype(np.int64) - 1, byte_fallback=fallback)
                done += lengths.size
                point(f"encode {split} {n}", writers[split].state)
                if j.due():
                    commit(i, done)
            commit(i + 1, 0)
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return writers
