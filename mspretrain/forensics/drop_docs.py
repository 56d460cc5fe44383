"""`replay --drop-docs`: the run's own loader, with every sample that touches a dropped document
swapped for a clean one.

The rule (printed by `replay`): a sample whose window overlaps a dropped document (any of its
seq_len + 1 tokens) is replaced by the next sample of the run's plan *after the replayed steps*
that overlaps no dropped document, taken in order, each once. Every other sample of every batch
stays where it was, so the replayed steps differ from the original only by the dropped samples,
and no substitute is a sample the replay also trains on in its own steps.

The swap is decided on the global batch (all ranks compute the same ids from the same position,
`data/order.py`), so every rank picks the same substitutes without talking to the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.budget import row_of_position
from mspretrain.data.order import SamplePlan
from mspretrain.data.shards import IndexedDataset
from mspretrain.errors import UserError
from mspretrain.monitor.spike_record import doc_ends
from mspretrain.paths import DataPaths

RULE = ("a sample whose window overlaps a dropped document is replaced by the next sample of the plan after the "
        "replayed steps that overlaps none (each used once); every other sample stays in place")


def parse_doc_ids(text: str, n_sources: int) -> list[tuple[int, int]]:
    """'12,40' (documents of the --data dir, source 0) or '1:7' (source 1's document 7) ->
    [(source, document)]. Ids are positions in the source's train split, as `spike` lists them."""
    out = []
    for word in (w.strip() for w in text.split(",")):
        src, _, doc = word.rpartition(":")
        try:
            pair = (int(src) if src else 0, int(doc))
        except ValueError:
            raise UserError(f"--drop-docs: {word!r} is not a document id", "give ids as listed by `mspretrain spike`, "
                            "e.g. --drop-docs 12,40 or 1:7 for source 1") from None
        if not 0 <= pair[0] < n_sources or pair[1] < 0:
            raise UserError(f"--drop-docs: {word!r} names no document of the run's {n_sources} source(s)",
                            "ids are >= 0; a source index is below the number of data.sources")
        out.append(pair)
    return out


@dataclass
class Swap:
    step: int
    position: int  # in the global batch
    dropped: tuple[int, int]  # (source, window)
    substitute: tuple[int, int]


class DropDocsLoader:
    """Wraps a `data.loader.Loader`: same batches, dropped samples swapped (see the module docstring).

    `end` is the global position after the replay's last step (where substitutes are drawn from);
    `first_step` the step the first `next_batch` belongs to; `accum` the micro-batches per step."""

    def __init__(self, loader: Any, *, plan: SamplePlan, sources: list[Path], docs: list[tuple[int, int]],
                 end: list[int], first_step: int, accum: int) -> None:
        self.loader, self.plan, self.accum = loader, plan, accum
        self.seq_len, self.rank, self.world = loader.seq_len, loader.rank, loader.world
        self.tokens = [IndexedDataset(DataPaths(p).prefix("train")).tokens for p in sources]
        self.bad = [np.zeros(n, dtype=bool) for n in plan.windows]  # windows that overlap a dropped document
        for j, d in docs:
            ends = doc_ends(sources[j])
            if d >= ends.size:
                raise UserError(f"--drop-docs: source {j} ({sources[j]}) has {ends.size} documents, not {d + 1}",
                                "use the ids `mspretrain spike` lists")
            start, stop = (int(ends[d - 1]) if d else 0), int(ends[d])
            lo = max(0, -(-(start - self.seq_len) // self.seq_len))  # first window whose last token >= start
            self.bad[j][lo:min((stop - 1) // self.seq_len + 1, plan.windows[j])] = True
        if all(bool(b.all()) for b in self.bad):  # no clean sample left: the search below would never end
            raise UserError(f"--drop-docs drops every sample of the run's data ({len(docs)} document(s) cover all "
                            f"{sum(plan.windows):,} windows)", "drop fewer documents")
        # a clean window exists; the plan visits every window of a source once per epoch, so one
        # search never needs more draws than this (a cap that turns a bug into an error, not a hang)
        self.max_draws = 2 * sum(plan.windows) + 1024
        self.cursor, self.calls, self.first_step = list(end), 0, first_step
        self.swaps: list[Swap] = []

    def __getattr__(self, name: str) -> Any:  # state(), load_state(), world_micro_batch ...: the loader's own
        return getattr(self.loader, name)

    def next_batch(self) -> Any:
        pos = [int(s["consumed"]) for s in self.loader.state()["sources"]]
        chunk = self.loader.world_micro_batch
        ids = self.plan.batch(pos, chunk)  # this call's positions of the global batch, all ranks
        batch = self.loader.next_batch()
        step = self.first_step + self.calls // self.accum
        micro_offset = (self.calls % self.accum) * chunk
        self.calls += 1
        for p in np.flatnonzero([self.bad[j][w] for j, w in ids.tolist()]):
            sub = self._substitute()
            self.swaps.append(Swap(step, micro_offset + int(p), (int(ids[p, 0]), int(ids[p, 1])), sub))
            rank, row = row_of_position(int(p), micro=self.loader.batch_size, world=self.world)
            if rank == self.rank:
                self._put(batch, row, sub)
        return batch

    def _substitute(self) -> tuple[int, int]:
        for _ in range(self.max_draws):
            j, w = (int(x) for x in self.plan.batch(self.cursor, 1)[0])
            self.cursor = self.plan.advance(self.cursor, 1)
            if not self.bad[j][w]:
                return j, w
        raise UserError(f"--drop-docs: no clean sample in the next {self.max_draws:,} of the plan (the sources that "
                        "still have clean windows are never drawn)", "drop fewer documents")

    def _put(self, batch: Any, row: int, sub: tuple[int, int]) -> None:
        j, w = sub
        start = w * self.seq_len
        batch.tokens[row] = self.tokens[j][start:start + self.seq_len + 1]
        if batch.positions is not None:  # reset_attention_at_eos: the substitute's own document layout
            pos, seg = self.loader._doc_layout(self.loader._sources[j], np.array([w], dtype=np.int64))
            batch.positions[row], batch.segments[row] = pos[0], seg[0]
