"""Which files `prepare` reads: inputs are files, directories (walked recursively, hidden entries
skipped, sorted) and globs. Inside directories only `.txt` / `.jsonl` (optionally `.gz` / `.zst`)
are read; a file named explicitly is read as text whatever its name. An input that matches
nothing is an error: a typo must not silently shrink the corpus.
"""
from __future__ import annotations

import glob
from pathlib import Path
from typing import Sequence

from mspretrain.errors import UserError
from mspretrain.prepare.filecounts import SourceStats

TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")


def _strip_compression(name: str) -> str:
    low = name.lower()
    for suf in COMPRESSED_SUFFIXES:
        if low.endswith(suf):
            return low[: -len(suf)]
    return low


def is_compressed(path: Path) -> bool:
    return _strip_compression(path.name) != path.name.lower()


def is_jsonl(path: Path) -> bool:
    return _strip_compression(path.name).endswith(JSONL_SUFFIXES)


def _supported(path: Path) -> bool:
    return _strip_compression(path.name).endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)


def discover(inputs: Sequence[str], stats: SourceStats | None = None) -> list[Path]:
    """The files to read, in a deterministic order; `UserError` if an input matches nothing."""
    return [path for path, _ in discover_named(inputs, stats)]


def discover_named(inputs: Sequence[str], stats: SourceStats | None = None) -> list[tuple[Path, str]]:
    """`discover`, each file with the name the manifest gives it: as the user named it (an input
    file as given, a file found under a directory or by a glob joined to it), so the manifest
    holds no absolute path the command line did not."""
    if not inputs:
        raise UserError("no input given", "name files, directories or globs: mspretrain prepare corpus/ --out data/")
    found: list[tuple[Path, str]] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        if p.is_file():
            found.append((p, raw))
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            usable = [f for f in files if _supported(f)]
            if stats is not None:
                stats.ignored += len(files) - len(usable)
            if not usable:
                raise UserError(f"directory {p} holds no .txt or .jsonl files (also .gz/.zst)",
                                "point prepare at your text files, or rename them to .txt / .jsonl")
            found.extend((f, (Path(raw) / f.relative_to(p)).as_posix()) for f in usable)
        elif glob.has_magic(raw):
            matches = _glob(p)
            if not matches:
                raise UserError(f"no files match {raw}", "check the pattern (quote it so the shell does not expand it) or list the files")
            found.extend((m, m.as_posix()) for m in matches)
        else:
            from mspretrain.fsutil import why_not

            raise UserError(f"input {raw} {why_not(p, 'a text file or a directory')}", "check the path; inputs may be files, directories or globs")
    unique: dict[Path, str] = {}
    for f, name in found:
        unique.setdefault(f.resolve(), name)  # a file named twice is read once, under its first name
    return list(unique.items())


def _glob(pattern: Path) -> list[Path]:
    """Files matching `pattern` (`**` included), sorted, without following symlinked directories.

    `glob.glob(recursive=True)` follows directory symlinks, so a link to a parent loops until
    the path is too long (it never returned in 20 s on a two-level loop). pathlib's `**` does not
    descend into symlinks (CPython 3.11 `pathlib._RecursiveWildcardSelector`). Hidden files and
    directories are skipped, as `glob.glob` and directory inputs do.
    """
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = Path(*parts[:first]) if first else Path(".")
    found = []
    for m in root.glob(str(Path(*parts[first:]))):
        rel = m.relative_to(root).parts
        if m.is_file() and not any(part.startswith(".") for part in rel):
            found.append(m)
    return sorted(found)

