"""Average the weights of several checkpoints of a run into one new, verified checkpoint.

The checkpoints are the newest N that verify (--last N) or the given steps (--steps A,B,...).
Uniform: each gets 1/N. --ema DECAY: the exponential moving average over the chosen checkpoints
in step order, e_1 = w_1, e_k = DECAY * e_{k-1} + (1 - DECAY) * w_k; so the oldest gets
DECAY^(N-1) and the k-th (k >= 2) (1 - DECAY) * DECAY^(N-k). --from-ema averages the EMA of the
weights the run kept (train.ema_decay) instead of the weights; `--last 1 --from-ema` turns one
checkpoint's EMA into a checkpoint of its own. Any layout is read (one file, or ZeRO-3's per-rank
files), one piece of one tensor at a time, summed in float64 and written as float32.

The output (default RUN_DIR/averaged/<uniform|emaDECAY>[-from-ema]-<N>ckpt-to-step_NNNNNN) is a
weights-only checkpoint dir: model.safetensors, config.toml and the tokenizer of the newest source,
train_state.json (what was averaged, with the sources' SHA-256), manifest.json last. eval, generate,
export and `train --init-from` take it like any checkpoint dir; it is never written over.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import add_quiet_argument, bounded, existing_path, say
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain average runs/a --last 5
  mspretrain average runs/a --steps 800,900,1000 --out ckpts/a-avg
  mspretrain average runs/a --last 5 --ema 0.9
  mspretrain average runs/a --last 1 --from-ema
  mspretrain eval runs/a/averaged/uniform-5ckpt-to-step_001000 --data data/"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=bounded(int, 1, 1 << 20), metavar="N", help="the newest N checkpoints that verify")
    which.add_argument("--steps", metavar="A,B,...", help="these steps' checkpoints (each must exist and verify)")
    p.add_argument("--ema", type=bounded(float, 0.0, 1.0), metavar="DECAY", default=None,
                   help="EMA weights instead of uniform: oldest DECAY^(N-1), k-th (1-DECAY)*DECAY^(N-k) (oldest first, k >= 2)")
    p.add_argument("--from-ema", action="store_true",
                   help="average the EMA of the weights saved with each checkpoint (train.ema_decay) instead of the weights")
    p.add_argument("--out", metavar="CKPT_DIR",
                   help="output checkpoint dir, must not exist (default RUN_DIR/averaged/<kind>-<N>ckpt-to-step_NNNNNN)")
    add_quiet_argument(p)


def _steps(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--steps {text!r} is not a list of step numbers", "write e.g. --steps 800,900,1000") from None
    if not steps or min(steps) < 0:
        raise UserError(f"--steps {text!r} names no step", "write e.g. --steps 800,900,1000")
    return steps


def default_out(run_dir: Path, n: int, newest: int, ema: float | None, from_ema: bool) -> Path:
    kind = "uniform" if ema is None else f"ema{ema:g}"
    return run_dir / "averaged" / f"{kind}{'-from-ema' if from_ema else ''}-{n}ckpt-to-step_{newest:06d}"


def run(args: argparse.Namespace) -> int:
    from mspretrain.checkpoint import average as avg

    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    if args.ema is not None and not 0 < args.ema < 1:
        raise UserError(f"--ema {args.ema} is not a decay in (0, 1)", "use e.g. --ema 0.9 (or leave it out for a uniform mean)")
    sources = avg.select(run_dir, last=args.last, steps=_steps(args.steps) if args.steps else None)
    weights = avg.uniform_weights(len(sources)) if args.ema is None else avg.ema_weights(len(sources), args.ema)
    out = Path(args.out) if args.out else default_out(run_dir, len(sources), sources[-1].step, args.ema, args.from_ema)
    method = {"method": "uniform"} if args.ema is None else {"method": "ema", "decay": args.ema}
    done = avg.average(sources, weights, out, method=method, from_ema=args.from_ema, log=lambda s: say(args, s))
    names = ", ".join(s.dir.name for s in sources)
    say(args, f"wrote {done} ({method['method']}{' of the EMA weights' if args.from_ema else ''} of {names})")
    if args.quiet:
        print(done)
    return 0
