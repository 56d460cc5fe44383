"""`prepare` in a subprocess (`prepare_subprocess`, `files_of`), killed and rerun (`killed_then_rerun`,
`points_of`, `chosen`), a small multi-file corpus (`make_corpus`) and a dedup corpus with its
in-memory reference (`dedup_corpus`, `dedup_reference`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import ROOT

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
