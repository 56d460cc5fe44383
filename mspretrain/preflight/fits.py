"""Does the run fit in this machine's memory? Checked before compute, refused in one line.

A `model.max_seq_len` or `train.global_batch` far too large used to end in an allocation failure
deep inside numpy or MindSpore (a traceback, or the OOM killer minutes later). The plan's memory
estimate (`mspretrain plan`) is compared with the host's RAM when training on CPU. On Ascend the
plan itself compares with device memory (`plan --devices`); host RAM is not the limit there.

Design choices:
- Refuse only when the estimate exceeds the machine's *physical* memory: no amount of waiting
  makes that fit. More than what is available right now is a warning (other jobs may finish).
- Every rank on this host counts: msrun starts `--local_worker_num` processes, each building the
  same model on the host, so the estimate of one process is multiplied by the ranks on this host.
  `mspretrain launch` exports that number (`LOCAL_RANKS_ENV`); under a bare msrun every rank of
  the world is taken to be local, which is how a CPU job runs (one host).
- The RoPE tables are added to the plan's figure: they scale with `model.max_seq_len`, not with
  `data.seq_len`, and are built on the host in float64 first (`model/decoder.py: rope_tables`).
"""
from __future__ import annotations

import os
from typing import Callable

from mspretrain.config.schema import Config
from mspretrain.device import LOCAL_RANKS_ENV
from mspretrain.errors import UserError, env_number

GB = 1 << 30


def local_ranks(world: int, env: dict[str, str] | None = None) -> int:
    """Training processes on this host: what `launch` exported, else the whole world."""
    env = os.environ if env is None else env
    n = env_number(LOCAL_RANKS_ENV, world, kind=int, minimum=1, value=env.get(LOCAL_RANKS_ENV, ""))
    return min(max(int(n), 1), max(world, 1))


def host_memory() -> tuple[int, int | None]:
    """(physical bytes, available bytes or None) of this machine."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return total, None


def estimate_bytes(cfg: Config, world: int) -> int:
    """Peak host bytes of one training process: the plan's figure plus the RoPE tables. `world`: all
    the ranks; the plan models the micro-batch of the run's data-parallel size (world / parallel.tp,
    mspretrain/parallel/plan.py), as train splits the batch."""
    from mspretrain.preflight.plan import make_plan

    plan = make_plan(cfg, devices=world, tokens=None, data_dir=None, tokens_per_s_per_device=None)  # memory needs no budget
    mem = plan["memory_bytes"]
    m = cfg.model
    rope = m.max_seq_len * m.head_size * 24  # float64 angles + float64 cos/sin + the fp32 copies
    return int(mem.get("peak", mem["total"])) + rope


def check_fits(cfg: Config, world: int, device: str, log: Callable[[str], None] = print,
               memory: tuple[int, int | None] | None = None, local: int | None = None) -> None:
    """Refuse a CPU run whose estimate (one process x the ranks on this host) exceeds physical
    memory; warn above the available memory."""
    if device != "cpu":
        return
    local = local_ranks(world) if local is None else local
    need = estimate_bytes(cfg, world) * local
    total, available = memory or host_memory()
    shape = (f"model.max_seq_len {cfg.model.max_seq_len:,}, train.global_batch {cfg.train.global_batch:,}, "
             f"data.seq_len {cfg.data.seq_len:,}, dim {cfg.model.dim:,} x {cfg.model.n_layers} layers"
             + (f", {local} ranks on this host" if local > 1 else ""))
    if need > total:
        raise UserError(f"this run needs about {need / GB:,.1f} GB of memory but the machine has {total / GB:,.1f} GB ({shape})",
                        "lower train.global_batch (or set train.micro_batch), data.seq_len, model.max_seq_len or the model size; "
                        "`mspretrain plan --config F` shows the estimate")
    if available is not None and need > available:
        log(f"warning: this run needs about {need / GB:,.1f} GB of memory and {available / GB:,.1f} GB are available now")
