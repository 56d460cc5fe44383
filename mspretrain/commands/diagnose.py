"""Find OOMs, killed processes, full disks, comm timeouts, NaN storms, spikes and stragglers in a run's logs."""
from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES = """examples:
  mspretrain diagnose runs/demo                 # train.log, metrics.jsonl and every *.log below
  mspretrain diagnose msrun_logs/worker_3.log
  mspretrain diagnose runs/demo --json

Exit code 1 when something was found, 0 when the logs look clean."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_DIR|LOGFILE")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from mspretrain.ops.diagnose import as_json, diagnose, format_findings

    findings = diagnose(Path(args.target))
    print(as_json(findings) if args.json else format_findings(findings))
    return 1 if findings else 0
