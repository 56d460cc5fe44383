"""Check a new node in minutes before committing compute: devices, versions, environment, flash
attention against the math path, fp16/bf16 train steps with an injected overflow, collectives
bandwidth, checkpoint disk speed and a 7B resume estimate, and one decoder layer's tokens/s and MFU.

On CPU every check CPU supports runs and the others say "needs Ascend" (never "passed").
Exit code 1 when a check fails, 0 otherwise."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mspretrain.commands.common import add_config_argument, load_config

EXAMPLES = """examples:
  mspretrain selftest --config configs/llama2-7b-910b.toml --run /data/runs/7b
  mspretrain selftest --config configs/llama2-7b-910b.toml --run /data/runs/7b --out selftest.json
  mspretrain plan --config configs/llama2-7b-910b.toml --devices 8 --from-selftest selftest.json
  mspretrain selftest --quick                      # small shapes (what CI runs on CPU)

The JSON schema is in docs/operators.md ("mspretrain selftest")."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--run", metavar="RUN_DIR", default=".",
                   help="where the run will write: the checkpoint check measures this disk (scratch files in RUN_DIR/.selftest-*/, removed after)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (for `plan --from-selftest`)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (the table still goes to stdout)")
    p.add_argument("--quick", action="store_true", help="smaller checkpoint and collective sizes, fewer timing repeats")


def is_selftest_output(head: bytes) -> bool:
    """Whether a file's first bytes are a selftest JSON (`--out` replaces only those)."""
    return head.lstrip().startswith(b"{") and b'"selftest_version"' in head


def run(args: argparse.Namespace) -> int:
    from mspretrain.outputs import check_output_file, write_output_file
    from mspretrain.preflight.selftest import failed, format_table, run_selftest

    cfg = load_config(args)
    if args.out:  # refused before minutes of checks, not after
        check_output_file(args.out, "selftest", is_ours=is_selftest_output)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.json else (lambda s: None)
    doc = run_selftest(cfg, Path(args.run), quick=args.quick, log=log)
    if args.out:
        write_output_file(args.out, json.dumps(doc, indent=1) + "\n", "selftest", is_ours=is_selftest_output)
    print(json.dumps(doc, indent=1) if args.json else format_table(doc))
    return 1 if failed(doc) else 0
