"""What `prepare`'s progress journal costs (issue 29, resume after kill -9).

Runs the whole `prepare` (pass 1, dedup, tokenizer training, pass 2, publish) on the
`prepare_bench.py` corpus with the journal committing at different intervals
(`MSPRETRAIN_PREPARE_COMMIT_SECONDS`): "stages only" (1e9 s: only the few commits at stage ends,
the reference), the default (`resume.COMMIT_SECONDS`), 1 s, and after every unit (0). Settings
alternate in each round so that load from other jobs hits them alike; the best wall time of
each is reported with its ratio to the reference, the number of commits and the time spent in
them (serial time of the main process: the direct measure, which the box's noise does not blur). The data dirs
must be byte-identical (the data fingerprint and the manifest are compared).

With `--given-tokenizer` the corpus is first prepared once to get a tokenizer, which every timed
run is then given: the one-pass path whose replay (pieces cut by the workers) commits per chunk.
The time in commits is also split by kind (pass 1, replay, pass 2, stage ends), and the dedup
partitions' result files (each written atomically and fsynced) are timed as well.

Usage: python benchmarks/prepare_resume_bench.py [--mb 20] [--workers 2] [--repeat 2] [--given-tokenizer]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prepare_bench import build_corpus  # noqa: E402
from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.prepare import diskdedup, resume, stage  # noqa: E402
from mspretrain.prepare.prepare import prepare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--given-tokenizer", action="store_true", help="give every timed run a tokenizer (one pass, pieces replay)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prepare_resume_bench_"))
    commits = [0, 0.0]  # commits, seconds spent in them (fsyncs, the journal's rename, the stage state files)
    plain = resume.Journal.commit

    kinds: dict[str, list] = {}  # kind of commit -> [commits, seconds]

    def counted(self, **kw):
        t = time.perf_counter()
        plain(self, **kw)
        spent = time.perf_counter() - t
        commits[0] += 1
        commits[1] += spent
        kind = "stage end" if "stage" in kw else next((k for k in ("pass1", "replay", "pass2") if k in kw), "other")
        k = kinds.setdefault(kind, [0, 0.0])
        k[0] += 1
        k[1] += spent

    resume.Journal.commit = counted
    plain_writer = diskdedup.atomic_writer

    @contextlib.contextmanager
    def timed_writer(*a, **kw):  # a dedup partition's result file: its commit
        t = time.perf_counter()
        with plain_writer(*a, **kw) as f:
            yield f
        k = kinds.setdefault("dedup partition", [0, 0.0])
        k[0] += 1
        k[1] += time.perf_counter() - t

    diskdedup.atomic_writer = timed_writer
    save = stage.Run.save_state

    def timed_save(*a, **kw):  # the per-stage state files: part of the journal's cost too
        t = time.perf_counter()
        save(*a, **kw)
        commits[1] += time.perf_counter() - t

    stage.Run.save_state = timed_save
    settings = {"stages only": "1e9", f"every {resume.COMMIT_SECONDS:g} s (default)": str(resume.COMMIT_SECONDS),
                "every 1 s": "1", "every unit": "0"}
    try:
        corpus = work / "corpus.txt"
        n_bytes, n_chars, n_lines = build_corpus(corpus, args.mb, 1)
        print(f"corpus: {n_bytes / 1e6:.1f} MB, {n_lines:,} lines; workers {args.workers}; vocab {args.vocab_size}")
        cfg = PrepareConfig(vocab_size=args.vocab_size, doc_per_line=True, valid_fraction=0.01, tokenizer_sample_chars=2_000_000)
        tok = None
        if args.given_tokenizer:
            m = prepare([str(corpus)], work / "tok", cfg, workers=args.workers, log=lambda _: None)
            tok = str(work / "tok" / "tokenizer.model")
        best: dict[str, tuple[float, int, float]] = {}
        prints: dict[str, tuple[str, str]] = {}
        for r in range(args.repeat):
            for name, seconds in settings.items():
                os.environ["MSPRETRAIN_PREPARE_COMMIT_SECONDS"] = seconds
                out = work / "data"
                commits[:] = [0, 0.0]
                kinds.clear()
                t = time.perf_counter()
                m = prepare([str(corpus)], out, cfg, tokenizer=tok, workers=args.workers, log=lambda _: None)
                wall = time.perf_counter() - t
                split = ", ".join(f"{k} {n} in {sec:.2f} s" for k, (n, sec) in kinds.items())
                print(f"round {r + 1} {name:24s} {wall:6.2f} s  {commits[0]:4d} commits taking {commits[1]:5.2f} s  "
                      f"load {os.getloadavg()[0]:.1f}  ({split})", flush=True)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, commits[0], commits[1])
                prints[name] = (m["fingerprint"], (out / "manifest.json").read_text(encoding="utf-8"))
                shutil.rmtree(out)
        ref = best["stages only"][0]
        print(f"\nbest of {args.repeat} ({n_bytes / 1e6:.1f} MB):")
        for name, (wall, n, spent) in best.items():
            print(f"  {name:24s} {wall:6.2f} s  {n_bytes / 1e6 / wall:5.2f} MB/s  x{wall / ref:.3f} of stages only  "
                  f"({n} commits, {spent:.2f} s in them = {100 * spent / wall:.1f} % of the run)")
        same = len(set(prints.values())) == 1
        print(f"data dirs identical across settings (fingerprint + manifest): {same}")
        if not same:
            sys.exit(1)
    finally:
        os.environ.pop("MSPRETRAIN_PREPARE_COMMIT_SECONDS", None)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
