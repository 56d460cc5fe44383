"""Quality models for `prepare` (issue 39): `quality train` fits the document classifier on
labelled files, `quality lm` counts the character n-gram model of a reference set.

Both read their files as `prepare` does (.txt by blank-line blocks or --doc-per-line, .jsonl by
--text-field, .gz / .zst) and clean the documents with the config's `prepare.*` rules, so a model
scores the same kind of text `prepare` gives it. Each writes `OUT` (.npz, no pickle) and
`OUT.sha256`; `prepare.quality_model` / `prepare.lm_model` name it. `--out` is created with its
parents; it may replace only a model of its kind that `quality` wrote (and its `.sha256`), never an
input or another file.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from mspretrain.commands.common import add_config_argument, add_quiet_argument, bounded, load_config, say
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain quality train --positive baike.jsonl textbooks/ --negative web_sample.jsonl --out quality.npz
  mspretrain quality train --positive baike.jsonl --negative web_sample.jsonl --features words --out quality-words.npz
  mspretrain quality lm baike.jsonl --out lm.npz
  mspretrain prepare web/ --out data/ prepare.quality_model=quality.npz prepare.quality_threshold=0.5
  mspretrain prepare --inspect data/"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="fit the quality classifier on positive and negative example files",
                       description="Logistic regression on hashed character 1-3-grams (or jieba words); documents of --positive are "
                                   "label 1 (e.g. encyclopaedia, textbooks), of --negative label 0 (e.g. random web text). "
                                   "A held-out share (--holdout, drawn from prepare.seed) reports precision and recall.")
    t.add_argument("--positive", nargs="+", required=True, metavar="FILE", help="files/dirs/globs of good documents")
    t.add_argument("--negative", nargs="+", required=True, metavar="FILE", help="files/dirs/globs of documents to filter out")
    t.add_argument("--holdout", type=bounded(float, 0, 0.5), default=0.1, metavar="F", help="share held out for the report (default 0.1)")
    t.add_argument("--l2", type=bounded(float, 0, 1), default=1e-6, metavar="L", help="L2 penalty on the weights (default 1e-6)")
    t.add_argument("--features", choices=("chars", "words"), default="chars",
                   help="character 1-3-grams (default), or jieba word 1-2-grams (needs the jieba package; ~50 x slower to score)")
    lm = sub.add_parser("lm", help="count the character n-gram model of a reference set (for perplexity bands)",
                        description="Hashed character 1-3-gram counts of the reference documents; `prepare` computes each "
                                    "document's perplexity under them (prepare.lm_model, prepare.ppl_min / ppl_max).")
    lm.add_argument("reference", nargs="+", metavar="FILE", help="files/dirs/globs of reference text (e.g. encyclopaedia)")
    for q in (t, lm):
        q.add_argument("--out", required=True, metavar="MODEL.npz", help="the model file to write (and MODEL.npz.sha256)")
        q.add_argument("--doc-per-line", action="store_true", default=None, help="in .txt files, one document per line")
        q.add_argument("--text-field", metavar="F", help="the .jsonl field holding the text (default: prepare.text_field)")
        add_config_argument(q)
        add_quiet_argument(q)


SHA_LINE = re.compile(r"[0-9a-f]{64}  [^\n/]+\n?")  # what `quality.write_model` writes beside a model


def check_out(out: Path, kind: str, inputs: list[Path]) -> None:
    """Before any work: `--out` may be written. It must not be one of the inputs, nor anything but
    a model of this kind that `quality` wrote (its `.sha256` beside it likewise), so no file of the
    user's is replaced; every refusal one line, nothing touched. Missing parents are created only
    when the model is written (`write`)."""
    from mspretrain.fsutil import file_kind, read_regular_text
    from mspretrain.prepare.quality import model_kind

    fix = "choose another --out (e.g. models/quality.npz): quality writes only new model files or its own"
    side = out.with_name(out.name + ".sha256")
    for p in (out, side):
        for i in inputs:
            if p.resolve() == i.resolve() or _same(p, i):
                raise UserError(f"--out {out}: {p} is one of the input files", fix)
    if os.path.islink(out) or os.path.islink(side):
        raise UserError(f"--out {out}: {out if os.path.islink(out) else side} is a symbolic link, which quality does not replace", fix)
    if os.path.lexists(out):
        if file_kind(out) != "a file":
            raise UserError(f"--out {out} is {file_kind(out)}, not a model file", fix)
        have = model_kind(out)
        if have is None:
            raise UserError(f"--out {out} exists and is not a model file `mspretrain quality` wrote; it is left as it is", fix)
        if have != kind:
            names = {"mspretrain-quality-classifier": "quality classifier", "mspretrain-char-lm": "perplexity model"}
            raise UserError(f"--out {out} is a {names.get(have, have)}, not a {names.get(kind, kind)}: "
                            f"`quality {'lm' if kind.endswith('lm') else 'train'}` does not replace it", fix)
    if os.path.lexists(side):
        text = read_regular_text(side, 1 << 12, "checksum file", fix, errors="replace") if file_kind(side) == "a file" else ""
        if not SHA_LINE.fullmatch(text):
            raise UserError(f"--out {out}: {side} exists and is not the checksum file quality writes beside a model; "
                            "it is left as it is", fix)
    for d in [out.parent, *out.parent.parents]:
        if os.path.lexists(d):
            if not d.is_dir():
                raise UserError(f"--out {out}: {d} is {file_kind(d)}, not a directory", "choose an --out under a directory")
            if d == out.parent and not os.access(d, os.W_OK | os.X_OK):
                raise UserError(f"--out {out}: the directory {d} is not writable", "choose an --out in a directory you can write to")
            break


def _same(a: Path, b: Path) -> bool:
    """The same file under two names (a hard link too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def write(out: Path, save) -> str:
    """Create --out's missing parents (as `prepare`, `export` and `tokenizer extend` do), then
    write the model through `save` (its SHA-256 back)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out.parent}: {exc.strerror or exc}", "choose an --out in a directory you can write to") from None
    return save(out)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import numpy as np

    from mspretrain.prepare import quality

    cfg = load_config(args).prepare
    flags = {"doc_per_line": args.doc_per_line, "text_field": args.text_field}
    cfg = replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    out = Path(args.out).expanduser()
    if args.action == "lm":
        check_out(out, quality.LM_KIND, quality.input_paths(args.reference))
        counts, total, docs = quality.train_lm(quality.iter_cleaned(args.reference, cfg))  # streamed: bounded memory
        digest = write(out, lambda o: quality.save_lm(o, counts, total, {"documents": docs, "characters": int(total)}))
        say(args, f"counted {docs:,} reference documents ({int(total):,} characters)")
        print(f"wrote {out} (sha256 {digest[:16]}); use it with prepare.lm_model={out} and see the perplexities with prepare --inspect")
        return 0
    pos_files, neg_files = quality.input_paths(args.positive), quality.input_paths(args.negative)
    check_out(out, quality.CLASSIFIER_KIND, pos_files + neg_files)
    both = [p for p in pos_files if any(p.resolve() == q.resolve() or _same(p, q) for q in neg_files)]
    if both:
        raise UserError(f"{both[0]} is given as both --positive and --negative: a model cannot learn to tell a file's documents "
                        "from themselves", "name different files: good documents for --positive, ones to drop for --negative")
    pos, neg = quality.read_cleaned(args.positive, cfg), quality.read_cleaned(args.negative, cfg)
    if not pos or not neg:
        raise UserError(f"the {'positive' if not pos else 'negative'} label set is empty (no document left after cleaning)",
                        "name files with documents for both --positive and --negative")
    shared, smaller = len(set(pos) & set(neg)), min(len(set(pos)), len(set(neg)))
    if 2 * shared >= smaller:  # at least half of one set is labelled both ways
        raise UserError(f"{shared:,} documents are both --positive and --negative ({shared:,} of the {smaller:,} distinct documents of "
                        "the smaller set): the labels contradict each other, and a model of them would mean nothing",
                        "name different documents for --positive and --negative")
    rng = np.random.default_rng(cfg.seed)  # the held-out draw: from prepare.seed, like every random choice of prepare

    def split(docs: list[str]) -> tuple[list[str], list[str]]:
        held = rng.random(len(docs)) < args.holdout
        if held.all():  # never train on nothing
            held[0] = False
        return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]

    (pos_tr, pos_ho), (neg_tr, neg_ho) = split(pos), split(neg)
    say(args, f"training on {len(pos_tr):,} positive and {len(neg_tr):,} negative documents")
    w, b, report = quality.train_classifier(pos_tr, neg_tr, l2=args.l2, kind=args.features)
    useless = None
    if pos_ho and neg_ho:
        clf = quality.Classifier(w, b, features=args.features)
        # precision / recall of "drop" (label 0) at the default threshold, as prepare uses it
        p_pos, p_neg = clf.score(pos_ho), clf.score(neg_ho)
        tp, fp = int((p_neg < 0.5).sum()), int((p_pos < 0.5).sum())
        report["holdout"] = {"positives": len(pos_ho), "negatives": len(neg_ho),
                             "drop_precision": tp / max(tp + fp, 1), "drop_recall": tp / len(neg_ho)}
        say(args, f"held out: dropping below 0.5 catches {tp}/{len(neg_ho)} negatives (recall {report['holdout']['drop_recall']:.3f}), "
                  f"precision {report['holdout']['drop_precision']:.3f}")
        balanced = (tp / len(neg_ho) + 1 - fp / len(pos_ho)) / 2
        if balanced < CHANCE:
            useless = balanced
    digest = write(out, lambda o: quality.save_classifier(o, w, b, report, args.features))
    if useless is not None:
        print(f"warning: on the held-out documents the model is right about {useless:.0%} of each class on average, near the 50% "
              "of a coin: it does not tell --positive from --negative; do not filter with it (check the two sets, or give more documents)")
        print(f"wrote {out} (sha256 {digest[:16]}; train accuracy {report['train_accuracy']:.3f})")
        return 0
    print(f"wrote {out} (sha256 {digest[:16]}; train accuracy {report['train_accuracy']:.3f}); "
          f"use it with prepare.quality_model={out}")
    return 0


CHANCE = 0.6  # held-out balanced accuracy under which a model is reported as not telling the classes apart
