"""What was in one step's batch, and which samples, documents and parameter groups made its loss
jump: every sample (rank, micro-batch, source, window, documents with their input file and offset,
first characters), then a replay to the step before it and the losses and gradient norms."""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import bounded

EXAMPLES = """examples:
  mspretrain spike runs/a --step 140
  mspretrain spike runs/a --step 140 --no-replay     # the batch only, in a second

The batch comes from RUN/batches.jsonl, or from RUN/spikes/step_SSSSSS.json, which the trainer
writes when its spike detector fires. Leave a document out and see the loss with
`mspretrain replay RUN --from-step K --steps N --drop-docs ID`."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--step", type=bounded(int, 0, 10**12), required=True, metavar="S", help="the step to take apart (as train.log shows it)")
    p.add_argument("--no-replay", action="store_true", help="list the batch only: no replay, no losses")
    p.add_argument("--history", type=bounded(int, 0, 10**12), default=8, metavar="H",
                   help="replay at least H steps before S when a checkpoint allows (their gradient norms are the "
                        "rolling medians); default 8")
    p.add_argument("--top", type=bounded(int, 1, 1 << 20), default=10, metavar="N", help="documents to list, most harmful first")
    p.add_argument("--out", metavar="SCRATCH", help="keep the replay's scratch run dir here (new or empty)")


def run(args: argparse.Namespace) -> int:
    from mspretrain.commands.common import refuse_overrides
    from mspretrain.errors import UserError
    from mspretrain.forensics.spike import analyse, format_analysis

    refuse_overrides(args, "spike", "spike uses the run's saved config")
    if args.history < 0 or args.top < 1:
        raise UserError("--history must be >= 0 and --top >= 1", "e.g. --history 8 --top 10")
    a = analyse(Path(args.run), args.step, history=args.history, losses=not args.no_replay, out=args.out)
    print(format_analysis(a, top=args.top))
    return 0
