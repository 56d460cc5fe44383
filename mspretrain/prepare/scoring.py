"""`prepare`'s quality stage (issue 39): per document, the decontamination hits, P(Chinese), the
perplexity and the classifier's score, a keep-or-drop decision, and the scores kept in a sidecar.

The stage runs in the workers right after cleaning (`workers.clean_chunk`), on the documents the
rules kept, before dedup: a dropped document never reaches dedup, the tokenizer sample or the
shards. Its models are loaded once by the main process (`QualityStage.load`, which refuses a
missing or corrupt file in one line before anything is written) and go to the workers as an init
argument: by content, so Ray nodes need no shared filesystem.

Scores and decisions are separate steps: `scores` computes a document's scores (a pure function
of its text and the models' bytes), `decide` applies the thresholds to them. So a stage may take
its scores from a sidecar written before (`source`, `rescore.py`) instead of its models: prepare
`--scores-from DATA_DIR` re-thresholds without scoring again, and a filter that keeps a fraction
(`prepare.quality_top_fraction`, `prepare.ppl_quantiles`) scores every document in a scan first
and then decides from the scan's sidecar with the thresholds the fractions resolve to.

The sidecar `quality.scores` in the data dir holds one record per scored document, in input order
(`RECORD`: its origin, the first 8 bytes of its dedup key, every score, and the reason it was
dropped, 0 if kept), so a user can see what another threshold would drop (`prepare --inspect`)
and re-threshold without scoring again. The main process appends each chunk's records as pass 1
takes the chunk's result; pass 1's commits record the file's length, and a resume cuts it back to
that, as it does the other pass-1 files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from mspretrain.config.schema import PrepareConfig
from mspretrain.errors import UserError
from mspretrain.prepare.decontam import EvalNgrams
from mspretrain.prepare.quality import CharLM, Classifier, LangID

SCORES = "quality.scores"
MAGIC = b"MSQSCORE"
VERSION = 2  # 2: `key` added (version 1 had no key; `read_scores` still reads it, `--scores-from` does not take it)
# why a document was dropped; the first that applies, in this order (cheapest decision to explain first)
REASONS = ("kept", "contaminated", "language", "perplexity", "quality")
RECORD = np.dtype([("file", "<u4"), ("offset", "<u8"), ("hits", "<u4"), ("zh", "<f4"), ("ppl", "<f4"), ("quality", "<f4"),
                   ("reason", "u1"), ("key", "<u8")])  # packed: 37 bytes; a score not computed is NaN
RECORD_V1 = np.dtype([("file", "<u4"), ("offset", "<u8"), ("hits", "<u4"), ("zh", "<f4"), ("ppl", "<f4"), ("quality", "<f4"),
                      ("reason", "u1")])
HEADER = MAGIC + np.array([VERSION, RECORD.itemsize], dtype="<u4").tobytes()
HEADER_V1 = MAGIC + np.array([1, RECORD_V1.itemsize], dtype="<u4").tobytes()
NO_FILE = 0xFFFFFFFF  # documents given without an origin
BATCH_CHARS = 1 << 16  # characters scored at once (`QualityStage.scores`)


class ScoresMissing(UserError):
    """A document that `--scores-from`'s sidecar holds no record of (raised in a worker: picklable
    with its hint, so the CLI prints both lines)."""

    def __reduce__(self):
        return (type(self), (self.cause, self.fix))


@dataclass(frozen=True)
class ScoreSource:
    """A sidecar holding the scores of every document of this run: another data dir's
    (`--scores-from`), or the scan's (`stage_scan.ScoreScan`). Looked up by each document's origin and key."""

    path: str

    def between(self, lo: tuple[int, int], hi: tuple[int, int]) -> np.ndarray:
        """The records whose origin (file, offset) is in [lo, hi]: the sidecar is in input order,
        so two binary searches on the memory-mapped file (~50 records read, not the file)."""
        r = _mapped(self.path)
        a, b = _bisect(r, lo, right=False), _bisect(r, hi, right=True)
        return np.array(r[a:b]) if a < b else np.zeros(0, dtype=RECORD)


def _bisect(r: np.ndarray, at: tuple[int, int], right: bool) -> int:
    """The first record whose (file, offset) is >= `at` (`right`: > `at`). A loop of record reads:
    `np.searchsorted` on a field of a memory map copies the whole field first."""
    lo, hi = 0, r.size
    while lo < hi:
        mid = (lo + hi) // 2
        rec = r[mid]
        k = (int(rec["file"]), int(rec["offset"]))
        if k < at or (right and k == at):
            lo = mid + 1
        else:
            hi = mid
    return lo


_MAPS: dict[tuple, np.ndarray] = {}  # per process: each source's memory map, opened once


def _mapped(path: str) -> np.ndarray:
    st = os.stat(path)
    at = (path, st.st_ino, st.st_size, st.st_mtime_ns)  # a file written anew at the same path is mapped anew
    if at not in _MAPS:
        _MAPS.clear()
        _MAPS[at] = read_scores(Path(path))
    return _MAPS[at]


@dataclass(frozen=True)
class Scored:
    """A work item of pass 1 with the source records of its input range (`rescore.attach`): on
    the path through the main process (`--ray`'s), whose nodes may not share the source's disk."""

    work: object
    records: np.ndarray


@dataclass(frozen=True)
class QualityStage:
    evals: EvalNgrams | None
    langid: LangID | None
    min_zh: float
    lm: CharLM | None
    ppl_min: float
    ppl_max: float
    classifier: Classifier | None
    threshold: float
    top_fraction: float = 0.0  # keep this fraction of the classifier's candidates (`rescore.resolve` sets `threshold`)
    ppl_quantiles: tuple = ()  # (lo, hi): the perplexity band by quantile (`rescore.resolve` sets ppl_min / ppl_max)
    source: ScoreSource | None = None  # take the scores from this sidecar instead of the models

    @staticmethod
    def load(cfg: PrepareConfig, lm: CharLM | None = None) -> "QualityStage | None":
        """The configured models, or None when no quality filter is on. `lm`: the model of
        `prepare.lm_reference` (`quality.reference_lm`), counted by the caller."""
        if not enabled(cfg):
            return None
        return QualityStage(
            evals=EvalNgrams.build(cfg.decontam, cfg.decontam_ngram) if cfg.decontam else None,
            langid=LangID() if cfg.min_zh_prob > 0 else None, min_zh=cfg.min_zh_prob,
            lm=CharLM.load(cfg.lm_model) if cfg.lm_model else lm, ppl_min=cfg.ppl_min, ppl_max=cfg.ppl_max,
            classifier=Classifier.load(cfg.quality_model) if cfg.quality_model else None, threshold=cfg.quality_threshold,
            top_fraction=cfg.quality_top_fraction, ppl_quantiles=tuple(cfg.ppl_quantiles))

    @property
    def by_fraction(self) -> bool:
        """Some threshold follows from the scores of every document (a scan or a source first)."""
        return bool(self.top_fraction or self.ppl_quantiles)

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """RECORD per text (origin, key and reason left 0), each score computed for every text,
        so the sidecar shows what any threshold would do.

        In batches of about BATCH_CHARS characters: a block of raw lines is a chunk of ~2 M
        characters, and the n-gram arrays of all of it at once (8 bytes per character and order,
        several of them) ran 10 x slower per document than cache-sized batches (measured:
        docs/benchmarks.md, "Quality filters"). A document's scores do not depend on its batch."""
        out, i = [], 0
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        ends = np.cumsum(lengths)
        while i < len(texts):
            j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + BATCH_CHARS, side="right")))
            out.append(self._scores(texts[i:j]))
            i = j
        return np.concatenate(out) if out else np.zeros(0, dtype=RECORD)

    def _scores(self, texts: Sequence[str]) -> np.ndarray:
        r = np.zeros(len(texts), dtype=RECORD)
        if self.evals is not None:
            r["hits"] = self.evals.hits(texts)
        r["zh"] = self.langid.zh_prob(texts) if self.langid is not None else np.nan
        r["ppl"] = self.lm.perplexity(texts) if self.lm is not None else np.nan
        r["quality"] = self.classifier.score(texts) if self.classifier is not None else np.nan
        return r

    def keep_only_own(self, r: np.ndarray) -> np.ndarray:
        """Source records (another run's, which may have scored more) as this stage's own
        `scores` would have made them: the scores of the filters that are off here cleared."""
        r = r.copy()
        if self.evals is None:
            r["hits"] = 0
        for k, on in (("zh", self.langid), ("ppl", self.lm), ("quality", self.classifier)):
            if on is None:
                r[k] = np.nan
        return r

    def before_quality(self, r: np.ndarray) -> np.ndarray:
        """Per record: kept by decontamination and language (the population of the perplexity
        quantiles). NaN compares False: a filter that is off keeps everything."""
        keep = np.ones(r.size, dtype=bool)
        if self.evals is not None:
            keep &= r["hits"] == 0
        if self.langid is not None:
            keep &= r["zh"] >= self.min_zh
        return keep

    def in_band(self, r: np.ndarray) -> np.ndarray:
        """Per record: inside the perplexity band (everything, without a language model)."""
        keep = np.ones(r.size, dtype=bool)
        if self.lm is not None:
            if self.ppl_min > 0:
                keep &= r["ppl"] >= self.ppl_min
            if self.ppl_max > 0:
                keep &= r["ppl"] <= self.ppl_max
        return keep

    def decide(self, r: np.ndarray) -> np.ndarray:
        """The reason (`REASONS` index) of each record under this stage's thresholds: the first
        filter that drops it, 0 if none."""
        reason = np.zeros(r.size, dtype=np.uint8)

        def drop(mask: np.ndarray, why: str) -> None:
            reason[(reason == 0) & mask] = REASONS.index(why)

        if self.evals is not None:
            drop(r["hits"] > 0, "contaminated")
        if self.langid is not None:
            drop(~(r["zh"] >= self.min_zh), "language")
        if self.lm is not None:
            drop(~self.in_band(r), "perplexity")
        if self.classifier is not None:
            drop(~(r["quality"] >= self.threshold), "quality")
        return reason

    def describe(self) -> dict:
        """The manifest's `quality` entry: every model by path and SHA-256, every threshold (and,
        for a filter that keeps a fraction, the fraction and the threshold it resolved to)."""
        out: dict = {"scores": SCORES, "reasons": list(REASONS)}
        if self.evals is not None:
            out["decontam"] = {"ngram": self.evals.n, "ngrams": int(self.evals.hashes.size),
                               **({"whole_items": self.evals.size - int(self.evals.hashes.size)} if self.evals.whole else {}),
                               "sets": [{"path": p, "sha256": h} for p, h in self.evals.files]}
        if self.langid is not None:
            out["language"] = {"model": "py3langid " + _version("py3langid"), "min_zh_prob": self.min_zh}
        if self.lm is not None:
            out["perplexity"] = {"model": self.lm.path, "sha256": self.lm.sha256, "min": self.ppl_min, "max": self.ppl_max,
                                 **({"quantiles": list(self.ppl_quantiles)} if self.ppl_quantiles else {})}
        if self.classifier is not None:
            out["classifier"] = {"model": self.classifier.path, "sha256": self.classifier.sha256, "threshold": self.threshold,
                                 **({"top_fraction": self.top_fraction} if self.top_fraction else {})}
        return out

    def identity(self) -> dict:
        """What of the models the run's fingerprint holds (a changed file must not resume)."""
        d = self.describe()
        d.pop("scores")
        d.pop("reasons")
        return d

    def scoring_only(self) -> "QualityStage":
        """This stage without a source, for the scan (its thresholds do not matter there)."""
        return replace(self, source=None)


def _version(lib: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(lib)
    except PackageNotFoundError:
        return "?"


def enabled(cfg: PrepareConfig) -> bool:
    return bool(cfg.decontam or cfg.min_zh_prob > 0 or cfg.lm_model or cfg.lm_reference or cfg.quality_model)


def apply(stage: QualityStage, texts: list[str], origin: np.ndarray | None, dropped: dict, keys: bytes,
          given: np.ndarray | None = None) -> tuple[list[str], np.ndarray | None, np.ndarray, bytes]:
    """A chunk's cleaned texts through the stage: (the texts kept, their origins, the chunk's
    sidecar records, the kept texts' dedup keys). `keys`: the texts' dedup keys (16 bytes each),
    whose first 8 bytes the records keep. The scores come from the models, or from the stage's
    source (`given`: its records of the chunk's input range, else looked up in its file). Drops
    are counted into `dropped` under their reason's name."""
    key = np.frombuffer(keys, dtype="<u8")[0::2] if texts else np.zeros(0, dtype="<u8")
    if stage.source is None:
        rec = stage.scores(texts)
    else:
        rec = stage.keep_only_own(lookup(stage.source, origin, key, given))
    if origin is not None:
        rec["file"], rec["offset"] = origin["file"], origin["offset"]
    else:
        rec["file"] = NO_FILE
    rec["key"] = key
    rec["reason"] = stage.decide(rec)
    keep = rec["reason"] == 0
    for k, n in zip(*np.unique(rec["reason"][~keep], return_counts=True)):
        dropped[REASONS[int(k)]] = dropped.get(REASONS[int(k)], 0) + int(n)
    if keep.all():
        return texts, origin, rec, keys
    kept_keys = np.frombuffer(keys, dtype="V16")[keep].tobytes()
    return [t for t, k in zip(texts, keep.tolist()) if k], None if origin is None else origin[keep], rec, kept_keys


def lookup(source: ScoreSource, origin: np.ndarray | None, key: np.ndarray, given: np.ndarray | None) -> np.ndarray:
    """The source's record of each document, matched by origin and key (pieces of one long
    record share its origin; the key tells them apart, and two with the same key have the same
    text, so the same scores). ScoresMissing names the first document it does not hold."""
    n = key.size
    if not n:
        return np.zeros(0, dtype=RECORD)
    if origin is None:
        raise ScoresMissing("--scores-from needs the documents' origins, and these have none", "run prepare without --scores-from")
    cand = given if given is not None else source.between((int(origin["file"][0]), int(origin["offset"][0])),
                                                          (int(origin["file"][-1]), int(origin["offset"][-1])))
    hc = _triple(cand["file"], cand["offset"], cand["key"])
    hq = _triple(origin["file"], origin["offset"], key)
    order = np.argsort(hc, kind="stable")
    pos = np.minimum(np.searchsorted(hc[order], hq), max(hc.size - 1, 0))
    j = order[pos] if hc.size else np.zeros(n, dtype=np.int64)
    ok = np.zeros(n, dtype=bool) if not hc.size else (
        (cand["file"][j] == origin["file"]) & (cand["offset"][j] == origin["offset"]) & (cand["key"][j] == key))
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ScoresMissing(f"the quality scores of --scores-from hold no record of the document of input file #{int(origin['file'][i])} "
                            f"at offset {int(origin['offset'][i])}: that prepare read other inputs or cleaned them otherwise",
                            "run prepare without --scores-from (it scores every document again)")
    return cand[j]


def _triple(file: np.ndarray, offset: np.ndarray, key: np.ndarray) -> np.ndarray:
    """One 64-bit hash of (file, offset, key) per record, to match records with one sort."""
    from mspretrain.prepare.hash64 import _mix

    with np.errstate(over="ignore"):
        h = _mix(file.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ offset.astype(np.uint64))
        return _mix(h ^ key.astype(np.uint64))


class ScoreWriter:
    """The sidecar, appended in input order; `length`: a commit's, to cut a torn tail back to."""

    def __init__(self, path: Path, length: int | None = None) -> None:
        self.path = path
        if length is None:
            with open(path, "wb") as f:
                f.write(HEADER)
        else:
            from mspretrain.fsutil import cut_back

            cut_back(path, length)  # a file shorter than the commit said is refused, not padded
        self._f = open(path, "ab")

    def add(self, records: np.ndarray) -> None:
        self._f.write(records.tobytes())

    def flush(self) -> int:
        self._f.flush()
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        self._f.close()


def read_scores(path: Path) -> np.ndarray:
    """The records of a sidecar, memory-mapped (37 bytes a document: not read whole); a version 1
    file (no `key`) in its own dtype."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(HEADER))
    dtype = RECORD if head == HEADER else RECORD_V1 if head == HEADER_V1 else None
    if dtype is None or (size - len(HEADER)) % dtype.itemsize:
        raise UserError(f"{path} is not a quality score file of this version", "run prepare again to write it")
    if size == len(HEADER):
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, mode="r", dtype=dtype, offset=len(HEADER))
