"""List the checkpoints of a run: step, size, age, and (with --verify) whether they verify.

The averages `mspretrain average` wrote into the run (RUN_DIR/averaged/*) are listed after them."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from mspretrain.checkpoint import store
from mspretrain.commands.common import existing_path
from mspretrain.paths import RunPaths

EXAMPLES = """examples:
  mspretrain checkpoints runs/demo
  mspretrain checkpoints runs/demo --verify"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--verify", action="store_true", help="re-hash every file against its manifest (slower)")


def _step_of(d: Path) -> int:
    """An average's step (its newest source's), from its manifest; -1 when that is unreadable."""
    files, _ = store.manifest_files(d)  # a manifest this accepts has a checked integer step
    return int(store.read_json(d / store.MANIFEST).get("step", -1)) if files is not None else -1


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def run(args: argparse.Namespace) -> int:
    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    ckpts = store.list_checkpoints(run_dir)
    averaged = run_dir / "averaged"  # commands/average.py's default place; never resumed from
    ckpts += sorted((_step_of(d), d) for d in averaged.iterdir() if d.is_dir() and not d.name.endswith(".tmp")) \
        if averaged.is_dir() else []
    root = RunPaths(run_dir).checkpoints
    tmp = sorted(root.glob("*.tmp")) if root.is_dir() else []
    if not ckpts and not tmp:
        print(f"{run_dir}: no checkpoints")
        return 0
    print(f"{'checkpoint':<14} {'step':>8} {'size':>10} {'age':>6}  status")
    bad = 0
    now = time.time()
    for step, d in ckpts:
        reason = store.verify(d, deep=args.verify)
        status = ("verified" if args.verify else "complete") if reason is None else f"CORRUPT: {reason}"
        bad += reason is not None
        name = d.name if d.parent.name != "averaged" else f"averaged/{d.name}"
        print(f"{name:<14} {step:>8} {_size(d) / 2**20:>8.1f}MB {_age(now - d.stat().st_mtime):>6}  {status}")
    for d in tmp:
        print(f"{d.name:<14} {'':>8} {'':>10} {'':>6}  unfinished (ignored; removed at the next train)")
    return 1 if bad and args.verify else 0
