"""Check this machine's environment: MindSpore, numpy, CANN, msrun, threads, logs, disk, memory."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from mspretrain.commands.common import add_config_argument, load_config

EXAMPLES = """examples:
  mspretrain doctor
  mspretrain doctor --run runs/big --config configs/llama2-7b.toml

Exit code 1 when a check fails, 0 otherwise (warnings included)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--run", metavar="RUN_DIR", default=".", help="where the run will write (disk and filesystem checks)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from mspretrain.preflight.doctor import format_findings, run_checks

    findings = run_checks(Path(args.run), load_config(args))
    print(json.dumps([asdict(f) for f in findings], indent=1) if args.json else format_findings(findings))
    return 1 if any(f.status == "fail" for f in findings) else 0
