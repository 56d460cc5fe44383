"""The [prepare] section (how raw text becomes shards) and the [data] section (what training reads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mspretrain.config.sections.base import Section, cap, check_seed, fail


def _check_fractions(c: "PrepareConfig") -> None:
    """The quality filters that keep a fraction (`prepare/rescore.py`): in range, and not given
    together with the fixed threshold they replace."""
    f = c.quality_top_fraction
    if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1):
        fail("prepare.quality_top_fraction", f"= {f} is outside (0, 1]", "the share of documents to keep, e.g. 0.3; 0 = off")
    if f and c.quality_threshold != 0.5:
        fail("prepare.quality_top_fraction", "and prepare.quality_threshold are both given", "keep by a threshold or by a fraction, not both")
    if f and not c.quality_model:
        fail("prepare.quality_top_fraction", "is set but prepare.quality_model is not", "train one with `mspretrain quality train` first")
    q = c.ppl_quantiles
    if not q:
        return
    if len(q) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in q) or not 0 <= q[0] < q[1] <= 1 \
            or tuple(q) == (0, 1):
        fail("prepare.ppl_quantiles", f"= {list(q)} is not [lo, hi] with 0 <= lo < hi <= 1 (and not [0, 1])",
              "e.g. [0, 0.6] keeps the 60 % least perplexing")
    if c.ppl_min > 0 or c.ppl_max > 0:
        fail("prepare.ppl_quantiles", "and prepare.ppl_min / ppl_max are both given", "keep a band by perplexity or by quantile, not both")
    if not (c.lm_model or c.lm_reference):
        fail("prepare.ppl_quantiles", "is set but prepare.lm_model is not", "train one with `mspretrain quality lm REFERENCE... --out lm.npz`")


@dataclass(frozen=True)
class PrepareConfig(Section):
    """How `prepare` turns raw text into shards (cleaning rules are switchable one by one)."""

    SECTION = "prepare"

    vocab_size: int = 8000
    character_coverage: float = 0.9995
    tokenizer_sample_chars: int = 20_000_000  # bounded sample the tokenizer is trained on
    valid_fraction: float = 0.01
    doc_per_line: bool = False
    text_field: str = "text"
    min_chars: int = 8
    strip_html: bool = True
    remove_urls: bool = True
    remove_emails: bool = True
    drop_control: bool = True
    normalize_whitespace: bool = True
    nfkc: bool = True
    t2s: bool = False
    char_whitelist: bool = False
    max_dup_line_fraction: float = 0.3  # Gopher: share of lines that are duplicates of another
    max_top_ngram_fraction: float = 0.2  # Gopher: share of chars covered by the top 2-gram
    near_dedup: bool = False
    near_dedup_threshold: float = 0.8
    seed: int = 1234
    # Model-based quality filters (issue 39; docs/operators.md "Quality filtering"), each off by default.
    quality_model: str = ""  # classifier from `mspretrain quality train`; "" = off
    quality_threshold: float = 0.5  # drop documents whose classifier score (P(positive), 0-1) is below this
    quality_top_fraction: float = 0.0  # instead: keep this fraction (0-1] of the classifier's candidates, best first; 0 = off
    lm_model: str = ""  # character n-gram model from `mspretrain quality lm`, for perplexity bands; "" = off
    lm_reference: tuple = ()  # instead: reference text files/dirs/globs prepare counts that model from (written as lm.npz)
    ppl_min: float = 0.0  # drop documents whose perplexity is below this (0 = no lower bound)
    ppl_max: float = 0.0  # drop documents whose perplexity is above this (0 = no upper bound)
    ppl_quantiles: tuple = ()  # instead: [lo, hi], keep the perplexity band between these quantiles (e.g. [0, 0.6])
    min_zh_prob: float = 0.0  # drop documents whose P(Chinese) by py3langid is below this (0 = off)
    # eval sets (C-Eval/CMMLU .csv / .jsonl files or dirs): drop documents sharing an n-gram with an item (its
    # question with labelled options, its options in order) or holding whole one shorter than n (operators.md §14)
    decontam: tuple = ()
    decontam_ngram: int = 13  # n of the character n-grams decontamination matches (after normalising)

    def check(self) -> None:
        if self.vocab_size < 256 + 4:
            fail("prepare.vocab_size", f"= {self.vocab_size} is too small", "byte fallback alone needs 260 pieces; use 8000-32000 for Chinese")
        if not 0 < self.character_coverage <= 1:
            fail("prepare.character_coverage", f"= {self.character_coverage} is outside (0, 1]", "the Llama value is 0.9995")
        if not 0 <= self.valid_fraction < 1:
            fail("prepare.valid_fraction", f"= {self.valid_fraction} is outside [0, 1)", "use e.g. 0.01")
        if not 0 < self.near_dedup_threshold <= 1:
            fail("prepare.near_dedup_threshold", f"= {self.near_dedup_threshold} is outside (0, 1]", "use e.g. 0.8")
        for name in ("max_dup_line_fraction", "max_top_ngram_fraction"):
            if not 0 < getattr(self, name) <= 1:
                fail(f"prepare.{name}", f"= {getattr(self, name)} is outside (0, 1]", "use 1 to switch the filter off")
        if self.min_chars < 0:
            fail("prepare.min_chars", f"= {self.min_chars} must not be negative", "use 0 to keep every document")
        if self.tokenizer_sample_chars <= 0:
            fail("prepare.tokenizer_sample_chars", f"= {self.tokenizer_sample_chars} must be positive", "the default is 20000000")
        check_seed(self, "seed")
        for name in ("quality_threshold", "min_zh_prob"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1):
                fail(f"prepare.{name}", f"= {v} is outside [0, 1]", "it is a probability; e.g. 0.5")
        for name in ("ppl_min", "ppl_max"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
                fail(f"prepare.{name}", f"= {v} must be a finite number >= 0", "0 = no bound; see the perplexities with prepare --inspect")
        if self.ppl_min > 0 and self.ppl_max > 0 and self.ppl_min >= self.ppl_max:
            fail("prepare.ppl_min", f"= {self.ppl_min} is not below prepare.ppl_max = {self.ppl_max}", "the band kept is [ppl_min, ppl_max]")
        _check_fractions(self)
        if self.lm_model and self.lm_reference:
            fail("prepare.lm_reference", "and prepare.lm_model are both given", "name the model file or the reference text, not both")
        if not all(isinstance(x, str) and x.strip() for x in self.lm_reference):
            fail("prepare.lm_reference", "must be a list of file, directory or glob names", 'e.g. prepare.lm_reference = ["baike/"]')
        if (self.ppl_min > 0 or self.ppl_max > 0) and not (self.lm_model or self.lm_reference):
            fail("prepare.ppl_max" if self.ppl_max > 0 else "prepare.ppl_min", "is set but prepare.lm_model is not",
                  "train one with `mspretrain quality lm REFERENCE... --out lm.npz` and set prepare.lm_model")
        for name in ("quality_model", "lm_model"):
            if not isinstance(getattr(self, name), str):
                fail(f"prepare.{name}", "must be a file name (a string)", 'e.g. prepare.quality_model = "quality.npz"')
        if not all(isinstance(x, str) and x.strip() for x in self.decontam):
            fail("prepare.decontam", "must be a list of file or directory names", 'e.g. prepare.decontam = ["ceval/val"]')
        if not 5 <= self.decontam_ngram <= 64:
            fail("prepare.decontam_ngram", f"= {self.decontam_ngram} is outside [5, 64]", "13 is the usual n")
        # SentencePiece parses its options as int32; the model section's vocabulary ceiling applies.
        cap(self, {"vocab_size": 1 << 22, "tokenizer_sample_chars": 1 << 40}, "more than any tokenizer trainer takes")


@dataclass(frozen=True)
class DataConfig(Section):
    SECTION = "data"

    seq_len: int = 64
    # Corpus mixing: weighted data dirs, e.g. sources = [{path = "a/", weight = 0.7}, {path = "b/",
    # weight = 0.3}], all tokenized with the --data dir's tokenizer. Empty = the --data dir alone.
    sources: tuple = ()
    reset_attention_at_eos: bool = False
    token_dtype: Literal["int32", "int64"] = "int32"  # int64 for the Ascend gather issue in the field report

    def check(self) -> None:
        if self.seq_len <= 0:
            fail("data.seq_len", f"= {self.seq_len} must be positive", "set data.seq_len to e.g. 64 (tests) or 2048 (production)")
        for i, src in enumerate(self.sources):
            if not isinstance(src, dict) or "path" not in src or set(src) - {"path", "weight"}:
                fail(f"data.sources[{i}]", "must be a table {path = \"DIR\", weight = W}",
                      'write data.sources = [{path = "a/", weight = 0.7}, {path = "b/", weight = 0.3}]')
            if not isinstance(src["path"], str) or not src["path"].strip():
                fail(f"data.sources[{i}].path", f"= {src['path']!r} is not a directory name", 'quote it: {path = "data/a", weight = 0.7}')
            w = src.get("weight", 1.0)
            # capped: weights are relative, and two weights of 1e308 sum to inf (every share then 0)
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not (0 < w <= 1e12):
                fail(f"data.sources[{i}].weight", "must be a positive number up to 1e12", "weights are relative, e.g. 0.7 and 0.3")
