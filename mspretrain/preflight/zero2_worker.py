"""The selftest's multi-rank ZeRO-2 step: every rank of the node trains the same tiny model with
sharded optimizer state and gradients (`optim.shard_optimizer` + `optim.shard_gradients`, the
trainer's TrainStep), and the selftest compares the result with one process that ran the whole
global batch (`run_steps(world=1)`, computed by the selftest itself).

`launch()` runs this file under msrun (`python zero2_worker.py OUT TARGET STEPS` in each worker), as the
collectives worker is run; each rank writes OUT/rank_R.json (its losses, grad norms and a digest of
its weights: the AllGathers must leave identical replicas), rank 0 also its weights (OUT/weights.npz)
and OUT/result.json. The tables are chosen so that one step crosses ranks in every way the trainer
has (parallel/layout.py): parameters split into a slice per rank (embedding, lm_head, w13: at least
SPLIT_MB), parameters too large for a bucket with their own collective (wqkv, w2), and buckets of
several parameters (the norms, wo); two micro-batches a rank, so the compiled `accumulate` graph
reduce-scatters each micro-batch and `apply` updates and gathers (both graphs of the step).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

STEPS, MICRO, ROWS, SEQ = 2, 2, 2, 32  # optimizer steps; micro-batches per rank; rows x tokens each
LR = 1e-3
# A 0.02 MB bucket cap (5,242 elements) and a 0.05 MB split threshold (13,107 elements) on the model
# below: embedding / lm_head (16,384) and w13 (24,576) are split, wqkv (8,192) and w2 (12,288) stand
# alone, wo (4,096) and the norms share buckets.
BUCKET_MB, SPLIT_MB = 0.02, 0.05


def model_config():
    from mspretrain.config import schema as cfgmod

    return cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=SEQ))


def global_batches(world: int) -> np.ndarray:
    """Tokens (STEPS, world x MICRO, ROWS, SEQ + 1): rank r's micro-batches of a step are r*MICRO ... r*MICRO+MICRO-1."""
    return np.random.default_rng(0).integers(0, 256, (STEPS, world * MICRO, ROWS, SEQ + 1)).astype(np.int32)


def digest(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name], np.float32).tobytes())
    return h.hexdigest()


def run_steps(target: str, world: int, rank: int, batches: np.ndarray) -> dict[str, Any]:
    """STEPS fp32 steps of the tiny model on this rank's share of `batches` (all of it at world 1,
    accumulated in the same micro-batch order). ZeRO-2 when world > 1, as train builds it."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.step.step import TrainStep

    model = Decoder(model_config(), dtype="fp32", device=target, seed=0)
    n_micro = batches.shape[1] // world
    step = TrainStep(model, cfgmod.OptimConfig(lr=LR), global_tokens=batches.shape[1] * ROWS * SEQ, world=world, rank=rank,
                     shard=world > 1, shard_grads=world > 1, bucket_mb=BUCKET_MB, split_mb=SPLIT_MB, device=target,
                     accumulation=n_micro)
    losses, norms, finite = [], [], []
    for s in range(STEPS):
        mine = batches[s, rank * n_micro:(rank + 1) * n_micro]
        res = step.run([(t, None, None) for t in mine], LR, 1.0)  # fp32: no loss scale
        losses.append(res.loss)
        norms.append(res.grad_norm)
        finite.append(res.finite)
    weights = {k: v.copy() for k, v in state_numpy(model).items()}
    return {"losses": losses, "grad_norms": norms, "finite": finite, "digest": digest(weights), "weights": weights,
            "collectives": step.collectives(n_micro)}


def launch(n: int, out: Path, *, target: str, steps: list[str] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the steps (preflight/selftest_order.py; default by device) on `n` msrun workers; every rank's record, and rank 0's weights."""
    from mspretrain.preflight import exec_order
    from mspretrain.preflight.collectives_worker import run_workers

    run_workers(n, out, [str(out), target, ",".join(steps or exec_order.steps(target))], script=__file__, timeout_s=timeout_s, what="the ZeRO-2 step")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))]
    with np.load(out / "weights.npz") as z:
        weights = {k: z[k] for k in z.files}
    return {"devices": n, "ranks": ranks, "weights": weights}


def main(argv: list[str]) -> int:
    out, target = Path(argv[0]), argv[1]
    from mspretrain.device import DeviceInfo, setup_mindspore
    from mspretrain.fsutil import atomic_write
    from mspretrain.parallel import distributed

    setup_mindspore(DeviceInfo(target=target, threads=max(1, (os.cpu_count() or 2) // 2), flash_attention=False))
    world = distributed.init(target)
    from mspretrain.preflight import selftest_order

    # the ZeRO-2 step, and on Ascend a tp and a ZeRO-3 step, inside MindSpore's runtime-order collection
    batches = global_batches(world.size)
    tiny = selftest_order.Tiny(model_config(), LR, BUCKET_MB, batches.shape[1] * ROWS * SEQ)
    done = selftest_order.run(argv[2].split(","), target, selftest_order.builders_for(
        target, world.size, world.rank, batches, tiny, lambda: run_steps(target, world.size, world.rank, batches)))
    res = done.pop("zero2")
    weights = res.pop("weights")
    record = {"rank": world.rank, **res, "order_steps": done}
    atomic_write(out / f"rank_{world.rank}.json", json.dumps(record))
    if world.rank == 0:
        tmp = out / "weights.tmp.npz"
        np.savez(tmp, **weights)
        os.replace(tmp, out / "weights.npz")
        atomic_write(out / "result.json", json.dumps({"devices": world.size}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # msrun runs this file by path
    sys.exit(main(sys.argv[1:]))
