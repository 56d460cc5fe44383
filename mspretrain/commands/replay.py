"""Replay steps of a run from one of its checkpoints in a scratch dir: as they ran (does the run
reproduce bit for bit?) or changed (without some documents, in fp32, at another lr or loss scale)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mspretrain.commands.common import bounded

EXAMPLES = """examples:
  mspretrain replay runs/a --from-step 100 --steps 20
  mspretrain replay runs/a --from-step 140 --steps 5 --drop-docs 1201
  mspretrain replay runs/a --from-step 140 --steps 5 --lr-scale 0.5 --out /tmp/replay-lr

Without interventions it says whether the losses equal metrics.jsonl's bit for bit (exit 0) or
names the first step that differs (exit 1); with interventions it prints the original and
replayed losses side by side. RUN is only read; the scratch dir is a temporary one unless --out."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--from-step", type=bounded(int, 0, 10**12), required=True, metavar="K",
                   help="start from the checkpoint of step K (or the newest verified one before it)")
    p.add_argument("--steps", type=bounded(int, 1, 10**12), required=True, metavar="N", help="replay steps K+1..K+N")
    p.add_argument("--drop-docs", metavar="IDS", help="document ids to leave out (as `spike` lists them: 12,40 or 1:7 "
                                                      "for source 1); their samples are swapped for clean ones")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="replay in this precision.dtype")
    p.add_argument("--lr-scale", type=float, metavar="X", help="multiply every step's lr by X")
    p.add_argument("--loss-scale", type=float, metavar="X", help="start the replay at loss scale X")
    p.add_argument("--out", metavar="SCRATCH", help="keep the scratch run dir here (new or empty); default: a "
                                                     "temporary dir, removed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from mspretrain.commands.common import refuse_overrides
    from mspretrain.errors import UserError
    from mspretrain.forensics.drop_docs import RULE, parse_doc_ids
    from mspretrain.forensics.replay import Interventions, format_replay, replay

    refuse_overrides(args, "replay", "give interventions as options: --dtype, --lr-scale, --loss-scale, --drop-docs")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: replay at least one step", "e.g. --steps 20")
    for name in ("lr_scale", "loss_scale"):
        v = getattr(args, name)
        high = 1e3 if name == "lr_scale" else 2.0**40  # an lr x1000 or a scale past fp32's gradient range is a typo
        # and a floor: --loss-scale 1e-320 is 0.0 in float32, and unscaling by it made every gradient NaN
        low = 1e-6 if name == "lr_scale" else 2.0**-24
        if v is not None and not low <= v <= high:  # also refuses nan and inf
            raise UserError(f"--{name.replace('_', '-')} {v} must be a positive finite number from {low:g} up to {high:g}",
                            "e.g. --lr-scale 0.5 or --loss-scale 1024")
    docs: tuple[tuple[int, int], ...] = ()
    if args.drop_docs:
        from mspretrain.config import schema as cfgmod

        run_cfg = Path(args.run) / "config.toml"
        n_sources = max(1, len(cfgmod.load(run_cfg).data.sources)) if run_cfg.is_file() else 1
        docs = tuple(parse_doc_ids(args.drop_docs, n_sources))
    changes = Interventions(drop_docs=docs, dtype=args.dtype, lr_scale=args.lr_scale, loss_scale=args.loss_scale)
    result = replay(Path(args.run), args.from_step, args.steps, changes=changes, out=args.out)
    bad = None if changes.any() else result.first_difference()
    if args.json:
        print(json.dumps({"from_checkpoint": result.start, "steps": [vars(r) for r in result.rows],
                          "world": result.world, "world_original": result.world_original,
                          "interventions": changes.describe(), "reproduced": None if changes.any() else bad is None,
                          "swaps": [vars(s) for s in result.swaps]}, indent=1))
    else:
        print(format_replay(result, drop_rule=RULE))
    return 1 if bad is not None else 0
