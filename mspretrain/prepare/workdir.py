"""The work dir of one prepare run and its one owner (`WorkDir`): every entry a stage may write
is named here, and only this class creates, renames or removes entries of the work dir.

A stage asks for the path of a name it writes (`path`): an output of the data dir (the shards,
their origin records, the tokenizer, the quality sidecar, the manifest, ...) or a scratch entry
of the stages between (pass 1's chunk spool and chunk files, the dedup partitions, the replay's
pieces, the spools of a trained tokenizer's run). Scratch is made empty for a stage (`fresh`)
and removed when the stage that reads it last has committed (`drop`, `remove_later`); what a
kill left is removed before the data dir is finished (`clean_scratch`), and the finished work
dir is put in place by it too (`publish`). Workers write inside the
scratch dirs they are handed, never beside them. The journal's state dir (`resume.STATE_DIR`)
is the journal's own (`Journal.state_path`); a stage removes a state file through `drop_state`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from mspretrain.data.origin import origin_name
from mspretrain.data.tokenizer import TOKENIZER_FILES
from mspretrain.paths import SPLITS, DataPaths
from mspretrain.prepare import publish
from mspretrain.prepare.quality import REFERENCE_LM
from mspretrain.prepare.resume import STATE_DIR, Journal
from mspretrain.prepare.scoring import SCORES

SPOOL = "pass1.tmp"  # pass 1's chunk results (`results.ChunkSpool`), until the replay (or the encode stage) is done
PIECES = "pass1.pieces"  # pass 1's per-chunk files written by the workers (`workers.spill_chunk`)
REPLAY_PIECES = "replay.pieces"  # the replay's per-chunk shard and origin pieces (`workers.replay_chunk`)
DEDUP = "dedup.tmp"  # the dedup partitions (`diskdedup.DiskDedup`)
SCRATCH_DIRS = (PIECES, REPLAY_PIECES, DEDUP)
MANIFEST = DataPaths(Path(".")).manifest.name  # the data dir's manifest, written last (the finalize stage)
TRASH = ".trash"  # a scratch dir renamed for its removal in the background (`remove_later`)


def split_spool(split: str) -> str:
    """A trained tokenizer's run without pass 1's chunk files (Ray): the split's cleaned texts (`spool.Spool`)."""
    return f"{split}.spool"


def _names() -> frozenset[str]:
    """Every name a stage may write: the data dir's outputs and the scratch between stages."""
    outputs = {*SPLITS, *(origin_name(s) for s in SPLITS), *TOKENIZER_FILES, SCORES,
               REFERENCE_LM, MANIFEST}
    return frozenset(outputs | {SPOOL, *SCRATCH_DIRS, *(split_spool(s) for s in SPLITS)})


NAMES = _names()


class WorkDir:
    """The entries of the work dir `root` (`.NAME.partial` beside `--out`) and the removals in
    flight. `journal`: the run's, whose state dir is inside `root`."""

    def __init__(self, root: Path, journal: Journal) -> None:
        self.root = root
        self.journal = journal
        self.removing: list = []  # background removals of scratch dirs (`remove_later`)

    def path(self, name: str) -> Path:
        """The path of `name` in the work dir, for a stage to write or read (one of `NAMES`)."""
        if name not in NAMES:
            raise AssertionError(f"{name!r} is not an entry of prepare's work dir (workdir.NAMES)")
        return self.root / name

    def fresh(self, name: str, make: bool = True) -> Path:
        """A scratch dir, empty (what a killed run left in it removed); `make`: created, else absent."""
        path = self.path(name)
        shutil.rmtree(path, ignore_errors=True)
        if make:
            path.mkdir()
        return path

    def drop(self, name: str) -> None:
        """Remove a scratch file or dir now (nothing if it is not there)."""
        path = self.path(name)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def drop_state(self, name: str) -> None:
        """Remove a file of the journal's state dir a stage no longer needs (nothing if it is not there)."""
        self.journal.state_path(name).unlink(missing_ok=True)

    def remove_later(self, name: str) -> None:
        """Remove a scratch dir (pass 1's chunk files, the dedup partitions) in a child process
        (`rm -rf`), while prepare goes on: freeing their pages costs the kernel ~0.4 ms per chunk,
        serial time this process no longer spends. Renamed first, so that a kill leaves a name
        `clean_scratch` removes. `clean_scratch` waits for them."""
        path = self.path(name)
        if not path.exists():
            return
        trash = path.with_name(path.name + TRASH)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        try:
            self.removing.append(subprocess.Popen(["rm", "-rf", "--", str(trash)], stdin=subprocess.DEVNULL))
        except OSError:  # no `rm` here
            shutil.rmtree(trash, ignore_errors=True)

    def clean_scratch(self) -> None:
        """Every scratch entry gone before the data dir is finished: the background removals
        waited for, and what a kill left (a kill just after a stage's commit, before its removals)."""
        for child in self.removing:
            child.wait()
        self.drop(SPOOL)
        for name in SCRATCH_DIRS:
            shutil.rmtree(self.path(name), ignore_errors=True)
            shutil.rmtree(self.root / (name + TRASH), ignore_errors=True)

    def outputs(self) -> list[str]:
        """The names of the entries in the work dir now, the journal's state dir left out (the
        manifest's `outputs`: what a later `--overwrite` may remove or replace)."""
        return [p.name for p in self.root.iterdir() if p.name != STATE_DIR]

    def files(self) -> list[Path]:
        """The files directly in the work dir, sorted (the finalize stage fsyncs them all at once)."""
        return sorted(p for p in self.root.iterdir() if p.is_file())

    def publish(self, out: Path) -> None:
        """The finished work dir put where `--out` names (`publish.publish`): its last act."""
        publish.publish(self.root, out)
