"""`plan`: numbers for a small config equal a hand computation; 7B parameters equal HF's count."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mspretrain.cli import main
from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.preflight.plan import LLAMA2_7B_PARAMS, _param_count, checkpoint_bytes, format_plan, make_plan

LLAMA2_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, ffn_dim=11008, max_seq_len=4096)
# Small config by hand: dim 64, 2 layers, 4 heads, vocab 1000, ffn = 32 * ceil(int(2*256/3) / 32) = 192.
P_SMALL = 1000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) + 64 + 64 * 1000  # embed, layers, final norm, head
assert P_SMALL == 234_816
# its decoder matrices (wqkv, wo, w13, w2), what precision.param_dtype=compute stores in half precision
P_HALF = 2 * (4 * 64 * 64 + 3 * 64 * 192)
assert P_HALF == 106_496


def small_cfg(*overrides: str) -> cfgmod.Config:
    return cfgmod.load(None, ["model.vocab_size=1000", "train.max_steps=100", *overrides])


def test_small_fp32_plan_by_hand():
    plan = make_plan(small_cfg(), devices=1, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert plan["params"] == P_SMALL
    mem = plan["memory_bytes"]
    assert mem["weights"] == 4 * P_SMALL and mem["half_weights"] == mem["master_weights"] == 0
    # global batch 8 on one device: no accumulation, so the step keeps no fp32 gradient buffers
    assert plan["accumulation"] == 1 and mem["gradients"] == 0 and mem["micro_gradients"] == 4 * P_SMALL
    assert mem["adam_moments"] == 8 * P_SMALL
    assert mem["collective_buffers"] == 0 and mem["framework_reserve"] == 0
    assert mem["update_temporaries"] == 8 * 1000 * 64  # the largest parameter (embedding = lm_head)
    # activations, fp32 (e=4), s=64, b=8, h=64, kv=64, f=192, a=4, 2 layers, V=1000:
    per_layer = 4 * 64 * 8 * (6 * 64 + 2 * 64 + 4 * 192) + 4 * 4 * 64 * 64 * 8
    logits = 8 * 64 * 8 * 1000
    assert mem["activations"] == 2 * per_layer + logits
    assert plan["activations_other_bytes"] == 2 * 4 * 64 * 8 * 64 + per_layer + logits  # with recompute
    assert mem["total"] == 16 * P_SMALL + 2 * per_layer + logits + 8 * 64000
    # peak: weights + moments, plus the larger of (activations + gradients) and (gradients + update temporaries)
    assert mem["peak"] == 12 * P_SMALL + max(2 * per_layer + logits + 4 * P_SMALL, 4 * P_SMALL + 8 * 64000)
    assert plan["tokens"] == 100 * 8 * 64 and plan["steps"] == 100
    assert plan["warmup_steps"] == math.ceil(0.02 * 51200 / (8 * 64)) == 2
    assert plan["lr"] == 3e-4 and plan["checkpoint_bytes"] == checkpoint_bytes(P_SMALL) == 12 * P_SMALL
    assert plan["warnings"] == [] and "time" not in plan and "reference" not in plan


def test_sharding_half_precision_recompute_time_cost_and_sqrt_lr():
    cfg = small_cfg("precision.dtype=fp16", "optim.lr_scaling=sqrt", "cost.price_per_device_hour=2.5", "device.target=cpu")
    plan = make_plan(cfg, devices=2, tokens=1_024_000, data_dir=None, tokens_per_s_per_device=1000.0,
                     zero=True, recompute=True)
    mem = plan["memory_bytes"]
    assert plan["micro_batch"] == 4 and plan["accumulation"] == 1 and plan["flash_attention"] is False
    # the heaviest rank's share of the moments: half of them, give or take one parameter
    assert mem["weights"] == 4 * P_SMALL and 8 * P_SMALL / 2 <= mem["adam_moments"] <= 8 * (P_SMALL / 2 + 64000)
    assert mem["half_weights"] == 2 * P_HALF and mem["master_weights"] == 0  # fp32 parameters: no masters
    half = make_plan(small_cfg("precision.dtype=fp16", "precision.param_dtype=compute", "optim.shard_optimizer=true"),
                     devices=2, tokens=1_024_000, data_dir=None, tokens_per_s_per_device=None)
    hm = half["memory_bytes"]
    p32 = P_SMALL - P_HALF
    assert (hm["weights"], hm["half_weights"], hm["micro_gradients"]) == (2 * P_HALF + 4 * p32, 0, 2 * P_HALF + 4 * p32)
    # owners are balanced within the half-precision group: each rank holds half of its masters
    assert hm["master_weights"] == 4 * P_HALF / 2
    assert half["zero"] and 8 * P_SMALL / 2 <= hm["adam_moments"] <= 8 * (P_SMALL / 2 + 64000)
    assert half["checkpoint_bytes"] == 14 * P_SMALL
    # fp16: e=2, math attention keeps (4 + 2) bytes per probability; recompute keeps each layer's input.
    per_layer = 2 * 64 * 4 * (6 * 64 + 2 * 64 + 4 * 192) + 6 * 4 * 64 * 64 * 4
    assert mem["activations"] == 2 * 2 * 64 * 4 * 64 + per_layer + 8 * 64 * 4 * 1000
    assert plan["steps"] == 1_024_000 // 512 and plan["warmup_steps"] == math.ceil(0.02 * 2000)
    assert plan["lr"] == pytest.approx(3e-4 * math.sqrt(8 / 32))
    hours = 1_024_000 / (1000 * 2) / 3600
    assert plan["time"] == pytest.approx({"tokens_per_s_per_device": 1000.0, "hours": hours,
                                          "device_hours": 2 * hours, "cost": 2 * hours * 2.5})


def test_data_dir_tokens_set_auto_warmup_and_the_budget_only_when_none_is_set(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"tokens": {"train": 5_000_000, "valid": 1}, "vocab_size": 777}))
    shape = ["train.global_batch=16", "data.seq_len=128", "model.max_seq_len=128"]
    # no budget in the config: one pass over the data
    plan = make_plan(cfgmod.load(None, shape), devices=1, tokens=None, data_dir=tmp_path, tokens_per_s_per_device=None)
    assert plan["model"]["vocab_size"] == 777 and plan["tokens_source"] == "data dir"
    assert plan["steps"] == math.ceil(5_000_000 / 2048) and plan["warmup_steps"] == math.ceil(0.02 * 5_000_000 / 2048)
    # the config's budget is what `train` runs: 100 steps, and the auto warm-up of 49 capped at a tenth
    plan = make_plan(cfgmod.load(None, shape + ["train.max_steps=100"]), devices=1, tokens=None, data_dir=tmp_path,
                     tokens_per_s_per_device=None)
    assert (plan["tokens_source"], plan["steps"], plan["tokens"]) == ("config", 100, 100 * 2048)
    assert plan["warmup_steps"] == 10 and "capped at a tenth of the 100 steps" in plan["warmup_note"]


def test_no_budget_still_plans_memory(capsys):
    plan = make_plan(cfgmod.load(None, ["model.vocab_size=1000"]), devices=1, tokens=None, data_dir=None,
                     tokens_per_s_per_device=100.0)
    assert plan["steps"] is None and plan["warmup_steps"] is None and "time" not in plan
    assert plan["memory_bytes"]["peak"] > 0
    text = format_plan(plan)
    assert "tokens     — (no budget" in text and "peak (largest set alive)" in text and "\nsteps " not in text
    # `plan --model llama2-7b --devices 8` plans, at the preset's seq and batch (not a silent seq 64 x batch 8)
    assert main(["plan", "--model", "llama2-7b", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "layout     8 devices, global batch 8 = micro 1 x accum 1 x 8, seq 4096" in out
    assert ("assumed    precision.dtype bf16 (Ascend's), train.global_batch 8 (the default), "
            "data.seq_len 4096 (the preset's max_seq_len)") in out
    assert "time       — (needs a token budget" in out and "reference  MindSpore Transformers" in out


def test_llama2_7b_param_count_matches_hf():
    from mspretrain.model.presets import preset

    assert _param_count(LLAMA2_7B) == LLAMA2_7B_PARAMS == 6_738_415_616
    assert _param_count(preset("llama2-7b")) == 6_738_415_616


def test_llama2_7b_on_8_devices_warns_and_cites_reference():
    cfg = cfgmod.Config(model=LLAMA2_7B, data=cfgmod.DataConfig(seq_len=4096),
                        train=cfgmod.TrainConfig(global_batch=512, micro_batch=1, max_steps=1),
                        precision=cfgmod.PrecisionConfig(dtype="bf16"), device=cfgmod.DeviceConfig(target="ascend"))
    plan = make_plan(cfg, devices=8, tokens=120_000_000_000, data_dir=None, tokens_per_s_per_device=3000.0)
    assert plan["flash_attention"] and plan["accumulation"] == 64
    assert plan["warnings"] and plan["warnings"][0].startswith("WILL NOT FIT")
    half = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, param_dtype="compute"))
    half = dataclasses.replace(half, optim=dataclasses.replace(half.optim, shard_gradients=True))
    fits = make_plan(half, devices=8, tokens=120_000_000_000, data_dir=None, tokens_per_s_per_device=None,
                     zero=True, recompute=True)
    assert fits["memory_bytes"]["peak"] < 58 * 1024**3 and not any("NOT FIT" in w for w in fits["warnings"])
    ref = plan["reference"]
    assert ref["tokens_per_s_per_device"] == 4100.0 and "llama2.md" in ref["source"]
    assert ref["ratio"] == pytest.approx(3000 / 4100)
    text = format_plan(plan)
    assert "WARNING: WILL NOT FIT" in text and "4,100 tokens/s/device" in text and "6,738,415,616" in text


def test_errors_are_user_errors(capsys):
    with pytest.raises(UserError):
        make_plan(small_cfg(), devices=3, tokens=None, data_dir=None, tokens_per_s_per_device=None)  # 8 % 3
    with pytest.raises(UserError):
        make_plan(cfgmod.load(None, ["train.max_steps=5"]), devices=1, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert main(["plan", "--devices", "0", "model.vocab_size=1000", "train.max_steps=5"]) == 2
    assert "error:" in capsys.readouterr().err


def test_plan_refuses_a_tp_that_train_would_refuse_and_says_what_its_figures_are(capsys):
    """parallel.tp is checked as `train` checks it (devices = tp x dp, the kv heads split), before any
    plan is printed; an accepted tp is named under the plan, whose headline figures are without it."""
    base = ["plan", "--model", "qwen3-14b", "--tokens", "1e9", "train.global_batch=64", "train.micro_batch=1"]
    assert main(base + ["--devices", "8", "parallel.tp=3"]) == 2
    err = capsys.readouterr()
    assert "parallel.tp = 3 does not divide --devices 8" in err.err and not err.out
    assert main(base + ["--devices", "16", "parallel.tp=16"]) == 2  # Qwen3-14B has 8 kv heads
    assert "does not divide model.n_kv_heads = 8" in capsys.readouterr().err
    assert main(base + ["--devices", "8", "parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "parallel.tp = 2: the memory above is the table's TP2 accounting" in out
    # the batch is split over the 4 data-parallel ranks, not the 8 devices
    assert "global batch 64 = micro 1 x accum 16 x 4 data-parallel (tensor parallel 2)" in out


def test_plan_cli_with_preset(capsys):
    assert main(["plan", "--model", "llama2-7b", "--devices", "8", "--tokens", "1e9", "data.seq_len=4096",
                 "train.global_batch=64", "train.micro_batch=1", "precision.dtype=bf16", "model.n_layers=16"]) == 0
    out = capsys.readouterr().out
    assert "dim 4096, 16 layers" in out  # the preset, with a model.* override on top


def test_plan_cli_json(capsys):
    assert main(["plan", "--json", "--tokens", "51200", "--tokens-per-s", "100", "model.vocab_size=1000", "train.max_steps=1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["params"] == P_SMALL and plan["steps"] == 100 and plan["time"]["hours"] == pytest.approx(51200 / 100 / 3600)


def test_llama2_7b_zh_continue_recipe_fits_both_stages():
    """configs/llama2-7b-zh-continue-910b.toml: stage 1 (embeddings + lm_head) as written and stage 2
    (everything, with the overrides its comment gives) plan to fit 8 x 910B with room (<= 52 GB)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "llama2-7b-zh-continue-910b.toml"
    stage1 = cfgmod.load(path)
    stage2 = cfgmod.load(path, ['train.trainable=["all"]', "optim.lr=5e-5", "train.max_tokens=20_000_000_000"])
    assert stage1.train.trainable == ("embeddings", "lm_head") and stage1.model.vocab_size == 49953
    text = path.read_text(encoding="utf-8")
    assert "--init-from RUN_STAGE1 'train.trainable=[\"all\"]' optim.lr=5e-5" in text  # the stage-2 command
    plans = [make_plan(c, devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None) for c in (stage1, stage2)]
    for plan in plans:
        assert not plan["warnings"] and plan["memory_bytes"]["peak"] <= 52 * 2**30, plan["memory_bytes"]["peak"] / 2**30
    one, two = plans
    assert one["params"] == two["params"] == LLAMA2_7B_PARAMS + 2 * 4096 * (49953 - 32000)
    embed = 4096 * 49953
    assert one["trained_params"] == 2 * embed and two["trained_params"] == two["params"]
    # stage 1 keeps Adam moments for its trained tables only; each table (819 MB, over the 256 MB
    # bucket cap) is split, so every rank holds 1/8 of both, with fp32 masters of its slices
    assert one["memory_bytes"]["adam_moments"] == 8 * 2 * embed // 8 and one["memory_bytes"]["master_weights"] == 4 * 2 * embed // 8
    assert one["checkpoint_bytes"] == checkpoint_bytes(one["params"], "fp16", trained=2 * embed)
    assert one["lr"] == 2e-4 and two["lr"] == 5e-5 and one["steps"] < two["steps"]
    assert f"{2 * embed:,} trained" in format_plan(one) and "trained" not in format_plan(two).splitlines()[1]
