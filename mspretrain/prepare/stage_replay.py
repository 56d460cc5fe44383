"""The replay of prepare (`Replay`): pass 1's results again, now that the dedup decisions are
known, to the splits and the outputs; resumed after a kill from its last commit.

Three ways, one chosen per run (`pipeline.chain`): `ReplayTake`, every chunk's documents through
this process (`sink.Sink.take`: with Ray, whose nodes may not share this disk); `ReplayPieces`, a
given tokenizer's run with pass 1's chunks in files, which workers cut into pieces of the outputs;
`ReplaySample`, a trained tokenizer's run with the chunks in files: only the counts and the
tokenizer sample here, the outputs waiting for the encode stage. The same bytes whichever way.
"""
from __future__ import annotations

import heapq
import io
import pickle
import time
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from mspretrain.data.origin import OriginWriter, origin_name
from mspretrain.data.shards import ShardWriter
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write
from mspretrain.paths import SPLITS
from mspretrain.prepare.diskdedup import DiskDedup
from mspretrain.prepare.pool import ordered, start_pool
from mspretrain.prepare.results import ChunkSpool, ReplayResult
from mspretrain.prepare.resume import Journal, point, truncate
from mspretrain.prepare.sink import RefSample, Sink
from mspretrain.prepare.spool import Spool
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.tasks import Copy, PlacePiece, ReplayTask
from mspretrain.prepare.workdir import DEDUP, PIECES, REPLAY_PIECES, SPOOL, split_spool
from mspretrain.prepare.workers import init_worker, place_piece, read_small, replay_chunk

REPLAY_LOG = "replay.log"  # in the state dir: `_replay_take`'s log of the sink's sample and held documents


@dataclass
class Outputs:
    """What a replay writes, reopened at its last commit's lengths: the shard writers (a given
    tokenizer's run), or the per-split spools of the kept texts (a trained tokenizer's run through
    this process), and the origin writers; none on `ReplaySample`'s path (the encode stage writes)."""
    writers: dict[str, ShardWriter] = field(default_factory=dict)
    spools: dict[str, Spool] | None = None
    origins: dict[str, OriginWriter] = field(default_factory=dict)


class Replay(Stage):
    """Pass 1's results again, with their fate known, to the sink; resumed after a kill from
    the last commit. `tokens`: a given tokenizer's run, whose replay writes the shards (its next
    stage is finalize); else the tokenizer is trained next, on the sample the sink kept."""

    name = "replay"
    tokens = False

    def run(self, r: Run, then: str | None) -> None:
        j = r.journal
        dd = r.dedup()
        dd.load_decisions(j.state_path("decisions.npy"))
        r.files.drop(DEDUP)  # (its records: the decisions are in the state dir)
        spool = r.chunk_spool()
        at = j.data.get("replay")  # resumed: the output files are cut back to the last commit
        out = self.outputs(r, at)
        sink = Sink(r.cfg, out.writers if self.tokens else out.spools, 0 if self.tokens else r.cfg.tokenizer_sample_chars, out.origins)
        if at is not None:
            r.log(f"resuming the replay after chunk {at['chunks']:,} of {spool.chunks:,}")
        for w in self.replay(r, dd, spool, sink, out):
            r.warn(w)
        for o in out.origins.values():
            o.close()
        for s in (out.spools or {}).values():
            s.close()
        _check_kept(r, sink)
        self.commit(r, then, sink, out)
        r.files.drop_state(REPLAY_LOG)  # `_replay_take`'s, not needed after the stage's commit
        self.cleanup(r)

    def cleanup(self, r: Run) -> None:
        """Pass 1's chunk spool and chunk files, not needed after the stage's commit."""
        r.files.drop(SPOOL)
        r.files.remove_later(PIECES)

    def outputs(self, r: Run, at: dict | None) -> Outputs:
        """What the replay writes, reopened at `at`'s lengths."""
        writers = {s: ShardWriter(r.files.path(s), r.dtype, at and at["writers"][s]) for s in SPLITS} if self.tokens else {}
        spools = None if self.tokens else {s: Spool(r.files.path(split_spool(s)), at and at["writers"][s]) for s in SPLITS}
        return Outputs(writers, spools, {s: OriginWriter(r.files.path(origin_name(s)), at and at["origins"][s]) for s in SPLITS})

    @abstractmethod
    def replay(self, r: Run, dd: DiskDedup, spool: ChunkSpool, sink: Sink, out: Outputs) -> list[str]:
        """Every chunk to the sink; the notes of the split move (`Sink.finish`): ReplayTake, ReplayPieces, ReplaySample."""

    def commit(self, r: Run, then: str | None, sink: Sink, out: Outputs) -> None:
        j, files, writers, origins = r.journal, r.files, out.writers, out.origins
        if self.tokens:
            r.save_state(then, sink=sink, tok_info={"trained": False, "source": str(r.given.path)})
            j.commit(fsync=[*(f for w in writers.values() for f in w.files()), *(files.path(origin_name(s)) for s in SPLITS), j.state_dir],
                     stage=then, state=then, writers={s: w.state() for s, w in writers.items()},
                     origin_records={s: o.records for s, o in origins.items()})
            for w in writers.values():
                w.close()
        else:
            r.save_state(then, sink=sink)
            j.commit(fsync=[*(files.path(split_spool(s)) for s in SPLITS), *(files.path(origin_name(s)) for s in SPLITS), j.state_dir],
                     stage=then, state=then, origin_records={s: o.records for s, o in origins.items()})


class ReplayTake(Replay):
    """Every chunk's documents through this process (`Sink.take`): the chunk spool holds whole
    results. `tokens`: to the shards (a given tokenizer), else to the spools the encode stage reads."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens

    def replay(self, r: Run, dd: DiskDedup, spool: ChunkSpool, sink: Sink, out: Outputs) -> list[str]:
        return _replay_take(spool, sink, dd, out.writers if self.tokens else out.spools, out.origins, r.journal)

    def __repr__(self) -> str:
        return f"ReplayTake(tokens={self.tokens})"


class ReplayPieces(Replay):
    """A given tokenizer's run with pass 1's chunks in files: workers cut them into the outputs."""

    tokens = True

    def replay(self, r: Run, dd: DiskDedup, spool: ChunkSpool, sink: Sink, out: Outputs) -> list[str]:
        return PieceReplay(r, "replay", dd, spool, sink, out).run()


class ReplaySample(Replay):
    """A trained tokenizer's run with pass 1's chunks in files (their texts stay there until the
    encode stage): the counts, the split move and the tokenizer sample by reference."""

    def outputs(self, r: Run, at: dict | None) -> Outputs:
        return Outputs()

    def replay(self, r: Run, dd: DiskDedup, spool: ChunkSpool, sink: Sink, out: Outputs) -> list[str]:
        notes, sink.moved, sink.sample = _replay_sample(r, dd, spool, sink)
        return notes

    def commit(self, r: Run, then: str | None, sink: Sink, out: Outputs) -> None:
        r.save_state(then, sink=sink)  # pass 1's chunk files and spool stay for the encode stage
        r.journal.commit(fsync=[r.journal.state_dir], stage=then, state=then, moved=list(sink.moved) if sink.moved else None)

    def cleanup(self, r: Run) -> None:
        pass  # pass 1's chunk files and spool stay: the encode stage reads the texts from them


# the quality stage's drop reasons (`scoring.REASONS`): the filter, and the settings that decide it
FILTER_KEYS = {"contaminated": ("decontamination", "prepare.decontam / prepare.decontam_ngram"),
               "language": ("language filter", "prepare.min_zh_prob"),
               "perplexity": ("perplexity band", "prepare.ppl_min / ppl_max / ppl_quantiles"),
               "quality": ("quality classifier", "prepare.quality_threshold / quality_top_fraction")}


def _check_kept(r: Run, sink: Sink) -> None:
    """Refuse a run that kept no document, saying why; else log what it kept."""
    if sink.docs["train"] + sink.docs["valid"] == 0 and r.stats.files == 0:
        # nothing was read at all: the reason is in the skips, not in the fields or the filters
        why = ", ".join(f"{v} {k}" for k, v in sorted(r.stats.skipped.items()))
        raise UserError(f"no documents left: all {len(r.paths)} input file{'s' * (len(r.paths) != 1)} were skipped ({why})",
                        "the warnings above say why for each file; prepare reads UTF-8 / GB18030 text (.txt, .jsonl, optionally .gz / .zst)")
    if sink.docs["train"] + sink.docs["valid"] == 0:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(sink.dropped.items())) or "none"
        by_filter = {k: v for k, v in sink.dropped.items() if k in FILTER_KEYS and v}
        if by_filter and 2 * sum(by_filter.values()) >= sum(sink.dropped.values()):
            # the quality filters dropped (most of) them: name them, not the inputs
            worst = max(by_filter, key=lambda k: by_filter[k])
            raise UserError(f"no documents left: {sink.docs_in} read, all dropped, {sum(by_filter.values()):,} of them by the quality "
                            f"filters (dropped: {dropped}); the {FILTER_KEYS[worst][0]} dropped the most",
                            f"relax {FILTER_KEYS[worst][1]} (see what each threshold keeps with prepare --inspect on a run that "
                            "keeps some), or check the model against these inputs")
        raise UserError(f"no documents left: {sink.docs_in} read, all dropped (dropped: {dropped})",
                        "check the inputs (--text-field for .jsonl, --doc-per-line for .txt), or relax prepare.min_chars and the filters")
    kept = sink.docs["train"] + sink.docs["valid"]
    r.log(f"kept {kept:,} of {sink.docs_in:,} documents ({sink.chars['train'] + sink.chars['valid']:,} characters, "
          f"{time.time() - r.t0:.1f} s)")


def _replay_take(spool: ChunkSpool, sink: Sink, dd: DiskDedup, outs: dict, origins: dict[str, OriginWriter], j: Journal) -> list[str]:
    """The replay through `Sink.take` (the chunk spool holds whole results: a trained tokenizer,
    or Ray), resumable per chunk. Every `commit_seconds()` the journal's "replay" names the chunks
    taken, where the next starts in the spool, the outputs' lengths and the sink's counters. What
    the sink holds beyond counters, the held-back document of each split and the tokenizer
    sample (up to `prepare.tokenizer_sample_chars`, 20 M characters), goes to an append-only log
    in the state dir instead, so that a commit writes only what changed since the last one: the
    sample's new members (texts), the numbers of those that left, and the held documents."""
    at = j.data.get("replay")
    path = j.state_path(REPLAY_LOG)
    live: set[int] = set()  # the sample members (their `order`) the log holds as of the last commit
    if at is None:
        skip, docs, offset = 0, 0, 0
        open(path, "wb").close()
    else:
        skip, docs, offset = at["chunks"], at["docs"], at["spool_bytes"]
        _restore_counts(sink, at["sink"])
        sink.sample_chars, sink.order = at["sample_chars"], at["order"]
        truncate(path, at["log_bytes"])  # a torn record after the commit
        members: dict[int, tuple] = {}
        with open(path, "rb") as f:
            while f.tell() < at["log_bytes"]:
                kind, *rec = pickle.load(f)
                if kind == "add":
                    members[rec[1]] = tuple(rec)
                elif kind == "del":
                    members.pop(rec[0])
                else:
                    sink.held, sink.held_origin = rec
        sink.sample = list(members.values())
        heapq.heapify(sink.sample)  # (-u, order) are unique: the same pops as the uninterrupted heap
        live.update(members)
    f_log = open(path, "ab")

    def flush() -> None:  # every buffered byte to the files: before a commit (and a test's kill: the uncommitted tail)
        for o in outs.values():
            o.state()
        for o in origins.values():
            o.seek_end()

    def commit(chunks: int, end: int) -> None:
        now = {e[1]: e for e in sink.sample}
        for o in sorted(live - now.keys()):
            pickle.dump(("del", o), f_log, protocol=5)
        for o in sorted(now.keys() - live):
            pickle.dump(("add", *now[o]), f_log, protocol=5)
        live.clear()
        live.update(now)
        pickle.dump(("held", sink.held, sink.held_origin), f_log, protocol=5)
        f_log.flush()
        flush()  # the origin records too: buffered in this process, they were lost to a kill after the commit
        j.commit(fsync=[path, *(f for o in outs.values() for f in o.files()), *(o.path for o in origins.values())], background=True,
                 replay={"chunks": chunks, "docs": docs, "spool_bytes": end, "log_bytes": f_log.tell(),
                         "writers": {s: o.state() for s, o in outs.items()}, "origins": {s: o.records for s, o in origins.items()},
                         "sink": _counts(sink), "sample_chars": sink.sample_chars, "order": sink.order})

    try:
        for i, (result, end) in enumerate(spool.read_from(offset, skip), skip):
            n = len(result.chars)
            sink.take(result, *dd.dropped(docs, docs + n))
            docs += n
            point(f"replay {i + 1}", flush)
            if j.due():
                commit(i + 1, end)
    finally:
        f_log.close()
    return sink.finish()


class PieceReplay:
    """The replay when pass 1's chunks are in files, run by two stages: workers cut each chunk
    into its kept documents' shard and origin pieces (`workers.replay_chunk`, one `ReplayTask`);
    here, per chunk, only the counts and each piece's place in the outputs, in order, where a
    worker copies it (`workers.place_piece`, one `PlacePiece`: in the kernel). Same bytes as
    `Sink.take`: each split's documents in input order, and at the end the move of `Sink.finish`.

    Resumable: every `commit_seconds()` the journal's entry of the stage names the chunks done,
    the writers' lengths and the sink's counters (a few hundred bytes: the pieces path holds no
    documents and no tokenizer sample); `Replay.outputs` cut the outputs back to them, and the
    chunks after the commit are cut and placed again (pass 1's chunk files stay until the
    stage's last commit).

    `stage` "replay" (`ReplayPieces`, a given tokenizer's run: the pieces hold tokens) counts
    what the sink counts and plans the split move. "encode" (`EncodePieces`, a trained
    tokenizer's run, its pieces hold texts): the same after training, with the workers encoding
    with the trained tokenizer (`Run.tok`); the sink's counts and the move were settled by the
    replay (`_replay_sample`, the journal's "moved"), so only the per-file tallies are added here."""

    def __init__(self, r: Run, stage: str, dd: DiskDedup, spool: ChunkSpool, sink: Sink, out: Outputs,
                 done_chunk: Callable[[int], object] | None = None) -> None:
        """`out`: the shard and origin writers, reopened at the stage's last commit; `done_chunk`:
        called with each chunk's number once it is placed (the encode stage's progress bar)."""
        self.r, self.stage, self.dd, self.spool, self.sink = r, stage, dd, spool, sink
        self.writers, self.origins, self.done_chunk = out.writers, out.origins, done_chunk
        self.counting = stage == "replay"
        j = r.journal
        self.tok_path = None if self.counting else str(r.tok.path)
        self.moved: tuple[str, str] | None = None if self.counting or not j.data.get("moved") else tuple(j.data["moved"])
        self.src = r.files.path(PIECES)
        self.dst = r.files.fresh(REPLAY_PIECES)
        at = j.data.get(stage)
        self.skip = at["chunks"] if at is not None else 0
        self.last_chars: dict[str, int] = {}
        if at is not None:
            _restore_counts(sink, at["sink"])
            self.last_chars.update(at["last_chars"])
        self.counted: deque = deque()  # per chunk sent out: what `Sink.count` adds when its result is in
        self.placing: deque = deque()  # `place_piece` tasks out: each chunk's pieces copied into the outputs
        self.workers = r.local_workers()
        self.in_flight = 2 * self.workers + 1
        self.pool = None

    def tasks(self) -> Iterator[ReplayTask]:
        """Every chunk after the last commit, with its dedup decisions."""
        done = 0
        for i, meta in enumerate(self.spool.read()):
            n = meta.n
            exact, near = self.dd.dropped(done, done + n)
            done += n
            if i < self.skip:  # committed: only its documents' place in the dedup decisions is needed
                continue
            if self.counting:
                self.counted.append((meta, exact, near))
            piece = meta.piece or f"{i:08d}"  # (named by work item since compressed files are items of several chunks)
            yield ReplayTask(str(self.src / piece), str(self.dst / f"{i:08d}"), exact | near, self.r.cfg.valid_fraction,
                             meta.has_origin, self.r.dtype, meta.text_piece)

    def drain(self) -> None:
        while self.placing:
            self.placing.popleft().get()

    def commit(self, chunks: int) -> None:
        self.drain()  # every piece up to `chunks` in its place before the files are fsynced
        writers, origins = self.writers, self.origins
        self.r.journal.commit(
            fsync=[*(f for w in writers.values() for f in w.files()), *(o.path for o in origins.values())], background=True,
            **{self.stage: {"chunks": chunks, "writers": {s: w.state() for s, w in writers.items()},
                            "origins": {s: o.records for s, o in origins.items()}, "last_chars": dict(self.last_chars),
                            "sink": _counts(self.sink)}})

    def place(self, i: int, res: ReplayResult) -> None:
        """Chunk `i`'s pieces: counted, their places reserved in the outputs, copied there by a worker."""
        sink = self.sink
        if self.counting:
            sink.count(*self.counted.popleft())  # in chunk order, as `Sink.take` counts, and only what is placed
        if res.per_file is not None:
            sink.per_file.merge(res.per_file)
        copies = []
        for split, p in res.splits.items():
            if self.counting:
                sink.docs[split] += p.docs
                sink.chars[split] += p.chars
            n_tok, n_len, n_org = p.sizes
            writer, origin = self.writers[split], self.origins[split]
            at_bin, at_len = writer.reserve(n_tok, n_len, p.max_token)
            w_bin, w_len = writer.files()
            copies += [Copy(str(w_bin), at_bin, p.at, n_tok), Copy(str(w_len), at_len, p.at + n_tok, n_len),
                       Copy(str(origin.path), origin.reserve(n_org), p.at + n_tok + n_len, n_org)]
            self.last_chars[split] = p.last_chars
        task = PlacePiece(str(self.dst / f"{i:08d}"), copies)
        if self.pool is None:
            place_piece(task)
        else:
            self.placing.append(self.pool.apply_async(place_piece, (task,)))
            while len(self.placing) > self.in_flight or (self.placing and self.placing[0].ready()):
                self.placing.popleft().get()

    def run(self) -> list[str]:
        """Every chunk to the outputs; the notes of the split move (`Sink.count_move`) when counting."""
        j, stage = self.r.journal, self.stage
        for o in self.origins.values():
            o.seek_end()  # the header on disk before the workers write after it
        todo = self.spool.chunks - self.skip
        # one chunk: no pool to start
        self.pool = start_pool(self.workers if todo > 1 else 1, init_worker, (self.r.cfg, self.tok_path, self.r.dtype.name))
        try:
            for i, res in enumerate(ordered(self.pool, replay_chunk, self.tasks(), self.in_flight), self.skip):
                self.place(i, res)
                if self.done_chunk is not None:
                    self.done_chunk(i)
                point(f"{stage} {i + 1}", self.drain)
                if j.due():
                    self.commit(i + 1)
            self.drain()
        finally:
            if self.pool is not None:
                self.pool.terminate()
        for w in (*self.writers.values(), *self.origins.values()):
            w.seek_end()
        moved = self.sink.planned_move() if self.counting else self.moved
        if moved:
            self.move_last(*moved)
        self.r.files.drop(REPLAY_PIECES)
        return self.sink.count_move(moved, self.last_chars[moved[0]] if moved else 0) if self.counting else []

    def move_last(self, a: str, b: str) -> None:
        """The split move (`Sink.finish`): the last document of split `a` appended to `b`.
        `peek_last` leaves the source's bytes until `finalize` cuts them to the counts of the
        commit after this, so a kill before that commit resumes from the last one."""
        writers, origins = self.writers, self.origins
        last = writers[a].peek_last()
        writers[b].add_flat(last, np.array([last.size], dtype=np.int32))
        if origins[a].records:
            origins[b].add(origins[a].peek_last())
        point(f"{self.stage} moved", lambda: (writers[b].state(), origins[b].seek_end()))  # flushed: the tail a kill leaves


def _replay_sample(r: Run, dd: DiskDedup, spool: ChunkSpool, sink: Sink) -> tuple[list[str], tuple[str, str] | None, RefSample]:
    """The replay of a trained tokenizer's run when pass 1's chunks are in files (their texts
    stay there until the encode stage): per chunk, the dedup decisions and the split of its
    documents from their per-document arrays (`workers.read_small`: characters and split numbers,
    24 bytes a document), the sink's counts, and the tokenizer sample as references
    (`sink.RefSample`: the same members as `Sink._sample`). Returns the notes of the split move
    (`Sink.finish`'s), the move (done on the shards in the encode stage), and the sample.

    Resumable: every `commit_seconds()` the journal's "replay" names the chunks done, the sink's
    counters and the sample's state, saved to a file of the state dir named by the commit."""
    j, cfg = r.journal, r.cfg
    src = r.files.path(PIECES)
    at = j.data.get("replay")
    skip = at["chunks"] if at is not None else 0
    last_chars: dict[str, int] = {}
    sample = RefSample(cfg.tokenizer_sample_chars)
    if at is not None:
        _restore_counts(sink, at["sink"])
        last_chars.update(at["last_chars"])
        sample.restore(np.load(j.state_path(at["sample_file"])), at["sample_chars"], at["order"])

    def commit(chunks: int) -> None:
        name = f"sample-{chunks:08d}.npy"
        buf = io.BytesIO()
        np.save(buf, sample.state())
        atomic_write(j.state_path(name), buf.getvalue())  # a new file per commit: the journal names the one it holds
        old = (j.data.get("replay") or {}).get("sample_file")
        j.commit(replay={"chunks": chunks, "sink": _counts(sink), "last_chars": dict(last_chars), "sample_file": name,
                         "sample_chars": sample.chars, "order": sample.order})
        if old and old != name:
            r.files.drop_state(old)

    # here, not in workers: reading 24 bytes a document from the page cache costs this process
    # less than the same arrays pickled through a pool's pipes (measured: docs/benchmarks/prepare.md)
    done = 0
    for i, meta in enumerate(spool.read()):
        n = meta.n
        exact, near = dd.dropped(done, done + n)
        done += n
        if i < skip:
            continue
        a = read_small(str(src / meta.piece or f"{i:08d}"), 2)  # chars and u
        sink.count(meta, exact, near)
        kept = np.flatnonzero(~(exact | near)).astype(np.int64)
        in_valid = a["u"][kept, 0] < cfg.valid_fraction
        for split, sel in (("train", kept[~in_valid]), ("valid", kept[in_valid])):
            if sel.size:
                sink.docs[split] += int(sel.size)
                sink.chars[split] += int(a["chars"][sel].sum())
                last_chars[split] = int(a["chars"][sel[-1]])
                if split == "train" and sample.budget:
                    sample.feed(a["u"][sel, 1], a["chars"][sel], i, sel)
        point(f"replay {i + 1}")
        if j.due():
            commit(i + 1)
    moved = sink.planned_move()
    return sink.count_move(moved, last_chars[moved[0]] if moved else 0), moved, sample


def _counts(sink: Sink) -> dict:
    """The counters of a sink on the pieces path, for the journal (JSON; Counters keep their order)."""
    return {"docs_in": sink.docs_in, "chars_in": sink.chars_in, "changed": list(sink.changed.items()),
            "dropped": list(sink.dropped.items()), "docs": dict(sink.docs), "chars": dict(sink.chars),
            "per_file": {k: v.tolist() for k, v in sink.per_file.sums.items()}}


def _restore_counts(sink: Sink, c: dict) -> None:
    sink.docs_in, sink.chars_in = c["docs_in"], c["chars_in"]
    sink.changed.clear()
    sink.changed.update(dict(c["changed"]))
    sink.dropped.clear()
    sink.dropped.update(dict(c["dropped"]))
    sink.docs.update(c["docs"])
    sink.chars.update(c["chars"])
    sink.per_file.sums = {k: np.asarray(v, dtype=np.int64) for k, v in c["per_file"].items()}
