"""ZeRO-3 steps of the Qwen2 (q/k/v bias) and Qwen3 (QK-norm) tiny models, and ZeRO-2 steps of a
one-layer Qwen3-MoE, run by tests/step/test_zero3.py in 2 msrun workers (`run_workers`, as the
selftest runs its ZeRO-2 worker) and, for the reference, in the test process itself at world 1
(`run_steps`).

Each family trains STEPS steps (fp32) on the same global batches: at world 2 fused steps, each rank
on its half of the rows; at world 1 the same two halves as two micro-batches of one step (each
half's gradients summed with the other's once, as the two ranks' AllReduce sums them). The MoE's
balance loss is formed per micro-batch of the whole world (step/objective.py), so its reference
runs the whole batch as one micro-batch. The MoE runs ZeRO-2 with tiny buckets and split size, so
its 3-D expert stacks are cut into a slice per rank (parallel/layout.py), with the load-balancing
loss and the aux-loss-free routing bias (moved by the world's counts) on.
Every rank writes OUT/rank_R.json (its losses and grad norms),
rank 0 also each family's whole weights (gathered, step/zero3.py `full_state`) to OUT/FAMILY.npz
and OUT/result.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 96  # optimizer steps; rows of a global batch; tokens a row; vocabulary
LR = 1e-2  # large enough that the zero-initialised q/k/v bias and the unit QK-norm weights move visibly
FAMILIES = {"qwen2": {"family": "qwen2", "qkv_bias": True}, "qwen3": {"family": "qwen3", "qk_norm": True, "head_dim": 16},
            "qwen3_moe": {"family": "qwen3_moe", "qk_norm": True, "head_dim": 16, "n_layers": 1, "num_experts": 4,
                          "experts_per_token": 2, "moe_ffn_dim": 32, "router_aux_loss_coef": 0.01,
                          "router_bias_update_rate": 1e-2}}
MOE = {**FAMILIES["qwen3_moe"], "router_bias_update_rate": 0.0}  # the bias is refused with expert parallel
FAMILIES["qwen3_moe_ep"] = MOE  # expert parallel over the 2 ranks (one expert-data-parallel rank each) with ZeRO-2


def model_config(family: str):
    from mspretrain.config import schema as cfgmod

    kw = {"n_layers": 2, **FAMILIES[family]}
    return cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, **kw))


def run_steps(family: str, world: int, rank: int) -> dict[str, Any]:
    """STEPS fp32 steps on this rank's rows of each global batch (world 1 or 2); ZeRO-3 (the MoE:
    ZeRO-2; "qwen3_moe_ep": ZeRO-2 and expert parallel) when world > 1."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder
    from mspretrain.parallel.plan import ParallelPlan
    from mspretrain.step.step import TrainStep

    tokens = np.random.default_rng(1).integers(0, VOCAB, (STEPS, ROWS, SEQ + 1)).astype(np.int32)
    model = Decoder(model_config(family), dtype="fp32", seed=0)
    half = ROWS // 2
    moe, ep = "num_experts" in FAMILIES[family], family.endswith("_ep")
    zero = {"shard_grads": world > 1, "bucket_mb": 0.02, "split_mb": 0.01} if moe else {"shard_params": world > 1}
    kind, where = TrainStep, {}
    if ep and world > 1:
        from mspretrain.step.ep import EPTrainStep, expert_mesh

        plan = ParallelPlan(world=world, rank=rank, ep=world, zero=2)
        mesh = expert_mesh(plan, "cpu")
        model.apply_ep(mesh.ep)
        kind, where = EPTrainStep, {"mesh": mesh, "plan": plan}
    step = kind(model, cfgmod.OptimConfig(lr=LR), global_tokens=ROWS * SEQ, world=world, rank=rank,
                device="cpu", accumulation=1 if moe else 2 // world, **zero, **where)
    mine = [rank] if world == 2 else [0, 1]  # the halves of the rows this process runs
    losses, norms = [], []
    for s in range(STEPS):
        if moe and world == 1:  # the world's micro-batch: both halves at once
            batches = [(tokens[s], None, None)]
        else:
            batches = [(tokens[s, k * half:(k + 1) * half], None, None) for k in mine]
        res = step.run(batches, LR, 1.0)
        losses.append(res.loss)
        norms.append(res.grad_norm)
    split = [n for i, n in enumerate(step.names) if step.layout.is_split(i)]  # cut into a slice per rank
    return {"losses": losses, "grad_norms": norms, "split": split, "weights": step.full_weights()}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    from mspretrain.device import DeviceInfo, setup_mindspore
    from mspretrain.fsutil import atomic_write
    from mspretrain.parallel import distributed

    setup_mindspore(DeviceInfo(target="cpu", threads=1, flash_attention=False))
    world = distributed.init("cpu")
    record: dict[str, Any] = {"rank": world.rank}
    for family in FAMILIES:
        res = run_steps(family, world.size, world.rank)
        weights = res.pop("weights")  # every rank gathers (a collective); rank 0 keeps them
        record[family] = res
        if world.rank == 0:
            np.savez(out / f"{family}.npz", **weights)
    atomic_write(out / f"rank_{world.rank}.json", json.dumps(record))
    if world.rank == 0:
        atomic_write(out / "result.json", json.dumps({"devices": world.size}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # msrun runs this file by path
    os.environ.setdefault("GLOG_v", "3")
    sys.exit(main(sys.argv[1:]))
