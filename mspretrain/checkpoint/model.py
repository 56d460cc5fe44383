"""The one road from a checkpoint to a model: weights, resolved config and tokenizer.

eval, generate, export (MINDIR), the bridges and the tests all load through `load_model`, so a
checkpoint is read, verified and checked the same way wherever it is used.

Lives in checkpoint/ (layer 3) because it joins three layer-2 and lower pieces that must not
import each other: the checkpoint files (checkpoint/store), the model (model/decoder) and the
tokenizer (data/tokenizer).

Design choices:
- The model shape comes from the checkpoint's config.toml with the vocabulary read from the
  weights themselves (`embed.weight`), so a config whose vocab_size is 0 (automatic) still loads.
- The tokenizer is the one `resolve_checkpoint` finds (checkpoint, run dir, then the run's data
  dir). When one is found its size must match the model's vocabulary, even where it is optional:
  a mismatched tokenizer copied next to an export would decode garbage without a word.
- `device=None` plans the checkpoint's own device and points MindSpore at it (eval, generate);
  a given device only selects the attention kernel and leaves MindSpore's context alone (MINDIR
  export, which wants the portable math path whatever the box is).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from mspretrain.checkpoint.store import CheckpointRef, read_model_tensors, resolve_checkpoint
from mspretrain.config.schema import Config, resolve_model
from mspretrain.errors import UserError

if TYPE_CHECKING:
    from mspretrain.data.tokenizer import Tokenizer
    from mspretrain.model.decoder import Decoder


@dataclass(frozen=True)
class LoadedModel:
    ref: CheckpointRef
    model: "Decoder"  # in eval mode (set_train(False))
    config: Config  # the checkpoint's config, model section resolved against the weights
    tokenizer: "Tokenizer | None"  # None only when not required and none was found


def load_model(source: str | Path | CheckpointRef, *, dtype: str | None = None, device: str | None = None,
               need_tokenizer: bool = True, log: Callable[[str], None] = lambda s: None) -> LoadedModel:
    """Load a RUN_DIR (its newest verified checkpoint), a CKPT_DIR, or an already resolved ref.

    dtype: compute dtype of the model; None = the checkpoint's `precision.dtype`.
    device: "cpu" or "ascend" selects the attention kernel without touching MindSpore's context;
        None = the device the checkpoint's config plans, with MindSpore set up for it.
    need_tokenizer: refuse (one line) when no tokenizer can be found for the checkpoint.
    log: where the fallback past corrupt checkpoints of a run dir is reported.
    """
    from mspretrain.model.decoder import Decoder, load_numpy

    ref = source if isinstance(source, CheckpointRef) else resolve_checkpoint(source, log=log)
    tensors = read_model_tensors(ref)
    cfg = resolved_config(ref, tensors)
    tokenizer = _tokenizer(ref, cfg.model.vocab_size, need_tokenizer)
    if device is None:
        from mspretrain.device import plan_device, setup_mindspore
        from mspretrain.world import select_launch

        info = plan_device(cfg)
        setup_mindspore(info, device_id=select_launch(info.target).device_id if info.target == "ascend" else None)
        device = info.target
    model = Decoder(cfg.model, dtype=dtype or cfg.precision.dtype, attention="auto", device=device)
    load_numpy(model, tensors)
    model.set_train(False)
    return LoadedModel(ref=ref, model=model, config=cfg, tokenizer=tokenizer)


def resolved_config(ref: CheckpointRef, tensors: dict[str, np.ndarray]) -> Config:
    """The checkpoint's config with its model section resolved against the weights (the
    vocabulary from `embed.weight`): the shape a model or an export of these weights has."""
    if "embed.weight" not in tensors:
        raise UserError(f"checkpoint {ref.dir} has no embed.weight", "this is not an mspretrain model checkpoint")
    return replace(ref.config, model=resolve_model(ref.config.model, int(tensors["embed.weight"].shape[0])))


def _tokenizer(ref: CheckpointRef, vocab_size: int, required: bool) -> "Tokenizer | None":
    from mspretrain.data.tokenizer import Tokenizer

    if ref.tokenizer_path is None:
        if required:
            raise UserError(f"no tokenizer found for {ref.dir}", "copy the data dir's tokenizer.model into the run or checkpoint dir")
        return None
    tok = Tokenizer.load(ref.tokenizer_path)
    if tok.vocab_size > vocab_size:  # fewer tokens than rows: a padded embedding (Qwen2.5's 152,064 rows)
        raise UserError(f"tokenizer {ref.tokenizer_path} has {tok.vocab_size} pieces but the model has vocab {vocab_size}",
                        "use the tokenizer the model was trained with")
    return tok
