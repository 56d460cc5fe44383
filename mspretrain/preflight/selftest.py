"""`mspretrain selftest`: the first command on a new node — a verdict in minutes, before a month of compute.

`run_selftest` runs every check in order and returns the JSON document (docs/operators.md,
"selftest"). The checks live by what they check:
- `preflight/selftest_numerics.py`: two numeric paths compared on this device (flash against math
  attention, each family's feature against the fp32 CPU path, fp16/bf16 steps against fp32);
- `preflight/selftest_moe.py`: the MoE layer on Ascend's fused permutation and grouped matmul
  against the fp32 CPU path;
- `preflight/selftest_node.py`: the node itself (NPUs, versions, doctor, HBM, collectives and a ZeRO-2
  step across its NPUs, the run dir's disk, one decoder layer timed for the plan);
- `preflight/selftest_result.py`: a check's result and the JSON read back (`plan --from-selftest`).
Nothing here writes outside a fresh `--run DIR/.selftest-XXXX/` (removed at the end; a run dir
the selftest created is removed too if it stays empty) and the JSON the user asks for.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import Config
from mspretrain.preflight.selftest_moe import NAME as MOE_KERNELS
from mspretrain.preflight.selftest_moe import check_moe_kernels
from mspretrain.preflight.selftest_node import (
    ZERO2,
    check_checkpoint,
    check_collectives,
    check_device_memory,
    check_devices,
    check_doctor,
    check_layer,
    check_versions,
    check_zero2,
    zero2_ranks,
)
from mspretrain.preflight.selftest_numerics import check_attention, check_feature, check_train_step, feature_seq, features
from mspretrain.preflight.selftest_result import (
    FAILED,
    PASSED,
    SKIPPED,
    Check,
    Context,
    failed,
    format_table,
    measured_tokens_per_s,
    read_selftest,
    timed,
)

# the selftest's JSON, read back by `plan --from-selftest` and printed by the command, from here too
__all__ = ["failed", "format_table", "measured_tokens_per_s", "read_selftest", "run_selftest"]


# --------------------------------------------------------------------------- running

def run_selftest(cfg: Config, run_dir: Path, *, target: str | None = None, quick: bool = False,
                 only: tuple[str, ...] = (), log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every check in order; returns the JSON document (see docs/operators.md, "selftest")."""
    from mspretrain.device import plan_device, resolve_target, setup_mindspore

    t_start = time.perf_counter()
    target = target or resolve_target(cfg.device.target)
    # a bf16 config on a CPU box is still worth checking: the bf16 checks say "needs Ascend"
    on_this_device = target if not (target == "cpu" and cfg.precision.dtype == "bf16") else None
    cfgmod.validate(cfg, device=on_this_device, budget=False)  # selftest trains a few fixed steps, not the config's budget
    # On Ascend the collectives check runs first, in msrun children, before this process binds an
    # NPU (setup_mindspore): a parent holding device 0 would collide with the rank that needs it.
    # The ZeRO-2 ranks run there too; their single-process reference is computed after setup.
    early: dict[str, Check] = {}
    ranks: dict[str, Any] | Check | None = None
    wanted = [name for name in ("collectives", ZERO2) if not only or name in only]
    if target == "ascend" and wanted:
        run_dir_ = Path(run_dir)
        run_dir_.mkdir(parents=True, exist_ok=True)
        pre = Context(cfg=cfg, target=target, work=Path(tempfile.mkdtemp(prefix=".selftest-", dir=run_dir_)), quick=quick)
        try:
            if "collectives" in wanted:
                early["collectives"] = timed("collectives", lambda: check_collectives(pre))
            if ZERO2 in wanted and early.get("collectives", Check("", PASSED, "")).status == FAILED:
                ranks = Check(ZERO2, SKIPPED, "the collectives check failed: a ZeRO-2 step needs them")
            elif ZERO2 in wanted:
                log(f"selftest: {ZERO2} (ranks) ...")
                ranks = zero2_ranks(pre)
        finally:
            shutil.rmtree(pre.work, ignore_errors=True)
    setup_mindspore(plan_device(cfg, target=target))
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".selftest-", dir=run_dir))  # never a name the user's files could have
    except OSError as exc:  # a read-only or full run dir: one line, not a traceback
        from mspretrain.outputs import os_error

        raise os_error(exc, f"the selftest's scratch files in {run_dir}",
                       "pass --run a directory you can write to (the checkpoint check measures its disk)") from None
    ctx = Context(cfg=cfg, target=target, work=work, quick=quick)
    if "collectives" in early:
        ctx.results["bus_gbps"] = early["collectives"].data.get("bus_gbps")
    ctx.vocab_note = "not in the config, Llama-2's 32000 assumed for FLOPs"
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("devices", lambda: check_devices(ctx)), ("versions", lambda: check_versions(ctx)),
        ("doctor", lambda: check_doctor(ctx)),
        ("flash attention fp16", lambda: check_attention(ctx, "fp16")),
        ("flash attention bf16", lambda: check_attention(ctx, "bf16")),
        (MOE_KERNELS, lambda: check_moe_kernels(ctx)),
        *((name, lambda name=name: check_feature(ctx, name)) for name in features(feature_seq(target))),
        ("train step fp16", lambda: check_train_step(ctx, "fp16")),
        ("train step bf16", lambda: check_train_step(ctx, "bf16")),
        ("device memory", lambda: check_device_memory(ctx)),
        ("collectives", lambda: check_collectives(ctx)), (ZERO2, lambda: check_zero2(ctx, ranks)),
        ("checkpoint", lambda: check_checkpoint(ctx)),
        ("decoder layer", lambda: check_layer(ctx)),
    ]
    checks = []
    try:
        for name, fn in steps:
            if only and name not in only:
                checks.append(Check(name, SKIPPED, "not selected (--only)"))
                continue
            log(f"selftest: {name} ...")
            check = early[name] if name in early else timed(name, fn)
            if name == "devices":
                ctx.results["npus"] = check.data.get("npus", 0)
                ctx.devices = max(1, check.data.get("npus", 0))
            checks.append(check)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(run_dir.iterdir()):
            run_dir.rmdir()
    import mindspore as ms

    doc = {"selftest_version": 1, "target": target, "mindspore": ms.__version__, "quick": quick,
           "devices": ctx.devices, "seconds": round(time.perf_counter() - t_start, 1),
           "checks": [c.as_dict() for c in checks],
           "tokens_per_s_per_device": ctx.results.get("tokens_per_s_per_device")}
    layer = next((c for c in checks if c.name == "decoder layer" and c.status == PASSED), None)
    if layer is not None:
        doc["config"] = {**layer.data["model"], "seq_len": layer.data["seq_len"], "dtype": layer.data["dtype"]}
    return doc

