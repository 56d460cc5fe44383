"""Run an mspretrain command on N data-parallel workers through msrun (MindSpore's launcher).

Builds the msrun line (`--worker_num`, `--local_worker_num`, `--master_addr/--master_port`,
`--node_rank`, `--log_dir`, `--join`), finds msrun and the mspretrain script next to this
interpreter (msrun starts `python` from PATH, so this venv's bin goes first on it), and runs it.
Nothing here is needed to use msrun directly; it saves typing the line right."""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES = """examples:
  mspretrain launch --nproc 2 -- train --config configs/tiny.toml --data data/ --run runs/dp
  mspretrain launch --nproc 8 --nodes 2 --node-rank 0 --master-addr 10.0.0.1 -- train --config configs/llama2-7b-910b.toml --data D --run R
  mspretrain launch --nproc 8 --dry-run -- train ...     # print the msrun line only"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="workers on this node (devices per node)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 on the master node")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=int, default=8118)
    p.add_argument("--log-dir", default="msrun_log", help="msrun writes worker_N.log and scheduler.log here")
    p.add_argument("--dry-run", action="store_true", help="print the msrun command line and exit")
    p.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the mspretrain command every worker runs, after --")


def run(args: argparse.Namespace) -> int:
    from mspretrain.errors import UserError
    from mspretrain.train.distributed import msrun_command

    cmd = list(args.command_args) + list(getattr(args, "overrides", ()))
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("no command to launch", "put the mspretrain command after --, e.g. mspretrain launch --nproc 2 -- train --config ...")
    if args.nproc < 1 or args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        raise UserError(f"--nproc {args.nproc}, --nodes {args.nodes}, --node-rank {args.node_rank} do not describe a cluster",
                        "use --nproc >= 1, --nodes >= 1 and 0 <= --node-rank < --nodes")
    bin_dir = Path(sys.executable).parent
    search = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    script = shutil.which("mspretrain", path=search) or str(bin_dir / "mspretrain")
    line = msrun_command(args.nproc, cmd, nodes=args.nodes, node_rank=args.node_rank, master_addr=args.master_addr,
                         master_port=args.master_port, log_dir=args.log_dir, script=script)
    if args.dry_run:
        print(line)
        return 0
    msrun = shutil.which("msrun", path=search)
    if msrun is None:
        raise UserError("msrun is not installed next to this Python", "install MindSpore >= 2.3 in this environment (msrun ships with it)")
    env = {**os.environ, "PATH": search}
    env.setdefault("GLOG_v", "3")  # MindSpore's native logs: warnings and errors only
    print(line, flush=True)
    code = subprocess.call([msrun, *shlex.split(line)[1:]], env=env)
    if code != 0:
        print(f"error: a worker failed (msrun exit {code})\nhint: read {args.log_dir}/worker_*.log "
              f"(`mspretrain diagnose {args.log_dir}` summarises them)", file=sys.stderr)
    return code
