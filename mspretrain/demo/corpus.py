"""The embedded demo corpus: Tang/Song poems and Song ci from the `chinese-poetry` npm package.

Design choices:
- The package (MIT licence, 85 MB tarball) comes from the npm registry with `npm pack`, the
  only network access the toolkit makes; it is cached in `$MSPRETRAIN_CACHE` (default
  `~/.cache/mspretrain`) with the extracted corpus, so later runs work offline.
- Only the complete collections are read: `quantangshi/poet.{tang,song}.N.json` and
  `songci/ci.song.N.json`. The selections (唐诗三百首, 宋词三百首), `rank/`, `strains/`,
  `quantangshi/error/` and `yudingquantangshi/` would only duplicate those poems.
- The JSON is read straight from the tarball (nothing is extracted to disk) and converted from
  Traditional to Simplified script with OpenCC `t2s`. One poem per `.jsonl` line, field `text`:
  the title (or the ci tune, 词牌) on the first line, then the verse lines.
- Poems are written in a fixed order (collection, file number, position), so the corpus file
  is byte-identical on every machine. `max_docs` takes evenly spaced poems of that order (a
  quick demo still sees Tang, Song and ci), cached as its own file.
- Trade-off: building holds the converted corpus (~21 M characters) in memory once (~100 MB)
  to sort it; streaming in archive order would save that but make the order depend on npm.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Callable

from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_writer, default_cache_dir

PACKAGE = "chinese-poetry"
VERSION = "2.0.1"
TARBALL = f"{PACKAGE}-{VERSION}.tgz"
CORPUS = f"{PACKAGE}-{VERSION}.jsonl"
# The complete collections; everything else in the package repeats these poems.
_WANTED = re.compile(r"^package/dist/(?:quantangshi/poet\.(tang|song)\.(\d+)|songci/ci\.song\.(\d+)y?)\.json$")
_SKIPPED_DIRS = ("/rank/", "/strains/", "/quantangshi/error/", "/yudingquantangshi/")
_BODY_KEYS = ("paragraphs", "content", "para")
_NO_NPM_FIX = "install Node.js (which brings npm), or prepare your own text instead: mspretrain prepare YOUR_TEXT --out DATA_DIR"


def poetry_corpus(cache_dir: Path | None = None, *, max_docs: int | None = None,
                  log: Callable[[str], None] = print) -> Path:
    """Path of the cached poetry `.jsonl` (one poem per line), fetching and building it once."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the cache dir {root} ({exc.strerror})", "set MSPRETRAIN_CACHE to a writable directory") from None
    if max_docs is not None and max_docs <= 0:
        raise UserError(f"max_docs = {max_docs} must be positive", "give a number of poems, e.g. 20000, or none for all")
    full = root / CORPUS
    if not full.is_file():
        tarball = _fetch(root, log)
        log(f"building the poetry corpus from {tarball.name} (Traditional -> Simplified, once)")
        n = _build(tarball, full)
        log(f"poetry corpus: {n:,} poems -> {full}")
    if max_docs is None:
        return full
    subset = root / f"{PACKAGE}-{VERSION}.max{max_docs}.jsonl"
    if not subset.is_file():
        _subset(full, subset, max_docs)
    return subset


def _fetch(root: Path, log: Callable[[str], None]) -> Path:
    tarball = root / TARBALL
    if tarball.is_file():
        return tarball
    npm = shutil.which("npm")
    if npm is None:
        raise UserError("npm is not installed, so the demo corpus (chinese-poetry from the npm registry) cannot be fetched", _NO_NPM_FIX)
    log(f"fetching {PACKAGE}@{VERSION} from the npm registry (85 MB, once) into {root}")
    # npm writes the tarball into its working directory; a private temp dir keeps a failed
    # download from leaving a truncated tarball under the final name.
    tmp = root / f".npm-pack-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        proc = subprocess.run([npm, "pack", f"{PACKAGE}@{VERSION}", "--silent"], cwd=tmp,
                              capture_output=True, text=True, timeout=1800)
        got = tmp / TARBALL
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
            raise UserError(f"`npm pack {PACKAGE}@{VERSION}` failed: {last}",
                            "check the network access to the npm registry, or prepare your own text: mspretrain prepare YOUR_TEXT --out DATA_DIR")
        os.replace(got, tarball)
    except subprocess.TimeoutExpired:
        raise UserError(f"`npm pack {PACKAGE}@{VERSION}` did not finish in 30 minutes", _NO_NPM_FIX) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tarball


def _poem_text(poem: dict) -> str | None:
    """Title (or ci tune) line + verse lines, or None for an entry without verses."""
    body = next((poem[k] for k in _BODY_KEYS if poem.get(k)), None)
    if isinstance(body, str):
        body = [body]
    if not isinstance(body, list):
        return None
    lines = [ln.strip() for ln in body if isinstance(ln, str) and ln.strip()]
    if not lines:
        return None
    title = poem.get("title") or poem.get("rhythmic") or ""
    title = title.strip() if isinstance(title, str) else ""
    return "\n".join([title, *lines] if title else lines)


def _sort_key(name: str) -> tuple[int, int] | None:
    if any(d in name for d in _SKIPPED_DIRS):
        return None
    m = _WANTED.match(name)
    if m is None:
        return None
    collection = {"tang": 0, "song": 1}[m.group(1)] if m.group(1) else 2  # 2 = Song ci
    return collection, int(m.group(2) or m.group(3))


def _build(tarball: Path, out: Path) -> int:
    import opencc

    t2s = opencc.OpenCC("t2s")
    chunks: dict[tuple[int, int], list[str]] = {}
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar:
                key = _sort_key(member.name) if member.isfile() else None
                if key is None:
                    continue
                poems = json.load(tar.extractfile(member))
                texts = [t for t in map(_poem_text, poems if isinstance(poems, list) else []) if t]
                # One OpenCC call per file: the per-call overhead would dominate per poem.
                converted = t2s.convert("\x00".join(texts)).split("\x00")
                chunks[key] = converted
    except (tarfile.TarError, OSError, EOFError, json.JSONDecodeError) as exc:
        tarball.unlink(missing_ok=True)  # a damaged download must not be reused
        raise UserError(f"the cached {tarball.name} is damaged ({exc})", "run the command again to download it afresh") from None
    if not chunks:
        raise UserError(f"{tarball.name} holds no Tang/Song poems", f"delete {tarball} and run again")
    n = 0
    with atomic_writer(out, text=True) as f:
        for key in sorted(chunks):
            for text in chunks[key]:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                n += 1
    return n


def _subset(full: Path, out: Path, max_docs: int) -> None:
    with open(full, encoding="utf-8") as f:
        total = sum(1 for _ in f)
    if max_docs >= total:
        with open(full, "rb") as src, atomic_writer(out) as dst:
            shutil.copyfileobj(src, dst)
        return
    # Evenly spaced line numbers: a pure function of (total, max_docs).
    wanted = {i * total // max_docs for i in range(max_docs)}
    with open(full, encoding="utf-8") as src, atomic_writer(out, text=True) as dst:
        for i, line in enumerate(src):
            if i in wanted:
                dst.write(line)
