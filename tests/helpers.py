"""What several test modules share, in one place: a test module imports from here (or from
tests/conftest.py, the fixtures and the tiny corpus), never from another test module.

Light to import: MindSpore, torch, transformers and sentencepiece are imported inside the helpers
that need them, so a test of pure Python does not pay for them.

- the command line in this process: `cli`, `refused`, `assert_refusal`, `assert_user_error`; what a
  command may not change: `checksum`, `state`;
- independent references of kernels only Ascend has: `rms_norm_reference`, `kernel_discard`,
  `flash_reference`;
- HF material made here (no download): `HF_VOCAB`, `train_tokenizer`, `tiny_hf_llama`;
- data dirs written by hand for the loader: `SEQ`, `make_dir`, `counting_dir`, `raw_windows`, `loader`;
- `prepare` in a subprocess (`prepare_subprocess`, `files_of`) and a dedup corpus with its
  in-memory reference (`dedup_corpus`, `dedup_reference`);
- msrun runs: `MSRUN`, `ARGS`/`STEPS`/`FINAL` (the reference run's), `msrun`, `losses`, `grad_norms`,
  `step_dir`, `replica_hashes`, `two_nodes`, `resume_on_one_process`, `assert_two_ranks_equal_one_process`,
  `fp16_run_equals_one_process`; a job killed or stopped mid-run: `LONG`, `start_launch`, `wait_for_rank`,
  `wait_for_beat_after`, `ended_within`, `kill_tree`;
- a two-node Ray cluster for `prepare --ray`: `ray_env`, `ray_cluster` (a module fixture), `run_local`,
  `run_prepare`, `same_files`; prepare killed and rerun: `killed_then_rerun`, `points_of`, `chosen`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.conftest import NO_EVAL, ONE_LAYER, REFERENCE_ARGS, REFERENCE_STEPS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


# --------------------------------------------------------------------------- the command line

def cli(capsys, *argv: object) -> tuple[int, str, str]:
    """`mspretrain ARGV` in this process: (exit code, stdout, stderr) of this call alone (what was
    captured before is dropped first). argparse's own refusals leave through SystemExit
    (cli._Parser.error); their exit code is returned like any other."""
    from mspretrain.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_refusal(code: int, err: str, needle: str = "") -> None:
    """The refusal contract: exit code 2, one `error:` line (holding `needle`), one `hint:` line, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert needle in lines[0], (needle, err)


def refused(capsys, *argv: object) -> str:
    """Run the command line, assert the refusal contract, return stderr."""
    code, _, err = cli(capsys, *argv)
    assert_refusal(code, err)
    return err


def assert_user_error(fn: Callable[[], object], *needles: str):
    """`fn()` raises a `UserError` whose cause (holding every needle) and fix are one line each."""
    from mspretrain.errors import UserError

    with pytest.raises(UserError) as exc:
        fn()
    e = exc.value
    assert e.cause and e.fix and "\n" not in e.cause and "\n" not in e.fix, str(e)
    for needle in needles:
        assert needle in e.cause, e.cause
    return e


# --------------------------------------------------------------------------- kernels only Ascend has

def rms_norm_reference(x, gamma, epsilon=1e-6):
    """ops.rms_norm's documented semantics (ops/auto_generate/gen_ops_def.py, `rms_norm`):
    y = x * rsqrt(mean(x^2, -1) + eps) * gamma, and rstd; computed here with CPU ops."""
    from mindspore import ops

    rstd = ops.rsqrt((x * x).mean(-1, keep_dims=True) + epsilon)
    return x * rstd * gamma, rstd


def kernel_discard(sparse_mode: int, pre_tokens: int, next_tokens: int, attn_mask: np.ndarray, S: int) -> np.ndarray:
    """The mask FlashAttentionScore applies for self-attention of length S (1 = discard), as 2.10's
    docstring (ops/auto_generate/gen_ops_prim.py) documents it, broadcastable to (B, N1, S, S):

    - the band: query i computes keys i - pre_tokens <= j <= i + next_tokens ("the part between
      counting preTokens and nextTokens"; the bounds as Huawei's CPU golden of the kernel draws them,
      mindstudio-probe's npu_fusion_attention.py generate_atten_mask);
    - sparse_mode 2 (leftUpCausal) and 4 (band) take the compressed 2048x2048 mask, triu(1), and
      apply causal (2, pre/next ignored) or the band (4); S1 == S2 here, so left-up and right-down
      origins coincide;
    - sparse_mode 0 takes the full (B, 1, S, S) mask and computes only within the band."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    outside_band = (j - i > next_tokens) | (i - j > pre_tokens)
    if sparse_mode in (2, 4):
        assert attn_mask.shape == (2048, 2048) and np.array_equal(attn_mask, np.triu(np.ones((2048, 2048), bool), 1))
        return (j > i)[None, None] if sparse_mode == 2 else outside_band[None, None]
    assert sparse_mode == 0 and attn_mask.ndim == 4 and attn_mask.shape[1:] == (1, S, S)
    return attn_mask | outside_band[None, None]


def flash_reference(prim, seen: list | None = None, out_dtype=np.float16):
    """FlashAttentionScore as documented (BNSD; N2 divides N1; the mask of `kernel_discard`), in
    numpy, with layout assertions; `seen` collects (sparse_mode, pre_tokens, next_tokens, attn_mask).

    UNVERIFIED ON HARDWARE: this is checked against our reading of the kernel's docs, not against
    the kernel (CPU has none). A misreading shared by the model code and this stand-in passes
    here; `mspretrain selftest` runs the same comparison against the real kernel on a 910B."""
    import mindspore as ms

    attrs = prim.init_attrs

    def run(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, qlen, kvlen):
        assert attrs["input_layout"] == "BNSD" and attrs["keep_prob"] == 1.0
        assert real_shift is None and drop_mask is None and padding_mask is None and prefix is None and qlen is None
        assert q.dtype == k.dtype == v.dtype and q.dtype in (ms.float16, ms.bfloat16)
        qn, kn, vn = (t.asnumpy().astype(np.float32) for t in (q, k, v))
        B, N1, S1, D = qn.shape
        N2 = kn.shape[1]
        assert attrs["head_num"] == N1 and N1 % N2 == 0 and kn.shape == vn.shape == (B, N2, S1, D)
        mask = attn_mask.asnumpy().astype(bool)
        if seen is not None:
            seen.append((attrs["sparse_mode"], attrs["pre_tokens"], attrs["next_tokens"], attn_mask))
        discard = kernel_discard(attrs["sparse_mode"], attrs["pre_tokens"], attrs["next_tokens"], mask, S1)
        kr, vr = np.repeat(kn, N1 // N2, axis=1), np.repeat(vn, N1 // N2, axis=1)  # head h uses kv head h // G
        s = attrs["scale_value"] * qn @ kr.transpose(0, 1, 3, 2)
        s = np.where(discard, -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        out = (p / p.sum(-1, keepdims=True)) @ vr
        return (None, None, None, ms.Tensor(out.astype(out_dtype)))

    return run


# --------------------------------------------------------------------------- HF material made here

HF_VOCAB = 320  # the vocabulary of `train_tokenizer`'s tokenizers in the HF tests


def train_tokenizer(path: Path, vocab: int) -> Path:
    """A small SentencePiece BPE model (byte fallback, Llama's special ids) written to `path`."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 40)]
    texts = ["".join(rng.choice(chars) for _ in range(rng.randint(4, 30))) + "，hello 12。" for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=vocab, character_coverage=1.0,
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def tiny_hf_llama(seed: int = 0, vocab: int = HF_VOCAB, tied: bool = False):
    """A random transformers Llama with configs/tiny.toml's model keys (dim 64, 2 layers, 4 heads,
    2 KV heads, 128 positions)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hc = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return transformers.LlamaForCausalLM(hc).eval()


# --------------------------------------------------------------------------- data dirs written by hand

SEQ = 8
EOS = 2


def make_dir(root: Path, name: str, docs: list[np.ndarray], *, vocab: int = 65000, fingerprint: str | None = None,
             extra: dict | None = None) -> Path:
    """A data dir with one `train` split of these documents and a hand-written manifest."""
    from mspretrain.data.shards import ShardWriter, token_dtype

    d = root / name
    d.mkdir()
    w = ShardWriter(d / "train", token_dtype(vocab))
    for doc in docs:
        w.add(doc)
    w.finalize()
    manifest = {"fingerprint": fingerprint or f"fp-{name}", "tokens": {"train": int(sum(len(x) for x in docs))},
                "vocab_size": vocab, "special_ids": {"bos": 1, "eos": EOS, "pad": 0, "unk": 3}, **(extra or {})}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def counting_dir(root: Path, name: str, n_tokens: int, offset: int = 0) -> Path:
    """Tokens offset, offset+1, ... split into uneven documents."""
    toks = np.arange(offset, offset + n_tokens, dtype=np.int64)
    cuts = np.arange(7, n_tokens, 13)
    return make_dir(root, name, np.split(toks, cuts))


def raw_windows(d: Path) -> np.ndarray:
    """Independent reference: every window of the split, sliced from the raw `.bin` bytes."""
    flat = np.fromfile(d / "train.bin", dtype=np.uint16).astype(np.int64)
    n = (flat.size - 1) // SEQ
    return np.stack([flat[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])


def loader(d: Path | None, *, sources: list | None = None, **kw):
    from mspretrain.data.loader import Loader

    args = dict(split="train", seq_len=SEQ, batch_size=4, seed=7, log=lambda m: None)
    args.update(kw)
    return Loader(sources if sources is not None else [(d, 1.0)], **args)


# --------------------------------------------------------------------------- prepare in a subprocess, dedup

PREPARE_ARGS = ["--doc-per-line", "--valid-fraction", "0.1", "prepare.near_dedup=true"]
PREPARE_TEST_ENV = ("MSPRETRAIN_PREPARE_TEST_POINTS", "MSPRETRAIN_PREPARE_TEST_KILL", "MSPRETRAIN_PREPARE_COMMIT_SECONDS",
                    "MSPRETRAIN_PREPARE_TEST_WORKER_KILL")
# prepare with every chunk's documents through the main process (`--ray`'s path; the default
# with local workers keeps them in per-chunk files): the same bytes
THROUGH_MAIN = ("import sys\nfrom mspretrain.prepare import pipeline\nfrom mspretrain.cli import main\n"
                "pipeline.LOCAL_PIECES = False\nsys.exit(main(sys.argv[1:]))\n")


def prepare_subprocess(raw: Path, out: Path, *extra: str, env: dict | None = None, workers: int = 2,
                       through_main: bool = False) -> subprocess.CompletedProcess:
    """`mspretrain prepare RAW --out OUT` with PREPARE_ARGS (and a 500-piece tokenizer unless
    `--tokenizer` is given) in its own process group, which is killed afterwards: a killed run's
    pool workers are never left behind."""
    e = {k: v for k, v in os.environ.items() if k not in PREPARE_TEST_ENV}
    e.update(PYTHONPATH=str(ROOT), GLOG_v="3", **(env or {}))
    vocab = [] if "--tokenizer" in extra else ["--vocab-size", "500"]
    head = ["-c", THROUGH_MAIN] if through_main else ["-m", "mspretrain.cli"]
    cmd = [sys.executable, *head, "prepare", str(raw), "--out", str(out), "--workers", str(workers),
           *PREPARE_ARGS, *vocab, *extra, "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:  # pool workers of a killed run: none should be left, but never leak one
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def points_of(p: subprocess.CompletedProcess) -> list[str]:
    """The unit boundaries a prepare run passed (`prepare-point:` lines, MSPRETRAIN_PREPARE_TEST_POINTS)."""
    return [ln.split(": ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("prepare-point: ")]


def chosen(points: list[str], stage: str) -> str:
    """The point of `stage` a test kills at: the middle one of its kind."""
    mine = [p for p in points if p.startswith(stage)]
    assert mine, f"no progress line of {stage} in {points}"
    return mine[len(mine) // 2]


def killed_then_rerun(raw: Path, out: Path, at: str, *extra: str, **kw) -> list[str]:
    """Kill -9 at the point `at` (a commit after every unit), rerun the same command with one
    worker; the rerun's progress points."""
    killed = prepare_subprocess(raw, out, *extra, env={"MSPRETRAIN_PREPARE_TEST_KILL": at, "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"},
                                **kw)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = prepare_subprocess(raw, out, *extra, workers=1, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"}, **kw)
    assert again.returncode == 0, again.stderr
    return points_of(again)


def files_of(d: Path) -> dict[str, bytes]:
    """The files of a dir (not recursive), name -> bytes: two data dirs compare byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def dedup_corpus(n: int, seed: int) -> list[str]:
    """Random Chinese-ish documents with exact copies, one-character edits and edits of edits."""
    rng = np.random.default_rng(seed)
    alpha = [chr(0x4E00 + 7 * i) for i in range(400)]
    docs: list[str] = []
    for _ in range(n):
        r = rng.random()
        if docs and r < 0.1:
            docs.append(docs[int(rng.integers(len(docs)))])
        elif docs and r < 0.3:
            src = docs[int(rng.integers(len(docs)))]
            pos = int(rng.integers(len(src)))
            docs.append(src[:pos] + alpha[int(rng.integers(400))] + src[pos + 1:])
        else:
            docs.append("".join(alpha[j] for j in rng.integers(0, 400, size=int(rng.integers(20, 120)))))
    return docs


def dedup_reference(docs: list[str], threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(exact duplicates, near duplicates) by the in-memory indexes, greedily in input order."""
    from mspretrain.prepare import dedup

    exact, near = dedup.ExactDedup(), dedup.NearDedup(threshold, seed=3)
    sigs = dedup.signatures(docs, seed=3)
    e = np.zeros(len(docs), dtype=bool)
    m = np.zeros(len(docs), dtype=bool)
    for i, d in enumerate(docs):
        if exact.seen(dedup.dedup_key(d)):
            e[i] = True
        elif near.seen(sigs[i]):
            m[i] = True
    return e, m


# --------------------------------------------------------------------------- msrun runs

# msrun ships with MindSpore next to this interpreter; CI runs the venv's python without the venv on PATH.
MSRUN = shutil.which("msrun", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")

# The msrun runs use the config of the session's single-process `reference_run` (tests/conftest.py):
# 8 steps, a checkpoint after each, every grad norm logged; without its final evaluation (`NO_EVAL`).
ARGS = [*REFERENCE_ARGS, "--quiet", NO_EVAL]
STEPS = list(range(1, REFERENCE_STEPS + 1))
FINAL = REFERENCE_STEPS


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and everything under it (msrun and its workers are in their own groups)."""
    from mspretrain.launcher.watchdog import kill_tree as kill

    kill(proc.pid)
    proc.wait(timeout=30)


def msrun(tmp_path: Path, data: Path, run: Path, *extra: str, args: list[str] = ARGS, nproc: int = 2,
          timeout: float = 600) -> None:
    """`nproc` workers through `mspretrain launch` (which must find msrun and itself next to the
    interpreter: CI runs the venv's python without the venv on PATH, as here); the tiny config,
    `args` (the reference run's) and `extra`. Asserts exit 0, with the workers' logs."""
    from mspretrain.parallel.distributed import free_local_port

    logs = tmp_path / f"logs-{run.name}"
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", str(nproc), "--master-port", str(free_local_port()),
           "--log-dir", str(logs), "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), *args, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})
    try:
        proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # a timeout: msrun and its workers (own process groups) go too,
            kill_tree(proc)      # not left training beside the rest of the suite
    text = "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))
    assert proc.returncode == 0, text[-3000:]


def losses(run: Path) -> dict[int, float]:
    """step -> loss, from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def final_nll(run: Path) -> float:
    """The valid NLL a run's final evaluation logged (its last metrics record)."""
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/nll" in last, f"{run.name}: no evaluation at its last step: {sorted(last)}"
    return last["eval/nll"]


def grad_norms(run: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "grad_norm" in r}


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def replica_hashes(run: Path) -> list[str]:
    """Each rank's digest of its weights (ranks/rank_*.json): equal when the replicas agree."""
    return [json.loads(p.read_text())["weights_sha256"] for p in sorted((run / "ranks").glob("rank_*.json"))]


def two_nodes(tmp_path: Path, data: Path, run: Path, *args: str, timeout: float = 900) -> None:
    """Node 0 and node 1 as two `mspretrain launch --nodes 2` processes of one worker each, as two
    hosts would run them: both exit 0, one scheduler, each node its own log dir."""
    from mspretrain.parallel.distributed import free_local_port

    logs, port = tmp_path / f"logs-{run.name}", str(free_local_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "1", "--nodes", "2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", port, "--log-dir", str(logs),
               "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), "--quiet", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "GLOG_v": "3"}))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        from mspretrain.launcher.watchdog import kill_tree

        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=30)
    logs_text = "".join(f.read_text(errors="replace")[-1500:] for f in sorted(logs.rglob("*.log")))
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node}: {out[-2000:]}\n{logs_text}"
    # one scheduler, each node its own log dir (two schedulers would fight over the port and scheduler.log)
    assert (logs / "node_0" / "scheduler.log").is_file() and (logs / "node_0" / "worker_0.log").is_file()
    assert (logs / "node_1" / "worker_1.log").is_file()


def resume_on_one_process(run: Path, data: Path, tmp_path: Path, at: int, *extra: str) -> Path:
    """A copy of `run` as it was after the save of step `at`, resumed to the end by one process
    (the tiny config, `ARGS`, `extra`)."""
    from mspretrain.cli import main

    resumed = tmp_path / f"resumed-{run.name}"
    shutil.copytree(run, resumed)
    for step in range(at + 1, FINAL + 1):
        shutil.rmtree(step_dir(resumed, step))
    (resumed / "metrics.jsonl").write_text("".join(l + "\n" for l in (resumed / "metrics.jsonl").read_text().splitlines()
                                                   if json.loads(l).get("step", 0) <= at))
    assert main(["train", "--config", str(TINY), "--data", str(data), "--run", str(resumed), *ARGS, *extra]) == 0
    assert f"resumed from step_{at:06d}" in (resumed / "train.log").read_text()
    return resumed


def assert_two_ranks_equal_one_process(two: Path, reference_run: Path, data: Path, tmp_path: Path) -> Path:
    """A 2-rank run against the one-process reference: losses (1e-5), grad norms (rel 1e-5), the
    final checkpoint, identical replicas; then resumed from its step 5 on one process, the same
    losses and grad norms to the end. Returns the resumed run dir."""
    from tests.conftest import assert_same_checkpoint

    one, got = losses(reference_run), losses(two)
    assert sorted(got) == STEPS
    for step in one:
        assert abs(one[step] - got[step]) <= 1e-5, (step, one[step], got[step])
    one_gn, got_gn = grad_norms(reference_run), grad_norms(two)
    for step in one_gn:
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], got_gn[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(step_dir(two, FINAL), step_dir(reference_run, FINAL), 1e-5)

    resumed = resume_on_one_process(two, data, tmp_path, 5)
    after, after_gn = losses(resumed), grad_norms(resumed)
    for step in range(6, FINAL + 1):
        assert abs(after[step] - one[step]) <= 1e-5, (step, one[step], after[step])
        assert after_gn[step] == pytest.approx(one_gn[step], rel=1e-5)
    return resumed


def fp16_run_equals_one_process(two: Path, one: Path) -> tuple[dict, dict]:
    """A 2-worker fp16 run against the same config on one process: losses, identical replicas,
    the final checkpoint. Returns both runs' losses by step."""
    from tests.conftest import assert_same_checkpoint

    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == STEPS
    # The two ranks sum the gradients in another order, and fp16 weights can round the other way
    # from there (one fp16 ulp of a weight is ~1e-3 relative): measured 1.7e-5 at step 7 of 8 with
    # the initial weights before issue 38, and 1.2e-5 at step 3 (ZeRO-2, bucket_mb 0) with the
    # counter-based draw; a loss of ~6.2, so 3e-5 is 5e-6 relative.
    for step in a:
        assert abs(a[step] - b[step]) <= (3e-5 if step <= 5 else 1e-4), (step, a[step], b[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # fp16 weights: one ulp is ~1e-3 relative, and summation order flips some roundings (measured
    # 1.6e-4 and 7.7e-4 in two runs), as in the fp16-wire test of test_distributed.py
    assert_same_checkpoint(step_dir(two, FINAL), step_dir(one, FINAL), 5e-3)
    return a, b


# --------------------------------------------------------------------------- a job killed or stopped mid-run

DEATH_BOUND_S = 60  # the job must end this long after a worker is killed or stopped, at most
# a constant lr: a relaunch that lowers max_steps would re-stretch a cosine schedule
LONG = ["train.max_steps=400", "checkpoint.every=2", "checkpoint.keep_last=3", "train.log_every=1", "schedule.kind=constant", NO_EVAL,
        ONE_LAYER]


def start_launch(tmp_path: Path, data: Path, run: Path, *extra: str, launch: tuple[str, ...] = ()) -> subprocess.Popen:
    """A 2-worker `mspretrain launch` of the tiny config, left running (the caller ends it)."""
    from mspretrain.parallel.distributed import free_local_port

    logs = tmp_path / f"logs-{run.name}"
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "2", "--master-port", str(free_local_port()), "--log-dir", str(logs),
           *launch, "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), "--quiet", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})


def wait_for_rank(run: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 600, not_pid: int = 0) -> dict:
    """Rank `rank`'s heartbeat once it has finished `step` steps (and a checkpoint exists); after a
    relaunch, `not_pid` (the old rank's) skips the heartbeat the killed job left behind."""
    import time

    path = run / "heartbeat" / f"rank_{rank:05d}.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("step", 0) >= step and beat.get("pid") != not_pid and list((run / "checkpoints").glob("step_*[0-9]")):
            return beat
        time.sleep(0.5)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")


def wait_for_beat_after(run: Path, rank: int, t0: float, proc: subprocess.Popen, timeout: float = 15) -> None:
    """Until rank `rank` has written a heartbeat after time `t0`."""
    import time

    path = run / "heartbeat" / f"rank_{rank:05d}.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads(path.read_text()).get("time", 0) > t0:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} wrote no heartbeat in the {timeout} s after the stop")


def ended_within(proc: subprocess.Popen, t0: float) -> tuple[str, float]:
    """The job's stderr once it has ended, and the seconds since `t0` (at most DEATH_BOUND_S + 30)."""
    import time

    try:
        _, err = proc.communicate(timeout=DEATH_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"the job still ran {DEATH_BOUND_S + 30} s after the signal") from None
    return err, time.time() - t0


# --------------------------------------------------------------------------- trees of files

def checksum(d: Path) -> dict[str, str]:
    """Every file and directory under `d` (a missing `d` is {}), files with their sha256; the lock
    file left out (a refused command may take the lock before it refuses: that is the lock's job).
    `state` is the stricter form: modes, mtimes and lock files too."""
    import hashlib

    from mspretrain.checkpoint.lock import LOCK_NAME

    if not d.exists():
        return {}
    out = {}
    for p in sorted(d.rglob("*")):
        if p.name == LOCK_NAME:
            continue
        out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def state(d: Path) -> dict[str, tuple]:
    """Every entry under `d`: mode, size, mtime and (files) sha256; symlinks by their target. Equal
    before and after a command: it touched nothing there, not even a lock file or a timestamp."""
    import hashlib

    out = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if p.is_symlink():
                what = "->" + os.readlink(p)
            elif p.is_file():
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                what = "dir"
            out[str(p.relative_to(d))] = (st.st_mode, st.st_size if p.is_file() else 0, st.st_mtime_ns, what)
    return out


# --------------------------------------------------------------------------- a two-node Ray cluster

RAY_START_SECONDS = 90  # a node's `ray start` on a busy 2-core box


def ray_env() -> dict:
    # the nodes' worker processes import this tree's mspretrain, as the driver does
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray 2.60 turns token authentication on at the head when ~/.ray/auth_token exists
            # (left by any earlier `ray get-auth-token --generate`), while a node started without
            # RAY_AUTH_MODE=token does not send it and cannot join: one mode for every process here
            "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def ray_cluster():
    """HOST:PORT of a Ray head (0 CPUs) with one worker node (1 CPU), both killed at the end.
    A module fixture: a test module takes it with `from tests.helpers import ray_cluster`."""
    import tempfile
    import time

    import ray  # noqa: F401  a pinned test dependency (pyproject [test]): missing must fail, not skip

    from mspretrain.parallel.distributed import free_local_port

    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    tmp = tempfile.mkdtemp(prefix="msr-", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    port = free_local_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory=80000000", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str) -> None:
        log = open(Path(tmp) / f"{name}.log", "wb")
        procs.append(subprocess.Popen([ray_bin, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                      env=ray_env(), start_new_session=True))  # its own group: killed whole below

    def started(name: str) -> bool:  # `ray start` prints this once its node has joined
        return "Ray runtime started" in (Path(tmp) / f"{name}.log").read_text(errors="replace")

    def nodes_up() -> bool:
        try:  # a `ray status` slow on a loaded box is "not yet": RAY_START_SECONDS bounds the wait
            out = subprocess.run([ray_bin, "status", f"--address={address}"], capture_output=True, text=True, env=ray_env(),
                                 timeout=max(1.0, min(30.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            return False
        return out.stdout.count(" node_") >= 2

    try:
        # both at once: the worker node waits for the head's GCS by itself
        start(["--head", f"--port={port}", "--num-cpus=0", f"--temp-dir={tmp}/t", "--include-dashboard=false"], "head")
        start([f"--address={address}", "--num-cpus=1"], "worker")
        deadline = time.time() + RAY_START_SECONDS
        while not (started("head") and started("worker") and nodes_up()):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                logs = "\n".join((Path(tmp) / f"{n}.log").read_text(errors="replace")[-2000:] for n in ("head", "worker"))
                raise AssertionError(f"the Ray cluster did not come up with 2 nodes in {RAY_START_SECONDS} s:\n{logs}")
            time.sleep(0.5)
        yield address
    finally:
        for p in reversed(procs):  # SIGTERM lets `ray start --block` stop its node; SIGKILL whatever is left
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 3
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def run_local(corpus: Path, out: Path, *extra: str) -> None:
    """`prepare` without --ray, in this process (no Ray in it)."""
    from mspretrain.cli import main

    assert main(["prepare", str(corpus), "--out", str(out), *extra, "--workers", "2", "--quiet",
                 "prepare.min_chars=4", "prepare.valid_fraction=0.1"]) == 0


def run_prepare(corpus: Path, out: Path, *extra: str) -> str:
    """The CLI in a process of its own, as a user runs it (ray.init's state stays out of pytest); its stdout."""
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--out", str(out), *extra,
           "prepare.min_chars=4", "prepare.valid_fraction=0.1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ray_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""  # Ray's own log lines stay out of prepare's output
    return r.stdout


def same_files(a: Path, b: Path) -> None:
    """Two data dirs hold the same file names, byte for byte."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "train.bin" in names and "manifest.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def read_tb_scalars(tb_dir: Path) -> dict[str, list[int]]:
    """tag -> steps, from TensorBoard event files: TensorBoard's own reader when it is installed,
    else the TFRecord framing (u64 length, u32 crc, payload, u32 crc) parsed with the Event proto."""
    import struct

    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[int]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            ev = Event.FromString(payload)
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append(ev.step)
    return out


def make_corpus(d: Path) -> Path:
    """Several small one-document-per-line files (a chunk each), exact duplicates across them,
    a .jsonl first (read by reference and parsed in the workers), an empty file and undecodable
    bytes (warnings and per-file counts that a resume must restore)."""
    from tests.conftest import make_poems

    d.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(500, seed=5)]
    for k in range(5):
        (d / f"p{k}.txt").write_text("\n".join(poems[k * 100: (k + 1) * 100] + poems[:4]) + "\n", encoding="utf-8")
    # read first: the chunks a resume skips include .jsonl blocks
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": p}, ensure_ascii=False) for p in poems[:60]) + "\n", encoding="utf-8")
    (d / "r.txt").write_bytes("一二三四五六七八九十\n".encode() + b"\xff\xfe\n" + "春眠不觉晓处处闻啼鸟\n".encode())
    (d / "s.txt").write_bytes(b"")
    return d
