"""Deciding from scores already computed (issue 39): re-thresholding from a data dir's sidecar
(`prepare --scores-from DATA_DIR`) and keeping by fraction (`prepare.quality_top_fraction`,
`prepare.ppl_quantiles`).

A document's scores are a pure function of its cleaned text and the models' bytes, and the
sidecar `quality.scores` holds every score of every cleaned document with its origin and the
first 8 bytes of its dedup key (`scoring.RECORD`). So pass 1 can take a document's scores from a
sidecar instead of the models (`scoring.lookup`, by origin and key) and apply other thresholds to
them: the output is the output of a fresh prepare with those thresholds, byte for byte, since
every later step sees the same kept documents.

Keeping a fraction needs every score before the first decision: a threshold that keeps the top
fraction of 16 M documents is known only when the last one is scored. Two passes:
1. the scan (`stage_scan.ScoreScan`, the first stage of the chain): read, clean and score every
   document, the records to a sidecar in the state dir (with `--scores-from`, that data dir's
   sidecar instead, and no scan);
2. the thresholds from it (`resolve`, exact: `kth`), then pass 1 as always, its scores looked up.
Cleaning runs twice (once per pass), scoring once. The scan is resumable like pass 1 (journal
key "scan": work items done and the sidecar's length) and its chunks are pass 1's.

The rule, ties included (`resolve`): the perplexity band's candidates are the documents that
decontamination and the language filter keep, n of them; `ppl_quantiles = [a, b]` sets ppl_min to
the (floor(a n) + 1)-th smallest perplexity among them (the floor(a n) lowest are dropped; no
lower bound if a = 0) and ppl_max to the ceil(b n)-th smallest (no upper bound if b = 1). The classifier's candidates are the documents the
three filters before it keep, m of them; `quality_top_fraction = f` sets the threshold to the
ceil(f m)-th largest score among them. A document is kept when its score is >= that threshold (or
its perplexity inside [ppl_min, ppl_max]): every document tied with the boundary one is kept, so a
few more than f m may be. Duplicates count as candidates (dedup runs after the quality stage).

Memory: the k-th value is found by two passes of a 65,536-bin histogram over the scores' float32
bits (order-preserving as unsigned integers): the top 16 bits, then the low 16 bits inside the
bin that holds it (`order_stats`). The sidecar is read in blocks (`BLOCK` records); nothing grows
with the corpus. `prepare --inspect` takes its percentiles the same way.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mspretrain import __version__
from mspretrain.config.schema import PrepareConfig
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json_file
from mspretrain.prepare import sources
from mspretrain.prepare.scoring import HEADER, RECORD, SCORES, QualityStage, Scored, ScoreSource, read_scores

BLOCK = 1 << 18  # records read at once (9.7 MB)


# ----------------------------------------------------------------------------- --scores-from

def open_source(data_dir: str, stage: QualityStage | None, cfg: PrepareConfig, names: list[str],
                paths: list[Path] | None = None) -> ScoreSource:
    """`--scores-from DATA_DIR`: its sidecar, refused in one line unless it holds the scores of
    every filter this run has on, made by the same models and this version of mspretrain, from
    the same input files cleaned by the same rules. (Each document is checked again when its
    scores are looked up, by origin and key: `scoring.lookup`.)"""
    from mspretrain.prepare.clean import Cleaner

    d = Path(data_dir).expanduser()
    fix = "run prepare without --scores-from (it scores every document)"
    if stage is None:
        raise UserError("--scores-from is given but no quality filter is on", "set prepare.quality_model, lm_model, min_zh_prob or decontam")
    side, man = d / SCORES, d / "manifest.json"
    if not side.is_file() or not man.is_file():
        raise UserError(f"--scores-from {d}: no {SCORES} and manifest.json there (not a data dir prepared with a quality filter)", fix)
    m = read_json_file(man, "manifest", fix)  # a regular file, bounded, not nested past the stack
    old = m.get("quality") if isinstance(m, dict) else None
    if not isinstance(old, dict):
        raise UserError(f"--scores-from {d}: its manifest.json names no quality models", fix)
    r = read_scores(side)
    if r.dtype != RECORD:
        raise UserError(f"--scores-from {d}: its {SCORES} predates the per-document keys (version 1)", fix)
    if m.get("created_by") != f"mspretrain {__version__}":
        raise UserError(f"--scores-from {d} was scored by {m.get('created_by')}, this is mspretrain {__version__}", fix)
    new = stage.identity()
    for key, what, same in (("decontam", "decontamination against prepare.decontam", lambda a, b: a["ngram"] == b["ngram"]
                             and [s["sha256"] for s in a["sets"]] == [s["sha256"] for s in b["sets"]]),
                            ("language", "P(Chinese)", lambda a, b: a["model"] == b["model"]),
                            ("perplexity", "the perplexities of prepare.lm_model", lambda a, b: a["sha256"] == b["sha256"]),
                            ("classifier", "the classifier scores of prepare.quality_model", lambda a, b: a["sha256"] == b["sha256"])):
        if key not in new:
            continue
        if key not in old or not isinstance(old[key], dict):
            raise UserError(f"--scores-from {d} holds no {what}: its prepare ran without that filter", fix)
        try:
            ok = same(old[key], new[key])
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise UserError(f"--scores-from {d} holds {what} made by another model or eval set (SHA-256)", fix)
    dedup_keys = ("exact_dedup", "near_dedup", "near_dedup_threshold")  # dedup comes after scoring: free to change
    rules = {k: v for k, v in Cleaner(cfg).rules().items() if k not in dedup_keys}
    if not isinstance(m.get("rules"), dict) or {k: v for k, v in m["rules"].items() if k not in dedup_keys} != rules:
        raise UserError(f"--scores-from {d} was cleaned by other rules (prepare.* cleaning keys differ)", fix)
    # the files may have moved (names differ): their order and contents are checked per document
    files = m.get("input_files") if isinstance(m.get("input_files"), list) else []
    if len(files) != len(names):
        raise UserError(f"--scores-from {d} was prepared from {len(files)} input files, these are {len(names)}", fix)
    if stage.by_fraction and paths is not None:
        # A fraction's threshold is taken over every record of the sidecar: the source's inputs must
        # be these, whole. (A prefix of them passed every per-document check, and the threshold
        # counted documents this run does not have.) Another size is refused here; the same size
        # with other documents, by the per-document lookup.
        for i, (p, f) in enumerate(zip(paths, files)):
            had = f.get("bytes") if isinstance(f, dict) else None
            size = p.stat().st_size
            if had != size:
                raise UserError(f"--scores-from {d} read {had if isinstance(had, int) else '?'} bytes of input file #{i + 1} "
                                f"({f.get('name') if isinstance(f, dict) else '?'}), this run's {p} has {size:,}: the thresholds "
                                "prepare.quality_top_fraction / ppl_quantiles resolve to would count documents this run does not have",
                                "run prepare without --scores-from (it scores these inputs), or with the same inputs as that prepare")
    return ScoreSource(str(side.resolve()))


def source_identity(data_dir: str) -> dict:
    """What the run's fingerprint holds of a `--scores-from` dir: a rerun with another must not resume."""
    p = Path(data_dir).expanduser() / SCORES
    st = p.stat()
    return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# ----------------------------------------------------------------------------- thresholds by fraction

def resolve(stage: QualityStage, source: ScoreSource) -> QualityStage:
    """The stage deciding from `source`, its fractions turned into thresholds (the module's rule)."""
    stage = replace(stage, source=source)
    if stage.ppl_quantiles and stage.lm is not None:
        lo, hi = stage.ppl_quantiles
        n = _count(source, stage.before_quality)
        ppl_min = _kth(source, "ppl", stage.before_quality, math.floor(lo * n) + 1, largest=False) if lo > 0 and n else 0.0
        ppl_max = _kth(source, "ppl", stage.before_quality, math.ceil(hi * n), largest=False) if hi < 1 and n else 0.0
        stage = replace(stage, ppl_min=ppl_min, ppl_max=ppl_max)
    if stage.top_fraction and stage.classifier is not None:

        def candidates(r: np.ndarray) -> np.ndarray:
            return stage.before_quality(r) & stage.in_band(r)

        m = _count(source, candidates)
        k = math.ceil(stage.top_fraction * m)
        stage = replace(stage, threshold=_kth(source, "quality", candidates, k, largest=True) if k else 0.0)
    return stage


def blocks(path: str | Path) -> Iterator[np.ndarray]:
    """A sidecar's records, `BLOCK` at a time (in memory: one block). Plain reads, not through a
    memory map: the map's pages would stay in this process's resident set as it walks the file."""
    dtype = read_scores(Path(path)).dtype  # (checks the header)
    with open(path, "rb") as f:
        f.seek(len(HEADER))
        while True:
            b = np.fromfile(f, dtype=dtype, count=BLOCK)
            if not b.size:
                return
            yield b


def _count(source: ScoreSource, mask: Callable[[np.ndarray], np.ndarray]) -> int:
    return sum(int(mask(b).sum()) for b in blocks(source.path))


def _kth(source: ScoreSource, field: str, mask: Callable[[np.ndarray], np.ndarray], k: int, largest: bool) -> float:
    return order_stats(lambda: (b[field][mask(b)] for b in blocks(source.path)), [k], largest)[0]


def _ordered_bits(v: np.ndarray) -> np.ndarray:
    """float32 -> uint32 with the same order (negative values' bits flipped, positive ones' sign set)."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    return np.where(u >> np.uint32(31), ~u, u | np.uint32(1 << 31)).astype(np.uint32)


def _from_bits(u: int) -> float:
    u = np.uint32(u)
    raw = u & np.uint32(0x7FFFFFFF) if u >> np.uint32(31) else ~u
    return float(np.array([raw], dtype=np.uint32).view(np.float32)[0])


def order_stats(values: Callable[[], Iterator[np.ndarray]], ks: list[int], largest: bool = False) -> list[float]:
    """The k-th smallest (`largest`: largest) of the float32 values `values()` yields, block by
    block, for each k (1-based, 1 <= k <= their number; no NaN among them). Exact, in two passes
    of a 65,536-bin histogram over the values' order-preserving bits: the top 16 bits, then the
    low 16 bits inside each bin holding a k-th value. Memory: the histograms and one block."""
    hist = np.zeros(1 << 16, dtype=np.int64)
    for v in values():
        hist += np.bincount(_ordered_bits(v) >> np.uint32(16), minlength=1 << 16)
    tops = [_bin_of(hist, k, largest) for k in ks]
    low = {t: np.zeros(1 << 16, dtype=np.int64) for t in sorted({t for t, _ in tops})}
    for v in values():
        u = _ordered_bits(v)
        hi = u >> np.uint32(16)
        for t, h in low.items():
            h += np.bincount(u[hi == t] & np.uint32(0xFFFF), minlength=1 << 16)
    return [_from_bits((t << 16) | _bin_of(low[t], k_in, largest)[0]) for t, k_in in tops]


def _bin_of(hist: np.ndarray, k: int, largest: bool) -> tuple[int, int]:
    """(the bin holding the k-th value counted from the small (large) end, k within that bin)."""
    h = hist[::-1] if largest else hist
    c = np.cumsum(h)
    i = int(np.searchsorted(c, k, side="left"))
    before = int(c[i - 1]) if i else 0
    return (h.size - 1 - i if largest else i), k - before


# ----------------------------------------------------------------------------- the path through the main process

def attach(work: Iterator, source: ScoreSource) -> Iterator[Scored]:
    """Pass 1's work items with the source records of each one's input range (`scoring.Scored`):
    the path through the main process (`--ray`'s nodes may not share the source's disk). A range
    is the item's first to last document origin (a block of raw lines: its bytes); the worker
    picks its documents' records out of them (`scoring.lookup`)."""
    for w in work:
        if isinstance(w, sources.RawLines):
            last = (w.rest or [w])[-1]
            end = last.offset + (len(last.data) if last.data is not None else last.size)
            lo, hi = (w.file, w.offset), (w.file, max(w.offset, end - 1))
        elif isinstance(w, tuple) and w[1] is not None and len(w[1]):
            lo, hi = (int(w[1]["file"][0]), int(w[1]["offset"][0])), (int(w[1]["file"][-1]), int(w[1]["offset"][-1]))
        else:
            yield Scored(w, np.zeros(0, dtype=RECORD))
            continue
        yield Scored(w, source.between(lo, hi))
