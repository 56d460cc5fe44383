"""The main-process side of `prepare` after pass 1: apply the dedup decisions, the train/valid split, the tokenizer sample.

Design choices:
- The split is a pure function of (document, seed) (see `dedup.uniforms`). If the hash puts no
  document in one split, the last document of the other split moves there, so a small corpus
  still gets both splits; documents keep their input order.
- The tokenizer sample is a bottom-k of the same per-document uniforms: a uniform sample of the
  train documents, bounded in characters, whatever the corpus size.
"""
from __future__ import annotations

import heapq
import os
from collections import Counter

import numpy as np

from mspretrain.config.schema import PrepareConfig
from mspretrain.data.origin import OriginWriter
from mspretrain.paths import SPLITS
from mspretrain.prepare import sources
from mspretrain.prepare.results import ChunkResult


class FileTally:
    """Per input file (index into `SourceStats.per_file`), over the documents that reach the
    shards: documents, characters, tokens without the EOS and byte-fallback tokens; the
    manifest's `input_tokens`. Summed per chunk (`np.bincount`), never per document in Python."""

    KEYS = ("documents", "characters", "tokens", "byte_fallback")

    def __init__(self) -> None:
        self.sums = {k: np.zeros(0, dtype=np.int64) for k in self.KEYS}

    def add(self, files: np.ndarray, **values: np.ndarray) -> None:
        self.merge(self.sums_of(files, **values))

    @staticmethod
    def sums_of(files: np.ndarray, **values: np.ndarray) -> dict[str, np.ndarray]:
        """One chunk's sums per file (what `add` adds; a worker computes them, `merge` adds them)."""
        if not files.size:
            return {}
        files = files.astype(np.int64)
        values.setdefault("documents", np.ones(files.size, dtype=np.int64))
        n = int(files.max()) + 1
        return {k: np.bincount(files, weights=v, minlength=n).round().astype(np.int64) for k, v in values.items()}

    def merge(self, sums: dict[str, np.ndarray]) -> None:
        for k, got in sums.items():
            have = self.sums[k]
            if have.size < got.size:
                have = np.concatenate([have, np.zeros(got.size - have.size, dtype=np.int64)])
            have[: got.size] += got
            self.sums[k] = have

    def get(self, key: str, file: int) -> int:
        v = self.sums[key]
        return int(v[file]) if file < v.size else 0


class Sink:
    """Dedup, split and hand documents (token arrays or texts) to the two split writers.

    The one place that sees each document's fate: in `take`, `sel` holds a chunk's kept
    documents of one split in output order (the last one is held back, and `finish` may move it
    to the other split). The origin index (`origins`, one writer per split) follows the same
    hold-back and move, so its records stay aligned with the shards' documents.
    """

    def __init__(self, cfg: PrepareConfig, outs: dict, sample_chars: int, origins: dict[str, OriginWriter] | None = None) -> None:
        self.cfg, self.outs, self.origins = cfg, outs, origins
        self.held_origin: dict = dict.fromkeys(SPLITS)  # the origin of the held document
        self.per_file = FileTally()
        self.changed: Counter = Counter()
        self.dropped: Counter = Counter()
        self.docs_in = self.chars_in = 0
        self.docs = dict.fromkeys(SPLITS, 0)
        self.chars = dict.fromkeys(SPLITS, 0)
        # The latest document of each split is held back until the next one (see finish).
        self.held: dict = dict.fromkeys(SPLITS)
        # (from, to) of the split move when it is done on the shards after the replay (a trained
        # tokenizer's run with pass 1's chunks in files: `stage_replay.ReplaySample`)
        self.moved: tuple[str, str] | None = None
        self.sample: list | RefSample = []  # bottom-k heap of (-u, order, text) for the tokenizer, or `RefSample`
        self.sample_chars, self.sample_budget, self.order = 0, sample_chars, 0

    def count(self, r: ChunkResult, exact_dup: np.ndarray, near_dup: np.ndarray) -> None:
        """What a chunk read, what cleaning changed and dropped, and the duplicates dropped."""
        self.docs_in += r.docs_in
        self.chars_in += r.chars_in
        self.changed.update(r.changed)
        self.dropped.update(r.dropped)
        # (a Counter keeps zero entries, and the manifest would show them)
        if exact_dup.any():
            self.dropped["exact_dup"] += int(exact_dup.sum())
        if near_dup.any():
            self.dropped["near_dup"] += int(near_dup.sum())

    def take(self, r: ChunkResult, exact_dup: np.ndarray, near_dup: np.ndarray) -> None:
        """One chunk's result (`workers.clean_chunk`), with the dedup decisions on its documents
        (`diskdedup.DiskDedup.dropped`: taken after pass 1, over the whole corpus)."""
        self.count(r, exact_dup, near_dup)
        kept = np.flatnonzero(~(exact_dup | near_dup)).astype(np.int64)
        in_valid = r.u[kept, 0] < self.cfg.valid_fraction
        tokens = r.tokens
        origin = r.origin
        if tokens is not None:
            starts = np.cumsum(r.lengths, dtype=np.int64) - r.lengths
        if origin is not None:  # what each input file gave the shards (both splits)
            more = {} if tokens is None else {"tokens": r.lengths[kept].astype(np.int64) - 1,
                                              "byte_fallback": r.fallback[kept]}
            self.per_file.add(origin["file"][kept], characters=r.chars[kept], **more)
        for split, sel in (("train", kept[~in_valid]), ("valid", kept[in_valid])):
            if not sel.size:
                continue
            self.docs[split] += int(sel.size)
            self.chars[split] += int(r.chars[sel].sum())
            if tokens is None and split == "train" and self.sample_budget:
                for i in sel:
                    self._sample(float(r.u[i, 1]), r.texts[i])
            # Each split holds back its latest document, which can still move (see finish).
            if self.held[split] is not None:
                self.outs[split].add_many([self.held[split][0]])
            body, last = sel[:-1], int(sel[-1])
            if self.origins is not None:  # the same hold-back as the documents
                if self.held_origin[split] is not None:
                    self.origins[split].add(self.held_origin[split])
                self.origins[split].add(origin[body])
                self.held_origin[split] = origin[last: last + 1]
            if tokens is None:
                self.outs[split].add_many([r.texts[i] for i in body])
                self.held[split] = (r.texts[last], int(r.chars[last]))
            else:
                # the tokens of the body documents, in order (`body` is ascending): a mask over
                # documents repeated per token is cheaper than computing every token's position
                in_body = np.zeros(len(r.lengths), dtype=bool)
                in_body[body] = True
                self.outs[split].add_flat(tokens[np.repeat(in_body, r.lengths)], r.lengths[body])
                self.held[split] = (tokens[starts[last]: starts[last] + r.lengths[last]].copy(), int(r.chars[last]))

    def _sample(self, u: float, text: str) -> None:
        heapq.heappush(self.sample, (-u, self.order, text))
        self.order += 1
        self.sample_chars += len(text)
        while self.sample_chars > self.sample_budget and len(self.sample) > 1:
            self.sample_chars -= len(heapq.heappop(self.sample)[2])

    def planned_move(self) -> tuple[str, str] | None:
        """(from, to) when the last document of one split must move to the other, left empty."""
        if self.docs["valid"] == 0 and self.cfg.valid_fraction > 0 and self.docs["train"] >= 2:
            return ("train", "valid")
        if self.docs["train"] == 0 and self.docs["valid"] >= 1:
            return ("valid", "train")
        return None

    def finish(self) -> list[str]:
        """Write the held documents, moving one across if a split would be empty."""
        moved = self.planned_move()
        for split in SPLITS:
            held = self.held[split]
            if held is not None:
                dest = moved[1] if moved and moved[0] == split else split
                self.outs[dest].add_many([held[0]])
                if self.origins is not None:
                    self.origins[dest].add(self.held_origin[split])
        return self.count_move(moved, self.held[moved[0]][1] if moved else 0)

    def count_move(self, moved: tuple[str, str] | None, chars: int) -> list[str]:
        """The counts after `moved` (a document of `chars` characters), and the notes to print."""
        notes = []
        if moved:
            src, dst = moved
            self.docs[src] -= 1
            self.docs[dst] += 1
            self.chars[src] -= chars
            self.chars[dst] += chars
            notes.append(f"the hash split left {dst} empty: moved the last {src} document to {dst}")
        if self.docs["valid"] == 0 and self.cfg.valid_fraction > 0:
            notes.append("the valid split is empty (too few documents): eval will have nothing to measure")
        return notes

    def sample_texts(self) -> list[str]:
        """The tokenizer sample in input order, long documents cut into ≤ 4,096-character pieces."""
        return [p for _, _, t in sorted(self.sample, key=lambda e: e[1]) for p in sources.cut_text(t, 4096)]


class RefSample:
    """`Sink._sample` over documents whose texts stay on disk: the same bottom-k heap, fed each
    kept train document's (u, chars) and a reference (chunk, number in the chunk) instead of its
    text, so that the main process never holds a document's bytes (`stage_replay.ReplaySample`).

    The heap is order-dependent (a short document with a large u stays if it fits the room the
    budget leaves), so it is replayed exactly, but cheaply: a document changes nothing (it is
    pushed and popped again at once) exactly when the heap is not empty, its u is above the
    heap's largest (strictly: on a tie the older entry goes) and its characters exceed the room
    (budget - sum; negative when one document alone is over the budget). Those cost two float
    comparisons each; only the other documents, the "events", touch the heap. (Events are not
    rare: the documents that fit the room keep the heap's largest u high. A numpy search for the
    next event over a growing window cost ~10x more per event than this loop per document, at the
    ~1 in 9 events of a 1.6 M-document run, docs/benchmarks/prepare.md.) Entries are
    (-u, order, chunk, index, chars); (-u, order) is unique, so the pops do not depend on the
    heap's internal layout (a resumed heap is rebuilt with `heapify`, or sorted).

    With the optional C extension (`_sample.c`) the same loop runs in C over a numpy array of
    entries, ~3x less per document than the Python loop (`benchmarks/prepare_ceiling_bench.py
    --trained`); the members are the same (tests/prepare/test_prepare.py runs both)."""

    DTYPE = np.dtype([("neg_u", "<f8"), ("order", "<i8"), ("chunk", "<i8"), ("index", "<i8"), ("chars", "<i8")])

    def __init__(self, budget: int) -> None:
        self.chars, self.budget, self.order = 0, budget, 0
        self._fast = _c_sample() is not None  # (a flag, not the module: the sink is pickled with the stage's state)
        self.heap: list[tuple] = []  # the Python heap (without the C extension)
        self._entries = np.zeros(0, dtype=self.DTYPE)  # the C heap: its first `_size` entries
        self._size = 0

    def feed(self, u: np.ndarray, chars: np.ndarray, chunk: int, index: np.ndarray) -> None:
        """One chunk's kept train documents, in input order: u (`u[:, 1]`), characters and their
        numbers in the chunk."""
        if self._fast:  # the same loop in C (mspretrain/prepare/_sample.c): ~10x less per document
            u, chars, index = (np.ascontiguousarray(a, dtype=t) for a, t in ((u, np.float64), (chars, np.int64), (index, np.int64)))
            need = self._size + u.size
            if self._entries.size < need:  # room for every document of the chunk (the heap grows by at most that)
                grown = np.zeros(max(need, 2 * self._entries.size), dtype=self.DTYPE)
                grown[: self._size] = self._entries[: self._size]
                self._entries = grown
            self._size, self.chars, self.order = _c_sample().feed(self._entries, self._size, self.budget, self.chars, self.order,
                                                             u, chars, index, chunk)
            return
        heap, budget, total, order = self.heap, self.budget, self.chars, self.order
        push, pop = heapq.heappush, heapq.heappop
        top = -heap[0][0] if heap else float("inf")  # an empty heap: every document is an event
        room = budget - total
        for x, c, i in zip(np.asarray(u, dtype=np.float64).tolist(), np.asarray(chars, dtype=np.int64).tolist(),
                           np.asarray(index).tolist()):
            if x > top and c > room:  # pushed and popped at once: only its order number is used
                order += 1
                continue
            push(heap, (-x, order, chunk, i, c))
            order += 1
            total += c
            while total > budget and len(heap) > 1:
                total -= pop(heap)[4]
            top, room = -heap[0][0], budget - total
        self.chars, self.order = total, order

    def state(self) -> np.ndarray:
        """The heap as an array (what `restore` takes back, with `chars` and `order`)."""
        if self._fast:
            return self._entries[: self._size].copy()
        return np.array(self.heap, dtype=self.DTYPE) if self.heap else np.zeros(0, dtype=self.DTYPE)

    def restore(self, entries: np.ndarray, chars: int, order: int) -> None:
        self.chars, self.order = chars, order
        if self._fast:  # sorted on (neg_u, order): a valid min-heap, whatever layout it was saved in
            self._entries = np.sort(np.asarray(entries, dtype=self.DTYPE), order=["neg_u", "order"])
            self._size = self._entries.size
            return
        self.heap = [tuple(e) for e in entries.tolist()]
        heapq.heapify(self.heap)

    def members(self) -> np.ndarray:
        """(chunk, index) of the sample's documents in input order (`Sink.sample_texts`'s order)."""
        s = self.state()
        s = s[np.argsort(s["order"], kind="stable")]
        return np.stack([s["chunk"], s["index"]], axis=1) if s.size else np.zeros((0, 2), dtype=np.int64)


def _c_sample():
    """The C heap of `RefSample` (optional extension `mspretrain/prepare/_sample.c`), or None: then
    Python runs the same heap. `MSPRETRAIN_SAMPLE=python` switches it off (the tests compare both)."""
    if os.environ.get("MSPRETRAIN_SAMPLE") == "python":
        return None
    try:
        from mspretrain.prepare import _sample
    except ImportError:
        return None
    return _sample
