"""Benchmark decontamination (issue 39): a document sharing a character 13-gram with a named
evaluation set is dropped from the corpus.

The eval sets are files in the layout `eval --choices` reads (C-Eval / CMMLU CSV or JSONL rows of
`question`, `A`..`D`, `answer`; or generic JSONL `context` / `choices`), or directories of them.
Their text is every string field of a row, joined: the question and each option, so an option
copied into a web page counts too. (`eval/choices.py` is a layer above `data/`, so the rows are
read here with the same rules, only for their text.)

Both sides are normalised the same way before n-grams are taken (`normalize`): NFKC, lower case,
and every character that is not a letter or a digit removed, so punctuation, spaces and
full-width forms do not hide a copied question (GPT-3's and Llama's decontamination normalise
likewise, on words; Chinese has no spaces, so characters). N-grams are 64-bit hashes
(`quality.ngram_hashes`); a collision could only drop a document too many, never keep one.
"""
from __future__ import annotations

import csv
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from mspretrain.errors import UserError
from mspretrain.prepare.quality import codepoints, ngram_hashes, sha256_file

_NOT_WORD = re.compile(r"[\W_]+")
SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson")


def normalize(text: str) -> str:
    return _NOT_WORD.sub("", unicodedata.normalize("NFKC", text).lower())


def eval_files(names: Sequence[str]) -> list[Path]:
    """The files named (a directory: its .csv / .jsonl files, sorted), refused in one line when
    one is missing or a directory holds none."""
    out: list[Path] = []
    for name in names:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
            if not found:
                raise UserError(f"prepare.decontam: {p} holds no .csv or .jsonl eval file", "name C-Eval/CMMLU .csv files or their directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UserError(f"prepare.decontam: eval set {p} does not exist", "name C-Eval/CMMLU .csv / .jsonl files or their directory")
    return out


def row_texts(path: Path) -> list[str]:
    """The text of each row of an eval file: its string fields (question and options; the answer
    letter and ids are not text worth matching), joined by newlines."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"prepare.decontam: cannot read {path} as UTF-8 text ({exc})", "save the eval set as UTF-8") from None
    rows: list[dict] = []
    if path.suffix.lower() == ".csv":
        try:
            rows = list(csv.DictReader(text.splitlines(keepends=True)))
        except csv.Error as exc:
            raise UserError(f"prepare.decontam: {path} is malformed CSV ({exc})", "pass C-Eval/CMMLU .csv files") from None
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise UserError(f"prepare.decontam: {path}:{n} is not a JSON object", "one object per line") from None
                if isinstance(obj, dict):
                    rows.append(obj)
    out = []
    for row in rows:
        parts: list[str] = []
        for k, v in row.items():
            if str(k).strip().lower() in ("answer", "id", "label", "explanation"):
                continue
            if isinstance(v, str):
                parts.append(v)
            elif isinstance(v, list):
                parts += [c for c in v if isinstance(c, str)]
        out.append("\n".join(parts))
    if not any(normalize(t) for t in out):
        raise UserError(f"prepare.decontam: {path} holds no question text", "pass C-Eval/CMMLU .csv files (question, A, B, C, D, answer)")
    return out


def doc_ngrams(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hash, document) of every n-gram of the normalised texts."""
    cp, starts = codepoints([normalize(t) for t in texts])
    return ngram_hashes(cp, starts, n)


@dataclass(frozen=True)
class EvalNgrams:
    """The sorted, unique n-gram hashes of the eval sets (8 bytes each: C-Eval's ~14 K questions
    are ~1.5 M n-grams, 12 MB), and what they came from."""

    hashes: np.ndarray  # uint64, sorted, unique
    n: int
    files: tuple[tuple[str, str], ...]  # (path, sha256)

    @staticmethod
    def build(names: Sequence[str], n: int) -> "EvalNgrams":
        files = eval_files(names)
        parts = [doc_ngrams(row_texts(f), n)[0] for f in files]
        h = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)
        return EvalNgrams(h, n, tuple((str(f), sha256_file(f)) for f in files))

    def hits(self, texts: Sequence[str]) -> np.ndarray:
        """Per text, how many of its n-grams (with repeats) are in the eval sets; uint32."""
        h, doc = doc_ngrams(texts, self.n)
        if not self.hashes.size or not h.size:
            return np.zeros(len(texts), dtype=np.uint32)
        at = np.minimum(np.searchsorted(self.hashes, h), self.hashes.size - 1)
        found = self.hashes[at] == h
        return np.bincount(doc[found], minlength=len(texts)).astype(np.uint32)
