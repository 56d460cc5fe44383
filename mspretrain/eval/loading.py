"""Load a run dir or checkpoint dir for inference: model with weights, tokenizer, resolved config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mspretrain.checkpoint.store import CheckpointRef, read_model_tensors, resolve_checkpoint
from mspretrain.config import Config
from mspretrain.errors import UserError


@dataclass
class Loaded:
    ref: CheckpointRef
    model: Any
    tokenizer: Any
    config: Config


def load_for_inference(path: str | Path, *, log: Callable[[str], None] = print) -> Loaded:
    from mspretrain.data.tokenizer import Tokenizer
    from mspretrain.device import plan_device, setup_mindspore
    from mspretrain.model.llama import Llama, load_numpy

    ref = resolve_checkpoint(path, log=log)
    cfg = ref.config
    if ref.tokenizer_path is None:
        raise UserError(f"no tokenizer found for {ref.dir}", "copy the data dir's tokenizer.model into the run or checkpoint dir")
    tok = Tokenizer.load(ref.tokenizer_path)
    if tok.vocab_size != cfg.model.vocab_size:
        raise UserError(f"tokenizer {ref.tokenizer_path} has {tok.vocab_size} pieces but the model has vocab {cfg.model.vocab_size}",
                        "use the tokenizer the model was trained with")
    info = plan_device(cfg)
    setup_mindspore(info)
    model = Llama(cfg.model, dtype=cfg.precision.dtype, attention="auto", device=info.target)
    load_numpy(model, read_model_tensors(ref))
    model.set_train(False)
    return Loaded(ref=ref, model=model, tokenizer=tok, config=cfg)
