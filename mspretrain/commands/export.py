"""Export a checkpoint as an HF model folder of its family (safetensors) or a verified MINDIR graph.

Formats: `hf` writes config.json, model.safetensors, generation_config.json and the tokenizer, loadable
with transformers' AutoModelForCausalLM/AutoTokenizer; `mindir` writes model.mindir (dynamic batch and
sequence) and export.json, then loads the file back and checks its logits against the model.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mspretrain.commands.common import add_quiet_argument, say
from mspretrain.errors import UserError

FORMATS = ("hf", "mindir")

EXAMPLES = """examples:
  mspretrain export runs/a --format hf --out exports/a-hf
  mspretrain export runs/a/checkpoints/step_000500 --format mindir --out exports/a-mindir
  mspretrain export runs/a --format hf --out exports/a-hf --overwrite"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="RUN_DIR|CKPT_DIR", help="a run dir (newest verified checkpoint) or one checkpoint dir")
    p.add_argument("--format", required=True, metavar="FORMAT",
                   help="hf: HF model folder of the checkpoint's family (config.json, model.safetensors, generation_config.json, tokenizer); "
                        "mindir: MindSpore MINDIR graph with dynamic batch/sequence, verified against the model")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created; must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (never files export did not write)")
    p.add_argument("--dtype", default="fp32", metavar="fp32|fp16", help="mindir: compute dtype of the exported graph (default fp32)")
    add_quiet_argument(p)


def output_dir(out: Path, overwrite: bool, source: Path):
    """The `OutputDir` export writes through (mspretrain/outputs.py): refuses an --out inside the
    checkpoint being read, a file, a dir with files export did not write, an earlier export without
    --overwrite; publishes the finished folder with one rename."""
    from mspretrain.outputs import OutputDir

    out_abs, src = out.resolve(), source.resolve()
    if out_abs == src or out_abs in src.parents or src in out_abs.parents:
        raise UserError(f"--out {out} would replace the checkpoint being read", "choose an output directory outside the run/checkpoint")
    return OutputDir(out, "export", overwrite=overwrite, inputs=[source])


def run(args: argparse.Namespace) -> int:
    fmt = str(args.format).lower()
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {args.format!r}", f"use --format {' or --format '.join(FORMATS)}")
    if args.dtype not in ("fp32", "fp16"):
        raise UserError(f"--dtype {args.dtype!r} is not supported for export", "use --dtype fp32 (default) or fp16")
    from mspretrain.checkpoint.store import read_model_tensors, resolve_checkpoint

    ref = resolve_checkpoint(args.path)
    out = Path(args.out)
    with output_dir(out, args.overwrite, ref.dir) as tmp:
        if fmt == "hf":
            from mspretrain.checkpoint.hf_folder import tokenizer_load_note, write_hf_folder
            from mspretrain.checkpoint.model import resolved_config

            tensors = read_model_tensors(ref)
            model_cfg = resolved_config(ref, tensors).model
            write_hf_folder(tmp, model_cfg, tensors, ref.tokenizer_path)
            note = tokenizer_load_note(model_cfg, ref.tokenizer_path)
        else:
            from mspretrain.checkpoint.model import load_model
            from mspretrain.model.mindir import export_mindir

            # the portable math path on whatever box exports; the checkpoint was verified above
            loaded = load_model(ref, dtype=args.dtype, device="cpu", need_tokenizer=False)
            ids = {}
            if loaded.tokenizer is not None:
                ids = loaded.tokenizer.special_ids()
                loaded.tokenizer.save_to(tmp)
            meta = export_mindir(loaded.model, tmp, special_ids=ids)
    if fmt == "hf":
        from mspretrain.families import family

        say(args, f"exported step {ref.step} from {ref.dir} to {out} (HF {family(model_cfg.family).label}, fp32 safetensors)")
        if note:
            print(note)
        if model_cfg.router_bias_update_rate > 0:  # HF Qwen3-MoE has no such tensor (docs/design.md, MoE)
            print("note: the routing biases (model.router_bias_update_rate) are not exported: HF's model chooses experts without them")
    else:
        print(f"MINDIR logits max abs diff vs model: {meta['verified_max_abs_diff']:.3g} (tolerance {meta['tolerance']:g})")
        say(args, f"exported step {ref.step} from {ref.dir} to {out / meta['file']} (+ export.json)")
    return 0
