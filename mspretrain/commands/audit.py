"""Check a run's whole history (every resume, rewind and world-size change) against the plan."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

EXAMPLES = """examples:
  mspretrain audit runs/demo
  mspretrain audit runs/demo --json

Exit code 0 when the run is exact, 1 when something was found or the record is incomplete
(it stops before the run's newest checkpoint or metrics, or records no step)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help='print {"exact", "steps", "resumes", "rewinds", "notes", "findings", "incomplete"}')


def run(args: argparse.Namespace) -> int:
    from mspretrain.forensics.audit import audit_run, format_audit

    result = audit_run(Path(args.run))
    if args.json:
        print(json.dumps({"exact": result.exact, "steps": result.steps, "resumes": result.resumes,
                          "rewinds": result.rewinds, "notes": result.notes,
                          "findings": [vars(f) for f in result.findings],
                          "incomplete": result.incomplete}, indent=1))
    else:
        print(format_audit(result, Path(args.run)))
    return 0 if result.exact else 1
