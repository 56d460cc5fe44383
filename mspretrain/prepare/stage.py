"""What every stage of prepare's pipeline shares: the `Stage` interface and the `Run` it works on.

A stage is one step of the journal (`resume.Journal.stage` names it): it reads what the stages
before it left (files in the work dir, the state file of the journal's `state`), does its work,
resumable from its own last commit, and ends with a commit that names the next stage. It writes
only the paths the run's `workdir.WorkDir` hands it, and creates or removes entries of the work
dir only through it: the work dir has one owner. The runner
(`pipeline.run`) holds the chain, a plain list of stage objects chosen once per run, and starts
at the stage the journal names: a run killed anywhere resumes at the stage it was in.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mspretrain.config.schema import PrepareConfig
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, read_regular_bytes
from mspretrain.prepare import dedup, sources
from mspretrain.prepare.diskdedup import DiskDedup
from mspretrain.prepare.results import ChunkSpool
from mspretrain.prepare.resume import Journal
from mspretrain.prepare.scoring import QualityStage
from mspretrain.prepare.sink import Sink
from mspretrain.prepare.workdir import DEDUP, SPOOL, WorkDir


@dataclass
class Run:
    """One prepare run, as its stages see it: the inputs and settings, and what one stage hands
    the next within a process (the rest goes through the work dir and the journal)."""
    paths: list[Path]
    names: list[str]
    files: WorkDir  # the work dir: every path a stage writes, and every creation and removal of its entries
    cfg: PrepareConfig
    given: Tokenizer | None  # a given tokenizer (saved into the work dir), or None: one is trained
    tok: Tokenizer | None  # the tokenizer of the shards: the given one, or the trained one from the encode stage on
    dtype: np.dtype
    workers: int
    progress: bool
    log: Callable[[str], None]
    warn: Callable[[str], None]
    stats: sources.SourceStats
    journal: Journal
    ray: object | None  # a `raypool.RayCluster`, or None: local worker processes
    quality: QualityStage | None
    pieces: bool  # pass 1's chunks in files written by local workers (else through this process, as with Ray)
    units: bool | None  # `pipeline.UNITS`: compressed files as whole-file work items
    t0: float
    total_bytes: int
    out: Path  # the data dir `--out` names, where the publish stage puts the work dir
    inputs: list[str]  # the inputs as given (the manifest's `inputs`)
    seq_len: int | None  # `--seq-len`: only to warn when a split is shorter than one window
    reference: bytes | None  # the perplexity model of `prepare.lm_reference`, written to the data dir
    manifest: dict | None = None  # the finalize stage's result, the data dir's manifest
    _dd: DiskDedup | None = None

    @property
    def work(self) -> Path:
        return self.files.root

    def dedup(self) -> DiskDedup:
        """The dedup state on disk (`diskdedup`: ~24 bytes per document for exact keys, ~16 per
        LSH band), one object from pass 1 to the replay."""
        if self._dd is None:
            self._dd = DiskDedup(self.files.path(DEDUP), self.total_bytes, dedup.LshSettings.of(self.cfg))
        return self._dd

    def chunk_spool(self) -> ChunkSpool:
        """Pass 1's chunk results, as its last commit left them (read-only from then on)."""
        p1 = self.journal.data["pass1"]
        spool = ChunkSpool(self.files.path(SPOOL), p1["spool_bytes"], p1["chunks"])
        spool.close()
        return spool

    def local_workers(self) -> int:
        """The workers of a stage that runs only here (the pieces are on this disk)."""
        return min(self.workers, len(os.sched_getaffinity(0)))

    def save_state(self, name: str, *, sink: Sink | None = None, tok_info: dict | None = None) -> None:
        """What the stage `name` starts from, beyond the journal: the source counts, the warnings
        so far, the sink (its writers left out). One file per stage, so that a kill between this
        write and the journal's commit leaves the previous stage's file as it was."""
        outs = origins = None
        if sink is not None:
            outs, origins, sink.outs, sink.origins = sink.outs, sink.origins, None, None
        try:
            data = pickle.dumps({"stats": self.stats, "warnings": list(self.journal.warnings), "sink": sink, "tok_info": tok_info},
                                protocol=5)
        finally:
            if sink is not None:
                sink.outs, sink.origins = outs, origins
        atomic_write(self.journal.state_path(f"state-{name}.pkl"), data)
        # its SHA-256 goes into the journal with the commit that names it (the caller's next commit)
        self.journal.data.setdefault("state_sha256", {})[name] = hashlib.sha256(data).hexdigest()

    def load_state(self, name: str) -> dict:
        """A stage's state, unpickled only when its bytes are the ones the journal's commit
        recorded (the journal itself is check-summed): a state file changed after the kill (a
        damaged disk, a hand) is refused in one line, never unpickled."""
        path = self.journal.state_path(f"state-{name}.pkl")
        fix = f"delete {self.journal.work} and {self.journal.path} to start over"
        data = read_regular_bytes(path, 1 << 40, "prepare state file", fix)
        want = (self.journal.data.get("state_sha256") or {}).get(name)
        if want != hashlib.sha256(data).hexdigest():
            raise UserError(f"{path} is not the state file the interrupted prepare's last commit recorded (its SHA-256): "
                            "the work dir was changed after the kill", fix)
        return pickle.loads(data)


class Stage(ABC):
    """One step of the chain. `name` is the journal's name of the stage (`Journal.stage`);
    `run` does the stage's work, resumed from its own last commit, and ends with the commit whose
    `stage` is `then`, the next stage's name (None: the last stage, publish, which removes the
    journal)."""

    name: str = ""

    @abstractmethod
    def run(self, r: Run, then: str | None) -> None:
        """Each stage's own work (its subclass)."""

    def resume(self, r: Run) -> None:
        """The chain starts at this stage after a kill: the source counts and the warnings so far,
        from the state file the stage before saved (`Run.save_state`)."""
        r.log(f"resuming the interrupted prepare at its stage '{self.name}'")
        saved = r.load_state(r.journal.data["state"])
        r.stats.per_file[:], r.stats.ignored = saved["stats"].per_file, saved["stats"].ignored
        r.journal.warnings[:] = saved["warnings"]

    def resumed_past(self, r: Run) -> None:  # noqa: B027 (a hook, not abstract: most stages need nothing here)
        """The chain resumes after this stage: put back in `r` what the stage hands on in memory.
        Most hand on through the work dir and the journal alone, so nothing here."""

    def __repr__(self) -> str:
        return type(self).__name__
