"""Perplexity (and bits per character) of a run or checkpoint on a split of a data dir; with
--choices, multiple-choice accuracy; with --tasks, lm-evaluation-harness tasks run by lm-eval's own
evaluator on our model (mspretrain/eval/harness.py), offline."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mspretrain.commands.common import add_quiet_argument, bounded, refuse_data_dir, refuse_overrides
from mspretrain.config.sections.observe import EVAL_MAX_BATCH
from mspretrain.errors import UserError
from mspretrain.paths import DataPaths

EXAMPLES = """examples:
  mspretrain eval runs/demo
  mspretrain eval runs/demo/checkpoints/step_000300 --data data/ --batch-size 3 --json
  mspretrain eval runs/demo --tasks mspretrain_zh_choices --output-path evals/
  mspretrain eval runs/demo --tasks ceval-local --include-path my_tasks/ --num-fewshot 5 --limit 100 --log-samples --output-path evals/"""


MAX_BATCH = EVAL_MAX_BATCH  # sequences per forward pass, as eval.batch_size (config/sections/observe.py)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="RUN_DIR|CKPT_DIR")
    p.add_argument("--data", metavar="DATA_DIR", help="default: the data dir the run was trained on")
    p.add_argument("--split", default="valid", choices=["train", "valid"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=bounded(int, 0, 10**15), default=0, help="bound the number of predicted tokens (0 = whole split)")
    p.add_argument("--seq-len", type=bounded(int, 0, 1 << 24), default=0, help="window length (default: the run's data.seq_len)")
    p.add_argument("--json", action="store_true", help='print {"ppl", "nll", "tokens", "bpc"} (with --choices: {"acc", "acc_norm", "count"})')
    p.add_argument("--choices", metavar="FILE", help="multiple-choice accuracy on FILE (.jsonl, or C-Eval/CMMLU .csv) instead of perplexity")
    p.add_argument("--dev", metavar="FILE", help="with --choices: few-shot examples (the first --shots items, in file order)")
    p.add_argument("--shots", type=bounded(int, 0, 1000), default=None,
                   help="with --choices: number of few-shot examples (default 5 with --dev, else 0)")
    h = p.add_argument_group("lm-evaluation-harness (pip install mspretrain[eval]; lm-eval's own flag names, - or _)")
    h.add_argument("--tasks", metavar="TASK[,TASK...]", help="lm-eval task, group or tag names (e.g. ceval-valid,cmmlu), run offline")
    h.add_argument("--include-path", "--include_path", dest="include_path", metavar="DIR",
                   help="directory of your own task YAML files (e.g. C-Eval from a local copy)")
    h.add_argument("--num-fewshot", "--num_fewshot", dest="num_fewshot", type=bounded(int, 0, 1000), default=None, metavar="K")
    h.add_argument("--limit", type=float, default=None, metavar="N", help="at most N examples per task (a fraction when < 1)")
    h.add_argument("--log-samples", "--log_samples", dest="log_samples", action="store_true", help="write each request's samples too")
    h.add_argument("--output-path", "--output_path", dest="output_path", metavar="DIR", help="where lm-eval's results (and samples) files go")
    add_quiet_argument(p)


def run(args: argparse.Namespace) -> int:
    from mspretrain.checkpoint.model import load_model
    from mspretrain.data.manifest import read_manifest
    from mspretrain.eval.perplexity import evaluate_split

    refuse_overrides(args, "eval", "use eval's own options, e.g. --max-tokens 65536 --batch-size 8 (see `mspretrain eval --help`)")
    if args.tasks is not None or args.include_path or args.num_fewshot is not None or args.limit is not None \
            or args.log_samples or args.output_path:
        return run_harness(args)
    if args.choices or args.dev or args.shots is not None:
        return run_choices(args)
    if not 0 < args.batch_size <= MAX_BATCH:  # the batch's logits are allocated whole
        raise UserError(f"--batch-size {args.batch_size} must be between 1 and {MAX_BATCH}", "use e.g. --batch-size 8")
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens {args.max_tokens} must not be negative", "use 0 for the whole split, or e.g. --max-tokens 32768")
    if args.seq_len < 0:
        raise UserError(f"--seq-len {args.seq_len} must not be negative", "use 0 for the run's data.seq_len")
    refuse_data_dir(args.path, "eval")
    loaded = load_model(args.path, log=(lambda s: None) if args.json else print)
    data_dir = Path(args.data) if args.data else loaded.ref.data_dir
    if data_dir is None or not DataPaths(data_dir).manifest.is_file():
        raise UserError(f"no data dir to evaluate on ({data_dir or 'unknown'})", "pass --data DATA_DIR (the output of `mspretrain prepare`)")
    manifest = read_manifest(data_dir)  # validated: a foreign or damaged manifest is one line
    if manifest.get("tokenizer_sha256") and loaded.tokenizer.sha256() != manifest["tokenizer_sha256"]:
        raise UserError(f"{data_dir} was tokenized with a different tokenizer than the model's",
                        "evaluate on a data dir prepared with the model's tokenizer (prepare --tokenizer RUN_DIR/tokenizer.model)")
    seq_len = args.seq_len or loaded.config.data.seq_len
    if not 0 < seq_len <= loaded.config.model.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is outside 1..{loaded.config.model.max_seq_len} (the model's context)",
                        "pick a window the model was built for")
    res = evaluate_split(loaded.model, data_dir, split=args.split, seq_len=seq_len,
                         batch_size=args.batch_size, max_tokens=args.max_tokens,
                         chars_per_token=manifest.get("chars_per_token"))
    if args.json:
        print(json.dumps(res))
    else:
        bpc = f", {res['bpc']:.3f} bits/char" if "bpc" in res else ""
        print(f"{loaded.ref.dir.name}: {args.split} perplexity {res['ppl']:.3f} (nll {res['nll']:.4f}{bpc}) over {res['tokens']:,} tokens"
              f"{scope_note(args.split, args.max_tokens, loaded.config.eval.max_tokens, res['tokens'])}")
    return 0


def scope_note(split: str, max_tokens: int, run_max_tokens: int, scored: int) -> str:
    """Which tokens were scored, next to the number: the run's own evals (report, demo, train.log)
    score only the first eval.max_tokens, so the two perplexities differ and both are right."""
    whole = not max_tokens or scored < max_tokens  # the limit was not reached: the split was shorter
    scope = f"the whole {split} split" if whole else f"the first {max_tokens:,} of the {split} split (--max-tokens)"
    # the run's evals scored the same tokens when their limit covers what was scored here
    same = run_max_tokens == max_tokens if not whole else (run_max_tokens == 0 or run_max_tokens >= scored)
    if split == "valid" and not same:
        scope += (f"; the run's own evals score up to the first {run_max_tokens:,} (eval.max_tokens)" if run_max_tokens
                  else "; the run's own evals score the whole split (eval.max_tokens = 0)")
    return f": {scope}"


def run_choices(args: argparse.Namespace) -> int:
    """`eval RUN --choices FILE [--dev FILE] [--shots K]`: accuracy by option log-likelihood."""
    import sys

    from mspretrain.checkpoint.model import load_model
    from mspretrain.commands.common import progress_enabled
    from mspretrain.eval.choices import check_shots, choices_accuracy, read_choices

    if not args.choices:
        raise UserError("--dev and --shots go with --choices FILE", "add --choices FILE.jsonl (or .csv)")
    perplexity_only = [name for name, given in (("--data", args.data), ("--max-tokens", args.max_tokens),
                                                ("--seq-len", args.seq_len), ("--split", args.split != "valid")) if given]
    if perplexity_only:
        raise UserError(f"{', '.join(perplexity_only)} {'is' if len(perplexity_only) == 1 else 'are'} for perplexity, not --choices",
                        "leave them out: --choices scores the file's questions")
    if not 0 < args.batch_size <= MAX_BATCH:  # the batch's logits are allocated whole
        raise UserError(f"--batch-size {args.batch_size} must be between 1 and {MAX_BATCH}", "use e.g. --batch-size 8")
    items = read_choices(args.choices)  # bad files fail before the model loads
    dev = read_choices(args.dev) if args.dev else []
    shots = args.shots if args.shots is not None else (min(5, len(dev)) if dev else 0)
    check_shots(dev, shots)
    refuse_data_dir(args.path, "eval")
    loaded = load_model(args.path, log=(lambda s: None) if args.json else print)
    bar = None
    if progress_enabled(args):
        from tqdm import tqdm

        bar = tqdm(total=sum(len(it.choices) for it in items), desc="options", unit="option", file=sys.stderr,
                   dynamic_ncols=True, leave=False)
    try:
        res = choices_accuracy(loaded.model, loaded.tokenizer, items, batch_size=args.batch_size, dev=dev, shots=shots,
                               progress=(lambda done, total: bar.update(done - bar.n)) if bar else None)
    finally:
        if bar:
            bar.close()
    if args.json:
        print(json.dumps(dict(res, shots=shots)))
    else:
        print(f"{loaded.ref.dir.name}: {Path(args.choices).name}: accuracy {res['acc']:.1%} (summed log-likelihood), "
              f"{res['acc_norm']:.1%} (per-token normalised) over {res['count']:,} questions, {shots}-shot")
    return 0


def run_harness(args: argparse.Namespace) -> int:
    """`eval RUN --tasks A,B [--include-path DIR] [--num-fewshot K] [--limit N] [--log-samples]
    [--output-path DIR]`: lm-eval's simple_evaluate on our model; lm-eval's results files."""
    import math

    if args.tasks is None:
        raise UserError("--include-path, --num-fewshot, --limit, --log-samples and --output-path go with --tasks",
                        "add --tasks NAME[,NAME...] (e.g. --tasks mspretrain_zh_choices)")
    other = [name for name, given in (("--data", args.data), ("--max-tokens", args.max_tokens), ("--seq-len", args.seq_len),
                                      ("--split", args.split != "valid"), ("--choices", args.choices), ("--dev", args.dev),
                                      ("--shots", args.shots is not None)) if given]
    if other:
        raise UserError(f"{', '.join(other)} {'does' if len(other) == 1 else 'do'} not go with --tasks",
                        "--tasks runs lm-eval's tasks; use --num-fewshot and --limit for its options")
    if not 0 < args.batch_size <= MAX_BATCH:
        raise UserError(f"--batch-size {args.batch_size} must be between 1 and {MAX_BATCH}", "use e.g. --batch-size 8")
    limit = args.limit
    if limit is not None:
        if not (math.isfinite(limit) and limit > 0 and (limit < 1 or limit == int(limit))):
            raise UserError(f"--limit {limit:g} must be a whole number of examples or a fraction in (0, 1)", "e.g. --limit 100 or --limit 0.1")
        limit = int(limit) if limit >= 1 else limit
    out = Path(args.output_path) if args.output_path else None
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--output-path {out} exists and is not a directory", "pass a directory (lm-eval writes its files inside)")
    refuse_data_dir(args.path, "eval")
    from mspretrain.eval import harness

    resolved = harness.resolve_tasks(args.tasks.split(","), args.include_path)  # unknown names, missing data: before the model loads
    from mspretrain.checkpoint.model import load_model
    from mspretrain.device import plan_device
    from mspretrain.parallel.distributed import init

    loaded = load_model(args.path, log=(lambda s: None) if args.json else print)  # sets MindSpore up first
    world = init(plan_device(loaded.config).target)  # under msrun (`launch --nproc N -- eval`): the ranks share the documents
    lm = harness.MindSporeLM(loaded.model, loaded.tokenizer, batch_size=args.batch_size, seed=loaded.config.train.seed, world=world)
    tracker = None
    if out is not None and lm.rank == 0:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=str(out))
    results = harness.evaluate(lm, args.tasks.split(","), num_fewshot=args.num_fewshot, limit=limit,
                               log_samples=args.log_samples, tracker=tracker, resolved=resolved,
                               model_args={"pretrained": str(args.path)})
    if results is None:  # a rank > 0 under msrun: rank 0 has every rank's results, and writes them
        return 0
    samples = results.pop("samples", None)
    if tracker is not None:  # as lm-eval's CLI saves them: results_<date>.json and samples_<task>_<date>.jsonl
        tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
        if args.log_samples:
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if args.json:
        print(json.dumps(harness.task_scores(results)))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
        if out is not None:
            print(f"lm-eval results written under {out}")
    return 0
