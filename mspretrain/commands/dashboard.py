"""Start TensorBoard on a run dir's event files, bound to 127.0.0.1 (reach it with an SSH tunnel)."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from mspretrain.commands.common import bounded, existing_path
from mspretrain.errors import UserError
from mspretrain.paths import RunPaths

EXAMPLES = """examples:
  mspretrain dashboard runs/demo
  mspretrain dashboard runs/ --port 6007     # every run under runs/
  ssh -L 6006:127.0.0.1:6006 trainhost       # then open http://127.0.0.1:6006 locally"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir, or a dir of run dirs")
    p.add_argument("--port", type=bounded(int, 1, 65535, what="a TCP port"), default=6006)


def tensorboard_command(logdir: str, port: int) -> list[str] | None:
    """The TensorBoard command line for this Python, or None when TensorBoard is not installed."""
    exe = shutil.which("tensorboard")
    if exe:
        return [exe, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        return [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]
    return None


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:  # checked before TensorBoard starts and fails with a traceback of its own
        raise UserError(f"--port {args.port} is not a TCP port (1-65535)", "use e.g. --port 6006")
    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    tb = RunPaths(run_dir).tb
    logdir = tb if tb.is_dir() else run_dir  # a dir of run dirs: TensorBoard finds every tb/ below
    cmd = tensorboard_command(str(logdir), args.port)
    if cmd is None:
        raise UserError("TensorBoard is not installed",
                        f'pip install "tensorboard>=2.16" (it works with numpy<2), then rerun; or make a static report: mspretrain report {run_dir}')
    print(f"TensorBoard on http://127.0.0.1:{args.port} for {logdir} (Ctrl-C to stop)", flush=True)
    return subprocess.call(cmd)
