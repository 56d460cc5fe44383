"""Plan a run before launch: parameters, memory per device, steps, warm-up, lr, wall time and cost."""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from mspretrain.commands.common import add_config_argument, load_config
from mspretrain.config.schema import Config

EXAMPLES = """examples:
  mspretrain plan --config configs/tiny.toml --data data/
  mspretrain plan --model llama2-7b --devices 8 --tokens 120e9 data.seq_len=4096 train.global_batch=512 precision.dtype=bf16
  mspretrain plan --config configs/llama2-7b.toml --devices 8 --tokens 2e12 --tokens-per-s 4100 --recompute --json
  mspretrain plan --config configs/llama2-7b-910b.toml --devices 8 --from-selftest selftest.json"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--model", metavar="PRESET", help="a model preset (e.g. llama2-7b) instead of the config's model section")
    p.add_argument("--devices", type=int, default=1, help="number of devices (data parallel)")
    p.add_argument("--tokens", type=float, help="token budget, e.g. 120e9 (default: the config's train.max_steps / "
                                                "max_tokens as `train` runs them, else one pass over --data)")
    p.add_argument("--data", metavar="DIR", help="data dir: its vocabulary, and its measured tokens for the auto warm-up "
                                                 "(and the budget when neither --tokens nor the config sets one)")
    p.add_argument("--tokens-per-s", type=float, metavar="X", help="tokens/s per device (measured or given) for time and cost")
    p.add_argument("--from-run", metavar="RUN_DIR", help="take tokens/s per device from a run's metrics.jsonl (median)")
    p.add_argument("--from-selftest", metavar="FILE", help="take tokens/s per device from `mspretrain selftest --json` (its decoder-layer timing)")
    p.add_argument("--bus-gbps", type=float, metavar="X", help="HCCL bus bandwidth in GB/s for the overlap estimate "
                                                             "(default: an assumed 100; `selftest` measures it)")
    p.add_argument("--device-mem-gb", type=float, help="usable device memory in GB (default: device.max_device_memory, "
                                                       "else 58 on Ascend 910B, else 64); wins over the config")
    p.add_argument("--zero", action="store_true", help="optimizer-state sharding across devices (as optim.shard_optimizer=true)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation (as train.recompute=true)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _measured_tokens_per_s(run_dir: Path) -> float | None:
    from mspretrain.forensics.report_summary import read_metrics, series
    from mspretrain.paths import RunPaths

    paths = RunPaths(run_dir)
    records, _ = read_metrics(paths.metrics)
    tps = series(records, "tokens_per_s")[1]
    meta = paths.meta
    from mspretrain.fsutil import read_json_file

    world = read_json_file(meta, "run_meta.json").get("world_size", 1) if meta.exists() else 1
    if not isinstance(world, int) or not 1 <= world <= 1 << 20:
        world = 1
    return statistics.median(tps) / world if tps else None


def _reapply_model_overrides(cfg: Config, args: argparse.Namespace) -> Config:
    """Re-apply model.* overrides on top of a preset so `--model llama2-7b model.n_layers=2` works."""
    from mspretrain.config.schema import apply_overrides

    return apply_overrides(cfg, [o for o in getattr(args, "overrides", ()) if o.startswith("model.")])


# the longest training window a preset alone is planned with: its context when shorter (a 40,960-token
# window is a long-context phase, not the pretraining shape the question is about)
PRESET_SEQ_CAP = 4096


def _preset_shape(cfg: Config, args: argparse.Namespace, fits: Callable[[Config], bool], *, ascend: bool) -> tuple[Config, list[str]]:
    """`--model` without `--config`: the defaults' batch shape (seq 64, batch 8, fp32) is the tiny
    model's. Plan a shape a run of the preset would use, and say what was assumed: bf16 when the plan
    is for Ascend; a global batch the data-parallel ranks divide (the default 8 is refused on 16);
    the longest window up to PRESET_SEQ_CAP within the preset's context that `fits` (the plan's
    headline or a layout of its table fits), halving it down to 128, else the shortest."""
    given = {o.split("=", 1)[0] for o in getattr(args, "overrides", ()) or ()}
    assumed = []
    if ascend and "precision.dtype" not in given and cfg.precision.dtype == "fp32":
        cfg = replace(cfg, precision=replace(cfg.precision, dtype="bf16"))
        assumed.append("precision.dtype bf16 (Ascend's)")
    dp = max(1, args.devices // cfg.parallel.tp)
    gb = cfg.train.global_batch
    if "train.global_batch" not in given:
        if gb % dp:
            gb = dp * -(-gb // dp)
            cfg = replace(cfg, train=replace(cfg.train, global_batch=gb))
            assumed.append(f"train.global_batch {gb} (a multiple of the {dp} data-parallel ranks)")
        else:
            assumed.append(f"train.global_batch {gb} (the default)")
    if "data.seq_len" not in given:
        top = min(cfg.model.max_seq_len, PRESET_SEQ_CAP)
        seqs = [top] + [s for s in (2048, 1024, 512, 256, 128) if s < top]
        for seq in seqs:
            trial = replace(cfg, data=replace(cfg.data, seq_len=seq))
            ok = fits(trial)
            if ok:
                break
        cfg = trial
        context = cfg.model.max_seq_len
        why = ("the preset's max_seq_len" if seq == context else f"the preset's max_seq_len {context:,} halved"
               if top == context else f"up to {PRESET_SEQ_CAP:,} of the preset's max_seq_len {context:,}")
        why += "" if seq == top else ": the longest that fits" if ok else ": none fits"
        assumed.append(f"data.seq_len {seq} ({why})")
    if assumed:
        assumed[-1] += "; set them with data.seq_len=N train.global_batch=N or use --config"
    return cfg, assumed


def _fits(plan: dict) -> bool:
    """The plan's own configuration fits, or a layout of its table does."""
    table = plan.get("layouts") or {}
    return not any(w.startswith("WILL NOT FIT") for w in plan["warnings"]) or bool(
        table.get("recommended") or table.get("recommended_unmeasured"))


def _check_numbers(args: argparse.Namespace) -> None:
    """Every number of the command line is finite and in range before anything is computed:
    `--tokens nan` printed "time nan h", `--tokens -1` was taken for "no budget", and a negative
    --tokens-per-s gave negative hours."""
    import math

    from mspretrain.errors import UserError

    for flag, value, low, high in (("--tokens", args.tokens, 1.0, 1e16), ("--tokens-per-s", args.tokens_per_s, 1e-6, 1e9),
                                   ("--device-mem-gb", args.device_mem_gb, 0.01, 1e5), ("--devices", args.devices, 1, 1e6),
                                   ("--bus-gbps", args.bus_gbps, 1e-3, 1e5)):
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise UserError(f"{flag} {value:g} is not a number between {low:g} and {high:g}",
                            f"give {flag} a positive finite value, e.g. --tokens 120e9 --tokens-per-s 4100 --devices 8")


def run(args: argparse.Namespace) -> int:
    from mspretrain.errors import UserError
    from mspretrain.preflight.plan import format_plan, make_plan, preset_model

    _check_numbers(args)
    cfg = load_config(args)
    if args.model:
        model = preset_model(args.model)
        if args.data:  # the data dir's tokenizer sets the vocabulary, as it will in `train`
            model = replace(model, vocab_size=0)
        cfg = replace(cfg, model=model)
        cfg = _reapply_model_overrides(cfg, args)
    assumed: list[str] = []
    _check_tp(cfg, args.devices)
    # device.target = auto plans for this machine (CPU here, Ascend on a node with NPUs), unless
    # --devices asks for more than one device: a cluster plan, Ascend's
    from mspretrain.device import resolve_target

    here = resolve_target("auto") if cfg.device.target == "auto" and args.devices == 1 else None
    plan_args = dict(devices=args.devices, tokens=int(args.tokens) if args.tokens is not None else None,
                     data_dir=Path(args.data) if args.data else None, device_mem_gb=args.device_mem_gb, zero=args.zero,
                     recompute=args.recompute, bus_gbps=args.bus_gbps, target=here)
    if args.model and not args.config:
        ascend = cfg.device.target == "ascend" or (cfg.device.target == "auto" and (here or "ascend") == "ascend")
        cfg, assumed = _preset_shape(cfg, args, lambda c: _fits(make_plan(c, tokens_per_s_per_device=None, **plan_args)),
                                     ascend=ascend)
    tps = args.tokens_per_s
    if tps is None and args.from_selftest:
        from mspretrain.preflight.selftest import measured_tokens_per_s, read_selftest

        tps = measured_tokens_per_s(read_selftest(args.from_selftest), cfg, source=args.from_selftest)
    if tps is None and args.from_run:
        tps = _measured_tokens_per_s(Path(args.from_run))
        if tps is None:
            raise UserError(f"{args.from_run} has no tokens_per_s in metrics.jsonl",
                            "run a few more steps (throughput is logged every metrics.throughput_every steps)")
    if tps is not None and not (tps > 0 and tps < float("inf")):  # a measured value from a damaged file
        raise UserError(f"the measured tokens/s per device is {tps:g}", "pass --tokens-per-s X instead")
    # every value is checked as `train` would (NaN, ranges, choices); the budget alone may come
    # from --tokens or --data instead, and make_plan refuses a plan without any
    from mspretrain.config.schema import validate

    validate(replace(cfg, train=replace(cfg.train, max_steps=cfg.train.max_steps or 1)))
    plan = make_plan(cfg, tokens_per_s_per_device=tps, assumed=assumed, **plan_args)
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan))
        if cfg.parallel.tp > 1:  # the headline memory is tensor parallel's (Megatron's accounting, preflight/layouts.py)
            print(f"parallel.tp = {cfg.parallel.tp}: the memory above is the table's TP{cfg.parallel.tp} accounting "
                  "(not yet measured on a TP step); the batch is split over the data-parallel ranks")
    return 0


def _check_tp(cfg: Config, devices: int) -> None:
    """What `train` would refuse of `parallel.tp` on --devices ranks (step/tp.py make_mesh,
    model/parallel.py check_tp), refused here in the same words before any plan is printed."""
    from mspretrain.config.schema import resolve_model
    from mspretrain.errors import UserError
    from mspretrain.model.parallel import check_tp

    tp = cfg.parallel.tp
    if tp > 1 and devices % tp:
        raise UserError(f"parallel.tp = {tp} does not divide --devices {devices}",
                        f"plan a multiple of {tp} devices (devices = tp x data-parallel ranks), or change parallel.tp")
    check_tp(resolve_model(cfg.model), tp)

