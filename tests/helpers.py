"""What several test modules share, in one place: a test module imports from here (or from
tests/conftest.py, the fixtures and the tiny corpus), never from another test module.

Light to import: MindSpore, torch, transformers and sentencepiece are imported inside the helpers
that need them, so a test of pure Python does not pay for them.

- the command line in this process: `cli`, `refused`, `assert_refusal`, `assert_user_error`;
- independent references of kernels only Ascend has: `rms_norm_reference`, `kernel_discard`,
  `flash_reference`;
- HF material made here (no download): `HF_VOCAB`, `train_tokenizer`, `tiny_hf_llama`;
- data dirs written by hand for the loader: `SEQ`, `make_dir`, `counting_dir`, `raw_windows`, `loader`;
- `prepare` in a subprocess (`prepare_subprocess`, `files_of`) and a dedup corpus with its
  in-memory reference (`dedup_corpus`, `dedup_reference`);
- msrun runs: `MSRUN`, `losses`, `grad_norms`, `step_dir`, `replica_hashes`, `two_nodes`.
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


def losses(run: Path) -> dict[int, float]:
    """step -> loss, from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


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
    from mspretrain.train.distributed import free_local_port

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
        from mspretrain.ops.watchdog import kill_tree

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


# --------------------------------------------------------------------------- trees of files

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
