"""Clean, dedup and tokenize raw text into a data dir (tokenizer + Megatron shards + manifest).

Flags override the matching `prepare.*` config fields (and --seq-len overrides data.seq_len);
section.key=value overrides may follow the options.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from mspretrain.commands.common import add_config_argument, add_quiet_argument, bounded, load_config, progress_enabled
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain prepare corpus/ --out data/ --vocab-size 16000
  mspretrain prepare 'news/*.jsonl.zst' --text-field content --out data/news --workers 8
  mspretrain prepare lines.txt --doc-per-line --tokenizer data/tokenizer.model --out data/more
  mspretrain prepare corpus/ --out data/ prepare.t2s=true prepare.near_dedup=true
  mspretrain prepare 'news/*.txt' --doc-per-line --out data/news --ray 10.0.0.1:6379
  mspretrain prepare web/ --out data/q7 --scores-from data/q5 prepare.quality_model=q.npz prepare.quality_threshold=0.7
  mspretrain prepare --inspect data/"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files, directories or globs of .txt / .jsonl (optionally .gz / .zst)")
    p.add_argument("--out", metavar="DATA_DIR", help="the data dir to write (must not exist unless --overwrite)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--vocab-size", type=bounded(int, 260, 1 << 22), metavar="N", help="train a SentencePiece BPE of N pieces (prepare.vocab_size)")
    tok.add_argument("--tokenizer", metavar="PATH", help="use an existing tokenizer.model / tokenizer.json (or a data dir holding one)")
    p.add_argument("--seq-len", type=bounded(int, 1, 1 << 24), metavar="L",
                   help="training sequence length, to check the splits are long enough (data.seq_len)")
    add_config_argument(p)
    p.add_argument("--doc-per-line", action="store_true", default=None,
                   help="in .txt files, one document per line (default: per blank-line separated block)")
    p.add_argument("--text-field", metavar="F", help="the .jsonl field holding the text (prepare.text_field, default text)")
    p.add_argument("--workers", type=bounded(int, 1, 1 << 20), metavar="N", help="worker processes (default: the number of cores)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run the chunks as Ray tasks on a cluster: HOST:PORT of its head, ray://HOST:PORT, auto or local "
                        "(needs pip install 'mspretrain[ray]' on every node; reading, dedup decisions and writing stay here)")
    p.add_argument("--valid-fraction", type=bounded(float, 0, 1), metavar="F", help="share of documents for the valid split (prepare.valid_fraction)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing data dir")
    p.add_argument("--scores-from", metavar="DATA_DIR",
                   help="take the quality filters' scores from DATA_DIR's quality.scores (a prepare of the same inputs with the "
                        "same models) instead of scoring again: only the thresholds are applied anew")
    p.add_argument("--inspect", metavar="DATA_DIR", help="print the manifest summary of a data dir and decode a few documents")
    add_quiet_argument(p)


def run(args: argparse.Namespace) -> int:
    from mspretrain.prepare.inspect import inspect
    from mspretrain.prepare.prepare import prepare

    if args.inspect:
        if args.inputs or args.out:
            raise UserError("--inspect reads an existing data dir and takes no INPUT or --out", "run: mspretrain prepare --inspect DATA_DIR")
        print(inspect(args.inspect))
        return 0
    if not args.inputs:
        raise UserError("no INPUT given", "name files, directories or globs: mspretrain prepare corpus/ --out data/")
    if not args.out:
        raise UserError("no --out given", "say where the data dir goes: mspretrain prepare corpus/ --out data/")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers} must be at least 1", "use e.g. --workers 2, or leave it out for one per core")
    if args.ray is not None and args.workers is not None:
        raise UserError("--workers and --ray exclude each other: with --ray every CPU of the cluster is a worker",
                        "leave out --workers (or --ray to run on this machine only)")
    if args.seq_len is not None and args.seq_len < 1:
        raise UserError(f"--seq-len {args.seq_len} must be positive", "use e.g. --seq-len 2048")
    cfg = load_config(args)
    flags = {"vocab_size": args.vocab_size, "doc_per_line": args.doc_per_line, "text_field": args.text_field,
             "valid_fraction": args.valid_fraction}
    cfg = replace(cfg, prepare=replace(cfg.prepare, **{k: v for k, v in flags.items() if v is not None}))
    if args.seq_len is not None:
        cfg = replace(cfg, data=replace(cfg.data, seq_len=args.seq_len))
    quiet = args.quiet

    def log(line: str) -> None:
        if not quiet or line.startswith("warning"):
            print(line, flush=True)

    options = dict(tokenizer=args.tokenizer, overwrite=args.overwrite, workers=args.workers, progress=progress_enabled(args),
                   log=log, seq_len=cfg.data.seq_len, scores_from=args.scores_from)
    if args.ray is None:
        prepare(args.inputs, args.out, cfg.prepare, **options)
    else:
        from mspretrain.prepare.raypool import RayCluster

        with RayCluster(args.ray) as cluster:  # connected and checked before anything is written
            log(f"on Ray at {args.ray}: {cluster.describe()}")
            prepare(args.inputs, args.out, cfg.prepare, **options, ray=cluster)
    if not quiet:
        print(f"next: mspretrain prepare --inspect {args.out}   or   mspretrain train --config configs/tiny.toml --data {args.out} --run runs/a")
    return 0
