"""Train a model on a data dir; if the run dir holds a checkpoint, resume from the newest one that verifies."""
from __future__ import annotations

import argparse
from typing import Sequence

from mspretrain.commands.common import add_config_argument, add_quiet_argument, bounded, existing_path, load_config
from mspretrain.config.schema import Config
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain train --config configs/tiny.toml --data data/ --run runs/tiny train.max_steps=50
  mspretrain train --config configs/demo.toml --data data/ --run runs/demo      # resumes if runs/demo has a checkpoint
  mspretrain train --model 125m --config configs/demo.toml --data data/ --run runs/125m   # a preset's architecture
  mspretrain train --init-from ~/models/Llama-2-7b-hf --config configs/llama2-7b-910b.toml --data data-zh/ --run runs/zh   # new run from HF weights
  msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=logs --join=True --cluster_time_out=1200 \\
        $(which mspretrain) train --config configs/tiny.toml --data data/ --run runs/dp"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument("--data", required=True, metavar="DATA_DIR", help="output of `mspretrain prepare`")
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="where metrics, logs and checkpoints go")
    from mspretrain.model.presets import PRESETS  # the help lists the table itself: a new preset is never hidden

    p.add_argument("--model", metavar="PRESET",
                   help=f"a model preset ({', '.join(PRESETS)}) instead of the config's [model]; "
                        "the vocabulary comes from the data dir, model.* overrides still apply")
    p.add_argument("--init-from", metavar="CKPT_DIR|HF_DIR",
                   help="start a new run (step 0, fresh optimizer, schedule and loss scale) from these weights: an mspretrain "
                        "checkpoint, a run dir (its newest verified checkpoint) or an HF model folder; the model config comes "
                        "from them, and a data dir whose tokenizer extends theirs grows the embedding and lm_head")
    p.add_argument("--upcycle", action="store_true",
                   help="with --init-from a dense checkpoint and a mixture-of-experts model config (model.family=qwen3_moe, "
                        "model.num_experts): start the MoE model from it, each expert a copy of the dense MLP")
    p.add_argument("--allow-config-change", action="store_true", help="resume even if the config changes numerics")
    p.add_argument("--allow-data-change", action="store_true", help="resume even if the data dir's fingerprint changed")
    p.add_argument("--restart", action="store_true",
                   help="when every checkpoint of RUN_DIR fails verification, move them (and metrics.jsonl) "
                        "to checkpoints.failed-<time>/ and start from step 0 instead of refusing")
    p.add_argument("--cpu-quota", type=bounded(float, 0, 100), default=None, metavar="PCT",
                   help="cap this process at PCT%% of all cores (cgroup v2, else affinity + nice)")
    add_quiet_argument(p)


def with_preset(cfg: Config, name: str, overrides: Sequence[str] = ()) -> Config:
    """`cfg` with a preset's architecture (vocab from the data dir), then the model.* overrides again."""
    from dataclasses import replace

    from mspretrain.config import schema as cfgmod
    from mspretrain.model.presets import preset

    cfg = replace(cfg, model=replace(preset(name), vocab_size=0))
    return cfgmod.apply_overrides(cfg, [o for o in overrides if o.startswith("model.")])


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    cfg = load_config(args)
    if args.model:
        cfg = with_preset(cfg, args.model, getattr(args, "overrides", ()))
    if args.cpu_quota is not None:
        cfg = replace(cfg, device=replace(cfg.device, cpu_quota=args.cpu_quota))
    existing_path(args.data, "data dir", "run `mspretrain prepare INPUT --out DATA_DIR` first")
    if cfg.device.cpu_quota:
        from mspretrain.preflight.isolate import apply_cpu_quota

        apply_cpu_quota(cfg.device.cpu_quota, log=print)
    from mspretrain.checkpoint.init_source import explicit_model_keys, init_for_run
    from mspretrain.preflight.fits import check_fits
    from mspretrain.train.build import build_trainer

    log = (lambda s: None) if args.quiet else print
    # --init-from, and the resume of a run that began from init weights: the model config comes from the weights
    if args.upcycle and args.init_from is None:
        raise UserError("--upcycle needs --init-from DENSE_CKPT (the dense checkpoint the MoE model starts from)",
                        "add --init-from; a run that was upcycled resumes without either flag")
    explicit = explicit_model_keys(args.config, getattr(args, "overrides", ()), preset=bool(args.model))
    cfg, init_weights, init_record = init_for_run(args.init_from, cfg, args.data, args.run, explicit=explicit,
                                                  allow_config_change=args.allow_config_change, log=log, upcycle=args.upcycle)
    trainer = build_trainer(cfg, args.data, args.run, allow_config_change=args.allow_config_change,
                            allow_data_change=args.allow_data_change, log=log, restart=args.restart,
                            init_weights=init_weights, run_meta={"init_from": init_record} if init_record else None, fits=check_fits)
    summary = trainer.train()
    if not args.quiet:
        last = f"{summary.losses[-1]:.4f}" if summary.losses else "n/a"
        print(f"done: step {summary.step}, {summary.tokens_seen:,} tokens, last loss {last}, run dir {summary.run_dir}")
    return 0
