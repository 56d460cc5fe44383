"""Perplexity that does not depend on the eval batch size.

Perplexity = exp(total NLL ÷ total predicted tokens), with an fp32 log-softmax. The split is cut
into the same packed windows the loader uses (seq_len + 1 tokens, stride seq_len, in file
order); the first token of each window is context only, never predicted. The last batch is
padded to the batch size with masked rows, so one compiled graph serves every batch and the
sums are exactly the same whatever `batch_size` is (the field report's "eval batch size 1"
workaround for averaging per-batch means is not needed). Sums are accumulated in float64 on
the host. Bits per character use the data manifest's chars/token, a figure comparable across
tokenizers.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain.data.shards import IndexedDataset
from mspretrain.errors import UserError
from mspretrain.paths import DataPaths


def _nll_fn(model: Any, jit_level: str = "O0") -> Callable[[Any], Any]:
    """A compiled tokens (B, T+1) -> per-token NLL (B, T) function, cached on the model.
    jit_level: device.jit_level, as the training step compiles (device.py)."""
    cache = model.__dict__.setdefault("_mspretrain_nll_fns", {})
    fn = cache.get(jit_level)
    if fn is None:
        import mindspore as ms

        from mspretrain.model.decoder import Decoder
        from mspretrain.model.loss import token_nll

        # tensor parallel: the logits are this rank's vocabulary columns (the decoder's declared `tp_loss`)
        tp_loss = model.tp_loss if isinstance(model, Decoder) else None
        plain = model.fused_kernels if isinstance(model, Decoder) else False

        def nll(tokens):
            if tp_loss is not None:
                return tp_loss(model(tokens[:, :-1]), tokens[:, 1:])[0]
            return token_nll(model(tokens[:, :-1]), tokens[:, 1:], plain_sum=plain)[0]

        fn = ms.jit(nll, jit_level=jit_level)
        cache[jit_level] = fn
    return fn


def windows(tokens: np.ndarray, seq_len: int, max_tokens: int = 0) -> np.ndarray:
    """Start offsets of the packed windows (stride seq_len), bounded by `max_tokens` predicted tokens."""
    n = (int(tokens.size) - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, math.ceil(max_tokens / seq_len)))
    return np.arange(n, dtype=np.int64) * seq_len


def evaluate_tokens(model: Any, tokens: np.ndarray, *, seq_len: int, batch_size: int, max_tokens: int = 0,
                    progress: Callable[[int, int], None] | None = None, jit_level: str = "O0") -> dict[str, float]:
    import mindspore as ms

    if batch_size <= 0:
        raise UserError(f"--batch-size {batch_size} must be positive", "use e.g. --batch-size 8")
    starts = windows(tokens, seq_len, max_tokens)
    if starts.size == 0:
        raise UserError(f"the split has {tokens.size} tokens, fewer than one window of {seq_len + 1}",
                        "prepare more validation text (prepare.valid_fraction) or lower data.seq_len")
    fn = _nll_fn(model, jit_level)
    offs = np.arange(seq_len + 1, dtype=np.int64)
    total, count = 0.0, 0
    for i in range(0, starts.size, batch_size):
        chunk = starts[i : i + batch_size]
        real = chunk.size
        if real < batch_size:  # pad with copies of the first window, masked out below
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - real)])
        batch = np.asarray(tokens[chunk[:, None] + offs[None, :]], dtype=np.int32)  # (B, T+1)
        nll = fn(ms.Tensor(batch)).asnumpy().astype(np.float64)  # (B, T)
        total += float(nll[:real].sum())
        count += real * seq_len
        if progress:
            progress(min(i + batch_size, starts.size), starts.size)
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count}


def evaluate_split(model: Any, data_dir: str | Path, *, split: str = "valid", seq_len: int, batch_size: int = 8,
                   max_tokens: int = 0, chars_per_token: float | None = None,
                   progress: Callable[[int, int], None] | None = None, jit_level: str = "O0") -> dict[str, float]:
    """Perplexity of `model` on DATA_DIR/SPLIT; adds bits per character when chars/token is known."""
    ds = IndexedDataset(DataPaths(data_dir).prefix(split))
    res = evaluate_tokens(model, ds.tokens, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens,
                          progress=progress, jit_level=jit_level)
    if chars_per_token:
        res["bpc"] = res["nll"] / math.log(2) / chars_per_token
    return res
