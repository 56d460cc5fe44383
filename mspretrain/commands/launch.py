"""Run an mspretrain command on N data-parallel workers through msrun (MindSpore's launcher).

Builds the msrun line (`--worker_num`, `--local_worker_num`, `--master_addr/--master_port`,
`--node_rank`, `--log_dir`, `--join`, `--cluster_time_out`), finds msrun and the mspretrain script next to this
interpreter (msrun starts `python` from PATH, so this venv's bin goes first on it), and runs it.
Nothing here is needed to use msrun directly; it saves typing the line right.

Two things msrun does not do, added here:
- A watchdog (launcher/: supervise.py, watchdog.py): for `train`, the ranks' heartbeats in the run dir and their
  processes are watched; when a rank dies or is stopped, the whole job is ended within seconds with
  one line naming the rank, its step and its phase (msrun alone ends it 30-40 s later naming a pid).
- Several "nodes" on one machine: msrun starts a scheduler on every node whose --master_addr is a
  local address (parallel/cluster/process_entity/_api.py: `is_master = _is_local_ip(master_addr)`),
  so on one host node 1 would start a second scheduler on node 0's port. Node ranks > 0 get
  MSPRETRAIN_NO_SCHEDULER=1, and that scheduler process exits at once (parallel/distributed.py); each
  node also logs into its own `LOG_DIR/node_N` (both schedulers would write LOG_DIR/scheduler.log).
  On separate hosts both are harmless.
- Before msrun starts a rank (issue 38): a memory pool (device.max_device_memory) larger than the
  NPUs' HBM is refused in one line (a 32 GB 910B4 under the 910B configs' 58 GB), and a `train` on
  Ascend gets HCCL_BUFFSIZE from its plan (parallel/hccl.py), unless the user exported one."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from mspretrain.commands.common import bounded
from mspretrain.launcher.supervise import supervise, train_run_dir, wait_for_master

EXAMPLES = """examples:
  mspretrain launch --nproc 2 -- train --config configs/tiny.toml --data data/ --run runs/dp
  mspretrain launch --nproc 8 --nodes 2 --node-rank 0 --master-addr 10.0.0.1 -- train --config configs/llama2-7b-910b.toml --data D --run R
  mspretrain launch --nproc 8 --dry-run -- train ...     # print the msrun line only
  # two "nodes" on one machine (one terminal each):
  mspretrain launch --nproc 1 --nodes 2 --node-rank 0 --master-port 8200 -- train --config C --data D --run R
  mspretrain launch --nproc 1 --nodes 2 --node-rank 1 --master-port 8200 -- train --config C --data D --run R"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=bounded(int, 1, 1024), required=True, metavar="N", help="workers on this node (devices per node)")
    p.add_argument("--nodes", type=bounded(int, 1, 1 << 16), default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=bounded(int, 0, 1 << 16), default=0, help="this node's index, 0 on the master node")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=bounded(int, 1, 65535, what="a TCP port"), default=8118)
    p.add_argument("--log-dir", default="msrun_log", help="msrun writes worker_N.log and scheduler.log here (with --nodes > 1: in LOG_DIR/node_N)")
    p.add_argument("--dry-run", action="store_true", help="print the msrun command line and exit")
    p.add_argument("--stale-after", type=bounded(float, 1e-3, 1e7), default=None, metavar="S",
                   help="end the job when a rank's heartbeat is S seconds old while the others beat (default 20)")
    p.add_argument("--stop-grace", type=bounded(float, 1e-3, 1e7), default=None, metavar="S",
                   help="end the job when a rank's process has been stopped (SIGSTOP, a debugger) for S seconds (default 5)")
    p.add_argument("--no-watchdog", action="store_true", help="leave dead or stopped ranks to msrun's own timeouts")
    p.add_argument("--master-wait", type=bounded(float, 1e-3, 1e7), default=300.0, metavar="S",
                   help="node ranks > 0: wait at most S seconds for node 0 to listen on --master-addr:--master-port "
                        "(default 300), then fail with one line instead of waiting forever")
    p.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the mspretrain command every worker runs, after --")


def check_worker_command(cmd: list[str]) -> None:
    """Parse the workers' command here, before msrun starts: an unknown command or option failed
    in every worker after msrun had started them (tracebacks in msrun_log/, exit 1), leaving the
    log dir of a job that never ran. Refused as the command itself would refuse it (exit 2)."""
    from mspretrain.cli import build_parser
    from mspretrain.errors import UserError

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _, extra = build_parser(cmd[0]).parse_known_args(cmd)
    except SystemExit as exc:  # the command's parser said `error: ...` / `hint: ...` (or printed its --help: exit 0)
        if not exc.code:
            raise
        lines = [x.partition(": ")[2] for x in said.getvalue().strip().splitlines()]
        raise UserError(f"mspretrain {cmd[0]}: {lines[0] if lines else 'bad arguments'}",
                        lines[1] if len(lines) > 1 else f"see `mspretrain {cmd[0]} --help`") from None
    bad = [e for e in extra if "=" not in e or e.startswith("-")]
    if bad:
        raise UserError(f"`mspretrain {cmd[0]}` does not take {' '.join(bad)}", f"see `mspretrain {cmd[0]} --help`")


def worker_config(cmd: list[str]) -> tuple[argparse.Namespace, Any] | None:
    """The worker command's parsed arguments and config, for the checks launch makes before msrun
    starts; None for a command that reads no config of its own (a run reader)."""
    from mspretrain.cli import TAKE_OVERRIDES, build_parser
    from mspretrain.commands.common import load_config

    if cmd[0] not in TAKE_OVERRIDES:
        return None
    args, extra = build_parser(cmd[0]).parse_known_args(cmd)
    args.overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    return args, load_config(args)


def check_worker_data(args: argparse.Namespace, cfg: Any) -> None:
    """A `train`'s data dirs (--data and data.sources) exist and hold a manifest, checked before
    msrun starts: a missing one failed in every worker after msrun had started them (a traceback per
    rank in msrun_log/, launch exit 1). The deep checks (tokenizer, shard sizes) stay the ranks'."""
    from mspretrain.commands.common import existing_path
    from mspretrain.data.loader import resolve_sources
    from mspretrain.data.manifest import read_manifest

    if args.command != "train":
        return
    existing_path(args.data, "data dir", "run `mspretrain prepare INPUT --out DATA_DIR` first")
    for path, _ in resolve_sources(args.data, cfg.data.sources):
        read_manifest(path)


def check_worker_train(args: argparse.Namespace, cfg: Any, world: int) -> None:
    """A `train`'s own config checks, made here before msrun starts as train makes them before its
    rendezvous (train/build.py `build_trainer`): the rules across sections (config/schema.py `validate`:
    tensor parallel with ZeRO-3 or eval.choices_file, ...), the model tensor parallel must cut
    (model/parallel.py `check_tp`: kv heads, heads, ffn, vocabulary) and a world that parallel.tp
    divides. Each failed in every worker after msrun had started them (a traceback per rank, exit 1).
    With --init-from an HF folder the model is its config.json's; a checkpoint's is the ranks' to check."""

    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError

    if args.command != "train":
        return
    if getattr(args, "model", None):
        from mspretrain.commands.train import with_preset

        cfg = with_preset(cfg, args.model, args.overrides)
    # the device the ranks resolve (device.py `resolve_target`), without its NPU-visibility check:
    # that one is the ranks' (and doctor's) to make
    target = cfg.device.target
    if target == "auto":
        target = "ascend" if any(os.path.exists(p) for p in ("/dev/davinci0", "/dev/davinci_manager")) else "cpu"
    cfgmod.validate(cfg, device=target)
    tp = cfg.parallel.tp
    if tp > 1 and world % tp:  # the words of step/tp.py `make_mesh`
        raise UserError(f"parallel.tp = {tp} does not divide the {world} ranks of this job",
                        f"launch a multiple of {tp} ranks (world = tp x data-parallel ranks), or change parallel.tp")
    if tp == 1:
        return
    from mspretrain.data.manifest import read_manifest
    from mspretrain.model.parallel import check_tp

    vocab = int(read_manifest(args.data)["vocab_size"])
    init = Path(args.init_from) if getattr(args, "init_from", None) else None
    if init is not None:
        # an HF folder's model is its config.json (read, not its weights); the vocabulary grows to
        # the data dir's when its tokenizer extends the model's. A checkpoint's is checked by the ranks.
        if (init / "config.json").is_file() and not (init / "manifest.json").exists():
            from dataclasses import replace

            from mspretrain.fsutil import read_json
            from mspretrain.model.hf import config_from_hf

            m = config_from_hf(read_json(init / "config.json", "re-save the model config"), str(init / "config.json"))
            check_tp(replace(m, vocab_size=max(m.vocab_size, vocab)), tp)
        return
    from mspretrain.checkpoint.init_source import explicit_model_keys, init_for_run

    # the model the ranks would build: a resumed run's saved one (no weights are read without --init-from)
    explicit = explicit_model_keys(args.config, args.overrides, preset=bool(getattr(args, "model", None)))
    cfg, _, _ = init_for_run(None, cfg, args.data, args.run, explicit=explicit, log=lambda s: None)
    check_tp(cfgmod.resolve_model(cfg.model, vocab), tp)


def check_device_pool(cfg: Any) -> None:
    """The worker config's Ascend memory pool (device.max_device_memory, 58 GB by default) against
    this node's NPUs, read with npu-smi (device.py `pool_checked`) before msrun starts a rank: on a
    32 GB 910B4 every rank would set the 58 GB cap and fail at its first large allocation, minutes
    in. Only a pool known not to fit is refused; an unreadable HBM is `doctor`'s warning."""
    from mspretrain.device import pool_checked
    from mspretrain.errors import UserError

    status, detail, fix = pool_checked(cfg)
    if status == "fail":
        raise UserError(f"{detail}: every rank would fail at its first large allocation", fix)


def hccl_buffsize(args: argparse.Namespace, cfg: Any, nproc: int, nodes: int) -> tuple[int, int, str] | None:
    """(HCCL_BUFFSIZE in MB, the largest collective in bytes, the tp and dp groups' buffers as
    `GROUP_BUFFSIZE_ENV` reads them) for a `train` on Ascend, from the plan of its config at this
    world size (preflight/plan.py, parallel/hccl.py `communicators`); None when the run is not one (CPU,
    another command) or its plan cannot be made here (the train says why itself)."""
    from dataclasses import replace

    from mspretrain.errors import UserError
    from mspretrain.preflight.plan import make_plan

    on_npu = any(os.path.exists(p) for p in ("/dev/davinci0", "/dev/davinci_manager"))
    if args.command != "train" or not (cfg.device.target == "ascend" or (cfg.device.target == "auto" and on_npu)):
        return None
    data = Path(args.data) if getattr(args, "data", None) else None
    try:
        if getattr(args, "model", None):
            from mspretrain.commands.train import with_preset

            cfg = with_preset(cfg, args.model, args.overrides)
        no_budget = replace(cfg.train, max_steps=0, max_tokens=0)  # the memory layout needs no schedule
        plan = make_plan(replace(cfg, train=no_budget), devices=nproc * nodes, tokens=None,
                         data_dir=data if data is not None and (data / "manifest.json").is_file() else None,
                         tokens_per_s_per_device=None, target="ascend", nodes_ranks=nproc)
    except (UserError, OSError, ValueError):
        return None
    hc = plan.get("hccl")
    from mspretrain.parallel.hccl import group_buffsize_env

    return (hc["buffsize_mb"], hc["largest_collective_bytes"], group_buffsize_env(hc["communicators"])) if hc else None


def run(args: argparse.Namespace) -> int:
    from mspretrain.cli import COMMANDS
    from mspretrain.errors import UserError
    from mspretrain.launcher.watchdog import STOP_GRACE_S
    from mspretrain.monitor.ranks import STALE_S
    from mspretrain.parallel.distributed import NO_SCHEDULER, msrun_command
    from mspretrain.preflight.fits import LOCAL_RANKS_ENV

    cmd = list(args.command_args) + list(getattr(args, "overrides", ()))
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("no command to launch", "put the mspretrain command after --, e.g. mspretrain launch --nproc 2 -- train --config ...")
    if cmd[0] not in COMMANDS:
        raise UserError(f"`{cmd[0]}` is not an mspretrain command", f"put one of {', '.join(COMMANDS)} after --")
    if args.nproc < 1 or args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        raise UserError(f"--nproc {args.nproc}, --nodes {args.nodes}, --node-rank {args.node_rank} do not describe a cluster",
                        "use --nproc >= 1, --nodes >= 1 and 0 <= --node-rank < --nodes")
    bin_dir = Path(sys.executable).parent
    search = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    script = shutil.which("mspretrain", path=search) or str(bin_dir / "mspretrain")
    log_dir = args.log_dir if args.nodes == 1 else os.path.join(args.log_dir, f"node_{args.node_rank}")
    line = msrun_command(args.nproc, cmd, nodes=args.nodes, node_rank=args.node_rank, master_addr=args.master_addr,
                         master_port=args.master_port, log_dir=log_dir, script=script)
    stale = STALE_S if args.stale_after is None else args.stale_after
    grace = STOP_GRACE_S if args.stop_grace is None else args.stop_grace
    for flag, value in (("--stale-after", stale), ("--stop-grace", grace), ("--master-wait", args.master_wait)):
        if not value > 0 or value == float("inf"):  # NaN fails the first test
            raise UserError(f"{flag} {value} is not a positive number of seconds", f"use e.g. {flag} 20")
    if args.dry_run:
        print(line)
        return 0
    msrun = shutil.which("msrun", path=search)
    if msrun is None:
        raise UserError("msrun is not installed next to this Python", "install MindSpore >= 2.3 in this environment (msrun ships with it)")
    check_worker_command(cmd)  # after --dry-run, which only prints; before anything is written
    worker = worker_config(cmd)
    if worker is not None:
        check_worker_data(*worker)
        check_worker_train(*worker, args.nproc * args.nodes)
        check_device_pool(worker[1])
    env = {**os.environ, "PATH": search}
    hccl = hccl_buffsize(*worker, args.nproc, args.nodes) if worker is not None else None
    if hccl is not None:  # the user's own value wins; docs/operators.md section 5 says why it is set
        from mspretrain.parallel.hccl import GROUP_BUFFSIZE_ENV, HCCL_BUFFSIZE_ENV

        mb, largest, groups = hccl
        given = env.get(HCCL_BUFFSIZE_ENV)
        env.setdefault(HCCL_BUFFSIZE_ENV, str(mb))
        if groups and not given:  # the tp and dp groups' own buffers (step/tp.py group_options); yours applies to all
            env.setdefault(GROUP_BUFFSIZE_ENV, groups)
        print(f"{HCCL_BUFFSIZE_ENV}={env[HCCL_BUFFSIZE_ENV]} ({'yours; ' if given else ''}the plan's: {mb} MB for a largest "
              f"collective of {largest / 2**20:,.0f} MB)" + (f"; groups {env[GROUP_BUFFSIZE_ENV]} MB" if env.get(GROUP_BUFFSIZE_ENV) else ""),
              flush=True)
    env.setdefault("GLOG_v", "3")  # MindSpore's native logs: warnings and errors only
    env[LOCAL_RANKS_ENV] = str(args.nproc)  # train's memory check counts every rank on this host
    if args.node_rank > 0:
        env[NO_SCHEDULER] = "1"
        wait_for_master(args.master_addr, args.master_port, args.master_wait)
    _check_log_dir(Path(log_dir))  # the first write, the last check before msrun starts
    print(line, flush=True)
    run_dir = None if args.no_watchdog else train_run_dir(cmd)
    code, verdict = supervise([msrun, *shlex.split(line)[1:]], env, run_dir, stale, grace)
    if verdict is not None:
        print(f"error: {verdict.message()}; the job was ended\n"
              f"hint: relaunch the same command to resume from the newest verified checkpoint; "
              f"`mspretrain diagnose {run_dir} --hang` shows every rank, {log_dir}/worker_{verdict.rank}.log the rank's output",
              file=sys.stderr)
        return 1
    if code in (128 + signal.SIGTERM, 128 + signal.SIGHUP):
        print("error: launch was ended by a signal; msrun and its workers were sent SIGTERM\n"
              "hint: relaunch the same command to resume from the newest verified checkpoint", file=sys.stderr)
        return code
    if code != 0:
        print(f"error: a worker failed (msrun exit {code})\nhint: read {log_dir}/worker_*.log "
              f"(`mspretrain diagnose {log_dir}` summarises them)", file=sys.stderr)
    return code


def _check_log_dir(log_dir: Path) -> None:
    """msrun writes every worker's log into --log-dir; on a full, read-only or misnamed one it dies
    with its own Python traceback after starting. Make the dir and write a byte there first."""
    import tempfile

    from mspretrain.errors import UserError

    made = not log_dir.exists()
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir) as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if made:  # a refused launch leaves no log dir of its own behind
            with contextlib.suppress(OSError):
                log_dir.rmdir()
        raise UserError(f"cannot write msrun's --log-dir {log_dir}: {exc.strerror or exc}",
                        "pass a --log-dir on a disk with free space that you can write to") from None
