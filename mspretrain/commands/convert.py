"""Import HF Llama weights (config.json + safetensors, sharded too) as an mspretrain checkpoint.

Only safetensors are read (pickled .bin files are refused). The result is a weights-only checkpoint
directory (model.safetensors, config.toml, tokenizer, manifest.json) that eval, generate, export
and train (as initial weights) accept.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import add_quiet_argument, say
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain convert --from-hf ~/models/Llama-2-7b-hf --out ckpt/llama2-7b
  mspretrain eval ckpt/llama2-7b --data data/"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-hf", required=True, metavar="HF_DIR", help="HF Llama folder: config.json, *.safetensors (+ index), tokenizer")
    p.add_argument("--out", required=True, metavar="CKPT_DIR", help="checkpoint directory to create (must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    add_quiet_argument(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mspretrain.checkpoint.hf_folder import read_hf_folder
    from mspretrain.checkpoint.store import write_weights_only_checkpoint
    from mspretrain.config import Config, DataConfig
    from mspretrain.model.presets import param_count

    src, out = Path(args.from_hf), Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is a file", "choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"output directory {out} exists and is not empty", "choose another --out, or pass --overwrite to replace it")
    if src.exists() and out.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents):
        raise UserError(f"--out {out} would replace the HF folder being read", "choose an output directory outside it")
    model_cfg, tensors, tok_path = read_hf_folder(src)
    cfg = replace(Config(), model=model_cfg, data=DataConfig(seq_len=min(DataConfig().seq_len, model_cfg.max_seq_len)))
    write_weights_only_checkpoint(out, tensors, cfg, tokenizer_path=tok_path)
    say(args, f"converted {src} -> {out}: {param_count(model_cfg):,} parameters, {model_cfg.n_layers} layers, "
              f"dim {model_cfg.dim}, vocab {model_cfg.vocab_size}, tied={model_cfg.tie_embeddings}"
              + ("" if model_cfg.family == "llama" else f", family {model_cfg.family}")
              + ("" if tok_path else " (no tokenizer in the HF folder: add one before generate/eval)"))
    return 0
