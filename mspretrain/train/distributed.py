"""Data parallel under msrun: rank detection, communication init, and the msrun command line.

Design choices: we detect msrun from the variables it exports to each worker (`MS_ROLE`,
`MS_WORKER_NUM`, `MS_SCHED_HOST`, `MS_SCHED_PORT`, `RANK_ID`, `RANK_SIZE`, `MS_NODE_ID`) and
refuse a half-set environment in one line instead of hanging in a rendezvous. Gradients are
summed across ranks inside the compiled step (`ops.AllReduce`), so every rank applies the same
update and agrees on overflow skips; only rank 0 writes checkpoints and metrics (with
`optim.shard_optimizer` each rank also writes its optimizer shard). On CPU the backend is
`mccl`; on Ascend it is HCCL. Optimizer-state sharding is our own (train/step.py: owner ranks
and one broadcast per parameter), not MindSpore's parallel optimizer, which CPU refuses
("parallel optimizer only supports Ascend in data parallel mode") and which would not apply to
our hand-written AdamW; so it runs, and is tested, on both backends.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from mspretrain.errors import UserError

MSRUN_VARS = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect(env: dict[str, str] | None = None) -> World | None:
    """The msrun world described by the environment, None when not under msrun."""
    env = dict(os.environ if env is None else env)
    present = [v for v in MSRUN_VARS if v in env]
    if not present:
        return None
    if len(present) != len(MSRUN_VARS):
        missing = [v for v in MSRUN_VARS if v not in env]
        raise UserError(f"msrun environment is half set (missing {', '.join(missing)})",
                        "launch with `msrun --worker_num=N --local_worker_num=N ... mspretrain train ...`, or unset the MS_* variables")
    try:
        size = int(env["MS_WORKER_NUM"])
        rank = int(env.get("RANK_ID", env.get("MS_NODE_ID", "0")))
    except ValueError:
        raise UserError("MS_WORKER_NUM / RANK_ID are not integers", "let msrun set them") from None
    if not 0 <= rank < size:
        raise UserError(f"RANK_ID = {rank} is outside 0..{size - 1}", "let msrun set RANK_ID")
    return World(rank=rank, size=size)


def init(target: str, env: dict[str, str] | None = None) -> World:
    """Initialise communication when under msrun; a single process otherwise."""
    world = detect(env)
    if world is None or world.size == 1:
        return World()
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init as comm_init

    comm_init("hccl" if target == "ascend" else None)
    world = World(rank=get_rank(), size=get_group_size())
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=False)
    return world


def msrun_command(nproc: int, args: list[str], *, nodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", master_port: int = 8118, log_dir: str = "msrun_log",
                  script: str = "mspretrain") -> str:
    """The msrun line for `nproc` workers per node (total nproc × nodes); msrun runs
    `python SCRIPT ARGS...` in each worker, so `script` is the mspretrain console script's path."""
    parts = ["msrun", f"--worker_num={nproc * nodes}", f"--local_worker_num={nproc}",
             f"--master_addr={master_addr}", f"--master_port={master_port}", f"--node_rank={node_rank}",
             f"--log_dir={log_dir}", "--join=True", script] + list(args)
    return " ".join(shlex.quote(p) for p in parts)
