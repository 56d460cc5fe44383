"""Quality models for `prepare` (issue 39): `quality train` fits the document classifier on
labelled files, `quality lm` counts the character n-gram model of a reference set.

Both read their files as `prepare` does (.txt by blank-line blocks or --doc-per-line, .jsonl by
--text-field, .gz / .zst) and clean the documents with the config's `prepare.*` rules, so a model
scores the same kind of text `prepare` gives it. Each writes `OUT` (.npz, no pickle) and
`OUT.sha256`; `prepare.quality_model` / `prepare.lm_model` name it.
"""
from __future__ import annotations

import argparse
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


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import numpy as np

    from mspretrain.prepare import quality
    from mspretrain.prepare.quality import read_cleaned

    cfg = load_config(args).prepare
    flags = {"doc_per_line": args.doc_per_line, "text_field": args.text_field}
    cfg = replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise UserError(f"--out {out} is a directory", "name the model file, e.g. --out quality.npz")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the directory {out.parent} does not exist", "create it first, or choose another path")
    if args.action == "lm":
        texts = read_cleaned(args.reference, cfg)
        counts, total = quality.train_lm(texts)
        digest = quality.save_lm(out, counts, total, {"documents": len(texts), "characters": int(total)})
        say(args, f"counted {len(texts):,} reference documents ({int(total):,} characters)")
        print(f"wrote {out} (sha256 {digest[:16]}); use it with prepare.lm_model={out} and see the perplexities with prepare --inspect")
        return 0
    pos, neg = read_cleaned(args.positive, cfg), read_cleaned(args.negative, cfg)
    if not pos or not neg:
        raise UserError(f"the {'positive' if not pos else 'negative'} label set is empty (no document left after cleaning)",
                        "name files with documents for both --positive and --negative")
    rng = np.random.default_rng(cfg.seed)  # the held-out draw: from prepare.seed, like every random choice of prepare

    def split(docs: list[str]) -> tuple[list[str], list[str]]:
        held = rng.random(len(docs)) < args.holdout
        if held.all():  # never train on nothing
            held[0] = False
        return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]

    (pos_tr, pos_ho), (neg_tr, neg_ho) = split(pos), split(neg)
    say(args, f"training on {len(pos_tr):,} positive and {len(neg_tr):,} negative documents")
    w, b, report = quality.train_classifier(pos_tr, neg_tr, l2=args.l2, kind=args.features)
    if pos_ho and neg_ho:
        clf = quality.Classifier(w, b, features=args.features)
        # precision / recall of "drop" (label 0) at the default threshold, as prepare uses it
        p_pos, p_neg = clf.score(pos_ho), clf.score(neg_ho)
        tp, fp = int((p_neg < 0.5).sum()), int((p_pos < 0.5).sum())
        report["holdout"] = {"positives": len(pos_ho), "negatives": len(neg_ho),
                             "drop_precision": tp / max(tp + fp, 1), "drop_recall": tp / len(neg_ho)}
        say(args, f"held out: dropping below 0.5 catches {tp}/{len(neg_ho)} negatives (recall {report['holdout']['drop_recall']:.3f}), "
                  f"precision {report['holdout']['drop_precision']:.3f}")
    digest = quality.save_classifier(out, w, b, report, args.features)
    print(f"wrote {out} (sha256 {digest[:16]}; train accuracy {report['train_accuracy']:.3f}); "
          f"use it with prepare.quality_model={out}")
    return 0
