"""The world of ranks this process belongs to, and how it was launched, read from the environment alone.

Split out of `parallel/distributed.py` so that `checkpoint/model.py` (loading a model on Ascend needs the
rank table's DEVICE_ID) and `train/` can both decide the launch without checkpoint importing train.

Design choices: msrun is detected from the variables it exports to each worker (`MS_ROLE`,
`MS_WORKER_NUM`, `MS_SCHED_HOST`, `MS_SCHED_PORT`, `RANK_ID`, `RANK_SIZE`, `MS_NODE_ID`) and a
half-set environment is refused in one line instead of hanging in a rendezvous. The classic
rank-table launch (one process per NPU started by a script, with `RANK_TABLE_FILE`, `RANK_ID`,
`RANK_SIZE`, `DEVICE_ID` set) must bind its own NPU; `select_launch` decides which launch this
process is in without touching MindSpore, so the decision is tested on CPU. A rank table on CPU is
refused: it describes NPUs and HCCL, which CPU does not have.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from mspretrain.errors import UserError

MSRUN_VARS = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")
RANK_TABLE_VARS = ("RANK_TABLE_FILE", "RANK_ID", "RANK_SIZE", "DEVICE_ID")
# MindSpore reads the table from either name (mindspore/communication/management.py, _check_parallel_envs)
TABLE_NAMES = ("RANK_TABLE_FILE", "MINDSPORE_HCCL_CONFIG_PATH")


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


@dataclass(frozen=True)
class Launch:
    """How this process was started: "single", "msrun" or "rank_table", its world, and the NPU
    it must bind (rank table only: msrun negotiates the device id itself)."""
    kind: str
    world: World
    device_id: int | None = None


def _rank_table(env: dict[str, str]) -> Launch:
    table = next(env[v] for v in TABLE_NAMES if v in env)
    missing = [v for v in RANK_TABLE_VARS[1:] if v not in env]
    if missing:
        raise UserError(f"rank-table launch environment is half set (missing {', '.join(missing)})",
                        "set RANK_TABLE_FILE, RANK_ID, RANK_SIZE and DEVICE_ID for every process, or launch with `mspretrain launch` (msrun)")
    try:
        rank, size, device_id = int(env["RANK_ID"]), int(env["RANK_SIZE"]), int(env["DEVICE_ID"])
    except ValueError:
        raise UserError("RANK_ID / RANK_SIZE / DEVICE_ID are not integers",
                        "set them to the values of this process's entry in the rank table") from None
    if not 0 <= rank < size:
        raise UserError(f"RANK_ID = {rank} is outside 0..{size - 1} (RANK_SIZE = {size})",
                        "set RANK_ID from the rank table's rank_id of this process")
    if device_id < 0:
        raise UserError(f"DEVICE_ID = {device_id} is negative", "set DEVICE_ID to this process's NPU (0-7 on an 8-NPU server)")
    if not os.path.isfile(table):
        raise UserError(f"RANK_TABLE_FILE {table} does not exist",
                        "point it at the rank table (`mspretrain` writes one with parallel/hccl.py's write_topology)")
    return Launch("rank_table", World(rank=rank, size=size), device_id)


def select_launch(target: str, env: dict[str, str] | None = None) -> Launch:
    """Which launch this process is in, decided from the environment without touching MindSpore.

    msrun's variables win (msrun also exports RANK_ID/RANK_SIZE/DEVICE_ID, and RANK_TABLE_FILE when
    given --rank_table_file); else RANK_TABLE_FILE (or MINDSPORE_HCCL_CONFIG_PATH) means the classic
    launch, which needs RANK_ID, RANK_SIZE, DEVICE_ID and device.target ascend."""
    env = dict(os.environ if env is None else env)
    world = detect(env)
    if world is not None:
        return Launch("msrun", world)
    if any(v in env for v in TABLE_NAMES):
        if target != "ascend":
            raise UserError(f"{next(v for v in TABLE_NAMES if v in env)} is set, but a rank table launches HCCL on Ascend NPUs and the device is CPU",
                            "unset RANK_TABLE_FILE on CPU; for several CPU processes use `mspretrain launch --nproc N -- train ...` (msrun)")
        return _rank_table(env)
    return Launch("single", World())
