"""The last stage of every chain (`Publish`): the finished work dir put where `--out` names
(`publish.publish`), then the journal removed. The journal names this stage once the work dir
holds every file of the data dir, its manifest last, all durable (the finalize stage's commit);
a kill from then on resumes here, or finds the data dir already in place (`already_published`),
or, killed while publishing file by file, starts over (`torn`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from mspretrain.errors import UserError
from mspretrain.fsutil import read_json_file
from mspretrain.paths import DataPaths
from mspretrain.prepare import publish
from mspretrain.prepare.resume import Journal, difference, point
from mspretrain.prepare.stage import Run, Stage


class Publish(Stage):
    name = "publish"

    def run(self, r: Run, then: str | None) -> None:
        j = r.journal
        j.drop_state()  # (again after a kill: it may have been half removed)
        point("publish")
        r.files.publish(r.out)
        j.remove()

    def resume(self, r: Run) -> None:
        """The work dir is the finished data dir: its manifest is the run's result."""
        r.log(f"resuming the interrupted prepare: publishing {r.out}")
        r.manifest = read_json_file(DataPaths(r.work).manifest, "manifest")


def torn(journal: Journal) -> bool:
    """A publish into a shared dir killed after it had moved some files: the work dir lacks files
    its manifest lists, so the run cannot resume; it starts over."""
    return journal.stage == Publish.name and not _complete(journal.work)


def _complete(work: Path) -> bool:
    """The work dir still holds every output its manifest lists (nothing was published yet)."""
    try:
        listed = read_json_file(DataPaths(work).manifest, "manifest")["outputs"]
    except (UserError, KeyError, TypeError):
        return False
    return isinstance(listed, list) and all(isinstance(n, str) and (work / n).exists() for n in listed)


def already_published(journal: Journal, out: Path, fingerprint: Callable[[], dict], log: Callable[[str], None]) -> dict | None:
    """The manifest of `out` when the same command was killed after publishing it but before it
    removed its journal: the data dir is finished, there is nothing left to do. `fingerprint`:
    this command's (computed only then: it loads the tokenizer and the quality models)."""
    old = journal.read()
    if old is None or old.get("stage") != Publish.name or journal.work.exists() or not DataPaths(out).manifest.is_file():
        return None
    if difference(old["fingerprint"], fingerprint()) is not None:
        return None
    manifest = read_json_file(DataPaths(out).manifest, "manifest")
    journal.remove()
    old = publish.old_dir(out)
    if publish._is_our_old(old):  # killed before the swap's old dir was removed
        publish._remove_old(old)
    log(f"{out} was already published by the interrupted prepare of the same command")
    return manifest
