"""Perplexity does not depend on the eval batch size and equals a numpy computation."""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.data.shards import IndexedDataset
from mspretrain.errors import UserError
from mspretrain.eval.generate import SamplingParams, generate, sample_next
from mspretrain.eval.perplexity import evaluate_tokens
from mspretrain.model.decoder import Decoder

SEQ = 16


@pytest.fixture(scope="module")
def model_and_tokens(tiny_data):
    from mspretrain.data.loader import read_manifest

    vocab = read_manifest(tiny_data)["vocab_size"]
    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64), vocab)
    tokens = np.asarray(IndexedDataset(tiny_data / "valid").tokens)[: 40 * SEQ + 1]
    return Decoder(cfg, seed=3), tokens


@pytest.mark.slow
def test_perplexity_is_independent_of_batch_size(model_and_tokens):
    model, tokens = model_and_tokens
    res = [evaluate_tokens(model, tokens, seq_len=SEQ, batch_size=b) for b in (1, 3, 8)]
    assert res[0]["tokens"] == res[1]["tokens"] == res[2]["tokens"] == 40 * SEQ
    for r in res[1:]:
        assert abs(r["ppl"] - res[0]["ppl"]) / res[0]["ppl"] <= 1e-6


def test_perplexity_equals_numpy(model_and_tokens):
    model, tokens = model_and_tokens
    # The windows are cut here with numpy's own stride view, not with perplexity.windows(): a bug
    # shared by the code and its reference must not pass. Packed windows of SEQ+1 tokens, stride SEQ.
    batch = np.lib.stride_tricks.sliding_window_view(tokens, SEQ + 1)[::SEQ].astype(np.int32)  # (N, SEQ+1)
    assert batch.shape == (40, SEQ + 1) and np.array_equal(batch[1, 0], tokens[SEQ])
    logits = model(ms.Tensor(batch[:, :-1])).asnumpy().astype(np.float64)  # (N, SEQ, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    token_nll = -np.take_along_axis(logp, batch[:, 1:, None].astype(np.int64), -1)[..., 0]  # (N, SEQ)
    nll = token_nll.mean()
    ours = evaluate_tokens(model, tokens, seq_len=SEQ, batch_size=8)
    assert ours["tokens"] == batch.shape[0] * SEQ
    assert ours["nll"] == pytest.approx(nll, rel=1e-6)
    assert ours["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)  # fp32 log-softmax vs float64 numpy
    capped = evaluate_tokens(model, tokens, seq_len=SEQ, batch_size=8, max_tokens=5 * SEQ)
    assert capped["tokens"] == 5 * SEQ
    assert capped["nll"] == pytest.approx(token_nll[:5].mean(), rel=1e-6)  # the first 5 windows


def test_too_short_split_is_a_user_error(model_and_tokens):
    model, tokens = model_and_tokens
    with pytest.raises(UserError, match="fewer than one window"):
        evaluate_tokens(model, tokens[:SEQ], seq_len=SEQ, batch_size=2)


def test_sampling_filters():
    rng = np.random.default_rng(0)
    logits = np.array([5.0, 4.0, 1.0, 0.0, -1.0])
    greedy = SamplingParams(greedy=True, repetition_penalty=1.0)
    assert sample_next(logits, [], greedy, rng) == 0
    assert sample_next(logits, [0], SamplingParams(greedy=True, repetition_penalty=10.0), rng) == 1
    top1 = SamplingParams(top_k=1, repetition_penalty=1.0)
    assert {sample_next(logits, [], top1, rng) for _ in range(20)} == {0}
    nucleus = SamplingParams(top_k=0, top_p=0.5, temperature=1.0, repetition_penalty=1.0)
    assert {sample_next(logits, [], nucleus, rng) for _ in range(50)} == {0}  # token 0 alone holds > 50 %
    wide = SamplingParams(top_k=0, top_p=1.0, temperature=5.0, repetition_penalty=1.0)
    assert len({sample_next(logits, [], wide, rng) for _ in range(200)}) == 5


def test_prompt_errors(model_and_tokens, tiny_data):
    from mspretrain.data.tokenizer import Tokenizer

    model, _ = model_and_tokens
    tok = Tokenizer.load(tiny_data)
    with pytest.raises(UserError, match="empty"):
        generate(model, tok, "   ", SamplingParams(), max_seq_len=64)
    with pytest.raises(UserError, match="context is 64"):
        generate(model, tok, "春风明月" * 40, SamplingParams(), max_seq_len=64)


def test_kv_cache_greedy_equals_full_recompute(model_and_tokens, tiny_data):
    from mspretrain.data.tokenizer import Tokenizer

    model, _ = model_and_tokens
    tok = Tokenizer.load(tiny_data)
    # 10 new tokens: without the cache each length compiles a graph of its own (eval/generate.py)
    p = SamplingParams(max_new_tokens=10, greedy=True, repetition_penalty=1.0, stop_at_eos=False)
    cached = generate(model, tok, "春风明月", p, max_seq_len=64, use_cache=True)
    full = generate(model, tok, "春风明月", p, max_seq_len=64, use_cache=False)
    assert len(full.ids) == 10 and cached.ids == full.ids
    sampled = [generate(model, tok, "江南", SamplingParams(max_new_tokens=12, seed=9, stop_at_eos=False), max_seq_len=64).ids
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # same seed, same sample


def test_bits_per_character_divides_by_the_manifests_chars_per_token(model_and_tokens, tiny_data):
    """bpc = bits per token / characters per token (total bits over total characters), on a data dir
    whose chars/token is far from 1, so that dividing by it, multiplying or leaving it out differ."""
    from mspretrain.data.loader import read_manifest
    from mspretrain.eval.perplexity import evaluate_split

    model, _ = model_and_tokens
    cpt = read_manifest(tiny_data)["chars_per_token"]
    assert abs(cpt - 1.0) > 0.2, cpt
    res = evaluate_split(model, tiny_data, split="valid", seq_len=SEQ, batch_size=8, max_tokens=8 * SEQ, chars_per_token=cpt)
    tokens = np.asarray(IndexedDataset(tiny_data / "valid").tokens)
    plain = evaluate_tokens(model, tokens, seq_len=SEQ, batch_size=8, max_tokens=8 * SEQ)
    assert res["nll"] == plain["nll"] and res["tokens"] == plain["tokens"]
    bits, characters = plain["nll"] * plain["tokens"] / math.log(2), cpt * plain["tokens"]
    assert res["bpc"] == pytest.approx(bits / characters, rel=1e-12)
    assert "bpc" not in evaluate_split(model, tiny_data, split="valid", seq_len=SEQ, max_tokens=8 * SEQ)
