"""optim.loss_chunk_tokens (model/loss.py `ChunkedNLL`): the LM head and the NLL over chunks of
tokens, each recomputed in the backward, give the unchunked step's loss, grad norm and gradients
in fp32 (the first step's exp_avg is (1 - beta1) x the clipped gradient), with the z-loss on (it
reads the chunks' log-sum-exp) and a chunk that does not divide the tokens (32 = 12 + 12 + 8).
Two compiled one-layer steps."""
from dataclasses import replace

import numpy as np
import pytest

from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model
from mspretrain.model.decoder import Decoder, state_numpy
from mspretrain.step.step import TrainStep
from tests.conftest import assert_close_rel

OPTIM = OptimConfig(lr=1e-3, grad_clip=0.0, z_loss=1e-3)


def _step(chunk: int) -> tuple[Decoder, TrainStep]:
    cfg = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64), vocab_size=128)
    model = Decoder(cfg, dtype="fp32", seed=7)
    return model, TrainStep(model, replace(OPTIM, loss_chunk_tokens=chunk), global_tokens=2 * 16)


def test_the_chunked_loss_equals_the_whole_one():
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 128, (2, 17)).astype(np.int32) for _ in range(2)]
    (a, sa), (b, sb) = _step(0), _step(12)
    assert sb.model is b
    for i, batch in enumerate(batches):
        ra = sa.run([(batch, None, None)], lr=1e-3, scale=1.0)
        rb = sb.run([(batch, None, None)], lr=1e-3, scale=1.0)
        assert rb.loss == pytest.approx(ra.loss, rel=1e-6) and rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-5)
        np.testing.assert_allclose(rb.row_nll, ra.row_nll, rtol=1e-6) if ra.row_nll is not None else None
        if i == 0:  # the first step's moments are the gradients, scaled
            oa, ob = sa.optimizer_state(), sb.optimizer_state()
            for k in sorted(set(oa) - {"opt_step"}):
                assert_close_rel(ob[k], oa[k], 1e-5, k)
    wa, wb = state_numpy(a), state_numpy(b)
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], atol=1e-6, err_msg=k)


def test_the_step_runs_the_head_in_chunks(monkeypatch):
    """The objective a chunked step differentiates calls the recomputed head once per chunk, on
    12, 12 and 8 tokens (eager, uncompiled: the call counted in Python)."""
    import mindspore as ms

    from mspretrain.model import loss
    from mspretrain.step.objective import make_objective

    seen: list[int] = []
    real = loss.HeadChunk.construct
    monkeypatch.setattr(loss.HeadChunk, "construct", lambda self, h, w, t: seen.append(h.shape[0]) or real(self, h, w, t))
    model, _ = _step(0)
    fn = make_objective(model, replace(OPTIM, loss_chunk_tokens=12), global_tokens=32, device="cpu", cfg=model.cfg).fn
    tokens = ms.Tensor(np.random.default_rng(5).integers(0, 128, (2, 17)).astype(np.int32))
    whole = make_objective(model, OPTIM, global_tokens=32, device="cpu", cfg=model.cfg).fn(tokens, None, None, ms.Tensor(1.0))
    chunked = fn(tokens, None, None, ms.Tensor(1.0))
    assert seen == [12, 12, 8] and loss.ChunkedNLL(12).head._has_config_recompute  # Cell.recompute() was called
    assert float(chunked[0].asnumpy()) == pytest.approx(float(whole[0].asnumpy()), rel=1e-6)
