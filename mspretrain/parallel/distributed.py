"""Data parallel under msrun: rank detection, communication init, and the msrun command line.

Design choices: we detect msrun from the variables it exports to each worker (`MS_ROLE`,
`MS_WORKER_NUM`, `MS_SCHED_HOST`, `MS_SCHED_PORT`, `RANK_ID`, `RANK_SIZE`, `MS_NODE_ID`) and
refuse a half-set environment in one line instead of hanging in a rendezvous. Gradients are
summed across ranks inside the compiled step (`ops.AllReduce`), so every rank applies the same
update and agrees on overflow skips; only rank 0 writes checkpoints and metrics (with
`optim.shard_optimizer` each rank also writes its optimizer shard). On CPU the backend is
`mccl`; on Ascend it is HCCL. Optimizer-state sharding is our own (step/step.py: owner ranks
and one broadcast per parameter), not MindSpore's parallel optimizer, which CPU refuses
("parallel optimizer only supports Ascend in data parallel mode") and which would not apply to
our hand-written AdamW; so it runs, and is tested, on both backends.

The classic rank-table launch (one process per NPU started by a script, with `RANK_TABLE_FILE`,
`RANK_ID`, `RANK_SIZE`, `DEVICE_ID` set) is supported too: that process must bind its own NPU
(`set_device("Ascend", DEVICE_ID)`; without an id MindSpore 2.10 binds device 0 —
mindspore/device_manager.py, `set_device`: "In a distributed scenario with other startup
methods, `device_id` is set to 0") and then call `init("hccl")`, which reads the rank table.
`select_launch` (mspretrain/world.py) decides which launch this process is in from the environment
alone, so the decision is tested on CPU; the HCCL initialisation itself only runs on Ascend and is unverified
here. A rank table on CPU is refused: it describes NPUs and HCCL, which CPU does not have.
"""
from __future__ import annotations

import os
import shlex

from mspretrain.world import World, select_launch

# Set by `mspretrain launch` on node ranks > 0: msrun starts a scheduler on every node whose
# --master_addr is local (several "nodes" on one host), and the extra one must not run.
NO_SCHEDULER = "MSPRETRAIN_NO_SCHEDULER"


def init(target: str, env: dict[str, str] | None = None) -> World:
    """Initialise communication for the launch in `env` (msrun or rank table); one process otherwise.

    Call after `device.setup_mindspore`, which binds the rank table's DEVICE_ID."""
    env = dict(os.environ if env is None else env)
    if env.get("MS_ROLE") == "MS_SCHED" and env.get(NO_SCHEDULER) == "1":
        # a second scheduler of a node > 0 on node 0's host: node 0's scheduler serves the job, and
        # this one would fight it for the port; msrun only waits for it to exit, so exit cleanly
        raise SystemExit(0)
    launch = select_launch(target, env)
    if launch.world.size == 1:
        return World()
    from mindspore.communication import get_group_size, get_rank
    from mindspore.communication import init as comm_init

    # HCCL on Ascend (for msrun and the rank table alike), MindSpore's CPU collectives otherwise.
    comm_init("hccl" if target == "ascend" else None)
    # No set_auto_parallel_context: the gradient all-reduce is written by hand in step/step.py,
    # and DATA_PARALLEL mode with gradients_mean=False only configured MindSpore's own
    # (unused) gradient reducer; the call is deprecated in MindSpore 2.10.
    return World(rank=get_rank(), size=get_group_size())


# msrun's --cluster_time_out: how long the processes wait for every rank to join the cluster
# (mindspore/parallel/cluster/run.py: default 600 s). Passed explicitly so the wait does not hang
# on an msrun default: the ranks join at `init`, after start-up (imports, config, the data check
# from the manifest) and before building the model, which takes seconds; 1,200 s leaves room for a
# slow shared filesystem on an 8-rank node, and still ends a job whose peer never comes.
CLUSTER_TIMEOUT_S = 1200


def free_local_port() -> int:
    """A TCP port nothing on 127.0.0.1 listens on now, for an msrun scheduler started on this
    host, chosen outside the kernel's ephemeral range. A port found by binding port 0 and then
    released comes from that range, where any process may be given it (its own bind to port 0, an
    outgoing connection) in the seconds before msrun binds it. Below the range only an explicit
    choice takes a port; from 20000 up, above older Ray versions' default worker ports."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()  # not the run seed: two jobs at once must not pick alike
    for _ in range(200):
        port = pick.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken (hardly): the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(nproc: int, args: list[str], *, nodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", master_port: int = 8118, log_dir: str = "msrun_log",
                  script: str = "mspretrain", cluster_timeout: int = CLUSTER_TIMEOUT_S) -> str:
    """The msrun line for `nproc` workers per node (total nproc × nodes); msrun runs
    `python SCRIPT ARGS...` in each worker, so `script` is the mspretrain console script's path."""
    parts = ["msrun", f"--worker_num={nproc * nodes}", f"--local_worker_num={nproc}",
             f"--master_addr={master_addr}", f"--master_port={master_port}", f"--node_rank={node_rank}",
             f"--log_dir={log_dir}", "--join=True", f"--cluster_time_out={cluster_timeout}", script] + list(args)
    return " ".join(shlex.quote(p) for p in parts)
