"""The steps the selftest's msrun workers run inside MindSpore's runtime-order collection (issue
51.7): the ZeRO-2 step the selftest compares with one process (preflight/zero2_worker.py), then one step
of the same tiny model under tensor parallel and one under ZeRO-3, built as `train` builds them
(step/tp.py, step/zero3.py through TrainStep). Each layout issues its own collectives on its own
groups (tp 2 x dp world/2: `tp_<g>` / `dp_<g>` sub-groups from world 4 on; ZeRO-3's gathers and
backward reduce-scatters), and 2.10 gives each group its own stream, so the backend's kernel
order, not the IR listing, is what HCCL pairs. Which steps are wrapped is chosen by device
(preflight/exec_order.py `steps`): on CPU only the ZeRO-2 step runs (its comparison), and no collection.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from mspretrain.preflight import exec_order

TP = 2  # the tp step's tensor-parallel size (the tiny model's 4 heads / 2 kv heads cut in two)


class Tiny(NamedTuple):
    """The ZeRO-2 step's model and settings (preflight/zero2_worker.py), which the tp and ZeRO-3 steps reuse."""
    model: Any  # a resolved ModelConfig
    lr: float
    bucket_mb: float
    global_tokens: int


def _decoder(target: str, tiny: Tiny):
    from mspretrain.model.decoder import Decoder

    # drawn on the host, only this rank's pieces sent to the device, as `train` does for a cut model
    # (train/build.py `builds_on_host`)
    return Decoder(tiny.model, dtype="fp32", device=target, seed=0, host_weights=True)


def _one_step(step: Any, batches: np.ndarray, dp_size: int, dp_rank: int, lr: float) -> dict[str, Any]:
    n_micro = batches.shape[1] // dp_size
    mine = batches[0, dp_rank * n_micro:(dp_rank + 1) * n_micro]  # the first step's batch of this dp rank
    res = step.run([(t, None, None) for t in mine], lr, 1.0)  # fp32: no loss scale
    return {"ran": True, "loss": float(res.loss), "finite": bool(res.finite)}


def tp_step(target: str, world: int, rank: int, batches: np.ndarray, tiny: Tiny) -> dict[str, Any]:
    """One step under tensor parallel: `make_mesh` (tp 2 x dp world/2), `split_model`, TPTrainStep
    with ZeRO-2 over the dp group (its sub-group reduce-scatters and broadcasts). An odd world has
    no tp 2 layout: not run, and said."""
    if world % TP:
        return {"ran": False, "why": f"{world} ranks are not a multiple of tp {TP}"}
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.parallel import split_model
    from mspretrain.step.tp import TPTrainStep, make_mesh

    mesh = make_mesh(rank, world, TP, target)
    model = _decoder(target, tiny)
    split_model(model, mesh.tp)
    sharded = mesh.dp.size > 1
    step = TPTrainStep(model, cfgmod.OptimConfig(lr=tiny.lr), mesh=mesh, global_tokens=tiny.global_tokens,
                       shard=sharded, shard_grads=sharded, bucket_mb=tiny.bucket_mb, device=target)
    return {**_one_step(step, batches, mesh.dp.size, mesh.dp.rank, tiny.lr), "tp": TP, "dp": mesh.dp.size}


def zero3_step(target: str, world: int, rank: int, batches: np.ndarray, tiny: Tiny) -> dict[str, Any]:
    """One ZeRO-3 step: TrainStep's `shard_params` (step/zero3.py: every trained weight a slice
    per rank, gathered where it is used, its gradient reduce-scattered in the backward)."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.step.step import TrainStep

    step = TrainStep(_decoder(target, tiny), cfgmod.OptimConfig(lr=tiny.lr), global_tokens=tiny.global_tokens, world=world,
                     rank=rank, shard=True, shard_grads=True, shard_params=True, bucket_mb=tiny.bucket_mb, device=target)
    return _one_step(step, batches, world, rank, tiny.lr)


def run(steps: list[str], target: str, builders: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    """Each of `steps` (names from exec_order.STEPS, in that order) inside one collection
    (exec_order.collect: MindSpore's comm_exec_order_check on Ascend only). One window around all
    of them: 2.10's CommExecOrderCheck refuses a second "start" before "end"
    (mindspore/utils/runtime_execution_order_check.py, `start_function`), so each rank's file holds
    the three steps' collectives in the order they ran. `builders`: each step by name (`builders_for`)."""
    done: dict[str, Any] = {}
    exec_order.collect(target, "start")
    try:
        for name in steps:
            done[name] = builders[name]()
    finally:
        exec_order.collect(target, "end")
    return done


def builders_for(target: str, world: int, rank: int, batches: np.ndarray, tiny: Tiny,
                 zero2: Callable[[], dict[str, Any]]) -> dict[str, Callable[[], dict[str, Any]]]:
    """The three steps by name: the worker's ZeRO-2 step (`zero2`), then tp and ZeRO-3 on `tiny`."""
    return {"zero2": zero2, "tp": lambda: tp_step(target, world, rank, batches, tiny),
            "zero3": lambda: zero3_step(target, world, rank, batches, tiny)}


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
