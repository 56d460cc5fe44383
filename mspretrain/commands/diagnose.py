"""Find OOMs, killed processes, full disks, comm timeouts, NaN storms, spikes and stragglers in a run's logs."""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import bounded

EXAMPLES = """examples:
  mspretrain diagnose runs/demo                 # train.log, metrics.jsonl and every *.log below
  mspretrain diagnose msrun_logs/worker_3.log
  mspretrain diagnose runs/demo --json
  mspretrain diagnose runs/dp --hang            # which rank lags, and in which phase (heartbeats)

Exit code 1 when something was found (with --hang: a rank lags), 0 when the logs look clean."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_DIR|LOGFILE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--hang", action="store_true",
                   help="read the ranks' heartbeats (RUN_DIR/heartbeat/): name the ranks that lag, died or stopped, and their phase")
    p.add_argument("--stale-after", type=bounded(float, 1e-3, 1e7), default=None, metavar="S",
                   help="with --hang: a heartbeat older than S seconds while other ranks beat is a silent rank (default 20)")


def run(args: argparse.Namespace) -> int:
    from mspretrain.forensics.diagnose import as_json, diagnose, format_findings, hang_report
    from mspretrain.monitor.ranks import STALE_S

    if args.hang:
        if args.json:
            raise_json_unsupported()
        stale = STALE_S if args.stale_after is None else args.stale_after
        if not stale > 0 or stale == float("inf"):  # NaN fails the first test
            from mspretrain.errors import UserError

            raise UserError(f"--stale-after {args.stale_after} is not a positive number of seconds", "use e.g. --stale-after 20")
        text, lag = hang_report(Path(args.target), stale_s=stale)
        print(text)
        return 1 if lag else 0
    findings = diagnose(Path(args.target))
    print(as_json(findings) if args.json else format_findings(findings))
    return 1 if findings else 0


def raise_json_unsupported() -> None:
    from mspretrain.errors import UserError

    raise UserError("--hang prints text only", "drop --json, or read RUN_DIR/heartbeat/rank_*.json directly (one JSON object per rank)")
