#!/usr/bin/env python3
"""Plant one-line bugs in the production code, one at a time, and run the tests that should catch each.

    python scripts/mutate.py                 # every mutant: CAUGHT / SURVIVED per line, then the count
    python scripts/mutate.py --list          # the mutants, without running anything
    python scripts/mutate.py step layout     # only mutants whose name contains one of these words
    python scripts/mutate.py --baseline      # the selected tests on the unmutated code (must all pass)

Each mutant is (name, file, the original snippet, the mutated snippet, pytest arguments). The snippet
must occur exactly once in the file, so a mutant whose line has changed is reported STALE instead of
planting a bug somewhere else. The file is restored after each run, also on Ctrl-C or SIGTERM; a copy
is kept in .mutate-backup/ while a mutant is planted, and a later start puts it back if this process
was killed outright (SIGKILL, power cut). A mutant is CAUGHT when pytest reports a failed test (exit
code 1); exit 0 is SURVIVED; anything else (collection error, timeout) is shown as such.

The tests are chosen per mutant to be the fast files that should catch it (seconds to ~2 minutes
each on 2 cores); the whole list takes ~20-30 minutes on an idle 2-core box. docs/benchmarks.md
records the last result.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKUP = ROOT / ".mutate-backup"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]  # pytest arguments (files, node ids, -k expressions)


STEP, LAYOUT, LLAMA = "mspretrain/step/step.py", "mspretrain/parallel/layout.py", "mspretrain/model/decoder.py"
TRAIN_STEP = "tests/step/test_train_step.py"

MUTANTS: list[Mutant] = [
    # ---- step: overflow, loss scale, clipping, AdamW
    Mutant("step/overflow_decays_moments", STEP, "b1 = ops.where(finite, self.beta1 * one, one)", "b1 = self.beta1 * one",
           (TRAIN_STEP, "-k", "overflow")),
    Mutant("step/overflow_advances_adam", STEP, "step = self.opt_step + finite.astype(ms.int32)", "step = self.opt_step + 1",
           (TRAIN_STEP, "-k", "overflow")),
    Mutant("step/clip_scaled_norm", STEP, "self.clip / (norm + 1e-6))", "self.clip / (ops.sqrt(sq) + 1e-6))",
           (TRAIN_STEP, "-k", "adamw")),
    Mutant("step/grad_norm_not_unscaled", STEP, "norm = ops.sqrt(sq) * inv_scale", "norm = ops.sqrt(sq)",
           (TRAIN_STEP, "-k", "adamw")),
    Mutant("step/decay_without_bias_correction", STEP, "wd_factor = ops.where(finite, bc1 / root_bc2, zero)",
           "wd_factor = ops.where(finite, one, zero)", (TRAIN_STEP, "-k", "adamw")),
    Mutant("step/eps_not_bias_corrected", STEP, "eps_t = self.eps * root_bc2", "eps_t = self.eps * one",
           (TRAIN_STEP, "-k", "adamw")),
    Mutant("step/accumulated_micro_batches_overscaled", STEP,
           "_, rows = self._accumulate(Tensor(tokens), as_t(positions), as_t(segments), scale_t, Tensor(k == 0))",
           "_, rows = self._accumulate(Tensor(tokens), as_t(positions), as_t(segments), scale_t * len(micro_batches), Tensor(k == 0))",
           (TRAIN_STEP, "-k", "accumulation or loss_scale")),
    Mutant("step/accumulation_buffers_not_reset", STEP, "ops.where(ops.broadcast_to(first, acc.shape), g, acc + g)",
           "ops.where(ops.broadcast_to(first, acc.shape), acc + g, acc + g)", (TRAIN_STEP, "-k", "accumulation or loss_scale")),
    # ---- layout: owners and buckets of sharded/bucketed collectives
    Mutant("layout/owners_balance_counts_not_elements", LAYOUT, "        owner[i] = r\n        load[r] += sizes[i]\n",
           "        owner[i] = r\n        load[r] += 1\n",
           ("tests/train/test_distributed.py", "tests/step/test_zero2.py", "-m", "not slow")),
    Mutant("layout/bucket_exceeds_cap", LAYOUT, "if cur and (cap <= 0 or total + n > cap):", "if cur and (cap <= 0 or total > cap):",
           ("tests/step/test_zero2.py", "-m", "not slow")),
    Mutant("layout/padding_threshold", LAYOUT, "if 4 * sum(b.used(r) for r in range(world)) < 3 * b.numel:",
           "if 2 * sum(b.used(r) for r in range(world)) < b.numel:", ("tests/step/test_zero2.py", "-m", "not slow")),
    # ---- budget
    Mutant("budget/token_budget_floors", "mspretrain/budget.py", "return math.ceil(tokens / per_step)", "return tokens // per_step",
           ("tests/preflight/test_budget.py",)),
    Mutant("budget/auto_warmup_cap_fifth", "mspretrain/budget.py", "return min(warmup, max(1, total // 10))",
           "return min(warmup, max(1, total // 5))", ("tests/preflight/test_budget.py",)),
    Mutant("budget/tokens_per_step_counts_the_shifted_token", "mspretrain/budget.py",
           "return cfg.train.global_batch * cfg.data.seq_len", "return cfg.train.global_batch * (cfg.data.seq_len + 1)",
           ("tests/preflight/test_budget.py",)),
    # ---- model
    Mutant("model/rope_frequencies", LLAMA, "np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)",
           "np.arange(0, head_dim, 2, dtype=np.float64) / (head_dim - 2))", ("tests/model/test_model.py", "-k", "not recompute")),
    Mutant("model/attention_scale", LLAMA, "self.scale = 1.0 / math.sqrt(self.head_dim)", "self.scale = 1.0 / self.head_dim",
           ("tests/model/test_model.py", "-k", "not recompute")),
    Mutant("model/rmsnorm_eps_outside_rsqrt", LLAMA, "return ops.rsqrt(row_sum(xf * xf) / x.shape[-1] + eps)",
           "return ops.rsqrt(row_sum(xf * xf) / x.shape[-1]) + eps", ("tests/model/test_model.py", "-k", "not recompute")),
    Mutant("model/residual_init_not_scaled", LLAMA, "out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)", "out_std = cfg.init_std",
           ("tests/model/test_model.py", "-k", "not recompute")),
    Mutant("model/hf_max_position_default", "mspretrain/model/hf.py", '"max_position_embeddings", source, 2048)',
           '"max_position_embeddings", source, 4096)', ("tests/cli/test_reader_defaults.py", "tests/model/test_hf_bridge.py", "-k", "config")),
    Mutant("model/hf_rms_eps_default", "mspretrain/model/hf.py", '"rms_norm_eps", source, 1e-6)', '"rms_norm_eps", source, 1e-5)',
           ("tests/cli/test_reader_defaults.py", "tests/model/test_hf_bridge.py", "-k", "config")),
    # ---- loader and sample order
    Mutant("loader/contiguous_rank_blocks", "mspretrain/data/loader.py",
           "ids = src.strided_ids(c[0] + self.rank, self.world, self.batch_size)",
           "ids = src.strided_ids(c[0] + self.rank * self.batch_size, 1, self.batch_size)", ("tests/data/test_loader.py",)),
    Mutant("loader/epoch_boundary", "mspretrain/data/loader.py", "e0, last = first // self.n, first + step * (count - 1)",
           "e0, last = first // self.n, first + step * (count - 2)", ("tests/data/test_loader.py",)),
    Mutant("loader/plan_epoch", "mspretrain/data/order.py", "epochs = ords[rows] // n", "epochs = ords[rows] // (n + 1)",
           ("tests/data/test_order.py", "tests/data/test_loader.py")),
    # ---- checkpoint
    Mutant("checkpoint/size_check_only_grown", "mspretrain/checkpoint/store.py", 'if size != files[name]["bytes"]:',
           'if size > files[name]["bytes"]:',
           ("tests/checkpoint/test_checkpoint_verify.py", "tests/checkpoint/test_checkpoint.py", "-m", "not slow")),
    Mutant("checkpoint/last_file_hash_ignored", "mspretrain/checkpoint/store.py",
           'return f"{names[first_bad[0]]} sha256 mismatch" if first_bad[0] < len(names) else None',
           'return f"{names[first_bad[0]]} sha256 mismatch" if first_bad[0] < len(names) - 1 else None',
           ("tests/checkpoint/test_checkpoint_verify.py", "tests/checkpoint/test_checkpoint.py", "-m", "not slow")),
    Mutant("checkpoint/prune_may_drop_newest_verified", "mspretrain/checkpoint/store.py", "if step in keep or d == newest_ok:",
           "if step in keep:", ("tests/checkpoint/test_checkpoint_verify.py",)),
    # ---- audit
    Mutant("audit/missing_steps_off_by_one", "mspretrain/forensics/audit.py", "elif step > state.step + 1:", "elif step > state.step + 2:",
           ("tests/forensics/test_audit.py", "-m", "not slow")),
    Mutant("audit/repeated_metrics_line", "mspretrain/forensics/audit.py", "        if step <= last:\n", "        if step < last:\n",
           ("tests/forensics/test_audit.py", "-m", "not slow")),
    Mutant("audit/replayed_vs_skipped", "mspretrain/forensics/audit.py", 'samples replayed" if have < want else',
           'samples replayed" if have > want else', ("tests/forensics/test_audit.py",)),
    # ---- eval
    Mutant("eval/acc_norm_not_normalised", "mspretrain/eval/choices.py",
           "return int(np.argmax(np.asarray(self.logprob) / np.asarray(self.tokens)))",
           "return int(np.argmax(np.asarray(self.logprob)))", ("tests/eval/test_choices.py", "-k", "normalisation")),
    Mutant("eval/bpc_per_token", "mspretrain/eval/perplexity.py", 'res["bpc"] = res["nll"] / math.log(2) / chars_per_token',
           'res["bpc"] = res["nll"] / math.log(2)', ("tests/eval/test_eval.py",)),
    Mutant("eval/perplexity_counts_padding", "mspretrain/eval/perplexity.py", "count += real * seq_len", "count += chunk.size * seq_len",
           ("tests/eval/test_eval.py",)),
]


def restore_leftovers() -> None:
    """Put back any file a killed earlier run left mutated."""
    if not BACKUP.is_dir():
        return
    for saved in BACKUP.rglob("*.py"):
        target = ROOT / saved.relative_to(BACKUP)
        shutil.copyfile(saved, target)
        print(f"restored {target.relative_to(ROOT)} from an interrupted run", flush=True)
    shutil.rmtree(BACKUP)


def _terminate(_signum, _frame):
    raise KeyboardInterrupt


def run_tests(args: tuple[str, ...], timeout: float) -> tuple[int | None, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_v="3")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=timeout), time.time() - t0
    except subprocess.TimeoutExpired:
        return None, time.time() - t0
    finally:
        if proc.poll() is None:  # timeout or Ctrl-C: the whole pytest process group (msrun workers too)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_mutant(m: Mutant, timeout: float) -> tuple[str, float]:
    path = ROOT / m.file
    text = path.read_text(encoding="utf-8")
    if text.count(m.original) != 1:
        return f"STALE (the snippet occurs {text.count(m.original)} times)", 0.0
    backup = BACKUP / m.file
    backup.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, backup)
    try:
        path.write_text(text.replace(m.original, m.mutated), encoding="utf-8")
        rc, took = run_tests(m.tests, timeout)
    finally:
        path.write_text(text, encoding="utf-8")
        shutil.rmtree(BACKUP)
    verdict = {0: "SURVIVED", 1: "CAUGHT", None: "TIMEOUT"}.get(rc, f"ERROR (pytest exit {rc})")
    return verdict, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="run only mutants whose name contains one of these")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="run the selected mutants' tests on the unmutated code")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant (default 900)")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or any(w in m.name for w in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:48s} {m.file}  ->  {' '.join(m.tests)}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    restore_leftovers()
    if args.baseline:
        failed = 0
        for tests in dict.fromkeys(m.tests for m in chosen):
            rc, took = run_tests(tests, args.timeout)
            failed += rc != 0
            print(f"{'ok' if rc == 0 else f'FAILED (exit {rc})':20s} {took:6.0f} s  {' '.join(tests)}", flush=True)
        return 1 if failed else 0
    caught = 0
    try:
        for m in chosen:
            verdict, took = run_mutant(m, args.timeout)
            caught += verdict == "CAUGHT"
            print(f"{verdict:10s} {took:6.0f} s  {m.name}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the mutated file was restored", flush=True)
        return 130
    print(f"caught {caught} of {len(chosen)}", flush=True)
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
