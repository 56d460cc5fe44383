"""`prepare --ray` against the same command with local worker processes, on one machine.

Starts a two-node Ray cluster on 127.0.0.1 (a head and one worker node, `ray start --block`,
N CPUs each, killed at the end), writes a synthetic one-document-per-line corpus
(`prepare_scale_bench.build_corpus`: planted exact and near duplicates), trains a tokenizer on its
start, then times `mspretrain prepare CORPUS --tokenizer T` with `--workers 2N` and with
`--ray HEAD` (the same 2N CPUs), near dedup off and on, and checks that the outputs are
byte-identical. On one box Ray only adds work (task submission, the object store, one more copy
of every chunk and result): the ratio is its overhead, not a speed-up.

Usage: nice python benchmarks/prepare_ray_bench.py [--docs 100000] [--cpus-per-node 1] [--repeat 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prepare_scale_bench import build_corpus  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_v="3", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(tmp: Path, cpus: int) -> tuple[str, list[subprocess.Popen]]:
    ray_bin = str(Path(sys.executable).parent / "ray")
    address = f"127.0.0.1:{free_port()}"
    common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--object-store-memory=200000000", "--disable-usage-stats"]
    procs = []
    for args in (["--head", f"--port={address.split(':')[1]}", f"--temp-dir={tmp}/t", "--include-dashboard=false"], [f"--address={address}"]):
        procs.append(subprocess.Popen([ray_bin, "start", *args, *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=ENV, start_new_session=True))
        want = len(procs)
        for _ in range(120):
            out = subprocess.run([ray_bin, "status", f"--address={address}"], capture_output=True, text=True, env=ENV)
            if out.stdout.count(" node_") >= want:
                break
            time.sleep(1)
        else:
            stop_cluster(procs)
            raise SystemExit("the Ray cluster did not start")
    return address, procs


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    time.sleep(5)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run(corpus: Path, tok: Path, out: Path, near: bool, *how: str) -> float:
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--doc-per-line", "--tokenizer", str(tok),
           "--out", str(out), "--quiet", "--overwrite", f"prepare.near_dedup={str(near).lower()}", *how]
    t0 = time.time()
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"prepare failed:\n{proc.stdout}{proc.stderr}")
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="msrb-", dir="/tmp"))
    try:
        corpus = tmp / "corpus.txt"
        build_corpus(corpus, args.docs, 0.05, 0.05)
        head = tmp / "head.txt"
        with open(corpus, "rb") as f:
            head.write_bytes(b"".join(f.readline() for _ in range(20_000)))
        subprocess.run([sys.executable, "-m", "mspretrain.cli", "prepare", str(head), "--doc-per-line", "--vocab-size", "4000",
                        "--out", str(tmp / "tok"), "--quiet", "--workers", "1"], env=ENV, check=True)
        tok = tmp / "tok" / "tokenizer.model"
        mb = corpus.stat().st_size / 1e6
        address, procs = start_cluster(tmp, args.cpus_per_node)
        workers = 2 * args.cpus_per_node
        print(f"corpus: {args.docs:,} documents, {mb:.1f} MB; Ray: 2 nodes x {args.cpus_per_node} CPU on 127.0.0.1; "
              f"local: --workers {workers}; best of {args.repeat}")
        try:
            for near in (False, True):
                local = min(run(corpus, tok, tmp / "local", near, "--workers", str(workers)) for _ in range(args.repeat))
                ray = min(run(corpus, tok, tmp / "ray", near, "--ray", address) for _ in range(args.repeat))
                same = all((tmp / "local" / p.name).read_bytes() == p.read_bytes() for p in (tmp / "ray").iterdir())
                print(f"near_dedup={str(near).lower():5}  local {local:6.1f} s ({mb / local:5.1f} MB/s)   "
                      f"ray {ray:6.1f} s ({mb / ray:5.1f} MB/s)   ray/local throughput {local / ray:.2f}x   byte-identical: {same}")
        finally:
            stop_cluster(procs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
