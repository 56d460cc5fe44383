"""Benchmark decontamination (issue 39): a document sharing a character 13-gram with a named
evaluation set, or holding whole an eval item shorter than that, is dropped from the corpus
(the rule: `EvalNgrams`).

The eval sets are files in the layout `eval --choices` reads (C-Eval / CMMLU CSV or JSONL rows of
`question`, `A`..`D`, `answer`; or generic JSONL `context` / `choices`), or directories of them.
Their text is every string field of a row, joined: the question and each option, so an option
copied into a web page counts too; and, as an exam page prints a question, the question followed by
its options each after its label (`A.` normalises to `a`, which broke every 13-gram of a short
question copied with its labels), and the options alone in order, labelled or not (`Item.forms`).
(`eval/choices.py` is a layer above `data/`, so the rows are
read here with the same rules, only for their text.)

Both sides are normalised the same way before n-grams are taken (`normalize`): NFKC, lower case,
and every character that is not a letter or a digit removed, so punctuation, spaces and
full-width forms do not hide a copied question (GPT-3's and Llama's decontamination normalise
likewise, on words; Chinese has no spaces, so characters). N-grams are 64-bit hashes
(`quality.ngram_hashes`); a collision could only drop a document too many, never keep one.
"""
from __future__ import annotations

import csv
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from mspretrain.errors import UserError
from mspretrain.prepare.modelfile import sha256_file
from mspretrain.prepare.quality import codepoints, ngram_hashes

_NOT_WORD = re.compile(r"[\W_]+")
SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson")


def normalize(text: str) -> str:
    return _NOT_WORD.sub("", unicodedata.normalize("NFKC", text).lower())


# An eval item (a row, or its options alone) whose normalised text is shorter than the n-gram has
# no n-gram at all: it is matched whole instead, if it has at least this many characters (fewer
# would match everywhere: "是", "1234").
MIN_WHOLE = 6
_OPTION_LIST = ("choices", "options", "endings")  # generic JSONL: the options as a list, labelled a, b, c...


def eval_files(names: Sequence[str]) -> list[Path]:
    """The files named (a directory: its .csv / .jsonl files, sorted), refused in one line when
    one is missing (or is a FIFO, a device...: named as what it is) or a directory holds none."""
    from mspretrain.fsutil import file_kind, why_not

    out: list[Path] = []
    for name in names:
        p = Path(name).expanduser()
        kind = file_kind(p)
        if kind == "a directory":
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
            if not found:
                raise UserError(f"prepare.decontam: {p} holds no .csv or .jsonl eval file", "name C-Eval/CMMLU .csv files or their directory")
            out += found
        elif kind == "a file":
            out.append(p)
        else:
            raise UserError(f"prepare.decontam: eval set {p} {why_not(p)}", "name C-Eval/CMMLU .csv / .jsonl files or their directory")
    return out


@dataclass(frozen=True)
class Item:
    """One eval row: its text fields in order (`parts`: question and options, as before options
    were told apart), and its options with their labels ("a".."d" of C-Eval's A-D columns)."""

    parts: tuple[str, ...]
    options: tuple[tuple[str, str], ...]

    def forms(self) -> list[str]:
        """The normalised texts a copy of this item may show: the row's text fields joined; the
        question followed by each option after its label (`A.` normalises to `a`), as an exam page
        prints it; and the options alone, in order, with and without their labels."""
        out = [normalize("\n".join(self.parts))]
        if self.options:
            opts = {o for _, o in self.options}
            question = normalize("".join(p for p in self.parts if p not in opts))
            labelled = "".join(normalize(lab) + normalize(o) for lab, o in self.options)
            out += [question + labelled, labelled, "".join(normalize(o) for _, o in self.options)]
        return out


def read_items(path: Path) -> list[Item]:
    """The rows of an eval file, read with the guards of every input (a regular file of at most
    TEXT_CAP bytes, JSON not nested past the stack): their string fields (question and options;
    the answer letter and ids are not text worth matching)."""
    from mspretrain.fsutil import TEXT_CAP, loads_json, read_regular_bytes

    fix = "save the eval set as UTF-8 C-Eval/CMMLU .csv or .jsonl"
    try:
        text = read_regular_bytes(path, TEXT_CAP, "prepare.decontam eval set", fix).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"prepare.decontam: cannot read {path} as UTF-8 text (byte {exc.start})", fix) from None
    rows: list[dict] = []
    if path.suffix.lower() == ".csv":
        try:
            rows = list(csv.DictReader(text.splitlines(keepends=True)))
        except csv.Error as exc:
            raise UserError(f"prepare.decontam: {path} is malformed CSV ({exc})", "pass C-Eval/CMMLU .csv files") from None
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                obj = loads_json(line, f"prepare.decontam: {path}:{n}", "one JSON object per line")
                if isinstance(obj, dict):
                    rows.append(obj)
    out = []
    for row in rows:
        parts: list[str] = []
        options: list[tuple[str, str]] = []
        for k, v in row.items():
            key = str(k).strip().lower()
            if key in ("answer", "id", "label", "explanation"):
                continue
            if isinstance(v, str):
                parts.append(v)
                if len(key) == 1 and "a" <= key <= "j":
                    options.append((key, v))
            elif isinstance(v, list):
                items = [c for c in v if isinstance(c, str)]
                parts += items
                if key in _OPTION_LIST:
                    options += [(chr(ord("a") + i), c) for i, c in enumerate(items[:10])]
        out.append(Item(tuple(parts), tuple(sorted(options))))
    if not any(normalize("\n".join(i.parts)) for i in out):
        raise UserError(f"prepare.decontam: {path} holds no question text", "pass C-Eval/CMMLU .csv files (question, A, B, C, D, answer)")
    return out


def row_texts(path: Path) -> list[str]:
    """The text of each row of an eval file: its string fields, joined by newlines."""
    return ["\n".join(i.parts) for i in read_items(path)]


def doc_ngrams(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hash, document) of every n-gram of the normalised texts."""
    cp, starts = codepoints([normalize(t) for t in texts])
    return ngram_hashes(cp, starts, n)


def _hashes(normalized: Sequence[str], n: int) -> np.ndarray:
    cp, starts = codepoints(list(normalized))
    return ngram_hashes(cp, starts, n)[0]


@dataclass(frozen=True)
class EvalNgrams:
    """The sorted, unique n-gram hashes of the eval sets (8 bytes each: C-Eval's ~14 K questions
    are ~1.5 M n-grams, 12 MB), the items matched whole (`whole`: per length under n, the
    hashes of the item texts of that length), and what they came from.

    The rule: a document is contaminated when its normalised text shares an n-gram with one of
    an item's forms (`Item.forms`: the row's text; the question and its labelled options; the
    options in order, labelled or not), or holds whole a form shorter than n (of at least
    MIN_WHOLE characters)."""

    hashes: np.ndarray  # uint64, sorted, unique
    n: int
    files: tuple[tuple[str, str], ...]  # (path, sha256)
    whole: tuple[tuple[int, np.ndarray], ...] = ()  # (length, sorted unique hashes of the forms of that length)

    @staticmethod
    def build(names: Sequence[str], n: int) -> "EvalNgrams":
        files = eval_files(names)
        forms = sorted({f for path in files for item in read_items(path) for f in item.forms() if len(f) >= MIN_WHOLE})
        long = [f for f in forms if len(f) >= n]
        h = np.unique(_hashes(long, n)) if long else np.zeros(0, dtype=np.uint64)
        by_len: dict[int, list[str]] = {}
        for f in forms:
            if len(f) < n:
                by_len.setdefault(len(f), []).append(f)
        whole = tuple((k, np.unique(_hashes(v, k))) for k, v in sorted(by_len.items()))
        if not h.size and not whole:
            raise UserError(f"prepare.decontam: no eval item of {', '.join(str(f) for f in files[:3])} has {MIN_WHOLE} characters "
                            "(letters and digits), too few to tell a copy from chance", "name C-Eval/CMMLU .csv / .jsonl files")
        return EvalNgrams(h, n, tuple((str(f), sha256_file(f)) for f in files), whole)

    @property
    def size(self) -> int:
        """Hashes held (the manifest's `ngrams`)."""
        return int(self.hashes.size) + sum(int(v.size) for _, v in self.whole)

    def hits(self, texts: Sequence[str]) -> np.ndarray:
        """Per text, how many of its n-grams (with repeats) are in the eval sets, plus how many
        times it holds a short item whole; uint32."""
        cp, starts = codepoints([normalize(t) for t in texts])
        out = np.zeros(len(texts), dtype=np.int64)
        for k, table in ((self.n, self.hashes), *self.whole):
            if not table.size:
                continue
            h, doc = ngram_hashes(cp, starts, k)
            if not h.size:
                continue
            at = np.minimum(np.searchsorted(table, h), table.size - 1)
            found = table[at] == h
            out += np.bincount(doc[found], minlength=len(texts))
        return out.astype(np.uint32)
