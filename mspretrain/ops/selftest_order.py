"""The steps the selftest's msrun workers run inside MindSpore's runtime-order collection (issue
51.7): the ZeRO-2 step the selftest compares with one process (ops/zero2_worker.py), then one step
of the same tiny model under tensor parallel and one under ZeRO-3, built as `train` builds them
(train/tp.py, train/zero3.py through TrainStep). Each layout issues its own collectives on its own
groups (tp 2 x dp world/2: `tp_<g>` / `dp_<g>` sub-groups from world 4 on; ZeRO-3's gathers and
backward reduce-scatters), and 2.10 gives each group its own stream, so the backend's kernel
order, not the IR listing, is what HCCL pairs. Which steps are wrapped is chosen by device
(ops/exec_order.py `steps`): on CPU only the ZeRO-2 step runs (its comparison), and no collection.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mspretrain.ops import exec_order

TP = 2  # the tp step's tensor-parallel size (the tiny model's 4 heads / 2 kv heads cut in two)


def _tiny(target: str):
    from mspretrain.model.decoder import Decoder
    from mspretrain.ops.zero2_worker import model_config

    # drawn on the host, only this rank's pieces sent to the device, as `train` does for a cut model
    # (train/build.py `builds_on_host`)
    return Decoder(model_config(), dtype="fp32", device=target, seed=0, host_weights=True)


def _one_step(step: Any, batches: np.ndarray, dp_size: int, dp_rank: int) -> dict[str, Any]:
    from mspretrain.ops.zero2_worker import LR

    n_micro = batches.shape[1] // dp_size
    mine = batches[0, dp_rank * n_micro:(dp_rank + 1) * n_micro]  # the first step's batch of this dp rank
    res = step.run([(t, None, None) for t in mine], LR, 1.0)  # fp32: no loss scale
    return {"ran": True, "loss": float(res.loss), "finite": bool(res.finite)}


def tp_step(target: str, world: int, rank: int, batches: np.ndarray) -> dict[str, Any]:
    """One step under tensor parallel: `make_mesh` (tp 2 x dp world/2), `split_model`, TPTrainStep
    with ZeRO-2 over the dp group (its sub-group reduce-scatters and broadcasts). An odd world has
    no tp 2 layout: not run, and said."""
    if world % TP:
        return {"ran": False, "why": f"{world} ranks are not a multiple of tp {TP}"}
    from mspretrain import config as cfgmod
    from mspretrain.model.parallel import split_model
    from mspretrain.ops.zero2_worker import BUCKET_MB, LR, ROWS, SEQ
    from mspretrain.train.tp import TPTrainStep, make_mesh

    mesh = make_mesh(rank, world, TP, target)
    model = _tiny(target)
    split_model(model, mesh.tp)
    sharded = mesh.dp.size > 1
    step = TPTrainStep(model, cfgmod.OptimConfig(lr=LR), mesh=mesh, global_tokens=batches.shape[1] * ROWS * SEQ,
                       shard=sharded, shard_grads=sharded, bucket_mb=BUCKET_MB, device=target)
    return {**_one_step(step, batches, mesh.dp.size, mesh.dp.rank), "tp": TP, "dp": mesh.dp.size}


def zero3_step(target: str, world: int, rank: int, batches: np.ndarray) -> dict[str, Any]:
    """One ZeRO-3 step: TrainStep's `shard_params` (train/zero3.py: every trained weight a slice
    per rank, gathered where it is used, its gradient reduce-scattered in the backward)."""
    from mspretrain import config as cfgmod
    from mspretrain.ops.zero2_worker import BUCKET_MB, LR, ROWS, SEQ
    from mspretrain.train.step import TrainStep

    step = TrainStep(_tiny(target), cfgmod.OptimConfig(lr=LR), global_tokens=batches.shape[1] * ROWS * SEQ, world=world,
                     rank=rank, shard=True, shard_grads=True, shard_params=True, bucket_mb=BUCKET_MB, device=target)
    return _one_step(step, batches, world, rank)


def run(target: str, world: int, rank: int, batches: np.ndarray, steps: list[str],
        builders: dict[str, Callable[[], dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Each of `steps` (names from exec_order.STEPS, in that order) inside one collection
    (exec_order.collect: MindSpore's comm_exec_order_check on Ascend only). One window around all
    of them: 2.10's CommExecOrderCheck refuses a second "start" before "end"
    (mindspore/utils/runtime_execution_order_check.py, `start_function`), so each rank's file holds
    the three steps' collectives in the order they ran. `builders` replaces the steps (a test)."""
    from mspretrain.ops.zero2_worker import run_steps

    todo = builders or {"zero2": lambda: run_steps(target, world, rank, batches),
                        "tp": lambda: tp_step(target, world, rank, batches),
                        "zero3": lambda: zero3_step(target, world, rank, batches)}
    done: dict[str, Any] = {}
    exec_order.collect(target, "start")
    try:
        for name in steps:
            done[name] = todo[name]()
    finally:
        exec_order.collect(target, "end")
    return done


def problems(ranks: list[dict[str, Any]], steps: list[str]) -> list[str]:
    """What the tp and ZeRO-3 steps' records show wrong: a rank that did not run a wanted step, or
    whose step overflowed (fp32: a collective returned garbage)."""
    out = []
    for name in steps:
        if name == "zero2":  # compared with one process by selftest_node.zero2_check
            continue
        recs = [r.get("order_steps", {}).get(name) for r in ranks]
        if any(r is None for r in recs):
            out.append(f"the {name} step: {sum(r is None for r in recs)} of {len(recs)} ranks reported none")
        elif any(r["ran"] and not r["finite"] for r in recs):
            out.append(f"the {name} step overflowed on ranks {[i for i, r in enumerate(recs) if r['ran'] and not r['finite']]}")
    return out
