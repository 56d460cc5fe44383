"""Import HF weights of a family in mspretrain/families.py (config.json + safetensors, sharded too) as an mspretrain checkpoint.

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
    p.add_argument("--from-hf", required=True, metavar="HF_DIR", help="HF model folder (Llama, Qwen2/3, Mistral, Qwen2/3-MoE): "
                        "config.json, *.safetensors (+ index), tokenizer")
    p.add_argument("--out", required=True, metavar="CKPT_DIR", help="checkpoint directory to create (must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier convert output in --out (never files convert did not write)")
    add_quiet_argument(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mspretrain.checkpoint.hf_folder import read_hf_folder
    from mspretrain.checkpoint.store import write_weights_only_checkpoint
    from mspretrain.config.schema import Config, DataConfig
    from mspretrain.model.presets import param_count
    from mspretrain.outputs import OutputDir

    src, out = Path(args.from_hf), Path(args.out)
    if src.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents
                         or src.resolve() in out.resolve().parents):
        raise UserError(f"--out {out} would replace the HF folder being read", "choose an output directory outside it")
    target = OutputDir(out, "convert", overwrite=args.overwrite, inputs=[src])  # refuses before reading gigabytes
    model_cfg, tensors, tok_path = read_hf_folder(src)
    cfg = replace(Config(), model=model_cfg, data=DataConfig(seq_len=min(DataConfig().seq_len, model_cfg.max_seq_len)))
    with target as tmp:
        # the checkpoint writer publishes into a dir of its own: write it inside the scratch dir, then lift its files out
        ckpt = write_weights_only_checkpoint(tmp / "checkpoint", tensors, cfg, tokenizer_path=tok_path)
        for f in ckpt.iterdir():
            f.rename(tmp / f.name)
        ckpt.rmdir()
    say(args, f"converted {src} -> {out}: {param_count(model_cfg):,} parameters, {model_cfg.n_layers} layers, "
              f"dim {model_cfg.dim}, vocab {model_cfg.vocab_size}, tied={model_cfg.tie_embeddings}"
              + ("" if model_cfg.family == "llama" else f", family {model_cfg.family}")
              + ("" if tok_path else " (no tokenizer in the HF folder: add one before generate/eval)"))
    return 0
