"""Model-based quality filters of `prepare` (issue 39): a linear classifier on hashed character
n-grams, a character n-gram language model for perplexity bands, and language identification.

All three score cleaned documents in `prepare`'s workers (`workers.clean_chunk`, through
`QualityStage.score`), a chunk at a time, with numpy over the chunk's characters at once: a
chunk's scores are a pure function of its texts and the models' bytes, so a resumed or `--ray`
run scores the same documents to the same bits.

Why these models:
- The classifier is logistic regression on the mean of hashed character 1-3-gram weights
  (FineWeb-Edu / CCI3-HQ use a linear head too; character n-grams need no word segmenter for
  Chinese). Training is full-batch L-BFGS (scipy), deterministic: no random choice at all.
- The language model is an interpolated character trigram over hashed count tables (the
  perplexity CCNet takes from KenLM, without KenLM's modified Kneser-Ney smoothing: fixed
  interpolation weights, which is enough to rank documents against a reference set).
- Language identification is py3langid (langid.py's model ships inside the wheel: nothing is
  downloaded at run time), asked for the probability that a document is Chinese; a document whose
  script already says so (mostly Han, no kana or hangul) skips the model (`LangID`).

Model files are `.npz` written without pickle (`modelfile.py`); their SHA-256 goes into the run's
fingerprint and the manifest, and a `NAME.sha256` file written beside each model is checked when
it is loaded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from mspretrain.errors import UserError
from mspretrain.prepare.hash64 import _MULT, _mix
from mspretrain.prepare.modelfile import CLASSIFIER_KIND, LM_KIND, load_model, model_bytes, save_model, write_model

ORDERS = (1, 2, 3)  # character n-gram orders of the classifier's features
CLASSIFIER_BITS = 20  # 1 M hashed features: ~4 MB of float32 weights
LM_BITS = 21  # per order: 2 M hashed counts
LM_LAMBDAS = (0.6, 0.3, 0.095, 0.005)  # trigram, bigram, unigram, uniform (over LM_VOCAB)
LM_VOCAB = 8000  # the uniform floor's vocabulary: a character never seen still has a probability

def codepoints(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the texts' codepoints back to back as uint64, the start of each text; len(texts) + 1)."""
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    starts = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    cp = np.frombuffer("".join(texts).encode("utf-32-le"), dtype="<u4").astype(np.uint64)
    return cp, starts


def ngram_hashes(cp: np.ndarray, starts: np.ndarray, n: int, room: np.ndarray | None = None,
                 doc: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every character n-gram inside one text (none across two), and the text
    each belongs to. Vectorised over the whole chunk: n array passes, no Python loop per document.
    `room`, `doc`: `layout(starts)`, when the caller takes several orders of one chunk."""
    total = cp.size - n + 1
    if total <= 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    if room is None:
        room, doc = layout(starts)
    h = np.full(total, np.uint64(n), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = (h * _MULT) ^ cp[k: k + total]
    inside = room[:total] >= n  # the n-gram ends in the text it starts in
    return _mix(h[inside]), doc[:total][inside]


def layout(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per character of the chunk: how many characters of its text are left from it (itself
    included), and its text's number. O(characters), no search."""
    lengths = np.diff(starts)
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    room = starts[1:][doc] - np.arange(doc.size, dtype=np.int64)
    return room, doc


def model_kind(path: Path) -> str | None:
    """CLASSIFIER_KIND or LM_KIND when `path` is a model file `quality` wrote (whole and checked);
    None for anything else (what `quality --out` must not replace)."""
    for kind, loader in ((CLASSIFIER_KIND, Classifier.load), (LM_KIND, CharLM.load)):
        try:
            loader(path)
            return kind
        except UserError:
            continue
    return None


# ----------------------------------------------------------------------------- the classifier

FEATURES = ("chars", "words")  # the classifier's features: character 1-3-grams, or jieba word 1-2-grams (`words.py`)


def features(texts: Sequence[str], bits: int = CLASSIFIER_BITS, kind: str = "chars") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(feature index per n-gram, its document, n-grams per document) over ORDERS (characters),
    or over word 1-2-grams (`kind` "words")."""
    if kind == "words":
        from mspretrain.prepare import words

        return words.features(texts, bits)
    cp, starts = codepoints(texts)
    room, where = layout(starts)
    idx, doc = [], []
    mask = np.uint64((1 << bits) - 1)
    for n in ORDERS:
        h, d = ngram_hashes(cp, starts, n, room, where)
        idx.append((h & mask).astype(np.int64))
        doc.append(d)
    ids, docs = np.concatenate(idx), np.concatenate(doc)
    counts = np.bincount(docs, minlength=len(texts)).astype(np.float64)
    return ids, docs, counts


@dataclass(frozen=True)
class Classifier:
    weights: np.ndarray  # float32 (2**bits,)
    bias: float
    sha256: str = ""
    path: str = ""
    features: str = "chars"  # one of FEATURES

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """P(positive) per text, float32: sigmoid(bias + mean weight of its n-grams)."""
        if not texts:
            return np.zeros(0, dtype=np.float32)
        bits = int(self.weights.size).bit_length() - 1
        ids, docs, counts = features(texts, bits, self.features)
        z = np.bincount(docs, weights=self.weights[ids].astype(np.float64), minlength=len(texts)) / np.maximum(counts, 1)
        return (1.0 / (1.0 + np.exp(-(z + self.bias)))).astype(np.float32)

    @staticmethod
    def load(path: str | Path) -> "Classifier":
        meta, a, digest = load_model(path, CLASSIFIER_KIND, "quality model", ("weights", "bias"))
        w = a["weights"].astype(np.float32)
        kind = meta.get("features", "chars")
        orders = meta.get("orders", [])
        if (w.ndim != 1 or not w.size or w.size & (w.size - 1) or a["bias"].size != 1 or not isinstance(kind, str)
                or kind not in FEATURES or kind == "chars" and (not isinstance(orders, list) or tuple(orders) != ORDERS)):
            raise UserError(f"quality model {path} has a feature layout this version does not read", "train it again with `mspretrain quality train`")
        if kind == "words":
            from mspretrain.prepare.words import require

            require()
        return Classifier(w, float(a["bias"].reshape(())), digest, str(path), kind)


def train_classifier(pos: Sequence[str], neg: Sequence[str], l2: float = 1e-6, bits: int = CLASSIFIER_BITS,
                     max_iter: int = 300, kind: str = "chars") -> tuple[np.ndarray, float, dict]:
    """Logistic regression, classes weighted to equal total weight, L2 `l2` on the weights; full
    batch L-BFGS from zeros (no random choice: the same files give the same model). Returns
    (weights, bias, training report)."""
    from scipy.optimize import minimize

    if not pos or not neg:
        raise UserError(f"the {'positive' if not pos else 'negative'} label set is empty (no document left after cleaning)",
                        "name files with documents for both --positive and --negative")
    texts = list(pos) + list(neg)
    y = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))])
    sw = np.where(y > 0, 0.5 / len(pos), 0.5 / len(neg))  # each class half the loss
    ids, docs, counts = features(texts, bits, kind)
    # memory: the examples' n-grams stay for every iteration, 16 bytes each (3 per character)
    ids, docs = ids.astype(np.int32), docs.astype(np.int32)
    inv = (1.0 / np.maximum(counts, 1))[docs].astype(np.float32)  # each n-gram's share of its document's mean
    dim = 1 << bits

    def f(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:dim], theta[dim]
        z = np.bincount(docs, weights=w[ids] * inv, minlength=len(texts)) + b
        # log(1 + e^-z) for y = 1, log(1 + e^z) for y = 0, stably
        loss = np.sum(sw * (np.logaddexp(0.0, -z) * y + np.logaddexp(0.0, z) * (1 - y))) + 0.5 * l2 * float(w @ w)
        g = sw * (1.0 / (1.0 + np.exp(-z)) - y)
        grad = np.empty_like(theta)
        grad[:dim] = np.bincount(ids, weights=g[docs] * inv, minlength=dim) + l2 * w
        grad[dim] = g.sum()
        return float(loss), grad

    res = minimize(f, np.zeros(dim + 1), jac=True, method="L-BFGS-B", options={"maxiter": max_iter})
    w = res.x[:dim].astype(np.float32)
    b = float(res.x[dim])
    p = Classifier(w, b, features=kind).score(texts)
    report = {"positives": len(pos), "negatives": len(neg), "iterations": int(res.nit), "loss": float(res.fun),
              "train_accuracy": float(np.mean((p >= 0.5) == (y > 0)))}
    return w, b, report


def save_classifier(path: Path, w: np.ndarray, b: float, report: dict, kind: str = "chars") -> str:
    # a character model's meta is as before word features existed (the same bytes, the same SHA-256)
    meta = {"orders": list(ORDERS)} if kind == "chars" else {"features": kind, "orders": list(words_orders())}
    return save_model(path, CLASSIFIER_KIND, {**meta, "bits": int(w.size).bit_length() - 1, "report": report},
                 {"weights": w.astype(np.float32), "bias": np.array(b, dtype=np.float64)})


def words_orders() -> tuple[int, ...]:
    from mspretrain.prepare.words import ORDERS as WORD_ORDERS

    return WORD_ORDERS


# ----------------------------------------------------------------------------- the language model

@dataclass(frozen=True)
class CharLM:
    """Interpolated character trigram over hashed counts: p(c | a b) = l3 n(abc)/n(ab) +
    l2 n(bc)/n(b) + l1 n(c)/N + l0/V. `counts[k]` holds the (k+1)-gram counts."""

    counts: np.ndarray  # float32 (3, 2**bits)
    total: float
    sha256: str = ""
    path: str = ""

    def perplexity(self, texts: Sequence[str]) -> np.ndarray:
        """Per text, exp of the mean negative log-probability of its characters (each predicted
        from up to two before it, within the text); float32. An empty text: 0."""
        if not texts:
            return np.zeros(0, dtype=np.float32)
        cp, starts = codepoints(texts)
        mask = np.uint64(self.counts.shape[1] - 1)
        n = cp.size
        room, doc = layout(starts)
        h = [ngram_hashes(cp, starts, k, room, doc)[0] for k in (1, 2, 3)]  # realigned below
        # position i's n-grams ending at i: valid only when they do not reach before the text's start
        pos = np.arange(n, dtype=np.int64) - starts[doc]
        probs = np.full(n, LM_LAMBDAS[3] / LM_VOCAB)
        c1 = self.counts[0][(h[0] & mask).astype(np.int64)].astype(np.float64)
        probs += LM_LAMBDAS[2] * c1 / max(self.total, 1.0)
        for k, lam in ((2, LM_LAMBDAS[1]), (3, LM_LAMBDAS[0])):
            ok = pos >= k - 1
            end_at = np.flatnonzero(ok)  # the n-gram ending here starts k - 1 before
            # ngram_hashes lists the n-grams inside texts in order; those ending at `end_at` are exactly them
            full = self.counts[k - 1][(h[k - 1] & mask).astype(np.int64)].astype(np.float64)
            ctx = self.counts[k - 2][(_ctx_hash(cp, starts, k - 1, end_at) & mask).astype(np.int64)].astype(np.float64)
            probs[end_at] += lam * np.where(ctx > 0, full / np.maximum(ctx, 1.0), 0.0)
        nll = np.bincount(doc, weights=-np.log(probs), minlength=len(texts))
        chars = np.diff(starts)
        return np.where(chars > 0, np.exp(nll / np.maximum(chars, 1)), 0.0).astype(np.float32)

    @staticmethod
    def load(path: str | Path) -> "CharLM":
        meta, a, digest = load_model(path, LM_KIND, "perplexity model", ("counts", "total"))
        c = a["counts"].astype(np.float32)
        if c.ndim != 2 or c.shape[0] != 3 or not c.shape[1] or c.shape[1] & (c.shape[1] - 1) or a["total"].size != 1:
            raise UserError(f"perplexity model {path} has a layout this version does not read", "train it again with `mspretrain quality lm`")
        return CharLM(c, float(a["total"].reshape(())), digest, str(path))


def _ctx_hash(cp: np.ndarray, starts: np.ndarray, n: int, end_at: np.ndarray) -> np.ndarray:
    """Hash of the n-gram ending one before each position of `end_at` (the context of the
    (n+1)-gram ending there), as `ngram_hashes` computes it."""
    first = end_at - n  # the context's first character
    h = np.full(end_at.size, np.uint64(n), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = (h * _MULT) ^ cp[first + k]
    return _mix(h)


LM_SEGMENT = 1 << 18  # characters counted at once: ~72 bytes each in flight (the arrays of `ngram_hashes`), ~19 MB


def train_lm(texts: Iterable[str], bits: int = LM_BITS) -> tuple[np.ndarray, float, int]:
    """Hashed 1-, 2-, 3-gram counts of the reference texts (float32 tables), their characters, and
    how many texts there were. Streaming, in bounded memory whatever the reference's size: texts
    are taken `LM_SEGMENT` characters at a time, a long one cut into segments that overlap by the
    two characters a trigram reaches past a cut; the overlap's own 1- and 2-grams, which both
    segments count, are counted once back (`sub`), so the counts are exactly the whole texts'."""
    counts = np.zeros((3, 1 << bits), dtype=np.float64)
    mask = np.uint64((1 << bits) - 1)
    add: list[str] = []
    sub: list[str] = []
    size = docs = 0

    def count(group: list[str], sign: float) -> None:
        cp, starts = codepoints(group)
        room, doc = layout(starts)
        for k in (1, 2, 3):
            h, _ = ngram_hashes(cp, starts, k, room, doc)
            if h.size:
                counts[k - 1] += sign * np.bincount((h & mask).astype(np.int64), minlength=1 << bits)

    for t in texts:
        docs += 1
        for at in range(0, len(t), LM_SEGMENT):
            add.append(t[at: at + LM_SEGMENT + 2])
            size += len(add[-1])
            if at + LM_SEGMENT < len(t):
                sub.append(t[at + LM_SEGMENT: at + LM_SEGMENT + 2])  # the next segment's start, counted there too
            if size >= LM_SEGMENT:
                count(add, 1.0)
                count(sub, -1.0)
                add, sub, size = [], [], 0
    count(add, 1.0)
    count(sub, -1.0)
    if not docs:
        raise UserError("the reference set is empty (no document left after cleaning)", "name files of reference text for `mspretrain quality lm`")
    return counts.astype(np.float32), float(counts[0].sum()), docs


def lm_bytes(counts: np.ndarray, total: float, report: dict) -> bytes:
    return model_bytes(LM_KIND, {"bits": int(counts.shape[1]).bit_length() - 1, "report": report},
                  {"counts": counts, "total": np.array(total, dtype=np.float64)})


def save_lm(path: Path, counts: np.ndarray, total: float, report: dict) -> str:
    return write_model(path, lm_bytes(counts, total, report))


REFERENCE_LM = "lm.npz"  # in the data dir: the model `prepare.lm_reference` counted


def reference_lm(cfg) -> tuple[CharLM, bytes]:
    """The character LM of `prepare.lm_reference` (`cfg`: a PrepareConfig), counted here as
    `quality lm` counts it (the same bytes for the same files and rules), and its file's bytes,
    which prepare writes to the data dir as REFERENCE_LM."""
    counts, total, docs = train_lm(iter_cleaned(list(cfg.lm_reference), cfg))
    data = lm_bytes(counts, total, {"documents": docs, "characters": int(total)})
    return CharLM(counts, total, hashlib.sha256(data).hexdigest(), REFERENCE_LM), data


def input_paths(inputs: list[str]) -> list[Path]:
    """The files `inputs` name (files, dirs, globs), as `prepare` finds them."""
    from mspretrain.prepare import sources

    return [p for p, _ in sources.discover_named(inputs, sources.SourceStats())]


def iter_cleaned(inputs: list[str], cfg) -> Iterator[str]:
    """The documents of `inputs`, read as `prepare` reads them (`cfg.doc_per_line`,
    `cfg.text_field`) and cleaned by its rules (`cfg`: a PrepareConfig), a batch at a time."""
    from mspretrain.prepare import sources
    from mspretrain.prepare.clean import Cleaner

    stats = sources.SourceStats()
    paths = [p for p, _ in sources.discover_named(inputs, stats)]
    cleaner = Cleaner(cfg)
    for batch in sources.iter_batches(paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field, stats=stats,
                                      warn=lambda m: None):
        yield from (t for t in cleaner.clean_many(batch) if t is not None)


def read_cleaned(inputs: list[str], cfg) -> list[str]:
    """`iter_cleaned` as a list (the classifier trains on all of its documents at once)."""
    return list(iter_cleaned(inputs, cfg))


# ----------------------------------------------------------------------------- language identification

class LangID:
    """P(Chinese) per text: by script where the script decides, else from py3langid's bundled model
    (langid.py's 97 languages).

    py3langid walks each text's bytes in Python (~2-5 K documents a second per worker, the slowest
    stage by far), and a text that is mostly Han characters with no kana or hangul is Chinese
    whatever it says (langid even gives short classical poems of that kind P(zh) < 0.5, as it has
    few byte n-grams to go on). So: at least `HAN_SHARE` of the characters Han and none Japanese
    or Korean -> 1.0, without the model; any other text goes to the model."""

    HAN_SHARE = 0.5

    def __init__(self) -> None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise UserError("prepare.min_zh_prob needs the py3langid package", "pip install 'py3langid==0.2.2'") from None
        self._ident = LanguageIdentifier.from_pickled_model(MODEL_FILE, norm_probs=True)

    def __getstate__(self) -> dict:  # a worker (or Ray node) loads the model from its own install
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def by_script(self, texts: Sequence[str]) -> np.ndarray:
        """bool per text: Chinese by script alone."""
        cp, starts = codepoints(texts)
        _, doc = layout(starts)
        han = ((cp >= 0x4E00) & (cp <= 0x9FFF)) | ((cp >= 0x3400) & (cp <= 0x4DBF)) | ((cp >= 0x20000) & (cp <= 0x2EBEF)) \
            | ((cp >= 0xF900) & (cp <= 0xFAFF))
        other = ((cp >= 0x3040) & (cp <= 0x30FF)) | ((cp >= 0x31F0) & (cp <= 0x31FF)) | ((cp >= 0xFF66) & (cp <= 0xFF9F)) \
            | ((cp >= 0xAC00) & (cp <= 0xD7AF)) | ((cp >= 0x1100) & (cp <= 0x11FF)) | ((cp >= 0x3130) & (cp <= 0x318F))
        n = len(texts)
        han_n = np.bincount(doc[han], minlength=n)
        other_n = np.bincount(doc[other], minlength=n)
        return (han_n >= self.HAN_SHARE * np.diff(starts)) & (han_n > 0) & (other_n == 0)

    def zh_prob(self, texts: Sequence[str]) -> np.ndarray:
        out = np.ones(len(texts), dtype=np.float32)
        for i in np.flatnonzero(~self.by_script(texts)).tolist():
            ranked = self._ident.rank(texts[i][:2000])  # the first 2,000 characters decide: cost bounded per document
            out[i] = next((p for lang, p in ranked if lang == "zh"), 0.0)
        return out
