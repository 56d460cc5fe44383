"""The selftest's collectives: one msrun worker per device times the collectives the trainer uses.

`launch()` runs this file under msrun (`python collectives_worker.py OUT SIZE_MB TARGET` in each
worker); every rank initialises communication like the trainer (parallel/distributed.py: HCCL on
Ascend, MindSpore's CPU collectives otherwise), checks each op's result against its definition
and times it; rank 0 writes OUT/result.json. Bus bandwidth follows nccl-tests' convention so the
numbers compare with published ones: algbw = bytes / time, busbw = algbw x 2(n-1)/n for
AllReduce, x (n-1)/n for AllGather and ReduceScatter (bytes = the full gathered tensor), x 1
for Broadcast. ReduceScatter runs on Ascend only (the trainer does not use it on CPU, where
MindSpore's CPU backend has no kernel for it).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mspretrain.errors import UserError


def launch(n: int, out: Path, *, size_mb: int, target: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run `n` workers through msrun on this node; rank 0's result."""
    run_workers(n, out, [str(out), str(size_mb), target], script=__file__, timeout_s=timeout_s,
                what="the collectives")
    return json.loads((out / "result.json").read_text())


def run_workers(n: int, out: Path, args: list[str], *, script: str, timeout_s: float, what: str) -> None:
    """`python SCRIPT ARGS...` in `n` msrun workers on this node (logs in OUT/logs); returns when
    all have exited 0 and OUT/result.json exists, else one-line UserError naming the worker logs."""
    from mspretrain.parallel.distributed import free_local_port, msrun_command

    bin_dir = Path(sys.executable).parent
    search = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    msrun = shutil.which("msrun", path=search)
    if msrun is None:
        raise UserError("msrun is not installed next to this Python", "install MindSpore >= 2.3 in this environment (msrun ships with it)")
    logs = out / "logs"
    line = msrun_command(n, args, master_port=free_local_port(), log_dir=str(logs), script=script)
    env = {**os.environ, "PATH": search, "GLOG_v": os.environ.get("GLOG_v", "3")}
    try:
        proc = subprocess.run([msrun, *shlex.split(line)[1:]], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} did not finish in {timeout_s:.0f} s", f"read {logs}/worker_*.log (HCCL timeouts show there)") from None
    if proc.returncode != 0 or not (out / "result.json").is_file():
        tail = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("worker_*.log")))[-400:].strip().splitlines()
        raise UserError(f"msrun exited {proc.returncode}: {tail[-1] if tail else 'no worker log'}", f"read {logs}/worker_*.log")


def bus_factor(op: str, n: int) -> float:
    return {"AllReduce": 2 * (n - 1) / n, "AllGather": (n - 1) / n, "ReduceScatter": (n - 1) / n, "Broadcast": 1.0}[op]


def _compiled(op: Any, *, broadcast: bool) -> Any:
    """The op as one compiled graph, as the trainer runs its collectives (inside ms.jit)."""
    import mindspore as ms

    if broadcast:  # Broadcast takes and returns a tuple of tensors
        def run(t):
            return op((t,))[0]
    else:
        def run(t):
            return op(t)
    return ms.jit(run)


def main(argv: list[str]) -> int:
    out, size_mb, target = Path(argv[0]), int(argv[1]), argv[2]
    import mindspore as ms
    import numpy as np
    from mindspore import ops

    from mspretrain.device import DeviceInfo, setup_mindspore
    from mspretrain.fsutil import atomic_write
    from mspretrain.parallel import distributed

    setup_mindspore(DeviceInfo(target=target, threads=max(1, (os.cpu_count() or 2) // 2), flash_attention=False))
    world = distributed.init(target)
    n, rank = world.size, world.rank
    dtype = np.float16 if target == "ascend" else np.float32
    count = size_mb * 2**20 // np.dtype(dtype).itemsize
    count -= count % n
    mine = np.full(count, rank + 1, dtype)
    ops_under_test: dict[str, tuple[Any, np.ndarray, int]] = {
        # op, expected result on every rank, bytes that count for bandwidth
        "AllReduce": (ops.AllReduce(ops.ReduceOp.SUM), np.full(count, n * (n + 1) / 2, dtype), count),
        "AllGather": (ops.AllGather(), np.repeat(np.arange(1, n + 1, dtype=dtype), count), count * n),
        "Broadcast": (ops.Broadcast(0), np.full(count, 1, dtype), count),
    }
    if target == "ascend":
        ops_under_test["ReduceScatter"] = (ops.ReduceScatter(ops.ReduceOp.SUM), np.full(count // n, n * (n + 1) / 2, dtype), count)
    results = {}
    x = ms.Tensor(mine)
    for name, (op, expected, nbytes_items) in ops_under_test.items():
        fn = _compiled(op, broadcast=name == "Broadcast")
        got = fn(x).asnumpy()  # compile + first run, also the correctness check
        correct = bool(got.shape == expected.shape and np.array_equal(got.astype(np.float64), expected.astype(np.float64)))
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            y = fn(x)
        y.asnumpy()
        dt = (time.perf_counter() - t0) / reps
        algbw = nbytes_items * np.dtype(dtype).itemsize / dt / 1e9
        results[name] = {"correct": correct, "seconds": dt, "alg_gbps": algbw, "bus_gbps": algbw * bus_factor(name, n)}
    if rank == 0:
        doc = {"devices": n, "dtype": np.dtype(dtype).name, "size_mb": size_mb, "ops": results}
        atomic_write(out / "result.json", json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # msrun runs this file by path
    sys.exit(main(sys.argv[1:]))
