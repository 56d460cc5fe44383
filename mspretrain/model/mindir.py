"""MINDIR export that proves itself: export, load back, compare logits.

Design choices:
- The output directory is created here and `ms.export` gets `DIR/model` (MindSpore appends
  `.mindir`). MindSpore 2.10's `export` has no `path=` argument (the field report's call does not
  exist) and does not create missing directories, which is where the report's paths went wrong.
- One export serves every batch size and sequence length: the input is declared as
  `Tensor(shape=[None, None], dtype=int32)`; positions/segments are left out (plain causal
  inference), so the graph has exactly one input, `tokens`, and one output, fp32 `logits`.
- The file is loaded back with `ms.load` + `nn.GraphCell` and its logits are compared with the
  training-side model on seeded samples of two different lengths; a difference above the
  tolerance is an error, so a broken export never looks like a success. The tolerance follows
  the compute dtype: the file runs as a compiled graph and the model eagerly, and in fp16/bf16
  the two may fuse and round differently (on Ascend; not observable on CPU). The fp32 logits come
  from half-precision hidden states there, so the bound is about one rounding step of the dtype
  (fp16 2^-10, bf16 2^-7) at logits of magnitude ~10; fp32 keeps the 1e-4 it always had.
- `export.json` says what a consumer needs without MindSpore: vocab, special ids, dtype, shapes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from mspretrain.errors import UserError
from mspretrain.model.decoder import Decoder

FILE_STEM = "model"
TOLERANCE = 1e-4  # fp32
TOLERANCES = {"fp32": TOLERANCE, "fp16": 1e-2, "bf16": 8e-2}


def tolerance_for(dtype: str) -> float:
    """Max |logits(MINDIR) - logits(model)| accepted for a model computing in `dtype`."""
    return TOLERANCES[dtype]


def sample_shapes(max_seq_len: int) -> list[tuple[int, int]]:
    """Two different (batch, length) samples, both within the model's context."""
    return [(2, max(1, min(16, max_seq_len))), (1, max(1, min(7, max_seq_len - 1)))]


def verify_mindir(model: Decoder, path: Path, *, seed: int = 0, tolerance: float | None = None) -> float:
    """Max |logits(MINDIR) - logits(model)| over seeded samples; UserError above `tolerance`
    (default: the one for the model's compute dtype)."""
    if tolerance is None:
        tolerance = tolerance_for(model.dtype_name)
    graph = nn.GraphCell(ms.load(str(path)))
    rng = np.random.default_rng(seed)
    worst = 0.0
    for batch, length in sample_shapes(model.cfg.max_seq_len):
        tokens = Tensor(rng.integers(0, model.cfg.vocab_size, (batch, length)).astype(np.int32))
        ours = model(tokens).asnumpy()
        theirs = graph(tokens).asnumpy()
        if theirs.shape != ours.shape:
            raise UserError(f"MINDIR logits have shape {theirs.shape}, the model gives {ours.shape}", "re-export; this is a MindSpore export problem")
        worst = max(worst, float(np.abs(theirs - ours).max()))
    if not worst <= tolerance:  # also catches NaN
        raise UserError(f"MINDIR logits differ from the model's by {worst:.3g} (tolerance {tolerance:g})",
                        "do not use this export; report the MindSpore version and the config")
    return worst


def export_mindir(model: Decoder, out_dir: str | Path, *, special_ids: dict[str, int] | None = None,
                  tolerance: float | None = None) -> dict[str, Any]:
    """Write `out_dir/model.mindir` + `export.json`, verify the file; returns the export.json dict."""
    if tolerance is None:
        tolerance = tolerance_for(model.dtype_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.set_train(False)
    ms.export(model, Tensor(shape=[None, None], dtype=ms.int32), file_name=str(out / FILE_STEM), file_format="MINDIR")
    path = out / f"{FILE_STEM}.mindir"
    if not path.is_file():
        raise UserError(f"MindSpore did not write {path}", "check free disk space and permissions of the output directory")
    diff = verify_mindir(model, path, tolerance=tolerance)
    ids = special_ids or {}
    meta = {
        "file": path.name, "format": "MINDIR", "mindspore_version": ms.__version__,
        "vocab_size": model.cfg.vocab_size, "max_seq_len": model.cfg.max_seq_len,
        "eos_id": ids.get("eos", -1), "bos_id": ids.get("bos", -1), "pad_id": ids.get("pad", -1),
        "dtype": model.dtype_name,
        "inputs": [{"name": "tokens", "dtype": "int32", "shape": ["batch", "seq"]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", model.cfg.vocab_size]}],
        "verified_max_abs_diff": diff, "tolerance": tolerance,
    }
    (out / "export.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return meta
