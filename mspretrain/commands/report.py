"""Write one self-contained HTML report of a run (plots embedded) plus PNGs in RUN_DIR/report/."""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import existing_path

EXAMPLES = """examples:
  mspretrain report runs/demo
  mspretrain report runs/demo --out /tmp/demo.html

Works while the run is still going (rerun to refresh)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", metavar="FILE", help="HTML file to write (default RUN_DIR/report/report.html)")


def run(args: argparse.Namespace) -> int:
    from mspretrain.monitor.report import build_report

    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    out = build_report(run_dir, Path(args.out) if args.out else None)
    print(f"report: {out}")
    print(f"plots:  {run_dir / 'report'}/*.png")
    return 0
