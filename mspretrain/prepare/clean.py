"""Document cleaning and quality filters, each rule switchable in `PrepareConfig` and counted.

Rules run in this order (each only when switched on):
  modifying: drop_control, strip_html, remove_urls, remove_emails, nfkc, t2s, char_whitelist,
             normalize_whitespace
  filtering: empty, min_chars, max_dup_line_fraction, max_top_ngram_fraction
A modifying rule counts the documents it changed, a filter the documents it dropped.

Design choices:
- Regular expressions and the stdlib (`html.unescape`, `unicodedata`) instead of an HTML
  parser: web dumps of Chinese text carry tag soup, not documents, and a regex pass is fast and
  never raises. Tag patterns need a letter right after `<`, so "a < b 且 c > d" survives.
- NFKC turns full-width digits and Latin (１２３ＡＢＣ) and compatibility forms into their plain
  forms, but Chinese full-width punctuation (，！？：；（）…) is kept as written: NFKC would
  turn it into ASCII and change the register of every Chinese sentence.
- The repetition filters follow Gopher (Rae et al. 2021, table A1) with characters in place of
  words, since Chinese has no spaces: the share of lines that repeat an earlier line, and the
  share of (letter/digit/CJK) characters covered by the most frequent character 2-gram. The
  n-gram rule is applied only from `NGRAM_MIN_CHARS` characters up, as Gopher applies its
  rules to documents of 50+ words: on a 20-character quatrain one repeated word is noise.
- Speed: most documents need few rules, so `clean_many` first classifies every code point of a
  batch through one lookup table (numpy) and runs a rule on a document only when one of its
  triggers occurs; the n-gram statistics are computed for the whole batch, first as a cheap
  upper bound (hashed buckets), then exactly (one sort) for the few documents the bound cannot clear.
  `Cleaner.__call__` is the plain one-document path; tests hold the two equal.
"""
from __future__ import annotations

import functools
import hashlib
import html
import inspect
import os
import re
import unicodedata
from collections import Counter
from typing import Callable, Iterable

import numpy as np

from mspretrain.config.schema import PrepareConfig
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, default_cache_dir, read_regular_bytes

MODIFY_RULES = ("drop_control", "strip_html", "remove_urls", "remove_emails", "nfkc", "t2s",
                "char_whitelist", "normalize_whitespace")
FILTER_RULES = ("empty", "min_chars", "max_dup_line_fraction", "max_top_ngram_fraction")
MARKUP_RULES = MODIFY_RULES[:4]
NGRAM_MIN_CHARS = 50

# C0/C1 controls except tab and newlines, zero-width and direction marks, stray BOMs, and
# U+FFFD (the mark of an earlier, lossy decode).
_CONTROL_CLASS = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200e\u200f\u2060\ufeff\ufff9-\ufffb\ufffd"
_CONTROL = re.compile(f"[{_CONTROL_CLASS}]")
_HTML_DROP = re.compile(r"<(script|style|noscript|template)\b[^>]*>.*?</\1\s*>|<!--.*?-->", re.I | re.S)
_HTML_BLOCK = re.compile(r"<\s*/?\s*(?:br|p|div|li|tr|h[1-6]|ul|ol|table|blockquote|section|article|header|footer|hr|pre)\b[^<>]*>", re.I)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]*(?:\s[^<>]*)?/?>|<![A-Za-z][^<>]*>")
_HTML_ENTITY = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")
# A URL ends at whitespace, quotes, brackets, CJK text or full-width punctuation, and does not
# take a sentence's final ASCII punctuation with it.
_URL = re.compile(r"(?:(?<![A-Za-z0-9])(?:https?|ftp)://|(?<![A-Za-z0-9])www\.)[^\s<>\"'\u3000-\u303f\u3400-\u9fff\uff00-\uffef]*"
                  r"[^\s<>\"'\u3000-\u303f\u3400-\u9fff\uff00-\uffef.,;:!?)\]}]", re.I)
_WWW = re.compile(r"www\.", re.I)
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# Full-width punctuation that NFKC would turn into ASCII, and the ellipsis it would spell "...".
_PROTECT_CHARS = ([chr(c) for c in range(0xFF01, 0xFF10)] + [chr(c) for c in range(0xFF1A, 0xFF21)]
                  + [chr(c) for c in range(0xFF3B, 0xFF41)] + [chr(c) for c in range(0xFF5B, 0xFF5F)] + ["\u2026"])
_PROTECTED = frozenset(_PROTECT_CHARS)
# Whitelist: CJK ideographs (all blocks), CJK/full-width punctuation, ASCII, Latin-1,
# general punctuation, and whitespace.
_NOT_WHITELISTED = re.compile("[^\t\n\x20-\x7e\u00a0-\u00ff\u2010-\u205e\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff"
                              "\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef\U00020000-\U0003134f]+")
_MANY_NEWLINES = re.compile("\n{3,}")

# Bits of the per-code-point table.
NFKC, MARKUP, ODD_SPACE, WORD, SPACE = 1, 2, 4, 8, 16


@functools.lru_cache(maxsize=1)
def char_table() -> np.ndarray:
    """uint8 flags for every code point (once per process; `prepare` loads it before forking its
    workers). NFKC: NFKC may change it (a decomposition, a combining mark, Hangul jamo), except
    the protected punctuation. MARKUP: a trigger of the markup rules. ODD_SPACE: whitespace
    (`str.isspace`) other than ' ' and newline. WORD: `str.isalnum` (beyond the BMP: CJK
    extensions, historic scripts, emoji, all counted as letters). SPACE: any whitespace."""
    return _cached_table(build_char_table)


def _cached_table(build: Callable[[], np.ndarray]) -> np.ndarray:
    """`build()`, kept in the cache dir (`$MSPRETRAIN_CACHE`) under a name that hashes the
    builder's source, the Unicode version and the character classes it reads, with a SHA-256
    of the table appended. Building is ~0.15 s of serial time at the start of every `prepare`
    (~4 % of a 50 MB run), loading ~5 ms; an unwritable or damaged cache just means building."""
    try:
        source = inspect.getsource(build)
    except (OSError, TypeError):
        return build()
    key = hashlib.sha256("\0".join([source, unicodedata.unidata_version, _CONTROL_CLASS, "".join(_PROTECT_CHARS),
                                     repr((NFKC, MARKUP, ODD_SPACE, WORD, SPACE))]).encode()).hexdigest()[:16]
    path = default_cache_dir() / f"char_table-{key}.bin"
    try:  # with the guards of every reader: a FIFO of that name would hang, a link to /dev/zero grow
        blob = read_regular_bytes(path, 0x110000 + 32, "cached character table")
        body, digest = blob[:0x110000], blob[0x110000:]
        if len(body) == 0x110000 and hashlib.sha256(body).digest() == digest:
            return np.frombuffer(body, dtype=np.uint8).copy()
    except UserError:
        pass
    table = build()
    if os.path.lexists(path) and (os.path.islink(path) or not path.is_file()):
        return table  # not a file this cache wrote (a FIFO, a link): left as it is, the table built each time
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a cache: atomic for concurrent readers, not worth an fsync (a bad copy fails its digest and is rebuilt)
        atomic_write(path, table.tobytes() + hashlib.sha256(table.tobytes()).digest(), fsync=False)
    except OSError:
        pass
    return table


def build_char_table() -> np.ndarray:
    """`char_table`, computed (~0.15 s)."""
    t = np.zeros(0x110000, dtype=np.uint8)
    nfkc_may_change = [c for c in range(0x2FA20) if unicodedata.decomposition(chr(c))
                       or unicodedata.category(chr(c))[0] == "M" or 0x1100 <= c < 0x1200]
    t[nfkc_may_change] |= NFKC
    t[[ord(ch) for ch in _PROTECT_CHARS]] &= ~np.uint8(NFKC)
    codes = np.arange(0x110000)
    markup = re.compile(f"[{_CONTROL_CLASS}<&@]")
    bmp = "".join(map(chr, range(0x10000)))  # one regex scan, not 65,536 matches (0.4 s, serial in prepare)
    t[[m.start() for m in markup.finditer(bmp)]] |= MARKUP
    t[[c for c in range(0x10000) if chr(c).isalnum()]] |= WORD
    t[codes >= 0x10000] |= WORD
    space = [c for c in range(0x10000) if chr(c).isspace()]  # none beyond the BMP
    t[space] |= SPACE
    t[[c for c in space if c not in (0x20, 0x0A)]] |= ODD_SPACE
    return t


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def strip_html(text: str) -> str:
    if "<" in text:
        text = _HTML_DROP.sub("", text)
        text = _HTML_BLOCK.sub("\n", text)
        text = _HTML_TAG.sub("", text)
    if "&" in text:
        text = _HTML_ENTITY.sub(lambda m: html.unescape(m.group()), text)
    return text


def remove_urls(text: str) -> str:
    # Every URL the pattern takes holds "://" or "www." (any case): cheap tests first (a
    # case-insensitive regex search costs ~5 us on a short document, a substring test 0.1 us).
    if "://" in text or (("w" in text or "W" in text) and _WWW.search(text)):
        return _URL.sub("", text)
    return text


def remove_emails(text: str) -> str:
    return _EMAIL.sub("", text) if "@" in text else text


@functools.lru_cache(maxsize=1)
def nfkc_runs() -> re.Pattern:
    """A regex matching each maximal run of BMP characters with the NFKC bit of `char_table`
    (one class of ~470 ranges, which `re` compiles to a bitmap; `prepare` builds it before
    forking its workers). Characters beyond the BMP are left out: `re` would test them as a
    list of ~180 ranges per character, 20x slower, so such texts take `_nfkc_by_table`."""
    marked = np.flatnonzero(char_table()[:0x10000] & NFKC)
    breaks = np.flatnonzero(np.diff(marked) != 1)
    firsts, lasts = np.r_[marked[0], marked[breaks + 1]], np.r_[marked[breaks], marked[-1]]
    ranges = "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in zip(firsts.tolist(), lasts.tolist()))
    return re.compile(f"[{ranges}]+")


@functools.lru_cache(maxsize=1)
def _nfkc_work() -> re.Pattern:
    """`nfkc_runs`' class plus every character beyond the BMP: one scan tells whether `nfkc`
    has any work (most documents reaching it, after an earlier rule changed them, have none)."""
    return re.compile(nfkc_runs().pattern[:-2] + "\U00010000-\U0010ffff]")


def warm_up() -> None:
    """Build the lookup tables and character-class regexes now (`prepare` does, before forking
    its workers, so that they inherit them instead of each building its own)."""
    char_table()
    _nfkc_work()


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _normalize_runs(text: str, runs: Iterable[tuple[int, int]]) -> str:
    """`text` with each (start, end) run NFKC-normalised together with the character before it
    (which a combining mark may compose with), unless that character is protected punctuation."""
    out, done = [], 0
    for start, end in runs:
        if start > done and text[start - 1] not in _PROTECTED:
            start -= 1
        out.append(text[done:start])
        out.append(unicodedata.normalize("NFKC", text[start:end]))
        done = end
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


def _nfkc_by_table(text: str) -> str:
    """`nfkc` through the code-point table: the reference, and the path for texts beyond the BMP."""
    marked = np.flatnonzero(char_table()[_code_points(text)] & NFKC)
    if not marked.size:
        return text
    breaks = np.flatnonzero(np.diff(marked) != 1)
    firsts, lasts = np.r_[marked[0], marked[breaks + 1]], np.r_[marked[breaks], marked[-1]]
    return _normalize_runs(text, zip(firsts.tolist(), (lasts + 1).tolist()))


def nfkc(text: str) -> str:
    """NFKC except for Chinese full-width punctuation (kept as written).

    Only the runs of characters NFKC may change are normalised, each with the character before
    it: the rest of the text is stable under NFKC, and `unicodedata.normalize` on a whole
    Chinese document was the slowest step of the cleaner. The runs are found by one regex scan
    in C (~2 us for a short document; most documents that reach this rule, after an earlier
    rule changed them, have no run at all)."""
    if text.isascii() or not _nfkc_work().search(text):
        return text
    if _ASTRAL.search(text):
        # Most characters beyond the BMP (CJK extensions, emoji) are not marked and simply
        # end a run, as in the table path; only a marked one needs that path.
        table = char_table()
        if any(table[ord(m.group())] & NFKC for m in _ASTRAL.finditer(text)):
            return _nfkc_by_table(text)
    return _normalize_runs(text, (m.span() for m in nfkc_runs().finditer(text)))


def normalize_whitespace(text: str) -> str:
    """Every run of whitespace inside a line becomes one space, lines lose their edge spaces,
    3+ newlines become 2, and the document is stripped ("whitespace" is `str.isspace`)."""
    lines = text.splitlines()
    if len(lines) <= 1:
        # Every line boundary of `splitlines` is whitespace to `split`, so one line (with or
        # without its break) needs no join of lines, and the result has no edge spaces.
        return " ".join(text.split())
    text = "\n".join([" ".join(line.split()) for line in lines])
    if "\n\n\n" in text:
        text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()


def dup_line_fraction(text: str) -> float:
    """Share of non-empty lines that repeat an earlier line."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if len(lines) < 2:
        return 0.0
    return (len(lines) - len(set(lines))) / len(lines)


def top_ngram_fraction(text: str, n: int = 2) -> float:
    """Share of letter/digit/CJK characters covered by the most frequent character n-gram.
    The plain per-document definition; `top_ngram_fractions` is the fast batch version."""
    table = char_table()
    chars = "".join(ch for ch in text if table[ord(ch)] & WORD) if len(text) >= NGRAM_MIN_CHARS else ""
    if len(chars) < max(NGRAM_MIN_CHARS, n + 1):
        return 0.0
    top = Counter(chars[i: i + n] for i in range(len(chars) - n + 1)).most_common(1)[0][1]
    return min(1.0, n * top / len(chars))


def _word_code_points(texts: list[str], shortest: int) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """(indices of the texts of `shortest`+ characters, their letter/digit/CJK code points back to
    back as uint32, the position of each code point's text in that list, letters per text)."""
    idx = [i for i, t in enumerate(texts) if len(t) >= shortest]
    batch = [texts[i] for i in idx]
    cps = _code_points("".join(batch))
    doc = np.repeat(np.arange(len(batch), dtype=np.int64), [len(t) for t in batch])
    keep = (char_table()[cps] & WORD).astype(bool)
    cps, doc = cps[keep], doc[keep]
    return idx, cps, doc, np.bincount(doc, minlength=len(batch))


def top_ngram_fractions(texts: list[str], n: int = 2) -> np.ndarray:
    """`top_ngram_fraction` of many documents at once (n <= 2): one UTF-32 encode and one sort
    for the whole batch instead of a Python Counter per document (~5x slower)."""
    if not 1 <= n <= 2 or len(texts) >= 1 << 21:
        raise ValueError("top_ngram_fractions packs (document, n-gram) into 64 bits: n <= 2, < 2^21 documents")
    out = np.zeros(len(texts))
    shortest = max(NGRAM_MIN_CHARS, n + 1)
    idx, cps, doc, words = _word_code_points(texts, shortest)
    if not idx:
        return out
    cps, doc = cps.astype(np.uint64), doc.astype(np.uint64)
    m = cps.size - n + 1
    if m <= 0:
        return out
    same = doc[:m] == doc[n - 1: n - 1 + m]  # the n-gram lies inside one document
    grams = doc[:m] << np.uint64(21 * n)  # (document, code point 1, ..., code point n)
    for j in range(n):
        grams |= cps[j: j + m] << np.uint64(21 * (n - 1 - j))
    keys = np.sort(grams[same])
    top = np.zeros(len(idx), dtype=np.int64)
    if keys.size:
        run_starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        runs = np.diff(np.r_[run_starts, keys.size])  # occurrences of each (document, n-gram)
        run_doc = (keys[run_starts] >> np.uint64(21 * n)).astype(np.int64)
        doc_starts = np.flatnonzero(np.r_[True, run_doc[1:] != run_doc[:-1]])
        top[run_doc[doc_starts]] = np.maximum.reduceat(runs, doc_starts)
    out[idx] = np.where(words >= shortest, np.minimum(1.0, n * top / np.maximum(words, 1)), 0.0)
    return out


NGRAM_BUCKETS = 128


def top_ngram_bounds(texts: list[str], n: int = 2) -> np.ndarray:
    """An upper bound of `top_ngram_fraction` per document, without a sort: each n-gram is
    hashed into one of NGRAM_BUCKETS buckets per document and the fullest bucket counted (a
    bucket holds every occurrence of its n-grams, so it counts at least the top n-gram). With
    ~80 n-grams per poem the fullest bucket holds 3-5, below a filter threshold, so only the
    few documents near it need the exact sort of `top_ngram_fractions`."""
    if not 1 <= n <= 2:
        raise ValueError("top_ngram_bounds handles n <= 2")
    out = np.zeros(len(texts))
    shortest = max(NGRAM_MIN_CHARS, n + 1)
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    idx = np.flatnonzero(lens >= shortest)
    if not idx.size:
        return out
    batch = texts if idx.size == len(texts) else [texts[i] for i in idx.tolist()]
    lens = lens[idx]
    cps = _code_points("".join(batch))
    keep = (char_table()[cps] & WORD).view(bool)
    words = np.add.reduceat(keep, np.cumsum(lens) - lens, dtype=np.int64)  # letters per document
    cps = cps[keep]
    m = cps.size - n + 1
    if m <= 0:
        return out
    h = cps[:m] * np.uint32(0x9E3779B1)  # uint32 math wraps: a multiplicative hash
    if n == 2:
        h = (h ^ cps[1:]) * np.uint32(0x85EBCA6B)
    bucket = (h >> np.uint32(32 - 7)).astype(np.int64)  # top 7 bits: NGRAM_BUCKETS = 128
    if n == 2:  # an n-gram across two documents goes to an extra bucket, left out below
        ends = np.cumsum(words) - 1
        bucket[ends[(ends >= 0) & (ends < m)]] = NGRAM_BUCKETS
    doc = np.repeat(np.arange(len(batch), dtype=np.int64), words)[:m]
    counts = np.bincount(doc * (NGRAM_BUCKETS + 1) + bucket, minlength=len(batch) * (NGRAM_BUCKETS + 1))
    top = counts.reshape(len(batch), NGRAM_BUCKETS + 1)[:, :NGRAM_BUCKETS].max(axis=1)
    out[idx] = np.where(words >= shortest, np.minimum(1.0, n * top / np.maximum(words, 1)), 0.0)
    return out


def top_ngram_exceeds(texts: list[str], threshold: float, n: int = 2) -> np.ndarray:
    """`top_ngram_fractions(texts, n) > threshold`, computing the exact fraction only where the
    cheap bound of `top_ngram_bounds` does not already rule it out."""
    out = np.zeros(len(texts), dtype=bool)
    maybe = np.flatnonzero(top_ngram_bounds(texts, n) > threshold).tolist()
    if maybe:
        out[maybe] = top_ngram_fractions([texts[i] for i in maybe], n) > threshold
    return out


def triggers(texts: list[str]) -> np.ndarray:
    """Per document, the bits NFKC | MARKUP | ODD_SPACE of any of its characters, plus SPACE
    when the whitespace is not already normal (double space, space at a line edge, 3+ newlines,
    leading or trailing whitespace). Rules whose bit is absent cannot change the document."""
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    flags = np.zeros(len(texts), dtype=np.uint8)
    cps = _code_points("".join(texts))
    if not cps.size:
        return flags
    per_char = char_table()[cps] & (NFKC | MARKUP | ODD_SPACE)
    sp, nl, slash = cps == 32, cps == 10, cps == 47
    spacing = np.zeros(cps.size, dtype=bool)  # marked at the first character of the pattern
    spacing[:-1] = (sp[:-1] & (sp[1:] | nl[1:])) | (nl[:-1] & sp[1:])
    spacing[:-2] |= nl[:-2] & nl[1:-1] & nl[2:]
    url = np.zeros(cps.size, dtype=bool)  # "//" and "www." (any case) trigger the URL rule
    url[:-1] = slash[:-1] & slash[1:]
    low = cps | 32
    url[:-3] |= (low[:-3] == 119) & (low[1:-2] == 119) & (low[2:-1] == 119) & (cps[3:] == 46)
    # (A pattern crossing into the next document only costs that document a needless check.)
    per_char |= spacing.astype(np.uint8) * SPACE | url.astype(np.uint8) * MARKUP
    starts = np.cumsum(lens) - lens
    nonempty = lens > 0
    flags[nonempty] = np.bitwise_or.reduceat(per_char, starts[nonempty])
    edge = char_table()[cps[np.r_[starts[nonempty], starts[nonempty] + lens[nonempty] - 1]]] & SPACE
    flags[nonempty] |= edge[: nonempty.sum()] | edge[nonempty.sum():]
    flags[(flags & ODD_SPACE) > 0] |= SPACE
    return flags


class Cleaner:
    """Applies the enabled rules of a `PrepareConfig`; `changed`/`dropped` count per rule."""

    def __init__(self, cfg: PrepareConfig) -> None:
        self.cfg = cfg
        self.changed: Counter = Counter()
        self.dropped: Counter = Counter()
        self._t2s = None
        if cfg.t2s:
            import opencc

            self._t2s = opencc.OpenCC("t2s")
        fns = {"drop_control": lambda t: _CONTROL.sub("", t), "strip_html": strip_html,
               "remove_urls": remove_urls, "remove_emails": remove_emails,
               "nfkc": nfkc, "t2s": lambda t: self._t2s.convert(t),
               "char_whitelist": lambda t: _NOT_WHITELISTED.sub("", t), "normalize_whitespace": normalize_whitespace}
        # (rule, function, the trigger bit a document needs for the rule to have work; 0 = any)
        needs = {"nfkc": NFKC, "normalize_whitespace": SPACE, **dict.fromkeys(MARKUP_RULES, MARKUP)}
        self._steps = [(name, fns[name], needs.get(name, 0)) for name in MODIFY_RULES if getattr(cfg, name)]
        self._always = any(need == 0 for _, _, need in self._steps)

    def rules(self) -> dict:
        """The rule settings, as recorded in the manifest."""
        c = self.cfg
        out: dict = {name: bool(getattr(c, name)) for name in MODIFY_RULES}
        out.update(min_chars=c.min_chars, max_dup_line_fraction=c.max_dup_line_fraction,
                   max_top_ngram_fraction=c.max_top_ngram_fraction, ngram_min_chars=NGRAM_MIN_CHARS,
                   exact_dedup=True, near_dedup=c.near_dedup,
                   near_dedup_threshold=c.near_dedup_threshold if c.near_dedup else None)
        return out

    def _modify(self, text: str, flags: int) -> str:
        if not flags and not self._always:
            return text
        for name, fn, need in self._steps:
            if need and not flags & need:
                continue
            new = fn(text)
            if new != text:
                self.changed[name] += 1
                text = new
                flags = 0xFF  # the text changed: the classification is stale, run every later rule
        return text

    def _line_filters(self, text: str) -> str | None:
        c = self.cfg
        if not text.strip():
            self.dropped["empty"] += 1
            return None
        if len(text) < c.min_chars:
            self.dropped["min_chars"] += 1
            return None
        # A fraction of 1 switches a filter off (no document can exceed it).
        if c.max_dup_line_fraction < 1 and "\n" in text and dup_line_fraction(text) > c.max_dup_line_fraction:
            self.dropped["max_dup_line_fraction"] += 1
            return None
        return text

    def __call__(self, text: str) -> str | None:
        """The cleaned document, or None if a filter dropped it (every rule runs)."""
        text = self._line_filters(self._modify(text, 0xFF))
        if text is not None and self.cfg.max_top_ngram_fraction < 1 \
                and top_ngram_fraction(text) > self.cfg.max_top_ngram_fraction:
            self.dropped["max_top_ngram_fraction"] += 1
            return None
        return text

    def clean_many(self, texts: list[str]) -> list[str | None]:
        """`[self(t) for t in texts]`, skipping rules a document cannot trigger, with the n-gram
        filter computed for the batch at once."""
        flags = triggers(texts).tolist()
        modify, line_filters = self._modify, self._line_filters
        # The common cases written out (a method call per document was ~10 % of the cleaner):
        # no trigger means no modifying rule has work, and a one-line, non-blank document of
        # min_chars+ characters passes every line filter.
        if self._always:
            texts = [modify(t, f) for t, f in zip(texts, flags)]
        else:
            texts = [modify(t, f) if f else t for t, f in zip(texts, flags)]
        least = max(self.cfg.min_chars, 1)
        out = [t if len(t) >= least and "\n" not in t and not t.isspace() else line_filters(t) for t in texts]
        if self.cfg.max_top_ngram_fraction < 1:
            alive = [i for i, t in enumerate(out) if t is not None]
            over = top_ngram_exceeds([out[i] for i in alive], self.cfg.max_top_ngram_fraction)
            for i, f in zip(alive, over.tolist()):
                if f:
                    out[i] = None
                    self.dropped["max_top_ngram_fraction"] += 1
        return out
