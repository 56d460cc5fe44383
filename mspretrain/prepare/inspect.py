"""`prepare --inspect`: a data dir's manifest in a few lines, and its first documents decoded."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mspretrain.data.manifest import read_manifest
from mspretrain.data.origin import MISSING_HINT, origin_path
from mspretrain.data.shards import IndexedDataset
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.paths import SPLITS, DataPaths
from mspretrain.prepare.scoring import NO_FILE, REASONS, SCORES, read_scores


def inspect(data_dir: str | Path, n_docs: int = 3, max_chars: int = 200) -> str:
    """A readable summary of a data dir's manifest and the first documents, decoded."""
    d = Path(data_dir).expanduser()
    paths = DataPaths(d)
    m = read_manifest(d, required={})  # shows what an old or edited manifest still holds
    tok = Tokenizer.load(d)

    def get(*keys: str) -> object:
        """m[k1][k2]... or "?" when a key is missing or a level is not an object (an old or edited manifest)."""
        v: object = m
        for k in keys:
            v = v.get(k, "?") if isinstance(v, dict) else "?"
        return v

    def num(*keys: str) -> str:
        v = get(*keys)
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

    cpt = get("chars_per_token")
    inputs = get("inputs")
    lines = [
        f"data dir     {d}",
        f"inputs       {', '.join(map(str, inputs)) if isinstance(inputs, list) else inputs}",
        f"files        {get('files', 'files')} read, by encoding {get('files', 'by_encoding')}, skipped {get('files', 'skipped')}, "
        f"{get('files', 'bytes_dropped')} undecodable bytes dropped",
        f"documents    {num('documents_in')} in -> train {num('documents', 'train')}, valid {num('documents', 'valid')}",
        f"characters   {num('characters_in')} in -> {num('characters')} kept",
        f"changed      {get('changed')}",
        f"dropped      {get('dropped')}",
        f"tokens       train {num('tokens', 'train')}, valid {num('tokens', 'valid')} ({get('token_dtype')}, "
        f"{f'{cpt:.2f}' if isinstance(cpt, (int, float)) else cpt} chars/token, EOS after each document)",
        f"tokenizer    {get('tokenizer', 'file')}, vocab {num('vocab_size')}, special ids {get('special_ids')}, "
        f"sha256 {str(get('tokenizer_sha256'))[:16]}",
        f"fingerprint  {get('fingerprint')}",
    ]
    missing = [k for k in ("documents", "tokens", "vocab_size", "fingerprint") if k not in m]
    if missing:
        lines.append(f"note         manifest.json lacks {', '.join(missing)}: not written by this version of prepare, or edited")
    fallback = get("byte_fallback_rate")
    if isinstance(fallback, (int, float)):
        lines.append(f"byte pieces  {100 * fallback:.3f} % of tokens are byte-fallback <0x..> pieces")
    lines += _per_file_lines(m.get("input_tokens"))
    kinds = get("origin", "offsets")
    if all(origin_path(d, s).is_file() for s in SPLITS) and isinstance(kinds, list):
        lines.append(f"origins      {', '.join(origin_path(d, s).name for s in SPLITS)}: input file and "
                     f"{' / '.join(sorted({str(k) for k in kinds if k})) or 'byte'} offset of every document")
    else:
        lines.append(f"origins      none (this data dir predates the document origin index): {MISSING_HINT}")
    lossy = _lossy_files(m.get("input_files"))
    if lossy:
        lines.append(f"lossy files  {len(lossy)}: " + "; ".join(lossy[:5]) + ("; ..." if len(lossy) > 5 else ""))
    if isinstance(m.get("warnings"), list) and m["warnings"]:
        lines.append(f"warnings     {len(m['warnings'])}: " + "; ".join(map(str, m["warnings"][:3])))
    if (d / SCORES).is_file():
        lines += quality_lines(d, m)
    eos = tok.eos_id
    for split in SPLITS:
        if not paths.idx(split).is_file():
            lines.append(f"\n[{split}: no {paths.idx(split).name}]")
            continue
        ds = IndexedDataset(paths.prefix(split))
        for i in range(min(n_docs if split == "train" else 1, len(ds))):
            ids = ds[i]
            ids = ids[:-1] if len(ids) and ids[-1] == eos else ids
            text = tok.decode(ids.tolist())
            text = text if len(text) <= max_chars else text[:max_chars] + "…"
            lines.append(f"\n[{split} #{i}, {len(ds[i])} tokens]\n{text}")
    return "\n".join(lines)


def _per_file_lines(entries: object, most: int = 10) -> list[str]:
    """Chars per token and byte-fallback rate per input file (the manifest's `input_tokens`),
    the files with the highest byte-fallback rate first: those are where the tokenizer is weakest."""
    rows = [e for e in entries if isinstance(e, dict) and e.get("tokens")] if isinstance(entries, list) else []
    rows.sort(key=lambda e: -(e.get("byte_fallback_rate") or 0))
    out = [f"  {e.get('name', '?')}: {e.get('tokens', 0):,} tokens, {e.get('chars_per_token', 0):.2f} chars/token, "
           f"byte fallback {100 * (e.get('byte_fallback_rate') or 0):.3f} %" for e in rows[:most]]
    if len(rows) > most:
        out.append(f"  ... {len(rows) - most} more files (manifest.json input_tokens)")
    return ["per file" + (" (highest byte fallback first)" if len(rows) > 1 else "")] + out if out else []


def _lossy_files(entries: object) -> list[str]:
    """"name: what it lost" for each input file that was skipped, cut short or lost bytes or
    lines (the manifest's `input_files`; absent from manifests older than it)."""
    out = []
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, dict):
            continue
        lost = [] if e.get("status", "read") == "read" else [str(e.get("status"))]
        lost += [f"{k} {v}" for k, v in e.items() if k not in ("name", "status", "encoding", "bytes", "documents", "mixed_gb18030_lines") and v]
        if lost:
            out.append(f"{e.get('name', '?')}: {', '.join(lost)}")
    return out


# what-if thresholds shown per score (the perplexity's come from its own quantiles)
WHAT_IF = {"quality": (0.1, 0.3, 0.5, 0.7, 0.9), "zh": (0.5, 0.8, 0.9, 0.99)}


def quality_lines(d: Path, m: dict, examples: int = 2, width: int = 60) -> list[str]:
    """The quality sidecar (`scoring.SCORES`): what was dropped and why, each score's distribution,
    what other thresholds would drop (each filter alone, over every scored document), with the
    dropped documents nearest the threshold as examples, read from the inputs by their origin.

    Read in blocks (`rescore.blocks`), its percentiles exact by histogram (`rescore.order_stats`:
    the k-th value with k = max(1, ceil(q n)), q the percentile's share), so the memory is the
    same for 16 M documents as for 16; a few passes over the file per score."""
    from mspretrain.prepare.rescore import blocks, order_stats

    path = d / SCORES
    r = read_scores(path)  # memory-mapped: the examples' records are read one by one
    q = m.get("quality") if isinstance(m.get("quality"), dict) else {}
    files = [e.get("name") if isinstance(e, dict) else None for e in m.get("input_files") or []]
    kinds = (m.get("origin") or {}).get("offsets") or [] if isinstance(m.get("origin"), dict) else []
    counts = np.zeros(len(REASONS), dtype=np.int64)
    first: dict[int, list[int]] = {k: [] for k in range(1, len(REASONS))}  # each reason's first documents, by index
    base = 0
    for b in blocks(path):
        counts += np.bincount(b["reason"], minlength=len(REASONS))[:len(REASONS)]
        for k, got in first.items():
            want = (examples if REASONS[k] != "contaminated" else 10) - len(got)
            if want > 0:
                got += (base + np.flatnonzero(b["reason"] == k)[:want]).tolist()
        base += b.size
    out = [f"quality      {r.size:,} documents scored ({SCORES}): kept {int(counts[0]):,}; dropped "
           + ", ".join(f"{REASONS[k]} {int(counts[k]):,}" for k in range(1, len(REASONS)))]

    def text(i: int) -> str:
        return _doc_text(d, files, kinds, int(r["file"][i]), int(r["offset"][i]), width)

    for k, got in first.items():
        for i in got:
            extra = f" ({int(r['hits'][i])} eval n-grams)" if REASONS[k] == "contaminated" else ""
            out.append(f"  dropped {REASONS[k]}{extra}: {text(i)}")
    for key, label, cfg in (("zh", "P(Chinese)", (q.get("language") or {}).get("min_zh_prob")),
                            ("ppl", "perplexity", (q.get("perplexity") or {}).get("max")),
                            ("quality", "classifier", (q.get("classifier") or {}).get("threshold"))):
        n = sum(int(np.isfinite(b[key]).sum()) for b in blocks(path))
        if not n:
            continue

        def finite(key: str = key):
            return (b[key][np.isfinite(b[key])] for b in blocks(path))

        shares = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0) + ((0.5, 0.75, 0.9, 0.95) if key == "ppl" else ())
        pct = order_stats(finite, [max(1, math.ceil(s * n)) for s in shares])
        out.append(f"  {label:<11} min {pct[0]:.4g}, p10 {pct[1]:.4g}, p25 {pct[2]:.4g}, median {pct[3]:.4g}, "
                   f"p75 {pct[4]:.4g}, p90 {pct[5]:.4g}, max {pct[6]:.4g}" + (f" (threshold now {cfg})" if cfg is not None else ""))
        if key == "ppl":  # an upper bound at each of these quantiles drops the tail above it
            out += _what_if(path, key, [(t, f"ppl_max={t:.4g}") for t in pct[7:]], n, text, examples, -1)
        else:
            name = "quality_threshold" if key == "quality" else "min_zh_prob"
            out += _what_if(path, key, [(t, f"{name}={t}") for t in WHAT_IF[key]], n, text, examples, 1)
    return out


def _what_if(path: Path, key: str, thresholds: list[tuple[float, str]], n: int, text, examples: int, sign: int) -> list[str]:
    """Per threshold: how many documents it drops (`sign` 1: score below it, -1: above it), and the
    dropped documents nearest it (what a user loses by moving it), in one pass over the sidecar."""
    from mspretrain.prepare.rescore import blocks

    dropped = [0] * len(thresholds)
    nearest: list[list[tuple[float, int, float]]] = [[] for _ in thresholds]  # (distance key, index, value)
    base = 0
    for b in blocks(path):
        v = b[key]
        for j, (t, _) in enumerate(thresholds):
            idx = np.flatnonzero(v < t if sign > 0 else v > t)
            dropped[j] += idx.size
            best = idx[np.argsort(-sign * v[idx], kind="stable")[:examples]]
            nearest[j] = sorted(nearest[j] + [(float(-sign * v[i]), base + int(i), float(v[i])) for i in best])[:examples]
        base += b.size
    lines = []
    for (_, label), count, near in zip(thresholds, dropped, nearest):
        lines.append(f"    {label:<26} drops {count:,} of {n:,} ({100 * count / max(n, 1):.1f} %)")
        lines += [f"      e.g. {value:.4g}: {text(i)}" for _, i, value in near]
    return lines


def _doc_text(d: Path, files: list, kinds: list, f: int, offset: int, width: int) -> str:
    """The start of the document at `offset` of input file `f` (as named in the manifest, read
    from where prepare ran or this dir); its origin alone when the file cannot be read here."""
    if f == NO_FILE or f >= len(files) or not files[f]:
        return "(no origin)"
    where = f"{files[f]}@{offset}"
    kind = kinds[f] if f < len(kinds) else "byte"
    path = Path(files[f])
    if kind != "byte" or path.suffix in (".gz", ".zst") or not path.is_file():
        return where
    jsonl = path.suffix == ".jsonl"
    try:
        with open(path, "rb") as fh:  # a regular file (checked above): a read of bounded size
            fh.seek(offset)
            raw = fh.readline(JSONL_PEEK if jsonl else 4 * width + 4)
    except OSError:
        return where
    t = raw.decode("utf-8", errors="ignore").split("\n", 1)[0]
    if jsonl:  # the record's text, not its JSON bytes
        t = jsonl_text(t)
    return f"{where} {' '.join(t.split())[:width]}"


JSONL_PEEK = 1 << 16  # bytes of a .jsonl record read to show its text


def jsonl_text(line: str) -> str:
    """The text of a JSON-lines record for a person to read: its `text` field (else its longest
    string field), escapes decoded. A record longer than what was read is cut: the start of its
    `text` string is decoded as far as it goes."""
    import json
    import re

    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        rec = None
    if isinstance(rec, dict):
        if isinstance(rec.get("text"), str):
            return rec["text"]
        strings = [v for v in rec.values() if isinstance(v, str)]
        return max(strings, key=len) if strings else line
    m = re.search(r'"text"\s*:\s*"', line)
    if m is None:
        return line
    body = line[m.end():]
    for cut in range(len(body), max(len(body) - 8, -1), -1):  # drop a cut escape (a \u12 of \u1234) at the end
        try:
            return json.loads('"' + body[:cut].rstrip("\\") + '"')
        except ValueError:
            continue
    return body
