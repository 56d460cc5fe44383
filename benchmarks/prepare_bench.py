"""`mspretrain prepare` vs the field report's recipe, on the same >= 50 MB of Chinese text and
the same tokenizer.

The corpus: the cached demo poetry corpus (fetched with npm once if missing), shuffled with a
fixed seed, one document per line (K poems per line, `--poems-per-line`), with noise: 5 % of
documents wrapped in HTML, 2 % with a URL, 2 % with full-width digits, 3 % exact repeats.

(a) `prepare(..., tokenizer=T, workers=N)`: read, clean, dedup, split, tokenize in N processes,
    write uint16 Megatron shards and the manifest (everything `mspretrain prepare` does, minus
    training the tokenizer, which both sides share).
(a') The same with `MSPRETRAIN_BPE=sentencepiece`: SentencePiece's own encoder in the workers
    instead of ours (mspretrain/data/_bpe.c); the shards are byte-identical, only the time differs.
(b) The field report's recipe (section 4.2): `f.readlines()`, per-line `encode`, truncate or
    pad every line to 2,048 tokens with EOS, `np.array(..., dtype=np.int64).tofile(...)`. Run in
    blocks of 4,096 lines appended to the file, which only helps it (the original builds one
    array of every padded line: ~5 GB here).

Usage: python benchmarks/prepare_bench.py [--mb 50] [--poems-per-line 1] [--workers N] [--repeat R]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece  # noqa: E402
from mspretrain.demo.corpus import poetry_corpus  # noqa: E402
from mspretrain.prepare.prepare import prepare  # noqa: E402

SEQ = 2048


def _cpu() -> tuple[float, float]:
    """(CPU seconds of this process, of its finished children: the prepare workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def build_corpus(path: Path, mb: float, poems_per_line: int, seed: int = 0) -> tuple[int, int, int]:
    """Write the benchmark text; returns (bytes, characters, lines)."""
    src = poetry_corpus()
    poems = [json.loads(x)["text"].replace("\n", " ") for x in src.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed)
    out, size, chars = [], 0, 0
    full = str.maketrans("0123456789", "０１２３４５６７８９")
    while size < mb * 1e6:
        rng.shuffle(poems)
        for i in range(0, len(poems) - poems_per_line, poems_per_line):
            doc = "　".join(poems[i: i + poems_per_line])
            r = rng.random()
            if r < 0.05:
                doc = f'<div class="poem"><p>{doc}</p>&nbsp;</div>'
            elif r < 0.07:
                doc = f"{doc} 来源：https://example.com/poem/{rng.randrange(10**6)}.html"
            elif r < 0.09:
                doc = f"第{rng.randrange(1000)}首 {doc}".translate(full)
            elif r < 0.12 and out:
                doc = out[rng.randrange(len(out))]
            out.append(doc)
            size += len(doc.encode()) + 1
            chars += len(doc) + 1
            if size >= mb * 1e6:
                break
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path.stat().st_size, chars, len(out)


def field_report_recipe(corpus: Path, model: Path, out: Path) -> dict:
    """Section 4.2 of the field report, with our SentencePiece model in place of LlamaTokenizer."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    eos = sp.eos_id()
    real = lost = 0
    with open(corpus, "r", encoding="utf-8") as f:
        lines = f.readlines()
    with open(out, "wb") as fo:
        for start in range(0, len(lines), 4096):
            input_ids_list = []
            for line in lines[start: start + 4096]:
                ids = sp.encode(line.strip())
                if len(ids) > SEQ:
                    lost += len(ids) - SEQ
                    ids = ids[:SEQ]
                real += len(ids)
                ids = ids + [eos] * (SEQ - len(ids))
                input_ids_list.append(ids)
            np.array(input_ids_list, dtype=np.int64).tofile(fo)
    return {"lines": len(lines), "real_tokens": real, "lost_tokens": lost, "bytes": out.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--poems-per-line", type=int, default=1)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each side, alternating; the best is reported")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prepare_bench_"))
    try:
        corpus = work / "corpus.txt"
        n_bytes, n_chars, n_lines = build_corpus(corpus, args.mb, args.poems_per_line)
        print(f"corpus: {n_bytes / 1e6:.1f} MB, {n_chars / 1e6:.2f} M characters, {n_lines:,} lines "
              f"({args.poems_per_line} poem(s) per line)")
        sample = corpus.read_text(encoding="utf-8").splitlines()[::4]
        t = time.time()
        tok, _ = train_sentencepiece(sample, work, args.vocab_size, num_threads=args.workers)
        del sample
        print(f"shared tokenizer: SentencePiece BPE, vocab {tok.vocab_size:,}, trained in {time.time() - t:.1f} s (not timed below)")

        # Runs alternate (prepare, recipe, prepare, recipe, ...) so that load from other jobs on a
        # shared machine hits both sides alike; the best run of each side is reported.
        load0 = os.getloadavg()[0]
        cfg = PrepareConfig(vocab_size=args.vocab_size, doc_per_line=True, valid_fraction=0.01)
        ours_runs, sp_runs, recipe_runs = [], [], []
        for i in range(args.repeat):
            for runs, encoder, label in ((ours_runs, "", "prepare"), (sp_runs, "sentencepiece", "prepare, SentencePiece encoder")):
                os.environ["MSPRETRAIN_BPE"] = encoder  # read by the workers when they load the tokenizer
                out = work / f"data{i}{encoder}"
                la = os.getloadavg()[0]
                cpu = _cpu()
                t = time.time()
                m = prepare([str(corpus)], out, cfg, tokenizer=str(tok.path), workers=args.workers, log=lambda _: None)
                runs.append((time.time() - t, [b - a for a, b in zip(cpu, _cpu())], la, m, out))
                print(f"  run {i + 1}: {label} {runs[-1][0]:.2f} s wall, {sum(runs[-1][1]):.2f} CPU s (load {la:.2f})", flush=True)
            os.environ.pop("MSPRETRAIN_BPE")
            same = all((ours_runs[-1][4] / f).read_bytes() == (sp_runs[-1][4] / f).read_bytes()
                       for f in ("train.bin", "train.idx", "valid.bin", "valid.idx"))
            assert same, "the two encoders wrote different shards"

            la = os.getloadavg()[0]
            cpu = _cpu()
            t = time.time()
            r = field_report_recipe(corpus, tok.path, work / "input_ids.bin")
            recipe_runs.append((time.time() - t, sum(b - a for a, b in zip(cpu, _cpu())), la, r))
            (work / "input_ids.bin").unlink()
            print(f"  run {i + 1}: recipe  {recipe_runs[-1][0]:.2f} s wall, {recipe_runs[-1][1]:.2f} CPU s (load {la:.2f})", flush=True)
        load1 = os.getloadavg()[0]
        t_ours, cpu_ours, _, m, out = min(ours_runs, key=lambda x: x[0])
        t_sp, cpu_sp = min(sp_runs, key=lambda x: x[0])[:2]
        t_recipe, cpu_recipe, _, r = min(recipe_runs, key=lambda x: x[0])
        ours_tokens = m["tokens"]["train"] + m["tokens"]["valid"]
        ours_bytes = sum((out / f"{s}.bin").stat().st_size for s in ("train", "valid"))

        # Encoding alone, one thread, in batches: SentencePiece (ids as numpy buffers, the
        # cheapest way it hands them back) and our C encoder, on the raw lines.
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tok.path))
        ours_encoder = Tokenizer.load(tok.path)._bpe_encoder()
        lines = corpus.read_text(encoding="utf-8").splitlines()
        cpu = _cpu()
        for start in range(0, len(lines), 4096):
            sp.EncodeAsNumpy(lines[start: start + 4096], num_threads=1)
        cpu_encode = sum(b - a for a, b in zip(cpu, _cpu()))
        cpu = _cpu()
        for start in range(0, len(lines), 4096):
            ours_encoder.encode(lines[start: start + 4096], tok.eos_id)
        cpu_encode_ours = sum(b - a for a, b in zip(cpu, _cpu()))
        del lines

        ours_cps, recipe_cps = n_chars / t_ours, n_chars / t_recipe
        print(f"load average during the runs: {load0:.2f} -> {load1:.2f} on {os.cpu_count()} cores (other jobs share the machine); "
              f"best of {args.repeat} run(s) per side")
        print(f"{'':28s}{'prepare':>16s}{'field recipe':>16s}{'prepare, SP enc.':>18s}")
        print(f"{'seconds':28s}{t_ours:16.2f}{t_recipe:16.2f}{t_sp:18.2f}")
        print(f"{'chars/s':28s}{ours_cps:16,.0f}{recipe_cps:16,.0f}{n_chars / t_sp:18,.0f}")
        print(f"{'CPU seconds (all processes)':28s}{sum(cpu_ours):16.2f}{cpu_recipe:16.2f}{sum(cpu_sp):18.2f}")
        print(f"{'  of which main process':28s}{cpu_ours[0]:16.2f}{cpu_recipe:16.2f}{cpu_sp[0]:18.2f}")
        print(f"{'chars per CPU second':28s}{n_chars / sum(cpu_ours):16,.0f}{n_chars / cpu_recipe:16,.0f}{n_chars / sum(cpu_sp):18,.0f}")
        print(f"{'bytes on disk':28s}{ours_bytes:16,}{r['bytes']:16,}")
        print(f"{'stored tokens':28s}{ours_tokens:16,}{r['bytes'] // 8:16,}")
        print(f"{'real tokens':28s}{ours_tokens:16,}{r['real_tokens']:16,}")
        print(f"{'bytes per real token':28s}{ours_bytes / ours_tokens:16.2f}{r['bytes'] / r['real_tokens']:16.2f}")
        print(f"{'real share of stored':28s}{1.0:16.1%}{r['real_tokens'] / (r['bytes'] // 8):16.1%}")
        print(f"{'tokens cut at 2,048':28s}{0:16,}{r['lost_tokens']:16,}")
        print(f"encoding alone (1 thread, same ids): SentencePiece {cpu_encode:.2f} CPU s, ours {cpu_encode_ours:.2f} CPU s "
              f"({cpu_encode / cpu_encode_ours:.1f}x less)")
        print(f"prepare with our encoder / with SentencePiece's: {t_sp / t_ours:.2f}x wall clock, "
              f"{sum(cpu_sp) / sum(cpu_ours):.2f}x per CPU second (byte-identical shards)")
        print(f"medians: prepare {statistics.median(r[0] for r in ours_runs):.2f} s, recipe "
              f"{statistics.median(r[0] for r in recipe_runs):.2f} s, ratio "
              f"{statistics.median(r[0] for r in recipe_runs) / statistics.median(r[0] for r in ours_runs):.1f}x")
        print(f"speed ratio prepare / recipe: {ours_cps / recipe_cps:.1f}x wall clock, "
              f"{(n_chars / sum(cpu_ours)) / (n_chars / cpu_recipe):.1f}x per CPU second "
              f"(prepare also cleaned {sum(m['changed'].values()):,} rule hits and dropped "
              f"{sum(m['dropped'].values()):,} documents; the recipe cleans nothing)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
