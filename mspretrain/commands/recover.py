"""Rebuild a lost or corrupt train_state.json / data_state.json from the weights and metrics.jsonl.

The field report's recover_state.py, done carefully: only a checkpoint whose weights still match
their manifest is used; the step comes from the directory name, tokens and the loss scale from
the metrics log, the loader position from the step (global batch × steps, the loader's order
being a pure function of seed and position); then the manifest is rewritten so the checkpoint
verifies again. Everything rebuilt, and everything that could not be, is said.
"""
from __future__ import annotations

import argparse

from mspretrain.commands.common import bounded, existing_path

EXAMPLES = """examples:
  mspretrain recover runs/demo
  mspretrain recover runs/demo --step 200"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=bounded(int, 0, 10**12), default=None, help="which checkpoint (default: the newest with intact weights)")


def run(args: argparse.Namespace) -> int:
    from mspretrain.checkpoint import lock
    from mspretrain.forensics.recover import recover

    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    lock.acquire(run_dir, "recover")  # never rewrite a manifest under a live trainer
    report = recover(run_dir, step=args.step)
    for line in report:
        print(line)
    return 0
