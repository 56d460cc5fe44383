"""The whole pipeline on a Chinese poetry corpus: Tang and Song poems → shards → the decoder → perplexity → poems.

Fetches `chinese-poetry@2.0.1` (MIT) from the npm registry into a cache on first use, converts it
to Simplified Chinese, prepares shards, trains the `demo` config, evaluates valid perplexity
before and after training, and writes a few poems from 春风, 明月 and 江南. Running it again
reuses the data and the finished run.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from mspretrain.commands.common import add_quiet_argument, progress_enabled
from mspretrain.errors import UserError
from mspretrain.paths import DataPaths, RunPaths

EXAMPLES = """examples:
  mspretrain demo                 # 300 steps, ~10 minutes on 2 cores
  mspretrain demo --quick         # 40 steps, ~4 minutes on 2 cores
  mspretrain demo --workdir /tmp/demo train.max_steps=500"""

PROMPTS = ("春风", "明月", "江南")
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="mspretrain-demo",
                   help="where data/ and run/ go (--quick: data-quick/ and run-quick/; default: ./mspretrain-demo)")
    p.add_argument("--quick", action="store_true", help="a smaller corpus and 40 steps (~4 minutes on 2 cores)")
    p.add_argument("--config", default=None, help="default: configs/demo.toml")
    p.add_argument("--cache", default=None, help="corpus cache dir (default: $MSPRETRAIN_CACHE or ~/.cache/mspretrain)")
    p.add_argument("--corpus", default=None, metavar="PATH",
                   help="use this text (files/dirs as for `prepare`) instead of fetching chinese-poetry")
    add_quiet_argument(p)


def config_path(args: argparse.Namespace) -> Path:
    """The demo's config file, absolute: the printed next steps must work from any directory."""
    return (Path(args.config) if args.config else CONFIG_DIR / "demo.toml").resolve()


def _config(args: argparse.Namespace):
    from mspretrain.config import schema as cfgmod

    path = config_path(args)
    if not path.is_file():
        raise UserError(f"demo config {path} not found", "pass --config with a TOML file such as configs/demo.toml")
    cfg = cfgmod.load(path)
    if args.quick:
        cfg = cfgmod.apply_overrides(cfg, ["train.max_steps=40", "eval.every=0", "checkpoint.every=20",
                                           "eval.max_tokens=8192", "prepare.vocab_size=7100"])
    return cfgmod.apply_overrides(cfg, getattr(args, "overrides", []))


def demo_dirs(work: Path, quick: bool) -> tuple[Path, Path]:
    """(data dir, run dir): the full demo's data/ and run/; --quick has its own data-quick/ and
    run-quick/, so a quick demo after `make demo` never resumes, rewrites or reports the full run."""
    suffix = "-quick" if quick else ""
    return work / f"data{suffix}", work / f"run{suffix}"


def check_run_dir(run_dir: Path, cfg, *, vocab_of_run: bool = False) -> None:
    """Refuse (one line, nothing written) a run dir whose config.toml is not the config this demo
    trains: a run continued with `train` (the printed next step (b)), or other overrides. Running
    the demo on it would rewrite its config.toml and report that run as the demo's.
    `vocab_of_run`: `cfg` is not resolved yet (no data dir to take the vocabulary from): resolve it
    with the run's, so the check can come before minutes of fetching and preparing."""
    from mspretrain.config import schema as cfgmod

    saved = RunPaths(run_dir).config
    if not saved.is_file():
        return
    old = cfgmod.load(saved)
    if vocab_of_run:
        cfg = replace(cfg, model=cfgmod.resolve_model(cfg.model, int(old.model.vocab_size)))
    if old == cfg:
        return
    diff = [f"{sec}.{k}" for sec in ("model", "data", "optim", "schedule", "train", "checkpoint", "eval", "precision")
            for k, v in vars(getattr(cfg, sec)).items() if getattr(getattr(old, sec), k, v) != v]
    shown = ", ".join(diff[:3]) + (", ..." if len(diff) > 3 else "") if diff else "other keys"
    raise UserError(f"{run_dir} holds a run with another config than this demo's ({shown} differ); the demo leaves it alone",
                    "continue it with `mspretrain train` (its config.toml), or give the demo another --workdir")


def run(args: argparse.Namespace) -> int:
    from mspretrain.demo.corpus import poetry_corpus
    from mspretrain.prepare.prepare import prepare

    t_start = time.perf_counter()
    cfg = _config(args)
    work = Path(args.workdir)
    data_dir, run_dir = demo_dirs(work, args.quick)
    say = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    say(f"== mspretrain demo in {work.resolve()}{' (quick)' if args.quick else ''}")

    # 1. corpus and shards (reused when a previous demo finished them)
    max_docs = 12_000 if args.quick else 60_000
    if DataPaths(data_dir).manifest.is_file():
        say(f"-- data: reusing {data_dir}")
    else:
        check_run_dir(run_dir, cfg, vocab_of_run=True)  # a refused demo prepares nothing first
        if args.corpus:
            corpus = Path(args.corpus)
            say(f"-- corpus: {corpus}")
        else:
            say("-- corpus: chinese-poetry@2.0.1 from the npm registry (cached after the first run)")
            corpus = poetry_corpus(Path(args.cache) if args.cache else None, max_docs=max_docs, log=say)
        say(f"-- prepare: cleaning, tokenizer (vocab {cfg.prepare.vocab_size}), shards -> {data_dir}")
        work.mkdir(parents=True, exist_ok=True)
        prepare([str(corpus)], data_dir, cfg.prepare, progress=progress_enabled(args), log=say)
    from mspretrain.data.manifest import read_manifest

    manifest = read_manifest(data_dir)

    # 2. a fresh model (same seed as training) gives the "before" perplexity
    from mspretrain.config import schema as cfgmod
    from mspretrain.data.tokenizer import Tokenizer
    from mspretrain.device import plan_device, setup_mindspore
    from mspretrain.eval.generate import SamplingParams, generate
    from mspretrain.eval.perplexity import evaluate_split
    from mspretrain.model.decoder import Decoder

    resolved = replace(cfg, model=cfgmod.resolve_model(cfg.model, int(manifest["vocab_size"])))
    check_run_dir(run_dir, resolved)  # before minutes of evaluation and training
    info = plan_device(resolved)
    setup_mindspore(info)
    ev = dict(split="valid", seq_len=cfg.data.seq_len, batch_size=cfg.eval.batch_size, max_tokens=cfg.eval.max_tokens,
              chars_per_token=manifest.get("chars_per_token"))
    fresh = Decoder(resolved.model, dtype=cfg.precision.dtype, device=info.target, seed=cfg.train.seed)
    before = evaluate_split(fresh, data_dir, **ev)
    say(f"-- valid perplexity before training: {before['ppl']:.1f}")
    del fresh

    # 3. train (resumes if a previous demo was interrupted; nothing to do if it finished)
    from mspretrain.preflight.fits import check_fits
    from mspretrain.train.build import build_trainer

    say(f"-- train: {cfg.train.max_steps} steps of {cfg.train.global_batch} x {cfg.data.seq_len} tokens -> {run_dir}")
    trainer = build_trainer(cfg, data_dir, run_dir, log=say, fits=check_fits)
    summary = trainer.train()
    after = evaluate_split(trainer.model, data_dir, **ev)
    say(f"-- valid perplexity after training: {after['ppl']:.1f}")

    # 4. poems
    tok = Tokenizer.load(data_dir)
    params = SamplingParams(max_new_tokens=48, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.2,
                            seed=cfg.train.seed)
    samples = [generate(trainer.model, tok, p, params, max_seq_len=resolved.model.max_seq_len) for p in PROMPTS]

    # 5. summary
    minutes = (time.perf_counter() - t_start) / 60
    docs = manifest.get("documents", {})
    print("\n== summary")
    print(f"data      {sum(docs.values()) if isinstance(docs, dict) else docs:,} poems, "
          f"{manifest['tokens']['train']:,} train tokens, {manifest.get('chars_per_token', 0):.2f} chars/token, vocab {manifest['vocab_size']}")
    print(f"training  {summary.step} steps, {summary.tokens_seen:,} tokens"
          + (f", {summary.tokens_per_s:,.0f} tokens/s" if summary.tokens_per_s else ""))
    print(f"valid ppl {before['ppl']:.1f} before -> {after['ppl']:.1f} after training"
          + (f" ({after['bpc']:.2f} bits/char)" if "bpc" in after else ""))
    for g in samples:
        print(f"sample    {g.prompt}{g.text}".replace("\n", " / "))
    print(f"run dir   {run_dir.resolve()}  ({minutes:.1f} minutes in all)")
    # (b) keeps the learning rate where the run ended: raising train.max_steps alone would
    # re-stretch the cosine and jump back up from its floor (the trainer says so at resume)
    from mspretrain.schedule import continuation_overrides

    tail = continuation_overrides(trainer.schedule(trainer.applied), cfg.optim.lr_scaling)
    print("\nnext:")
    print(f"  mspretrain report {run_dir}                       # (a) HTML report with the curves")
    print(f"  mspretrain train --config {RunPaths(run_dir).config} --data {data_dir} --run {run_dir} train.max_steps={summary.step + 300} {tail}"
          "   # (b) 300 more steps at the final learning rate")
    print(f"  mspretrain prepare YOUR_TEXT_DIR --out my-data && mspretrain train --config {config_path(args)} --data my-data --run runs/mine"
          "   # (c) your own text")
    print(f"  mspretrain export {run_dir} --format hf --out {work / ('hf-quick' if args.quick else 'hf')}   # (d) a Hugging Face Llama folder")
    if after["ppl"] >= before["ppl"]:
        raise UserError(f"the demo did not learn (perplexity {before['ppl']:.1f} -> {after['ppl']:.1f})",
                        "this is a bug; please report it with the run dir's train.log")
    return 0
