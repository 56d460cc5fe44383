"""Tokenizer tools: `tokenizer extend` adds pieces learned from new text to a base tokenizer, keeping every base id.

The output dir holds tokenizer.model (SentencePiece), tokenizer.json (HF tokenizers) and
extend.json (what was done); `mspretrain prepare --tokenizer DIR/tokenizer.model` uses it as is.
"""
from __future__ import annotations

import argparse

from mspretrain.commands.common import add_quiet_argument, bounded, refuse_overrides, say

EXAMPLES = """examples:
  mspretrain tokenizer extend llama2/tokenizer.model --train zh_corpus/ --add 20000 --out tok-zh/
  mspretrain tokenizer extend llama2/tokenizer.model --with zh_sp.model --out tok-zh/
  mspretrain prepare zh_corpus/ --tokenizer tok-zh/tokenizer.model --out data-zh/"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = sub.add_parser("extend", help="append new pieces to a SentencePiece BPE tokenizer; base ids unchanged",
                       description="Append the N most useful new pieces (learned from --train text, or taken from --with "
                                   "another SentencePiece model) to BASE, keeping every base piece, id and score.")
    e.add_argument("base", metavar="BASE", help="the base tokenizer.model (e.g. Llama-2's), or a dir holding one")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--train", nargs="+", metavar="CORPUS", help="text files/dirs/globs (.txt, .jsonl with a text field) to learn new pieces from")
    src.add_argument("--with", dest="with_model", metavar="OTHER.model", help="take the new pieces from this SentencePiece model instead")
    e.add_argument("--add", type=bounded(int, 1, 1_000_000), metavar="N",
                   help="how many new pieces (required with --train; with --with, default all)")
    e.add_argument("--held-out", nargs="+", metavar="CORPUS", help="with --with: text to measure chars/token on (every 20th document)")
    e.add_argument("--out", required=True, metavar="DIR", help="new or empty directory for tokenizer.model and tokenizer.json")
    add_quiet_argument(e)


def run(args: argparse.Namespace) -> int:
    from mspretrain.prepare.tokenizer_extend import extend_tokenizer

    refuse_overrides(args, "tokenizer", "use the command's own options (see `mspretrain tokenizer extend --help`)")
    res = extend_tokenizer(args.base, args.out, add=args.add, train=args.train or (),
                           with_model=args.with_model, held_out=args.held_out or (), log=lambda s: say(args, s))
    print(f"{res.base_size:,} base pieces kept with their ids; {len(res.added):,} new pieces appended "
          f"(ids {res.base_size:,}-{res.base_size + len(res.added) - 1:,}), {res.base_size + len(res.added):,} in all")
    if res.chars_per_token_before is not None:
        print(f"chars per token on the held-out slice ({res.held_out_docs:,} documents (lines), every 20th): "
              f"{res.chars_per_token_before:.3f} before, {res.chars_per_token_after:.3f} after "
              f"({res.chars_per_token_after / res.chars_per_token_before:.2f}x)")
    else:
        print("chars per token not measured (no held-out text: pass --held-out CORPUS with --with)")
    print(f"wrote {', '.join(str(f) for f in res.files)}")
    return 0
