"""The decoder model: parity with HF transformers, masks, RoPE constants, precision islands, flash layout,
initialisation, presets' parameter counts, and the sparse token NLL."""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import numpy as np
import pytest

# Plain imports, not importorskip: torch and transformers are pinned test dependencies
# (pyproject [test]); a missing one must fail collection loudly, not skip every parity test.
import torch  # noqa: E402
import transformers  # noqa: E402

from mspretrain import device as device_mod
from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.errors import UserError
from mspretrain.model import attention, layers
from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
from mspretrain.model.hf import hf_to_ours, our_shapes
from mspretrain.model.loss import token_nll
from mspretrain.model.presets import PRESETS, param_count, preset

V = 320


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96, max_seq_len=64, rope_theta=5000.0)
    base.update(kw)
    return resolve_model(ModelConfig(**base))


def hf_model(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings)
    return transformers.LlamaForCausalLM(hc).eval()


def ours_from_hf(hf, cfg: ModelConfig, **kw) -> Decoder:
    model = Decoder(cfg, **kw)
    load_numpy(model, hf_to_ours({k: v.detach().numpy() for k, v in hf.state_dict().items()}, cfg))
    return model


def tokens(shape, seed=0, vocab=V):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_cfg()
    hf = hf_model(cfg)
    return cfg, hf, ours_from_hf(hf, cfg)


# --------------------------------------------------------------------------- parity with HF

@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_loss_match_hf(tied):
    cfg = tiny_cfg(tie_embeddings=tied)
    hf = hf_model(cfg, seed=1)
    ours = ours_from_hf(hf, cfg)
    tok = tokens((2, 40), seed=2)
    with torch.no_grad():
        out = hf(torch.tensor(tok, dtype=torch.long), labels=torch.tensor(tok, dtype=torch.long))
    logits = ours(ms.Tensor(tok)).asnumpy()
    assert logits.dtype == np.float32 and logits.shape == (2, 40, V)
    assert np.abs(logits - out.logits.numpy()).max() <= 1e-4
    nll, _ = token_nll(ms.Tensor(logits[:, :-1]), ms.Tensor(tok[:, 1:]))
    assert abs(float(nll.asnumpy().mean()) - float(out.loss)) <= 1e-5


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_gradients_match_hf(mode):
    # The backward pass has hand-written pieces (RMSNorm, softmax, loss): check every parameter's
    # gradient against PyTorch autograd on HF's model, mapped through the same converter.
    cfg = tiny_cfg(tie_embeddings=(mode == "jit"))
    hf = hf_model(cfg, seed=4)
    ours = ours_from_hf(hf, cfg)
    tok = tokens((2, 24), seed=5)
    hf(torch.tensor(tok).long(), labels=torch.tensor(tok).long()).loss.backward()
    expected = hf_to_ours({k: p.grad.numpy() for k, p in hf.named_parameters()}, cfg)

    def loss_fn(x, y):
        return token_nll(ours(x), y)[0].mean()

    grad_fn = ms.value_and_grad(loss_fn, None, ours.trainable_params())
    if mode == "jit":
        grad_fn = ms.jit(grad_fn)
    _, grads = grad_fn(ms.Tensor(tok[:, :-1]), ms.Tensor(tok[:, 1:]))
    got = {p.name: g.asnumpy() for p, g in zip(ours.trainable_params(), grads)}
    assert got.keys() == expected.keys()
    for name in got:
        scale = np.abs(expected[name]).max()
        assert np.abs(got[name] - expected[name]).max() <= 1e-4 * scale + 1e-7, name


def test_jit_matches_pynative(pair):
    cfg, _, ours = pair
    tok = ms.Tensor(tokens((2, 24), seed=3))
    assert np.array_equal(ms.jit(ours.construct)(tok).asnumpy(), ours(tok).asnumpy())


def test_gqa_grouping_matches_hf_repeat_kv():
    # n_kv_heads=1 (multi-query) and n_kv_heads=n_heads (no grouping) take the two code paths.
    for kv in (1, 4):
        cfg = tiny_cfg(n_kv_heads=kv)
        hf = hf_model(cfg, seed=kv)
        tok = tokens((1, 17), seed=kv)
        with torch.no_grad():
            ref = hf(torch.tensor(tok, dtype=torch.long)).logits.numpy()
        assert np.abs(ours_from_hf(hf, cfg)(ms.Tensor(tok)).asnumpy() - ref).max() <= 1e-4


# --------------------------------------------------------------------------- masks and positions

def test_documents_never_attend_across_segments(pair):
    cfg, _, ours = pair
    a, b = tokens((1, 5), seed=4), tokens((1, 7), seed=5)
    packed = np.concatenate([a, b], axis=1)
    segments = np.array([[0] * 5 + [1] * 7], np.int32)
    positions = np.array([list(range(5)) + list(range(7))], np.int32)
    out = ours(ms.Tensor(packed), ms.Tensor(positions), ms.Tensor(segments)).asnumpy()
    alone_a, alone_b = ours(ms.Tensor(a)).asnumpy(), ours(ms.Tensor(b)).asnumpy()
    assert np.abs(out[:, :5] - alone_a).max() <= 1e-5
    assert np.abs(out[:, 5:] - alone_b).max() <= 1e-5
    # Without the segment mask the second document sees the first: the test can fail.
    leaky = ours(ms.Tensor(packed), ms.Tensor(positions)).asnumpy()
    assert np.abs(leaky[:, 5:] - alone_b).max() > 1e-3


def test_causal_future_tokens_do_not_change_the_past(pair):
    _, _, ours = pair
    tok = tokens((1, 20), seed=6)
    changed = tok.copy()
    changed[0, 12:] = (changed[0, 12:] + 1) % V
    a, b = ours(ms.Tensor(tok)).asnumpy(), ours(ms.Tensor(changed)).asnumpy()
    assert np.abs(a[:, :12] - b[:, :12]).max() == 0.0
    assert np.abs(a[:, 12:] - b[:, 12:]).max() > 0.0


def test_explicit_positions_equal_default(pair):
    _, _, ours = pair
    tok = tokens((2, 9), seed=7)
    pos = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    assert np.abs(ours(ms.Tensor(tok), ms.Tensor(pos)).asnumpy() - ours(ms.Tensor(tok)).asnumpy()).max() <= 1e-6


# --------------------------------------------------------------------------- state, RoPE, init

def test_rope_tables_are_constants_not_parameters(pair):
    cfg, _, ours = pair
    names = [p.name for p in ours.get_parameters()]
    assert not any("rope" in n or "inv_freq" in n for n in names)
    assert isinstance(ours.rope_cos, ms.Tensor) and not isinstance(ours.rope_cos, ms.Parameter)
    assert ours.rope_cos.dtype == ms.float32 and ours.rope_cos.shape == (cfg.max_seq_len, cfg.dim // cfg.n_heads)
    state = state_numpy(ours)
    assert set(state) == set(our_shapes(cfg))
    assert {p.name for p in ours.trainable_params()} == set(state)
    assert all("norm" in n for n in state if n.endswith("norm.weight")) and "embed.weight" in state


def test_rope_table_values():
    cos, sin = attention.rope_tables(8, 5, 10000.0)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ang = 3 * np.concatenate([inv, inv])
    assert np.allclose(cos[3], np.cos(ang), atol=1e-7) and np.allclose(sin[3], np.sin(ang), atol=1e-7)


def test_load_numpy_is_strict(pair):
    cfg, _, ours = pair
    state = state_numpy(ours)
    with pytest.raises(UserError, match="norm.weight"):
        load_numpy(ours, {k: v for k, v in state.items() if k != "norm.weight"})
    with pytest.raises(UserError, match="extra.weight"):
        load_numpy(ours, dict(state, **{"extra.weight": np.zeros(1, np.float32)}))
    with pytest.raises(UserError, match="embed.weight"):
        load_numpy(ours, dict(state, **{"embed.weight": np.zeros((3, 3), np.float32)}))
    load_numpy(ours, state)  # and the round trip itself works


def test_init_is_llama_and_seeded():
    cfg = tiny_cfg(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, init_std=0.02)
    a, b, c = (state_numpy(Decoder(cfg, seed=s)) for s in (7, 7, 8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed.weight"], c["embed.weight"])
    scaled = 0.02 / np.sqrt(2 * cfg.n_layers)
    for name, std in [("embed.weight", 0.02), ("layers.0.attn.wqkv.weight", 0.02), ("layers.0.mlp.w13.weight", 0.02),
                      ("lm_head.weight", 0.02), ("layers.1.attn.wo.weight", scaled), ("layers.1.mlp.w2.weight", scaled)]:
        assert abs(a[name].std() / std - 1) < 0.05, name
        assert abs(a[name].mean()) < 0.1 * std
    assert np.all(a["norm.weight"] == 1) and np.all(a["layers.0.attn_norm.weight"] == 1)


# --------------------------------------------------------------------------- precision policy

def test_fp16_keeps_fp32_islands(pair, monkeypatch):
    cfg, hf, ref = pair
    seen = {"rms_in": set(), "rms_out": set(), "softmax_out": set(), "head_in": set()}
    orig_rms, orig_soft = layers.rms_statistic, layers.softmax_fp32

    def rms(x, eps):
        out = orig_rms(x, eps)
        seen["rms_in"].add(x.dtype), seen["rms_out"].add(out.dtype)
        return out

    def soft(s):
        out = orig_soft(s)
        seen["softmax_out"].add(out.dtype)
        return out


    monkeypatch.setattr(layers, "rms_statistic", rms)  # where the norm and softmax cells look them up
    monkeypatch.setattr(layers, "softmax_fp32", soft)
    model = ours_from_hf(hf, cfg, dtype="fp16")
    head = model.head_matmul
    model.head_matmul = lambda h, w: (seen["head_in"].add((h.dtype, w.dtype)), head(h, w))[1]
    tok = ms.Tensor(tokens((2, 16), seed=8))
    logits = model(tok)
    assert seen["rms_in"] == {ms.float16}  # the residual stream really runs in fp16 ...
    assert seen["rms_out"] == {ms.float32}  # ... but norm statistics are fp32,
    assert seen["softmax_out"] == {ms.float32}  # the attention softmax is fp32,
    assert seen["head_in"] == {(ms.float32, ms.float32)}  # the lm_head runs in fp32,
    assert logits.dtype == ms.float32  # and logits are fp32.
    assert all(p.dtype == ms.float32 for p in model.get_parameters())  # fp32 master weights
    assert np.abs(logits.asnumpy() - ref(tok).asnumpy()).max() < 2e-2  # and fp16 is close to fp32


def test_bf16_refused_on_cpu_and_bad_names():
    with pytest.raises(UserError, match="bf16"):
        Decoder(tiny_cfg(), dtype="bf16", device="cpu")
    with pytest.raises(UserError):
        Decoder(tiny_cfg(), dtype="fp8")
    with pytest.raises(UserError):
        Decoder(tiny_cfg(), attention="sdpa")
    with pytest.raises(UserError, match="resolve"):
        Decoder(ModelConfig(vocab_size=0))


# --------------------------------------------------------------------------- flash attention (Ascend) layout

def test_attention_selection_by_device():
    assert device_mod.select_attention("auto", "ascend", "fp16") and device_mod.select_attention("auto", "ascend", "bf16")
    assert not device_mod.select_attention("auto", "cpu", "fp16")
    assert not device_mod.select_attention("auto", "ascend", "fp32")  # the kernel has no fp32
    assert not device_mod.select_attention("math", "ascend", "fp16")
    with pytest.raises(UserError):
        device_mod.select_attention("flash", "cpu", "fp16")
    with pytest.raises(UserError):
        device_mod.select_attention("flash", "ascend", "fp32")


def test_flash_path_argument_layout(pair, monkeypatch):
    # Checked against our reading of the kernel's docs; unverified on hardware (see flash_reference).
    from mspretrain.model import decoder as decoder_mod
    from tests.helpers.kernels import flash_reference, rms_norm_reference

    monkeypatch.setattr(decoder_mod.ops, "rms_norm", rms_norm_reference)  # Ascend's fused norm has no CPU kernel
    cfg, hf, _ = pair
    math16 = ours_from_hf(hf, cfg, dtype="fp16", device="cpu")
    flash16 = ours_from_hf(hf, cfg, dtype="fp16", device="ascend")
    assert flash16.use_flash and not math16.use_flash
    for layer in flash16.layers:
        layer.attn.flash_causal = flash_reference(layer.attn.flash_causal)
        layer.attn.flash_masked = flash_reference(layer.attn.flash_masked)
    tok = tokens((2, 12), seed=9)
    seg = np.array([[0] * 5 + [1] * 7, [0] * 12], np.int32)
    pos = np.array([list(range(5)) + list(range(7)), list(range(12))], np.int32)
    # the selftest's comparison (fp16 tolerance 1e-2), which a 910B runs against the real kernel
    from mspretrain.preflight.selftest_numerics import compare_outputs

    a = flash16(ms.Tensor(tok)).asnumpy()
    b = math16(ms.Tensor(tok)).asnumpy()
    assert compare_outputs(a, b, "fp16").passed
    a = flash16(ms.Tensor(tok), ms.Tensor(pos), ms.Tensor(seg)).asnumpy()
    b = math16(ms.Tensor(tok), ms.Tensor(pos), ms.Tensor(seg)).asnumpy()
    assert compare_outputs(a, b, "fp16").passed


# --------------------------------------------------------------------------- presets

@pytest.mark.parametrize("name", [n for n in PRESETS if PRESETS[n]().family == "llama"])  # others: test_families.py
@pytest.mark.parametrize("tied", [False, True])
def test_preset_param_count_equals_hf(name, tied):
    from dataclasses import replace

    cfg = preset(name)
    cfg = resolve_model(replace(cfg, tie_embeddings=tied), 8000 if cfg.vocab_size == 0 else None)
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, tie_word_embeddings=tied)
    with torch.device("meta"):
        n_hf = sum(p.numel() for p in transformers.LlamaForCausalLM(hc).parameters())
    assert param_count(cfg) == n_hf
    if name == "llama2-7b" and not tied:
        assert n_hf == 6_738_415_616


def test_param_count_equals_model_and_presets_errors():
    cfg = tiny_cfg(tie_embeddings=True)
    assert param_count(cfg) == sum(int(np.prod(p.shape)) for p in Decoder(cfg).get_parameters())
    with pytest.raises(UserError, match="vocab_size"):
        param_count(preset("tiny"))
    with pytest.raises(UserError, match="preset"):
        preset("13b")


# --------------------------------------------------------------------------- loss

def test_token_nll_matches_torch_values_and_grads():
    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((2, 6, 50)) * 5).astype(np.float32)
    logits[0, 0] += 1e4  # large values must not overflow
    targets = rng.integers(0, 50, (2, 6)).astype(np.int32)
    tl = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(tl.reshape(-1, 50), torch.tensor(targets).long().reshape(-1), reduction="none")
    w = rng.standard_normal((2, 6)).astype(np.float32)  # a weighted sum exercises the full backward
    (ref * torch.tensor(w).reshape(-1)).sum().backward()
    nll, lse = token_nll(ms.Tensor(logits), ms.Tensor(targets))
    assert nll.dtype == ms.float32 and nll.shape == (2, 6)
    assert np.allclose(nll.asnumpy().reshape(-1), ref.detach().numpy(), atol=1e-4, rtol=1e-6)
    assert np.allclose(lse.asnumpy(), torch.logsumexp(tl, -1).detach().numpy(), rtol=1e-6)
    grad = ms.grad(lambda x: (token_nll(x, ms.Tensor(targets))[0] * ms.Tensor(w)).sum())(ms.Tensor(logits))
    assert np.allclose(grad.asnumpy(), tl.grad.numpy(), atol=1e-6)


# --------------------------------------------------------------------------- incremental decoding

def test_kv_cache_greedy_equals_full_recompute():
    cfg = tiny_cfg(init_std=0.1)
    model = Decoder(cfg, seed=5)
    prompt, n_new = tokens((2, 6), seed=11), 10

    seq = prompt.copy()
    full_logits = []
    for _ in range(n_new):
        logits = model(ms.Tensor(seq)).asnumpy()[:, -1]
        full_logits.append(logits)
        seq = np.concatenate([seq, logits.argmax(-1).astype(np.int32)[:, None]], axis=1)

    cache = model.init_cache(2, prompt.shape[1] + n_new)
    logits, cache = model.prefill(ms.Tensor(prompt), cache)
    step = ms.jit(model.decode_step)  # one compiled graph for every position
    out, cached_logits = prompt.copy(), []
    last = logits.asnumpy()[:, -1]
    for i in range(n_new):
        cached_logits.append(last)
        nxt = last.argmax(-1).astype(np.int32)[:, None]
        out = np.concatenate([out, nxt], axis=1)
        pos = ms.Tensor(np.int32(prompt.shape[1] + i))
        logits, cache = step(ms.Tensor(nxt), pos, ms.mutable(cache))
        last = logits.asnumpy()[:, -1]
    assert np.array_equal(out, seq)
    assert np.abs(np.stack(cached_logits) - np.stack(full_logits)).max() <= 1e-4
    with pytest.raises(UserError, match="max_seq_len"):
        model.init_cache(1, cfg.max_seq_len + 1)
