"""Upcycling: an MoE model built from a dense Qwen3 checkpoint equals it at step 0;
and an MoE model decodes with the K/V cache as its full forward computes."""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

from dataclasses import replace

import mindspore as ms
import numpy as np

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
from mspretrain.model.upcycle import upcycle
from tests.helpers.cli import assert_user_error

DENSE = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=32,
                                  family="qwen3", qk_norm=True))
MOE = replace(DENSE, family="qwen3_moe", num_experts=6, experts_per_token=2, moe_ffn_dim=96)


def test_upcycled_model_equals_dense_at_step_0():
    dense = Decoder(DENSE, seed=5)
    moe = Decoder(MOE, seed=9)  # the run seed: its routers are kept
    routers = state_numpy(moe)
    want_router = routers["layers.1.mlp.router.weight"].copy()
    load_numpy(moe, upcycle(state_numpy(dense), DENSE, MOE, routers))
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32))
    want, got = dense(tokens).asnumpy(), moe(tokens).asnumpy()
    assert np.abs(want).max() > 0.05
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    st = state_numpy(moe)
    np.testing.assert_array_equal(st["layers.1.mlp.router.weight"], want_router)
    assert np.abs(want_router).max() > 0  # a seeded router, not zeros: tokens are routed from step 0


def test_upcycle_refusals():
    st = {}
    assert_user_error(lambda: upcycle(st, replace(DENSE, family="llama", qk_norm=False), MOE, st), "cannot upcycle")
    assert_user_error(lambda: upcycle(st, DENSE, replace(MOE, norm_topk_prob=False), st), "norm_topk_prob")
    assert_user_error(lambda: upcycle(st, DENSE, replace(MOE, moe_ffn_dim=64), st), "moe_ffn_dim")
    assert_user_error(lambda: upcycle(st, DENSE, replace(MOE, dim=128, head_dim=16), st), "model.dim")


def test_moe_cached_decoding_matches_the_full_forward():
    """generate's path (prefill + decode_step with the K/V cache) runs the MoE blocks too."""
    m = Decoder(MOE, seed=1)
    tok = np.random.default_rng(0).integers(0, 128, (1, 10)).astype(np.int32)
    full = m(ms.Tensor(tok)).asnumpy()
    logits, cache = m.prefill(ms.Tensor(tok[:, :6]), m.init_cache(1, 16))
    np.testing.assert_allclose(logits.asnumpy(), full[:, :6], atol=1e-6, rtol=0)
    for p in range(6, 10):
        logits, cache = m.decode_step(ms.Tensor(tok[:, p:p + 1]), ms.Tensor(p, ms.int32), cache)
        np.testing.assert_allclose(logits.asnumpy()[:, 0], full[:, p], atol=1e-6, rtol=0)
