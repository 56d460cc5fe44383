"""The bigram model the step tests train (tests/step/test_train_step.py, test_bf16_moments.py):
logits = embed[tokens] @ w, small enough to mirror exactly in PyTorch."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

V, D = 50, 16


class Bigram(nn.Cell):
    """logits = embed[tokens] @ w: small enough to mirror exactly in PyTorch."""

    def __init__(self, emb: np.ndarray, w: np.ndarray) -> None:
        super().__init__()
        self.embed = Parameter(Tensor(emb), name="embed.weight")
        self.w = Parameter(Tensor(w), name="lm_head.weight")  # a name of model/params.py's table: the step reads its decay there

    def construct(self, tokens, positions=None, segments=None):
        return ops.matmul(ops.gather(self.embed, tokens, 0), self.w)


class Bigram16(Bigram):
    """The same in fp16 compute with fp32 parameters (what precision.dtype=fp16 does): small
    gradients of the loss times a real loss scale are what fp16 needs the scale for."""

    def construct(self, tokens, positions=None, segments=None):
        x = ops.gather(self.embed, tokens, 0).astype(ms.float16)
        return ops.matmul(x, self.w.astype(ms.float16)).astype(ms.float32)
