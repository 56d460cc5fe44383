"""`prepare`'s quality stage (issue 39): per document, the decontamination hits, P(Chinese), the
perplexity and the classifier's score, a keep-or-drop decision, and the scores kept in a sidecar.

The stage runs in the workers right after cleaning (`workers.clean_chunk`), on the documents the
rules kept, before the dedup keys: a dropped document never reaches dedup, the tokenizer sample or
the shards. Its models are loaded once by the main process (`QualityStage.load`, which refuses a
missing or corrupt file in one line before anything is written) and go to the workers as an init
argument: by content, so Ray nodes need no shared filesystem.

The sidecar `quality.scores` in the data dir holds one record per scored document, in input order
(`RECORD`: its origin, every score, and the reason it was dropped, 0 if kept), so a user can see
what another threshold would drop (`prepare --inspect`) without scoring again. The main process
appends each chunk's records as pass 1 takes the chunk's result; pass 1's commits record the
file's length, and a resume cuts it back to that, as it does the other pass-1 files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from mspretrain.config import PrepareConfig
from mspretrain.data.decontam import EvalNgrams
from mspretrain.data.quality import CharLM, Classifier, LangID
from mspretrain.errors import UserError

SCORES = "quality.scores"
MAGIC = b"MSQSCORE"
VERSION = 1
# why a document was dropped; the first that applies, in this order (cheapest decision to explain first)
REASONS = ("kept", "contaminated", "language", "perplexity", "quality")
RECORD = np.dtype([("file", "<u4"), ("offset", "<u8"), ("hits", "<u4"), ("zh", "<f4"), ("ppl", "<f4"), ("quality", "<f4"),
                   ("reason", "u1")])  # packed: 29 bytes; a score not computed is NaN
HEADER = MAGIC + np.array([VERSION, RECORD.itemsize], dtype="<u4").tobytes()
NO_FILE = 0xFFFFFFFF  # documents given without an origin
BATCH_CHARS = 1 << 16  # characters scored at once (`QualityStage.score`)


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

    @staticmethod
    def load(cfg: PrepareConfig) -> "QualityStage | None":
        """The configured models, or None when no quality filter is on."""
        if not enabled(cfg):
            return None
        return QualityStage(
            evals=EvalNgrams.build(cfg.decontam, cfg.decontam_ngram) if cfg.decontam else None,
            langid=LangID() if cfg.min_zh_prob > 0 else None, min_zh=cfg.min_zh_prob,
            lm=CharLM.load(cfg.lm_model) if cfg.lm_model else None, ppl_min=cfg.ppl_min, ppl_max=cfg.ppl_max,
            classifier=Classifier.load(cfg.quality_model) if cfg.quality_model else None, threshold=cfg.quality_threshold)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """RECORD per text (origin left 0), each score computed for every text, so the sidecar
        shows what any threshold would do; `reason` the first filter that drops it.

        In batches of about BATCH_CHARS characters: a block of raw lines is a chunk of ~2 M
        characters, and the n-gram arrays of all of it at once (8 bytes per character and order,
        several of them) ran 10 x slower per document than cache-sized batches (measured:
        docs/benchmarks.md, "Quality filters"). A document's scores do not depend on its batch."""
        out, i = [], 0
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        ends = np.cumsum(lengths)
        while i < len(texts):
            j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + BATCH_CHARS, side="right")))
            out.append(self._score(texts[i:j]))
            i = j
        return np.concatenate(out) if out else np.zeros(0, dtype=RECORD)

    def _score(self, texts: Sequence[str]) -> np.ndarray:
        r = np.zeros(len(texts), dtype=RECORD)
        for k in ("zh", "ppl", "quality"):
            r[k] = np.nan
        reason = np.zeros(len(texts), dtype=np.uint8)

        def drop(mask: np.ndarray, why: str) -> None:
            reason[(reason == 0) & mask] = REASONS.index(why)

        if self.evals is not None:
            r["hits"] = self.evals.hits(texts)
            drop(r["hits"] > 0, "contaminated")
        if self.langid is not None:
            r["zh"] = self.langid.zh_prob(texts)
            drop(r["zh"] < self.min_zh, "language")
        if self.lm is not None:
            r["ppl"] = self.lm.perplexity(texts)
            drop(((r["ppl"] < self.ppl_min) if self.ppl_min > 0 else False) | ((r["ppl"] > self.ppl_max) if self.ppl_max > 0 else False),
                 "perplexity")
        if self.classifier is not None:
            r["quality"] = self.classifier.score(texts)
            drop(r["quality"] < self.threshold, "quality")
        r["reason"] = reason
        return r

    def describe(self) -> dict:
        """The manifest's `quality` entry: every model by path and SHA-256, every threshold."""
        out: dict = {"scores": SCORES, "reasons": list(REASONS)}
        if self.evals is not None:
            out["decontam"] = {"ngram": self.evals.n, "ngrams": int(self.evals.hashes.size),
                               "sets": [{"path": p, "sha256": h} for p, h in self.evals.files]}
        if self.langid is not None:
            out["language"] = {"model": "py3langid " + _version("py3langid"), "min_zh_prob": self.min_zh}
        if self.lm is not None:
            out["perplexity"] = {"model": self.lm.path, "sha256": self.lm.sha256, "min": self.ppl_min, "max": self.ppl_max}
        if self.classifier is not None:
            out["classifier"] = {"model": self.classifier.path, "sha256": self.classifier.sha256, "threshold": self.threshold}
        return out

    def identity(self) -> dict:
        """What of the models the run's fingerprint holds (a changed file must not resume)."""
        d = self.describe()
        d.pop("scores")
        d.pop("reasons")
        return d


def _version(lib: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(lib)
    except PackageNotFoundError:
        return "?"


def enabled(cfg: PrepareConfig) -> bool:
    return bool(cfg.decontam or cfg.min_zh_prob > 0 or cfg.lm_model or cfg.quality_model)


def apply(stage: QualityStage, texts: list[str], origin: np.ndarray | None, dropped: dict) -> tuple[list[str], np.ndarray | None, np.ndarray]:
    """A chunk's cleaned texts through the stage: (the texts kept, their origins, the chunk's
    sidecar records). Drops are counted into `dropped` under their reason's name."""
    rec = stage.score(texts)
    if origin is not None:
        rec["file"], rec["offset"] = origin["file"], origin["offset"]
    else:
        rec["file"] = NO_FILE
    keep = rec["reason"] == 0
    for k, n in zip(*np.unique(rec["reason"][~keep], return_counts=True)):
        dropped[REASONS[int(k)]] = dropped.get(REASONS[int(k)], 0) + int(n)
    if keep.all():
        return texts, origin, rec
    return [t for t, k in zip(texts, keep.tolist()) if k], None if origin is None else origin[keep], rec


class ScoreWriter:
    """The sidecar, appended in input order; `length`: a commit's, to cut a torn tail back to."""

    def __init__(self, path: Path, length: int | None = None) -> None:
        self.path = path
        if length is None:
            with open(path, "wb") as f:
                f.write(HEADER)
        else:
            with open(path, "r+b") as f:
                f.truncate(length)
        self._f = open(path, "ab")

    def add(self, records: np.ndarray) -> None:
        self._f.write(records.tobytes())

    def flush(self) -> int:
        self._f.flush()
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        self._f.close()


def read_scores(path: Path) -> np.ndarray:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(HEADER))
    if head != HEADER or (size - len(HEADER)) % RECORD.itemsize:
        raise UserError(f"{path} is not a quality score file of this version", "run prepare again to write it")
    if size == len(HEADER):
        return np.zeros(0, dtype=RECORD)
    return np.memmap(path, mode="r", dtype=RECORD, offset=len(HEADER))  # 29 bytes a document: not read whole

