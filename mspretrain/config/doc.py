"""Generate `docs/config-reference.md` from the config dataclasses, so the reference cannot drift.

Design choices:
- The schema is `mspretrain/config/schema.py`; its inline `# ...` comments are the documentation a
  maintainer already keeps next to each field. We read them with `ast` + `tokenize` from the
  module's source (a comment on the field's line, or a comment block right above it) instead of
  asking config/schema.py to carry a second copy in `field(metadata=...)`.
- Fields whose meaning their name alone does not carry and that have no comment get a short text
  from `MEANINGS` below. A field with neither is an error (`undocumented()`), which the docs test
  turns into a failure naming the field — a new key cannot land undocumented.
- Types, defaults and allowed values come from the live dataclasses (choices are their `Literal`
  types, read through `sections.base.choices`), so they are the values the code uses, rendered as TOML.
- Output is deterministic (no dates, no paths): regenerating gives the same bytes, which is what
  the up-to-date test compares.

Regenerate with: python -m mspretrain.config.doc --out docs/config-reference.md
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import math
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from mspretrain.config import schema as cfgmod
from mspretrain.config.sections.base import choices

REGENERATE = "python -m mspretrain.config.doc --out docs/config-reference.md"

# Meanings for fields config/schema.py leaves uncommented (kept short; config/schema.py's own comments win).
MEANINGS: dict[str, str] = {
    "model.dim": "hidden size (width of the residual stream)",
    "model.n_layers": "number of transformer blocks",
    "model.n_heads": "attention (query) heads; dim / n_heads is the head size and must be even (RoPE)",
    "model.multiple_of": "ffn_dim is rounded up to a multiple of this (Llama-2-7B: 256 gives 11008)",
    "model.rope_theta": "RoPE base frequency",
    "model.norm_eps": "RMSNorm epsilon",
    "model.tie_embeddings": "share the embedding matrix with the lm_head (Llama-2: false)",
    "model.init_std": ("std of the normal init of embeddings and linear weights (residual projections scaled by 1/sqrt(2 n_layers)); "
                       "set explicitly because MindSpore's nn defaults differ"),
    "prepare.vocab_size": "SentencePiece vocabulary size trained by `prepare` (16k-32k is the useful range for Chinese)",
    "prepare.character_coverage": "SentencePiece character coverage; rarer characters fall back to bytes",
    "prepare.valid_fraction": "share of documents held out as the valid split",
    "prepare.doc_per_line": "treat every line of a .txt file as one document (default: blank lines separate documents)",
    "prepare.text_field": "field holding the text in .jsonl inputs",
    "prepare.min_chars": "drop documents shorter than this after cleaning",
    "prepare.strip_html": "remove HTML tags and decode entities",
    "prepare.remove_urls": "remove URLs",
    "prepare.remove_emails": "remove e-mail addresses",
    "prepare.drop_control": "remove control characters, zero-width and direction marks",
    "prepare.normalize_whitespace": "collapse runs of spaces and blank lines",
    "prepare.nfkc": "Unicode NFKC normalisation (full-width Latin and digits to ASCII)",
    "prepare.t2s": "convert Traditional to Simplified Chinese with OpenCC",
    "prepare.char_whitelist": "keep only Chinese, Latin letters, digits and common punctuation",
    "prepare.near_dedup": "MinHash near-duplicate removal across documents",
    "prepare.near_dedup_threshold": "Jaccard similarity above which two documents are near-duplicates",
    "prepare.seed": "seed for the valid split and the tokenizer's sample",
    "data.seq_len": "tokens per training sequence (each window reads seq_len + 1 tokens)",
    "data.reset_attention_at_eos": "block-diagonal attention and positions restarting at each document in a packed window",
    "optim.lr": "peak learning rate",
    "optim.weight_decay": "decoupled AdamW weight decay (not applied to norms; embeddings only with decay_embeddings)",
    "optim.beta1": "AdamW first-moment decay",
    "optim.beta2": "AdamW second-moment decay",
    "optim.eps": "AdamW epsilon, outside the square root as in PyTorch (MindSpore's own default is 1e-6)",
    "optim.decay_embeddings": "apply weight decay to the embedding matrix too",
    "optim.z_loss": "coefficient of PaLM's z-loss on the log-partition function; 0 = off",
    "schedule.min_lr_ratio": "final learning rate as a share of the peak",
    "train.max_tokens": ("token budget (global_batch x seq_len per step); 0 = not set; "
                         "the run stops at whichever of max_steps / max_tokens comes first"),
    "train.seed": "the run's seed: initialisation and data order derive from it",
    "train.log_every": "steps between console / train.log lines",
    "precision.scale_warmup_steps": "length of the linear loss-scale warm-up (the field report: 500)",
    "schedule.kind": "learning-rate schedule: warm-up then cosine decay, the field report's two-phase warm-up, warmup-stable-decay, or constant",
    "train.mode": "jit compiles the step with ms.jit (about 2.3x faster); pynative runs it eagerly, for debugging",
    "precision.dtype": ("compute dtype; the lm_head, norms, softmax and loss stay fp32, "
                        "weights too unless precision.param_dtype=compute (bf16 is Ascend-only)"),
    "device.target": "auto = Ascend when an NPU is visible, else CPU",
    "spike.action": "what a loss spike does: log a warning, or rewind to the last checkpoint and skip the batches",
    "checkpoint.every": "steps between checkpoints (one is always written at the end and on Ctrl-C)",
    "checkpoint.keep_last": "how many of the newest checkpoints to keep",
    "checkpoint.async_save": "write checkpoints on a background thread after a host copy of the state",
    "checkpoint.on_error": "what a failed save does: stop the run, or warn and continue",
    "eval.max_tokens": "bound on the valid tokens scored per evaluation",
    "eval.batch_size": "sequences per eval batch (perplexity does not depend on it)",
    "precision.growth_interval": "dynamic loss scale: double after this many finite steps in a row",
    "precision.min_scale": "dynamic loss scale never goes below this",
    "precision.max_scale": "dynamic loss scale never goes above this",
    "metrics.tensorboard": "also write TensorBoard event files to RUN_DIR/tb",
    "metrics.loss_every": "steps between loss records",
    "metrics.lr_every": "steps between learning-rate records",
    "metrics.loss_scale_every": "steps between loss-scale records",
    "metrics.grad_norm_every": "steps between gradient-norm records",
    "metrics.memory_every": "steps between memory records",
    "metrics.throughput_every": "steps between throughput (tokens/s, MFU) records",
}

INTRO = """# Config reference

<!-- GENERATED by `{cmd}` from mspretrain/config/schema.py. Do not edit by hand: tests/docs/test_docs.py fails when it is out of date. -->

A config is a TOML file whose sections and keys are the fields below (`configs/*.toml` are
examples). Any key can be overridden on the command line after the options, as
`section.key=value` with a TOML value: `train.max_steps=50`, `optim.lr=3e-4`,
`precision.dtype=fp16`, `schedule.warmup_steps="auto"`, `model.tie_embeddings=true`.
Unknown keys and impossible values are refused before any compute, with the key named.
Values documented as "0 = ..." are resolved at train time; `RUN_DIR/config.toml` holds the
resolved config of a run.
"""


def _comments(source: str) -> dict[int, str]:
    """Line number -> text of the `#` comment on that line (without the `#`)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments() -> dict[str, str]:
    """`section.key` -> the comment the schema keeps beside (or right above) the field (the section
    classes live in mspretrain/config/sections/, one module per subject, joined by config/schema.py)."""
    section_of = {type(getattr(cfgmod.Config(), s)).__name__: s for s in cfgmod.SECTIONS}
    modules = dict.fromkeys(inspect.getmodule(type(getattr(cfgmod.Config(), s))) for s in cfgmod.SECTIONS)
    out: dict[str, str] = {}
    for module in modules:
        source = inspect.getsource(module)
        lines = source.splitlines()
        comments = _comments(source)
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef) or node.name not in section_of:
                continue
            for stmt in node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                texts = []
                above = stmt.lineno - 1  # a comment block right above the field, read upwards
                while above >= 1 and lines[above - 1].strip().startswith("#"):
                    texts.insert(0, comments.get(above, ""))
                    above -= 1
                if stmt.lineno in comments:
                    texts.append(comments[stmt.lineno])
                if texts:
                    out[f"{section_of[node.name]}.{stmt.target.id}"] = " ".join(t for t in texts if t)
    return out


def _is_choice_list(text: str) -> bool:
    """True for a comment that only lists values, such as `"stop" | "continue"`."""
    return bool(re.fullmatch(r'"[^"]+"(\s*\|\s*"[^"]+")*', text.strip()))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 1e6:
            exp = int(math.log2(value)) if value > 0 else 0
            return f"{value:.0f} (2^{exp})" if value == 2.0**exp else f"{value:g}"
        return repr(value)
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _type_name(typ: Any) -> str:
    if typ is tuple:
        return "array of tables"
    if get_origin(typ) is Literal:  # the allowed values are listed in the meaning
        return _type_name(type(get_args(typ)[0]))
    if get_origin(typ) is tuple:  # tuple[X, ...]
        return f"array of {_type_name(get_args(typ)[0])}s"
    args = getattr(typ, "__args__", None)
    if args:  # Union[int, str]
        return " or ".join(_type_name(a) for a in args)
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(typ, getattr(typ, "__name__", str(typ)))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_rows() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section, [(key, type, default, meaning), ...]), ...] in config/schema.py's order."""
    comments = field_comments()
    base = cfgmod.Config()
    out = []
    for section in cfgmod.SECTIONS:
        obj = getattr(base, section)
        hints = get_type_hints(type(obj))
        rows = []
        for f in dataclasses.fields(obj):
            key = f"{section}.{f.name}"
            meaning = comments.get(key, "")
            if not meaning or _is_choice_list(meaning):
                meaning = MEANINGS.get(key, "")
            allowed = choices(type(obj), f.name)
            if allowed and not all(f'"{c}"' in meaning for c in allowed):
                meaning = f"{meaning}; one of: {', '.join(allowed)}" if meaning else f"one of: {', '.join(allowed)}"
            rows.append((f.name, _type_name(hints[f.name]), _toml_value(getattr(obj, f.name)), meaning))
        out.append((section, rows))
    return out


def undocumented() -> list[str]:
    """`section.key` of every field with neither a comment in config/schema.py nor an entry in MEANINGS."""
    return [f"{s}.{k}" for s, rows in reference_rows() for k, _, _, meaning in rows
            if not meaning or meaning.startswith("one of:")]


def render() -> str:
    """The whole Markdown reference."""
    parts = [INTRO.format(cmd=REGENERATE)]
    base = cfgmod.Config()
    parts.append("Sections: " + ", ".join(f"[`[{s}]`](#{s})" for s in cfgmod.SECTIONS) + "\n")
    for section, rows in reference_rows():
        doc = inspect.getdoc(type(getattr(base, section))) or ""
        parts.append(f"## {section}\n")
        if doc and not doc.startswith(type(getattr(base, section)).__name__ + "("):  # skip dataclass auto-docs
            parts.append(doc.strip() + "\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        for key, typ, default, meaning in rows:
            parts.append(f"| `{section}.{key}` | {typ} | `{_cell(default)}` | {_cell(meaning)} |")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the config reference generated from mspretrain/config/schema.py.")
    p.add_argument("--out", help="file to write (default: print to stdout)")
    args = p.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"error: undocumented config fields: {', '.join(missing)}\nhint: add a # comment in config/schema.py "
              "or an entry to MEANINGS in mspretrain/config/doc.py", file=sys.stderr)
        return 2
    text = render()
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
