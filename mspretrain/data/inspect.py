"""`prepare --inspect`: a data dir's manifest in a few lines, and its first documents decoded."""
from __future__ import annotations

from pathlib import Path

from mspretrain.data.manifest import read_manifest
from mspretrain.data.origin import MISSING_HINT, origin_path
from mspretrain.data.shards import IndexedDataset
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.paths import SPLITS, DataPaths


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
