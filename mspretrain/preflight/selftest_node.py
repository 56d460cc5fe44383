"""The selftest's checks of the node itself: its NPUs and versions, `doctor`'s environment
checks, each device's HBM, the collectives and a ZeRO-2 step across the node's NPUs (msrun
workers, run before the selftest process binds an NPU), the run dir's disk through a real
checkpoint, and one decoder layer of the config timed.

Measured numbers feed the plan: the decoder-layer timing gives tokens/s per device, written to
the JSON as `tokens_per_s_per_device`, which `mspretrain plan --from-selftest FILE` reads.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.preflight.selftest_result import FAILED, NEEDS_ASCEND, PASSED, SKIPPED, Check, Context

GB = 1e9
LLAMA_VOCAB = 32000  # used for FLOPs per token when neither the config nor --data gives a vocabulary


def check_devices(ctx: Context) -> Check:
    if ctx.target != "ascend":
        return Check("devices", NEEDS_ASCEND, f"no NPU visible; running on CPU ({os.cpu_count()} cores)",
                     data={"npus": 0, "cpu_cores": os.cpu_count()})
    from mindspore.device_context.ascend import device_count

    n = int(device_count())
    nodes = len([p for p in Path("/dev").glob("davinci[0-9]*")])
    # fewer than the device nodes is not an error: ASCEND_RT_VISIBLE_DEVICES may hide some on purpose
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    return Check("devices", PASSED if n >= 1 else FAILED,
                 f"{n} NPUs visible to MindSpore" + (f", {nodes} /dev/davinci* nodes" if nodes else "")
                 + (f", ASCEND_RT_VISIBLE_DEVICES={visible}" if visible else ""), data={"npus": n, "device_nodes": nodes})


def check_versions(ctx: Context) -> Check:
    import mindspore as ms

    from mspretrain import __version__
    from mspretrain.preflight.doctor import check_ascend

    cann = next((f.detail for f in check_ascend() if f.name == "CANN toolkit"), None)
    data = {"mindspore": ms.__version__, "mspretrain": __version__, "python": sys.version.split()[0], "cann": cann}
    ok = ms.__version__.startswith("2.10")
    return Check("versions", PASSED if ok else FAILED,
                 f"MindSpore {ms.__version__}, CANN {cann or 'not installed'}, Python {data['python']}"
                 + ("" if ok else " (mspretrain is built and tested against MindSpore 2.10)"), data=data)


def check_doctor(ctx: Context) -> Check:
    from mspretrain.preflight.doctor import run_checks

    findings = run_checks(ctx.work.parent, ctx.cfg)
    fails = [f for f in findings if f.status == "fail"]
    warns = [f for f in findings if f.status == "warn"]
    detail = (f"{len(findings)} environment checks: {len(fails)} failed, {len(warns)} warnings"
              + "".join(f"; FAIL {f.name}: {f.detail}" for f in fails) + "".join(f"; warn {f.name}" for f in warns))
    return Check("doctor", FAILED if fails else PASSED, detail,
                 data={"findings": [asdict(f) for f in findings]})


def check_collectives(ctx: Context) -> Check:
    name = "collectives"
    if ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "AllReduce/AllGather/Broadcast/ReduceScatter bandwidth is measured across the node's NPUs "
                                         "through msrun with HCCL; CPU data parallel is covered by tests/train/test_distributed.py")
    from mspretrain.preflight import collectives_worker

    n = ctx.results.get("npus", 0) or visible_npus()
    if n < 2:
        return Check(name, SKIPPED, f"{n} NPU visible: nothing to communicate with")
    out = ctx.work / "collectives"
    out.mkdir(parents=True, exist_ok=True)
    size_mb = 64 if ctx.quick else 256
    res = collectives_worker.launch(n, out, size_mb=size_mb, target="ascend")
    return _collectives_check(res, n, size_mb)


ZERO2 = "zero2 step"
# max |difference| of the ZeRO-2 ranks from one process (fp32 both): the same micro-batch gradients,
# summed across ranks instead of accumulated in one process, differ only in the order of fp32 sums.
# Measured on 2 CPU workers: losses 4.8e-7, grad norms 0, weights 5.4e-7. AdamW's first steps move
# each weight by ~lr = 1e-3, so a wrong gradient sum or a stale slice shows 100 x above these bounds.
ZERO2_TOLERANCE = {"losses": 1e-5, "grad_norms": 1e-4, "weights": 1e-5}


def zero2_ranks(ctx: Context, steps: list[str] | None = None) -> dict[str, Any] | Check:
    """The ZeRO-2 step on every NPU of the node (msrun workers), run before this process binds one
    (as the collectives), and on Ascend a tp and a ZeRO-3 step after it for the runtime order
    (`steps`, default preflight/exec_order.py `steps(target)`); a Check when it could not run."""
    from mspretrain.preflight import exec_order, zero2_worker

    steps = exec_order.steps(ctx.target) if steps is None else steps

    n = ctx.results.get("npus", 0) or visible_npus()
    if n < 2:
        return Check(ZERO2, SKIPPED, f"{n} NPU visible: no ranks to shard over")
    out = ctx.work / "zero2"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res = zero2_worker.launch(n, out, target=ctx.target, steps=steps)
    except UserError as exc:
        return Check(ZERO2, FAILED, f"{exc.cause} ({exc.fix})" if getattr(exc, "fix", None) else str(exc),
                     seconds=time.perf_counter() - t0)
    res["seconds"], res["steps"] = time.perf_counter() - t0, steps
    if exec_order.wanted(ctx.target):  # read now: the selftest removes this work dir before check_zero2
        res["exec_order"] = exec_order.verdict(exec_order.rank_folders(order_roots(ctx)))
    return res


def check_zero2(ctx: Context, ranks: dict[str, Any] | Check | None) -> Check:
    """The ranks' ZeRO-2 steps against the same steps on one process, computed here."""
    if isinstance(ranks, Check):
        return ranks
    if ranks is None:
        return Check(ZERO2, NEEDS_ASCEND, "a ZeRO-2 step (reduce-scatter, sharded AdamW, all-gather) on every NPU through msrun "
                                          "against one process; tested on 2 CPU processes in tests/preflight/test_selftest.py")
    from mspretrain.preflight import zero2_worker

    ref = zero2_worker.run_steps(ctx.target, 1, 0, zero2_worker.global_batches(ranks["devices"]))
    check = zero2_check(ranks, ref)
    from mspretrain.preflight import exec_order, selftest_order

    steps = ranks.get("steps", ["zero2"])
    others = selftest_order.problems(ranks["ranks"], steps)  # the tp and ZeRO-3 steps ran, finite
    if others:
        check.status = FAILED
        check.detail += "; " + "; ".join(others)
    elif len(steps) > 1 and ranks["ranks"]:
        recs = [r["order_steps"] for r in ranks["ranks"]]
        check.detail += "; " + ", ".join(
            f"{name} step: " + (f"loss {recs[0][name]['loss']:.4f}" if recs[0][name]["ran"] else f"not run ({recs[0][name]['why']})")
            for name in steps if name != "zero2")
    check.data["order_steps"] = steps
    if exec_order.wanted(ctx.target):  # the workers' runtime order over all their steps, checked by MindSpore (preflight/exec_order.py)
        ok, said = ranks.get("exec_order") or exec_order.verdict(exec_order.rank_folders(order_roots(ctx)))
        check.data["exec_order"] = {"passed": ok, "detail": said, "steps": steps}
        check.detail += f"; runtime order of the {' + '.join(steps)} steps: {said}"
        if ok is False:
            check.status = FAILED
    return check


def order_roots(ctx: Context) -> list[Path]:
    """Where the workers' rank_R/execute_order/comm_execute_order.csv are looked for: their working
    directory (the selftest's: msrun's workers inherit it), their output dir and the selftest's work
    dir (where 2.10 writes them is unverified: preflight/exec_order.py)."""
    return [Path.cwd(), ctx.work / "zero2", ctx.work]


def zero2_check(ranks: dict[str, Any], ref: dict[str, Any]) -> Check:
    """The comparison: every rank finite, with rank 0's losses, grad norms and weights within
    ZERO2_TOLERANCE of the single process, and every rank holding the same weights (digest)."""
    n, recs = ranks["devices"], ranks["ranks"]
    problems = []
    if len(recs) != n:
        problems.append(f"{len(recs)} of {n} ranks reported")
    if len({r["digest"] for r in recs}) > 1:
        odd = [r["rank"] for r in recs if r["digest"] != recs[0]["digest"]]
        problems.append(f"ranks {odd} hold other weights than rank 0 after the all-gather")
    if not all(all(r["finite"]) for r in recs) or not all(ref["finite"]):
        problems.append("a step overflowed (fp32: a collective returned garbage)")
    diffs = {"losses": float(np.abs(np.subtract(recs[0]["losses"], ref["losses"])).max()) if recs else float("nan"),
             "grad_norms": float(np.abs(np.subtract(recs[0]["grad_norms"], ref["grad_norms"])).max()) if recs else float("nan"),
             "weights": max(float(np.abs(ranks["weights"][k] - ref["weights"][k]).max()) for k in ref["weights"])}
    for k, d in diffs.items():
        if not d <= ZERO2_TOLERANCE[k]:
            problems.append(f"{k} differ from one process by {d:.3g} (tolerance {ZERO2_TOLERANCE[k]:g})")
    calls = ref.get("collectives", {})
    mine = recs[0].get("collectives", {}) if recs else {}
    from mspretrain.preflight.zero2_worker import STEPS

    detail = (f"{n} ranks, {STEPS} fp32 steps of a 2-layer model with 2 micro-batches a rank, "
              f"{mine.get('calls', '?')} collectives a step (split, single and bucketed parameters): losses "
              f"{' -> '.join(f'{x:.4f}' for x in ref['losses'])} as one process (max |diff| {diffs['losses']:.2g}), "
              f"weights max |diff| {diffs['weights']:.2g}, replicas identical")
    data = {"devices": n, "max_abs_diff": diffs, "tolerance": ZERO2_TOLERANCE, "losses": recs[0]["losses"] if recs else [],
            "reference_losses": ref["losses"], "collectives": mine, "reference_collectives": calls,
            "ranks_seconds": ranks.get("seconds")}
    return Check(ZERO2, FAILED if problems else PASSED, "; ".join(problems) if problems else detail, data=data)


def visible_npus(env: dict[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """NPUs this process may use, without asking the runtime (which would bind one): the
    ASCEND_RT_VISIBLE_DEVICES list when set, else the /dev/davinciN nodes."""
    env = os.environ if env is None else env
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if visible:
        return len([v for v in visible.split(",") if v.strip()])
    return len(list(dev.glob("davinci[0-9]*")))


def check_hbm(total_bytes: int, max_device_memory_gb: float) -> Check:
    """Each device's HBM against `device.max_device_memory` (the pool MindSpore may take): a 910B4
    has 32 GB, so the 910B templates' 58 GB would fail at the first large allocation. The rule is
    device.py's `pool_problem`, which `doctor` and `launch` apply before the pool is set."""
    from mspretrain.device import GIB, pool_fix, pool_problem

    total_gb = total_bytes / GIB
    if total_bytes <= 0:
        return Check("device memory", SKIPPED, "the runtime reported no HBM size")
    problem = pool_problem(total_bytes, max_device_memory_gb)
    detail = f"{total_gb:.1f} GB HBM per device, device.max_device_memory {max_device_memory_gb:g} GB"
    if problem:
        detail += f": larger than the device; {pool_fix(total_bytes)}"
    return Check("device memory", FAILED if problem else PASSED, detail,
                 data={"hbm_bytes": total_bytes, "max_device_memory_gb": max_device_memory_gb})


def check_device_memory(ctx: Context) -> Check:
    if ctx.target != "ascend":
        return Check("device memory", NEEDS_ASCEND, "HBM per device against device.max_device_memory")
    import mindspore as ms

    from mspretrain.device import plan_device

    # mindspore.hal.get_device_properties: the one 2.10 API that reports an NPU's HBM size (hal/device.py;
    # marked "will be deprecated", no successor named). It needs the device initialised: one op first.
    (ms.Tensor([1.0]) + 1).asnumpy()
    props = ms.hal.get_device_properties(0, "Ascend")
    return check_hbm(int(getattr(props, "total_memory", 0)), plan_device(ctx.cfg, target="ascend").max_device_memory_gb)


def _collectives_check(res: dict[str, Any], n: int, size_mb: int) -> Check:
    bad = [k for k, v in res["ops"].items() if not v["correct"]]
    detail = f"{n} devices, {size_mb} MB per op: " + ", ".join(
        f"{k} {v['bus_gbps']:.1f} GB/s bus" for k, v in res["ops"].items())
    if bad:
        detail += f"; WRONG RESULT from {', '.join(bad)}"
    return Check("collectives", FAILED if bad else PASSED, detail, data={"devices": n, "ops": res["ops"],
                                                                        "bus_gbps": _reduction_bus_gbps(res["ops"])})


def _reduction_bus_gbps(ops: dict[str, Any]) -> float | None:
    """The bus bandwidth of the gradient reduction's collectives (the slower of ReduceScatter and AllReduce)."""
    rates = [v["bus_gbps"] for k, v in ops.items() if k in ("ReduceScatter", "AllReduce") and v.get("bus_gbps")]
    return min(rates) if rates else None


def check_checkpoint(ctx: Context) -> Check:
    """Write, verify, cold-read and load a checkpoint on the run dir's disk; predict a 7B resume."""
    from safetensors.numpy import load_file

    from mspretrain.checkpoint import store
    from mspretrain.checkpoint.diskspeed import layout_7b, read_cold, verify_time
    from mspretrain.model.presets import preset

    total = (64 if ctx.quick else 512) * 2**20
    rng = np.random.default_rng(0)
    n_model = total // 3 // 4  # a third as weights, two thirds as optimizer state, as in a real checkpoint
    model = {"w": rng.standard_normal(n_model, dtype=np.float32)}
    optim = {"exp_avg.w": rng.standard_normal(n_model, dtype=np.float32),
             "exp_avg_sq.w": rng.standard_normal(n_model, dtype=np.float32)}
    ck = ctx.work / "checkpoints" / store.step_dir_name(1)
    t0 = time.perf_counter()
    store.write_checkpoint_dir(ck, step=1, model=model, optimizer=optim, train_state={"selftest": True},
                               data_state=None, config=ctx.cfg)
    t_write = time.perf_counter() - t0
    files = [ck / store.MODEL_FILE, ck / store.OPTIM_FILE]
    nbytes = sum(p.stat().st_size for p in files)
    problem = store.verify(ck)
    t0 = time.perf_counter()
    mode = ""
    for p in files:
        _, mode = read_cold(p)
    t_read = time.perf_counter() - t0
    loaded = {**load_file(str(files[0])), **load_file(str(files[1]))}
    same = all(np.array_equal(loaded[k], v) for k, v in {**model, **optim}.items())
    sha = _sha256_rate()
    write_bps, read_bps = nbytes / t_write, nbytes / t_read
    # a 7B checkpoint as this config would write it on one 8-device node (weights + optimizer state)
    cfg7 = replace(ctx.cfg, model=preset("llama2-7b"))
    layout = layout_7b(cfg7, ranks=8)
    ck_bytes, largest = sum(layout.values()), max(layout.values())
    own = [v for k, v in layout.items() if k != store.MODEL_FILE][0]
    cores = max(1, (os.cpu_count() or 8) // max(ctx.devices, 1))
    t_verify = verify_time(ck_bytes, largest, read_bps, read_bps, sha, sha * cores)
    t_load = (layout[store.MODEL_FILE] + own) / read_bps
    ok = problem is None and same
    detail = (f"{nbytes / 2**20:.0f} MB written (fsync + hash) at {write_bps / GB:.2f} GB/s, read cold ({mode}) at "
              f"{read_bps / GB:.2f} GB/s, verify {'ok' if problem is None else 'FAILED: ' + problem}, load "
              f"{'bit-identical' if same else 'DIFFERENT'}; predicted Llama-2-7B resume ({ck_bytes / 1e9:.0f} GB, {ctx.devices} "
              f"device(s), {cores} cores each for hashing): verify {t_verify:.0f} s + load {t_load:.0f} s = {(t_verify + t_load) / 60:.1f} min")
    return Check("checkpoint", PASSED if ok else FAILED, detail,
                 data={"bytes": nbytes, "write_gbps": write_bps / GB, "cold_read_gbps": read_bps / GB, "read_mode": mode,
                       "sha256_gbps": sha / GB, "resume_7b_s": t_verify + t_load, "resume_7b_bytes": ck_bytes})


def _sha256_rate(size: int = 64 << 20) -> float:
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return size / (time.perf_counter() - t0)


def layer_flops_per_token(m, seq: int) -> float:
    """Training FLOPs of one decoder layer per token, on monitor/mfu.py's accounting (PaLM appendix B)."""
    hd = m.head_size
    params = 2 * m.dim * m.n_heads * hd + 2 * m.dim * m.n_kv_heads * hd + 3 * m.dim * m.ffn_dim
    return 6.0 * params + 12.0 * m.n_heads * hd * seq


def check_layer(ctx: Context) -> Check:
    """One decoder layer of the chosen config, forward + backward, timed; tokens/s and MFU per device."""
    name = "decoder layer"
    dtype = ctx.cfg.precision.dtype
    if dtype == "bf16" and ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "the config computes in bf16, which has no CPU kernels")
    import mindspore as ms

    from mspretrain.device import select_attention
    from mspretrain.model.attention import rope_tables
    from mspretrain.model.block import Block
    from mspretrain.model.decoder import InitStreams
    from mspretrain.model.layers import COMPUTE_DTYPES, FLASH_MASK_SIZE, NEG
    from mspretrain.monitor.mfu import device_peak_tflops, flops_per_token

    m = ctx.cfg.model
    seq = ctx.cfg.data.seq_len
    micro = ctx.cfg.train.micro_batch or 1
    if ctx.quick and ctx.target != "ascend":
        seq = min(seq, 256)
    layer_cfg = cfgmod.resolve_model(replace(m, n_layers=1, max_seq_len=max(m.max_seq_len, seq), vocab_size=m.vocab_size or 1))
    use_flash = select_attention("auto", ctx.target, dtype, layer_cfg.head_size)
    compute = COMPUTE_DTYPES[dtype]
    block = Block(layer_cfg, InitStreams(0), compute, use_flash)
    if ctx.cfg.train.recompute:
        block.recompute()
    cos, sin = rope_tables(layer_cfg.head_size, seq, layer_cfg.rope_theta)
    cos_t, sin_t = (ms.Tensor(t[:, None, :]).astype(compute) for t in (cos, sin))  # (T, 1, hd), as the Attention applies it
    causal = np.triu(np.ones((seq, seq), np.float32), 1) * NEG
    bias = ms.Tensor(causal[None, None])
    discard = ms.Tensor(np.triu(np.ones((FLASH_MASK_SIZE,) * 2, np.uint8), 1)) if use_flash else None
    x = ms.Tensor(np.random.default_rng(1).standard_normal((micro, seq, layer_cfg.dim)).astype(np.float32)).astype(compute)
    params = block.trainable_params()

    def loss(x):
        return block(x, cos_t, sin_t, bias, discard).astype(ms.float32).sum()

    grad = ms.value_and_grad(loss, None, params)
    if ctx.cfg.train.mode == "jit":  # compiled at the config's device.jit_level, as training should be
        grad = ms.jit(grad, jit_level=ctx.cfg.device.jit_level)

    def once() -> None:
        _, grads = grad(x)
        grads[0].asnumpy()  # wait for the device

    once()  # compile
    reps = 2 if ctx.quick else 5
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    t_layer = float(np.median(times))
    tokens = micro * seq
    rate = layer_flops_per_token(layer_cfg, seq) * tokens / t_layer  # achieved FLOP/s on this layer
    vocab = m.vocab_size or LLAMA_VOCAB
    full = cfgmod.resolve_model(replace(m, vocab_size=vocab))
    tps = rate / flops_per_token(full, seq)  # whole model, assuming every matmul runs at this layer's rate
    peak = device_peak_tflops(ctx.target, dtype, ctx.cfg.device.peak_tflops) * 1e12
    mfu = min(1.0, rate / peak) if peak else None  # a low measured CPU peak: never above 100 % (monitor/mfu.py)
    ctx.results["tokens_per_s_per_device"] = tps
    data = {"dtype": dtype, "seq_len": seq, "micro_batch": micro, "layer_s": t_layer, "layer_tflops": rate / 1e12,
            "tokens_per_s_per_device": tps, "mfu": mfu, "flash_attention": use_flash,
            "model": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": layer_cfg.n_kv_heads,
                      "ffn_dim": layer_cfg.ffn_dim, "vocab_size": vocab}}
    detail = (f"{dtype}, {micro} x {seq} tokens, {'flash' if use_flash else 'math'} attention: {t_layer * 1e3:.1f} ms forward+backward "
              f"({rate / 1e12:.3g} TFLOPS) -> {tps:,.0f} tokens/s per device for all {m.n_layers} layers"
              + (f", MFU {mfu:.1%}" if mfu is not None else ", MFU unknown (set device.peak_tflops)")
              + (f" (vocabulary {vocab}: {ctx.vocab_note})" if not m.vocab_size else ""))
    detail += _plan_estimate(ctx, full, tps, data)
    return Check(name, PASSED, detail, data=data)


def _plan_estimate(ctx: Context, model, tps: float, data: dict[str, Any]) -> str:
    from mspretrain.preflight.plan import make_plan

    try:
        plan = make_plan(replace(ctx.cfg, model=model), devices=ctx.devices, tokens=None, data_dir=None,
                         tokens_per_s_per_device=tps, bus_gbps=ctx.results.get("bus_gbps"))
    except UserError as exc:
        return f"; no plan wall time ({exc.cause})"
    hours = (plan.get("time") or {}).get("hours")  # make_plan's wall time at the measured rate
    overlap = ""
    if "overlap" in plan:  # item 1's estimate, at the bus bandwidth the collectives check measured
        o = plan["overlap"]
        data["overlap"] = {k: o[k] for k in ("comm_s", "backward_s", "exposed_s", "bus_gbps")}
        overlap = (f"; overlap: reduction {o['comm_s'] * 1e3:,.0f} ms at {o['bus_gbps']:.0f} GB/s ({o['bus_source']}) vs backward "
                   f"{o['backward_s'] * 1e3:,.0f} ms, exposed {o['exposed_s'] * 1e3:,.0f} ms")
    if hours is None:
        return overlap
    data["plan_hours"] = hours
    when = f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"
    return f"; plan: {when} wall time on {ctx.devices} device(s) for the config's budget" + overlap

