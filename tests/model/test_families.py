"""Model families: Llama-3.1 (llama3 RoPE), Qwen2/2.5 (q/k/v bias, tied), Qwen3 (QK-norm,
explicit head_dim), Mistral (GQA, sliding window), each a tiny random model built by transformers
(no download): logits and loss within 1e-5 of transformers after `convert`; `export` reloads in
transformers as the same class with logits within 1e-5; `--init-from` on the HF folder equals the
converted checkpoint; one AdamW train step's loss and grad norm equal PyTorch's; bad configs are
one line naming the field."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import numpy as np
import pytest
import torch
import transformers

from mspretrain.checkpoint.init_source import load_init
from mspretrain.checkpoint.model import load_model
from mspretrain.config.schema import OptimConfig
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
from mspretrain.model.hf import config_from_hf, hf_to_ours
from mspretrain.model.loss import token_nll
from mspretrain.model.presets import param_count, preset
from mspretrain.step.step import TrainStep, decay_mask
from tests.helpers.cli import assert_refusal, cli
from tests.helpers.hf import HF_VOCAB, train_tokenizer

V = HF_VOCAB

COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=3)
FAMILIES = {
    # Llama-3.1: theta 500 000 and llama3 scaling whose low/high wavelengths fall inside head_dim 16's range
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(rms_norm_eps=1e-6, rope_theta=1e6, head_dim=32)),  # head_dim != 64 / 4
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=8)),  # window < the 33-token test sequences
}


def build_hf(family: str, seed: int = 0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hc = cfg_cls(**COMMON, **extra)
    hc._attn_implementation = "eager"
    model = model_cls(hc).eval()
    with torch.no_grad():  # HF starts norms at one and biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    """family -> (HF folder, HF model, converted checkpoint)."""
    root = tmp_path_factory.mktemp("families")
    tok = train_tokenizer(root / "tok" / "tokenizer.model", V)
    from mspretrain.cli import main

    out = {}
    for i, family in enumerate(FAMILIES):
        d = root / family
        model = build_hf(family, seed=i)
        model.save_pretrained(d)
        shutil.copy(tok, d / "tokenizer.model")
        ck = root / f"{family}_ckpt"
        assert main(["convert", "--from-hf", str(d), "--out", str(ck), "--quiet"]) == 0
        out[family] = (d, model, ck)
    return out


def tokens(seed: int, shape=(2, 33)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


def hf_forward(model, tok: np.ndarray):
    with torch.no_grad():
        return model(torch.tensor(tok).long(), labels=torch.tensor(tok).long())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_matches_transformers(fam, family):
    d, hf, ck = fam[family]
    loaded = load_model(ck)
    m = loaded.ref.config.model
    assert m.family == ("llama" if family == "llama3" else family)
    assert (m.qkv_bias, m.qk_norm) == (family == "qwen2", family == "qwen3")
    assert m.head_size == (32 if family == "qwen3" else 16) and m.tie_embeddings == (family == "qwen2")
    assert m.sliding_window == (8 if family == "mistral" else 0) and m.rope_scaling == ("llama3" if family == "llama3" else "none")
    tok = tokens(1)
    ref = hf_forward(hf, tok)
    logits = loaded.model(ms.Tensor(tok)).asnumpy()
    assert np.abs(logits - ref.logits.numpy()).max() <= 1e-5
    nll, _ = token_nll(ms.Tensor(logits[:, :-1]), ms.Tensor(tok[:, 1:]))
    assert abs(float(nll.asnumpy().mean()) - float(ref.loss)) <= 1e-5
    # the family's own switch matters: the same weights without it are far off (the test can fail)
    plain = replace(m, family="mistral" if family == "mistral" else "llama", qkv_bias=False, qk_norm=False,
                    sliding_window=0, rope_scaling="none")
    model = Decoder(plain)
    tensors = {k: v for k, v in state_numpy(loaded.model).items() if not k.endswith(("bias", "q_norm.weight", "k_norm.weight"))}
    load_numpy(model, tensors)
    assert np.abs(model(ms.Tensor(tok)).asnumpy() - ref.logits.numpy()).max() > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reloads_in_transformers(fam, family, capsys):
    d, hf, ck = fam[family]
    out = d.parent / f"{family}_export"
    rc, stdout, err = cli(capsys, "export", ck, "--format", "hf", "--out", out)
    assert rc == 0, err
    # the tokenizer reads back with our ids; a qwen2 folder's only through the class the export names
    # (transformers 5 forces its byte-level Qwen2Tokenizer there: CJK text became no tokens at all)
    text = "春风明月 江南"
    theirs = (transformers.LlamaTokenizer if family == "qwen2" else transformers.AutoTokenizer).from_pretrained(out)
    assert theirs(text)["input_ids"] == Tokenizer.load(out / "tokenizer.model").encode(text)
    assert ("LlamaTokenizer.from_pretrained" in stdout) == (family == "qwen2")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(hf)
    for key in ("tie_word_embeddings", "sliding_window", "rope_parameters", "rms_norm_eps", "num_key_value_heads"):
        assert getattr(back.config, key, None) == getattr(hf.config, key, None), key
    head = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert head(back.config) == head(hf.config)
    tok = tokens(2)
    a, b = hf_forward(back, tok), hf_forward(hf, tok)
    assert np.abs(a.logits.numpy() - b.logits.numpy()).max() <= 1e-5
    # the same weights, bit for bit, under the same names
    sd_a, sd_b = back.state_dict(), hf.state_dict()
    assert set(sd_a) == set(sd_b)
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_hf_folder_equals_converted(fam, family):
    d, hf, ck = fam[family]
    a, b = load_init(d), load_init(ck)
    assert a.config == b.config
    assert a.tensors.keys() == b.tensors.keys()
    assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    # and so the first step's loss is the same
    tok = tokens(3)
    losses = []
    for src in (a, b):
        model = Decoder(src.config)
        load_numpy(model, src.tensors)
        nll, _ = token_nll(model(ms.Tensor(tok[:, :-1])), ms.Tensor(tok[:, 1:]))
        losses.append(float(nll.asnumpy().mean()))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_adamw_step_matches_pytorch(fam, family):
    """Two TrainSteps (loss, grad norm before clipping; the second loss sees the first update) against
    transformers' model trained by torch.optim.AdamW with the same decay groups and clipping."""
    d, _, ck = fam[family]
    hf = build_hf(family, seed=list(FAMILIES).index(family))  # fresh, same weights as the folder
    loaded = load_model(ck)
    model, m = loaded.model, loaded.ref.config.model
    lr, clip = 1e-3, 1.0
    optim = OptimConfig(lr=lr, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=clip)
    batches = [tokens(10 + k, (2, 17)) for k in range(2)]
    step = TrainStep(model, optim, global_tokens=2 * 16, jit=True)
    ours = [step.run([(b, None, None)], lr=lr, scale=1.0) for b in batches]

    # torch: the same decay rule, applied to HF's names through the bridge's name map
    names = [n for n, _ in hf.named_parameters()]
    probe = hf_to_ours({n: np.full(p.shape, i, np.float32) for i, (n, p) in enumerate(hf.named_parameters())}, m)
    ours_of = {}
    for our_name, arr in probe.items():
        for idx in np.unique(arr):
            ours_of[names[int(idx)]] = our_name
    decay = dict(zip(probe, decay_mask(list(probe), False)))
    params = dict(hf.named_parameters())
    groups = [{"params": [params[n] for n in names if decay[ours_of[n]]], "weight_decay": 0.1},
              {"params": [params[n] for n in names if not decay[ours_of[n]]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    hf.train()
    for b, res in zip(batches, ours):
        tb = torch.tensor(b).long()
        logits = hf(tb[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tb[:, 1:].reshape(-1), reduction="sum") / 32
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        opt.step()
        assert res.loss == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        assert res.grad_norm == pytest.approx(norm.item(), rel=1e-4)


# --------------------------------------------------------------------------- refusals, presets

def _hf_dict(family: str) -> dict:
    cfg_cls, _, extra = FAMILIES[family]
    return cfg_cls(**COMMON, **extra).to_dict()


@pytest.mark.parametrize("family,key,value,needle", [
    ("llama3", "rope_scaling", {"type": ["llama3"], "factor": 8.0}, "rope_scaling.type"),
    ("llama3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
    ("llama3", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "'dynamic'"),
    ("llama3", "rope_scaling", ["llama3"], "rope_scaling"),
    ("llama3", "mlp_bias", True, "mlp_bias"),
    ("llama3", "attention_bias", True, "attention_bias"),
    ("qwen3", "attention_bias", True, "attention_bias"),
    ("qwen2", "use_sliding_window", True, "use_sliding_window"),
    ("qwen2", "model_type", "deepseek_v3", "model_type"),  # qwen2_moe and qwen3_moe convert
    ("mistral", "model_type", "mixtral", "model_type"),
    ("qwen2", "num_experts", 8, "num_experts"),
    ("qwen2", "hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_fields_are_refused_naming_the_field(family, key, value, needle):
    hf = _hf_dict(family)
    hf[key] = value
    if key == "model_type":
        hf["architectures"] = []
    with pytest.raises(UserError) as e:
        config_from_hf(hf)
    assert needle in e.value.cause and "\n" not in str(e.value)


def test_list_valued_rope_type_is_one_line_from_the_cli(fam, capsys, tmp_path):
    d, _, _ = fam["llama3"]
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_scaling"] = {"type": ["llama3", "linear"], "factor": 8.0}
    cfg.pop("rope_parameters", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "convert", "--from-hf", bad, "--out", tmp_path / "out")
    assert_refusal(rc, err, "rope_scaling.type")
    assert not (tmp_path / "out").exists()


def test_mistral_window_wider_than_the_context_is_full_attention():
    hf = _hf_dict("mistral")
    hf["sliding_window"] = 64  # == max_position_embeddings: never narrower than a sequence
    assert config_from_hf(hf).sliding_window == 0
    hf["sliding_window"] = None
    assert config_from_hf(hf).sliding_window == 0


@pytest.mark.parametrize("name,cls", [("llama3-8b", "LlamaConfig"), ("qwen2.5-7b", "Qwen2Config"), ("qwen3-8b", "Qwen3Config")])
def test_family_presets_count_what_transformers_counts(name, cls):
    """The presets' real shapes: our closed-form count equals transformers' num_parameters() of the
    model built from the exported config.json on the meta device (no memory, no download)."""
    from mspretrain.model.hf import config_to_hf

    m = preset(name)
    hc = getattr(transformers, cls).from_dict(config_to_hf(m))
    with torch.device("meta"):
        n_hf = transformers.AutoModelForCausalLM.from_config(hc).num_parameters()
    assert param_count(m) == n_hf
    assert config_from_hf(config_to_hf(m)) == m


def test_qwen25_910b_recipe_plans_within_52_gb():
    """configs/qwen2.5-7b-zh-continue-910b.toml: Qwen2.5-7B's real shape (= the preset, 7,615,616,512
    parameters with the 152,064 x 3584 embedding and lm_head) plans <= 52 GB per device on 8 x 910B."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.plan import make_plan

    path = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-7b-zh-continue-910b.toml"
    cfg = cfgmod.load(path)
    assert cfg.model == replace(preset("qwen2.5-7b"), max_seq_len=cfg.model.max_seq_len)
    plan = make_plan(cfg, devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert plan["params"] == 7_615_616_512 and not plan["warnings"]
    assert plan["memory_bytes"]["peak"] <= 52 * 2**30, plan["memory_bytes"]["peak"] / 2**30
    # the lm_head trains, the frozen embedding is still held: the weights count it
    table = 152064 * 3584
    assert plan["trained_params"] == plan["params"] - table
    assert cfg.optim.split_mb == "auto" and cfg.train.trainable == ("attention", "mlp", "norms", "lm_head")
    # split (ZeRO, optim.split_mb): every device holds 1/8 of the lm_head's moments and fp32 master,
    # not one device all of them; the largest unit a device updates is its lm_head slice
    mem = plan["memory_bytes"]
    assert mem["update_temporaries"] == 8 * table // 8
    assert mem["adam_moments"] < 8 * (plan["trained_params"] / 8) * 1.01
    # with the embedding trained too the plan is over the 52 GB bar (by ~1 GB; the recipe says so)
    both = make_plan(cfgmod.load(path, ['train.trainable=["all"]']), devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert 52 * 2**30 < both["memory_bytes"]["peak"] <= 54 * 2**30
    assert f"{both['memory_bytes']['peak'] / 2**30:.2f} GB" in path.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b", "llama3-8b"])
def test_plan_model_presets(name, capsys):
    rc, out, err = cli(capsys, "plan", "--model", name, "--devices", "8", "--tokens", "1e9")
    assert rc == 0, err
    assert f"{param_count(preset(name)):,}" in out


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b", "llama3-8b"])
def test_mfu_counts_the_family_matmuls(name):
    """MFU's matmul parameters are the 2-D weights of param_shapes (q width n_heads x head_dim, the
    lm_head once whether tied or not, the embedding gather not): biases and QK-norm are not matmuls."""
    import math

    from mspretrain.model.presets import param_shapes
    from mspretrain.monitor.mfu import flops_per_token, matmul_params

    m = preset(name)
    mats = sum(math.prod(s) for n, s in param_shapes(m) if len(s) == 2 and n != "embed.weight")
    assert matmul_params(m) == mats + (m.vocab_size * m.dim if m.tie_embeddings else 0)
    tied = replace(m, tie_embeddings=True)
    assert matmul_params(tied) == matmul_params(m)  # the lm_head matmul runs either way
    assert flops_per_token(m, 4096) == 6 * mats + 12 * m.n_layers * m.n_heads * m.head_size * 4096
    # Qwen3-0.6B's shape: head_dim 128 with dim 1024 and 16 heads, q width 2048 != dim
    small = replace(preset("qwen3-8b"), dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                    tie_embeddings=True)
    assert matmul_params(small) == sum(math.prod(s) for n, s in param_shapes(small) if len(s) == 2)


def _flash_kernels(attn, seen: list, out_dtype=np.float16) -> None:
    """Every FlashAttentionScore of `attn` replaced by the documented-semantics stand-in, recording."""
    from tests.helpers.kernels import flash_reference

    for name in ("flash_causal", "flash_masked", "flash_band", "flash_band_masked"):
        if hasattr(attn, name):
            setattr(attn, name, flash_reference(getattr(attn, name), seen, out_dtype))


def test_sliding_window_on_the_flash_path_matches_the_math_path(monkeypatch):
    """Mistral's window on Ascend: band mode (sparse_mode 4, pre_tokens = window - 1, next_tokens 0)
    with the one compressed 2048x2048 mask; with documents, the full (B, 1, T, T) mask in sparse_mode
    0 with the same band bounds. Checked on CPU against the documented kernel semantics
    (tests/helpers/kernels.py kernel_discard; unverified on hardware, like every flash layout test), and
    the window really masks (a window of T gives other logits)."""
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model import decoder as decoder_mod
    from tests.helpers.kernels import rms_norm_reference

    monkeypatch.setattr(decoder_mod.ops, "rms_norm", rms_norm_reference)  # Ascend's fused norm has no CPU kernel

    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96, max_seq_len=64,
                                    family="mistral", sliding_window=4, init_std=0.2))
    math16 = Decoder(cfg, dtype="fp16", device="cpu", seed=3)
    flash16 = Decoder(cfg, dtype="fp16", device="ascend", seed=3)
    assert flash16.use_flash and not math16.use_flash
    seen: list = []
    for layer in flash16.layers:
        _flash_kernels(layer.attn, seen)
    tok = tokens(9, (2, 12))
    seg = np.array([[0] * 5 + [1] * 7, [0] * 12], np.int32)
    pos = np.array([list(range(5)) + list(range(7)), list(range(12))], np.int32)
    def rel(x, y):  # fp16 rounding relative to the logits' size (init_std 0.2 makes them large enough to test the mask)
        return np.abs(x - y).max() / np.abs(y).max()

    a, b = flash16(ms.Tensor(tok)).asnumpy(), math16(ms.Tensor(tok)).asnumpy()
    assert rel(a, b) <= 5e-3
    # both layers: the band, with the model's one compressed mask (no (B, 1, T, T) tensor)
    assert [x[:3] for x in seen] == [(4, 3, 0)] * 2 and all(x[3] is flash16.flash_causal_mask for x in seen)
    seen.clear()
    a = flash16(ms.Tensor(tok), ms.Tensor(pos), ms.Tensor(seg)).asnumpy()
    assert rel(a, math16(ms.Tensor(tok), ms.Tensor(pos), ms.Tensor(seg)).asnumpy()) <= 5e-3
    assert [x[:3] for x in seen] == [(0, 3, 0)] * 2 and all(tuple(x[3].shape) == (2, 1, 12, 12) for x in seen)
    full = Decoder(replace(cfg, sliding_window=0), dtype="fp16", device="ascend", seed=3)
    seen.clear()
    for layer in full.layers:
        _flash_kernels(layer.attn, seen)
    assert rel(full(ms.Tensor(tok)).asnumpy(), b) > 5e-2
    assert [x[:3] for x in seen] == [(2, 2147483647, 0)] * 2  # no window: leftUpCausal, as before


T_EDGE = 12


@pytest.mark.parametrize("window", [1, 2, T_EDGE - 1, T_EDGE, T_EDGE + 1])
@pytest.mark.parametrize("documents", [False, True])
def test_banded_window_equals_plain_attention_on_every_edge(window, documents):
    """The flash path's kernel arguments (recorded from Attention._flash), turned
    into the mask the kernel applies by the documented semantics (kernel_discard), then fed to the
    model's plain fp32 attention, equal the model's own sliding-window attention within 1e-5, at
    window 1, 2, T-1, T, T+1, with and without documents. The masks are also compared exactly, and
    pre_tokens = window (one more) would fail: the edge is tested, not only the bulk."""
    from mspretrain.config.schema import ModelConfig, resolve_model
    from tests.helpers.kernels import kernel_discard

    cfg = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96, max_seq_len=64,
                                    family="mistral", sliding_window=window))
    flash16 = Decoder(cfg, dtype="fp16", device="ascend", seed=1)
    plain32 = Decoder(cfg, dtype="fp32", device="cpu", seed=1)
    B, T, hd = 2, T_EDGE, cfg.head_size
    rng = np.random.default_rng(window)
    # fp16-representable inputs: both sides see the same values (the kernel's inputs are fp16)
    q, k, v = (rng.standard_normal((B, h, T, hd)).astype(np.float16).astype(np.float32)
               for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads))
    seg = ms.Tensor(np.array([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9], np.int32)) if documents else None

    seen: list = []
    attn = flash16.layers[0].attn
    _flash_kernels(attn, seen, out_dtype=np.float32)
    _, discard = flash16._mask(seg, T, B)
    banded = attn._flash(*(ms.Tensor(x).astype(ms.float16) for x in (q, k, v)), discard).asnumpy()
    (mode, pre, nxt, mask), = seen
    windowed = window < T
    assert (mode, pre, nxt) == ((0 if documents else 4, window - 1, 0) if windowed else
                                (0 if documents else 2, 2147483647, 0))
    if documents:
        assert tuple(mask.shape) == (B, 1, T, T)
    else:
        assert mask is flash16.flash_causal_mask  # the compressed 2048x2048 mask, never a (B, 1, T, T) one

    bias, _ = plain32._mask(seg, T, B)
    plain = plain32.layers[0].attn.attend(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), bias).asnumpy()
    kernel_mask = kernel_discard(mode, pre, nxt, mask.asnumpy().astype(bool), T)
    assert np.array_equal(np.broadcast_to(kernel_mask, (B, 1, T, T)), np.broadcast_to(bias.asnumpy() != 0, (B, 1, T, T)))
    as_bias = ms.Tensor(np.where(kernel_mask, np.float32(-1e9), np.float32(0)))
    via_kernel_mask = plain32.layers[0].attn.attend(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), as_bias).asnumpy()
    assert np.abs(via_kernel_mask - plain).max() <= 1e-5
    assert np.abs(banded - plain).max() <= 1e-5  # the stand-in kernel itself (numpy, fp32) agrees too
    if windowed and not documents:  # band mode: one token more of band is another mask, the off-by-one is seen
        # (with documents the full mask holds the window; the band bounds only let blocks be skipped,
        # and one too narrow would fail the mask comparison above)
        wider = kernel_discard(mode, pre + 1, nxt, mask.asnumpy().astype(bool), T)
        assert not np.array_equal(np.broadcast_to(wider, (B, 1, T, T)), np.broadcast_to(kernel_mask, (B, 1, T, T)))


def test_sliding_window_kv_cache_greedy_equals_full_recompute():
    """Mistral's window in prefill and decode_step (what `generate` runs) equals recomputing the
    whole sequence with the windowed mask, past the window."""
    from mspretrain.config.schema import ModelConfig, resolve_model

    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96, max_seq_len=64,
                                    family="mistral", sliding_window=4, init_std=0.1))
    model = Decoder(cfg, seed=5)
    prompt, n_new = tokens(11, (2, 6)), 8
    seq, full_logits = prompt.copy(), []
    for _ in range(n_new):
        logits = model(ms.Tensor(seq)).asnumpy()[:, -1]
        full_logits.append(logits)
        seq = np.concatenate([seq, logits.argmax(-1).astype(np.int32)[:, None]], axis=1)
    cache = model.init_cache(2, prompt.shape[1] + n_new)
    logits, cache = model.prefill(ms.Tensor(prompt), cache)
    step = ms.jit(model.decode_step)
    out, cached_logits, last = prompt.copy(), [], logits.asnumpy()[:, -1]
    for i in range(n_new):
        cached_logits.append(last)
        nxt = last.argmax(-1).astype(np.int32)[:, None]
        out = np.concatenate([out, nxt], axis=1)
        logits, cache = step(ms.Tensor(nxt), ms.Tensor(np.int32(prompt.shape[1] + i)), ms.mutable(cache))
        last = logits.asnumpy()[:, -1]
    assert np.array_equal(out, seq)
    assert np.abs(np.stack(cached_logits) - np.stack(full_logits)).max() <= 1e-4


# --------------------------------------------------------------------------- the table (mspretrain/families.py)

def test_family_table_is_what_transformers_says():
    """Each row's facts against transformers' own classes: model_type, the architecture's class,
    the config defaults convert fills in, and which config keys the class has."""
    from mspretrain.families import FAMILIES

    for f in FAMILIES:
        hc = getattr(transformers, f"{f.label}Config")()
        assert hc.model_type == f.name
        assert hasattr(transformers, f.hf_class) and f.hf_class == f"{f.label}ForCausalLM"
        assert hc.max_position_embeddings == f.max_position_default, f.name
        assert (getattr(hc, "sliding_window", None) or 0) == f.sliding_window_default, f.name
        assert hasattr(hc, "attention_bias") == f.attention_bias_key, f.name
        assert hasattr(hc, "use_sliding_window") == f.per_layer_window, f.name
        assert hasattr(hc, "head_dim") == f.head_dim_written, f.name
        if f.head_dim_default is not None:
            assert hc.head_dim == f.head_dim_default, f.name
        assert hc.num_key_value_heads == (f.kv_heads_default or hc.num_attention_heads), f.name


def test_family_table_drives_config_presets_and_shapes():
    """model.family's choices are the table's names; a preset's switches and so its parameters
    (a q/k/v bias, QK-norm weights) come from its family's row; a switch its family lacks is one line."""
    from mspretrain.config.schema import ModelConfig
    from mspretrain.config.sections.base import choices
    from mspretrain.families import FAMILIES, NAMES, family
    from mspretrain.model.presets import param_shapes

    assert choices(ModelConfig, "family") == NAMES == tuple(f.name for f in FAMILIES)
    for name in ("qwen2.5-7b", "qwen3-8b", "llama3-8b"):
        m = preset(name)
        f = family(m.family)
        assert (m.qkv_bias, m.qk_norm) == (f.qkv_bias, f.qk_norm)
        names = [n for n, _ in param_shapes(m)]
        assert any(n.endswith("wqkv.bias") for n in names) == f.qkv_bias
        assert any(n.endswith("q_norm.weight") for n in names) == f.qk_norm
    with pytest.raises(UserError) as e:
        ModelConfig(family="qwen2")
    assert e.value.cause == "model.qkv_bias = False is not what model.family = qwen2 has"
    assert e.value.fix == ("qwen2 has qkv_bias, qwen2_moe has qkv_bias, qwen3 has qk_norm, qwen3_moe has qk_norm, "
                           "only mistral has a sliding_window; llama has none of them")
    with pytest.raises(UserError, match="not supported"):
        family("gpt2")


# --------------------------------------------------------------------------- as transformers loads a folder

def _resave(src: Path, dst: Path, edit) -> Path:
    """A copy of the HF folder `src` whose weights went through `edit(dict of torch tensors)`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case", ["own_lm_head", "only_lm_head", "equal_lm_head"])
def test_a_tied_folder_is_read_as_transformers_loads_it(fam, capsys, tmp_path, case):
    """config.json ties the embeddings (Qwen2 here) and the folder holds lm_head.weight: transformers
    keeps a different one untied, ties to an lm_head that is the only copy, and ties an equal one;
    convert's logits are transformers' in each case (dropping the own lm_head was off by ~40)."""
    d, _, _ = fam["qwen2"]
    gen = torch.Generator().manual_seed(5)

    def edit(sd):
        emb = sd["model.embed_tokens.weight"]
        if case == "own_lm_head":
            sd["lm_head.weight"] = torch.randn(emb.shape, generator=gen)
        elif case == "only_lm_head":
            sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")
        else:
            sd["lm_head.weight"] = emb.clone()
    src = _resave(d, tmp_path / "hf", edit)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    assert ref.config.tie_word_embeddings
    rc, out, err = cli(capsys, "convert", "--from-hf", src, "--out", tmp_path / "ck", "--quiet")
    assert rc == 0, err
    loaded = load_model(tmp_path / "ck")
    assert loaded.ref.config.model.tie_embeddings == (case != "own_lm_head")
    tok = tokens(7)
    assert np.abs(loaded.model(ms.Tensor(tok)).asnumpy() - hf_forward(ref, tok).logits.numpy()).max() <= 1e-5


@pytest.mark.parametrize("rope_parameters,rope_scaling,top_theta,ok", [
    ({"rope_type": "default", "rope_theta": 1e6}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, None, False),
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16},
     {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, None, False),
    ({"rope_type": "default", "rope_theta": 1e6}, {"type": "default", "rope_theta": 1e4}, None, False),
    ({"rope_type": "default", "rope_theta": 1e6}, None, 1e4, False),
    ({"rope_type": "default", "rope_theta": 1e6}, {"type": "default"}, 1e6, True),
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16}, 5e5, True),
])
def test_rope_parameters_and_legacy_rope_scaling_must_agree(rope_parameters, rope_scaling, top_theta, ok):
    """transformers 4.x reads rope_scaling and the top-level rope_theta, 5.x rope_parameters: a
    folder whose readings differ has no one model; one whose readings agree is read as both read it."""
    hf = {k: v for k, v in _hf_dict("llama3").items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    hf["rope_parameters"] = dict(rope_parameters)
    if rope_scaling is not None:
        hf["rope_scaling"] = dict(rope_scaling)
    if top_theta is not None:
        hf["rope_theta"] = top_theta
    if ok:
        m = config_from_hf(hf)
        assert m.rope_theta == rope_parameters["rope_theta"]
        assert m.rope_scaling == rope_parameters["rope_type"].replace("default", "none")
        return
    with pytest.raises(UserError) as e:
        config_from_hf(hf)
    assert ("disagree" in e.value.cause or "rope_theta has 2 values" in e.value.cause) and "\n" not in str(e.value)


def test_train_help_lists_every_preset(capsys):
    """`train --help` listed 6 presets and hid the family ones: it names the table's."""
    from mspretrain.model.presets import PRESETS

    rc, out, _ = cli(capsys, "train", "--help")
    assert rc == 0
    text = " ".join(out.split())
    for name in PRESETS:
        assert f"{name}," in text or f"{name})" in text, name
