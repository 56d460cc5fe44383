"""The 7B-on-8x910B recipe (configs/llama2-7b-910b.toml), checked as far as a CPU box can:

1. its model has Llama-2-7B's 6,738,415,616 parameters, by the closed form and by building our
   real `Decoder` module at full size with shape-only (not allocated) parameters;
2. `mspretrain plan` for it on 8 devices equals a hand computation, byte for byte;
3. one real fp16 train step of the same config scaled down (2 layers, dim 64, seq 32, the data
   dir's vocabulary, one rank's share of the batch) runs on CPU with the field report's
   loss-scale warm-up and the fp32 lm_head.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.config import schema as cfgmod
from mspretrain.model.presets import param_count
from mspretrain.preflight.plan import make_plan

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llama2-7b-910b.toml"
P_7B = 6_738_415_616  # HF meta-llama/Llama-2-7b-hf num_parameters()
GB = 1024**3
P_HALF = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # the decoder matrices: fp16 with param_dtype=compute


@pytest.fixture(scope="module")
def cfg_7b() -> cfgmod.Config:
    cfg = cfgmod.load(CONFIG)
    cfgmod.validate(cfg)
    return cfg


def test_param_count_closed_form(cfg_7b):
    m = cfgmod.resolve_model(cfg_7b.model)
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (4096, 32, 32, 32, 11008, 32000)
    # By hand: embed + lm_head 2 x 32000 x 4096; per layer q,k,v,o 4 x 4096^2 + MLP 3 x 4096 x 11008
    # + 2 norms x 4096; final norm 4096.
    by_hand = 2 * 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert by_hand == P_7B
    assert param_count(m) == P_7B


def test_full_size_module_built_shape_only(cfg_7b, monkeypatch):
    """Our Decoder class at 7B size with lazily initialised parameters: ~0.4 GB of RSS, not 27 GB."""
    import mindspore as ms
    from mindspore import Parameter
    from mindspore.common.initializer import Normal, initializer

    import mspretrain.model.decoder as decoder

    # The model draws its init from numpy; swap in MindSpore's lazy initializer so that
    # `no_init_parameters` keeps every large weight as shape + dtype only.
    monkeypatch.setattr(decoder, "_normal", lambda rng, shape, std: Parameter(initializer(Normal(std), shape, ms.float32), name="weight"))
    with ms.nn.utils.no_init_parameters():
        model = decoder.Decoder(cfgmod.resolve_model(cfg_7b.model), dtype=cfg_7b.precision.dtype, device="cpu")
    params = model.trainable_params()
    assert sum(math.prod(p.shape) for p in params) == P_7B
    assert len(params) == 1 + 32 * 6 + 1 + 1  # embed; per layer 2 norms, wqkv, wo, w13, w2; final norm; lm_head
    big = [p for p in params if math.prod(p.shape) > 4096]
    assert big and all(p.has_init for p in big)  # still unallocated
    assert all(p.dtype == ms.float32 for p in params)  # fp32 master weights
    assert model.dtype == ms.float16 and model.lm_head.dtype == ms.float32  # fp16 compute, fp32 lm_head island
    assert model.layers[0].attn.wqkv.weight.shape == (3 * 4096, 4096)


def test_memory_plan_on_8_devices_by_hand(cfg_7b):
    # Why the memory options are on: the same recipe with replicated fp32 state.
    replicated = dataclasses.replace(cfg_7b, optim=dataclasses.replace(cfg_7b.optim, shard_optimizer=False, shard_gradients=False),
                                     train=dataclasses.replace(cfg_7b.train, recompute=False, micro_batch=1),
                                     precision=dataclasses.replace(cfg_7b.precision, param_dtype="fp32"))
    plan = make_plan(replicated, devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert plan["params"] == P_7B
    assert (plan["micro_batch"], plan["accumulation"], plan["flash_attention"]) == (1, 32, True)
    # Budget 120e9 tokens at 256 x 2048 = 524,288 tokens per step.
    assert plan["steps"] == 228_882 == math.ceil(120e9 / 524_288)
    assert plan["warmup_steps"] == 4_578 == math.ceil(0.02 * 120e9 / 524_288)
    mem = plan["memory_bytes"]
    assert mem["weights"] == 4 * P_7B and mem["half_weights"] == 2 * P_HALF and mem["master_weights"] == 0
    assert mem["gradients"] == mem["micro_gradients"] == 4 * P_7B and mem["adam_moments"] == 8 * P_7B
    # Activations, fp16 (2 bytes), s=2048, b=1, h=4096, kv=4096, f=11008, 32 heads, flash attention:
    # per layer 2 x 2048 x (6 x 4096 + 2 x 4096 + 4 x 11008) = 314,572,800 + flash 64 x 32 x 2048 = 4,194,304;
    # logits + log-probs fp32 8 x 2048 x 32000 = 524,288,000.
    assert mem["activations"] == 32 * 318_767_104 + 524_288_000 == 10_724_835_328
    persistent = 4 * P_7B + 2 * P_HALF + 4 * P_7B + 8 * P_7B  # weights, cast copies, accumulation, moments
    assert mem["peak"] >= persistent + mem["activations"] + 4 * P_7B  # + one micro-batch's gradients
    assert plan["warnings"] and plan["warnings"][0].startswith(f"WILL NOT FIT: peak {mem['peak'] / GB:.1f} GB per device > 58 GB usable")
    assert plan["reference"]["tokens_per_s_per_device"] == 4100.0

    # The config as shipped: ZeRO-2 (moments, masters and accumulation buffers of the owned
    # parameters), fp16 decoder matrices, recompute, micro-batch 4 x 8 accumulated. Split
    # (optim.split_mb = "auto": at least the 256 MB bucket cap, 67,108,864 elements): the
    # embedding, the lm_head (131,072,000 each) and the 32 w13 (90,177,536 each) are cut into 8
    # slices, one per rank. Owners of the rest: wqkv, wo and w2 evenly (4 of each per rank), the
    # 65 norms 9 on the heaviest rank. It holds 809,500,672 half-precision elements (the 32 w13
    # slices and 12 whole matrices), 2 x 16,384,000 fp32 slices and 9 norms.
    sharded = make_plan(cfg_7b, devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    smem = sharded["memory_bytes"]
    assert (sharded["micro_batch"], sharded["accumulation"], sharded["shard_gradients"]) == (4, 8, True)
    p32 = P_7B - P_HALF
    owned_half = 32 * 90_177_536 // 8 + 4 * (50_331_648 + 16_777_216 + 45_088_768)
    owned_split32 = 2 * 131_072_000 // 8
    owned = owned_half + owned_split32 + 9 * 4096
    assert owned_half == P_HALF // 8 == 809_500_672
    # masters: the half-precision elements, and the fp32 slices (a slice needs a tensor of its own)
    assert (smem["weights"], smem["half_weights"], smem["master_weights"]) == (2 * P_HALF + 4 * p32, 0, 4 * (owned_half + owned_split32))
    assert smem["micro_gradients"] == 2 * P_HALF + 4 * p32
    assert smem["adam_moments"] == 8 * owned and smem["gradients"] == 4 * owned
    # recompute: each layer's input 32 x 2 x 2048 x 4 x 4096, one layer's activations, logits 8 x 2048 x 4 x 32000
    act = 32 * 2 * 2048 * 4 * 4096 + (2 * 2048 * 4 * (6 * 4096 + 2 * 4096 + 4 * 11008) + 64 * 32 * 2048 * 4) + 8 * 2048 * 4 * 32000
    assert smem["activations"] == act == 5_519_704_064
    assert smem["update_temporaries"] == 8 * 50_331_648  # the largest owned unit: a whole wqkv (a split one is 1/8)
    assert smem["framework_reserve"] == GB
    persistent = smem["weights"] + smem["master_weights"] + smem["adam_moments"] + smem["gradients"]
    accumulate = act + smem["micro_gradients"] + smem["collective_buffers"] / (1 + 1 / 8)  # flat copy + the 1/8 ReduceScatter result
    assert smem["peak"] >= persistent + act + smem["micro_gradients"] + GB
    assert smem["peak"] <= persistent + accumulate + smem["collective_buffers"] + GB
    assert smem["peak"] <= 52e9  # the margin: <= 52 GB of the 58 usable
    assert sharded["warnings"] == []
    assert sharded["checkpoint_bytes"] == 14 * P_7B  # fp16 weights + fp32 masters + moments
    calls, wire = sharded["collectives_per_step"]["calls"], sharded["collectives_per_step"]["bytes"]
    assert 8 * 2 * P_7B <= wire <= 8 * 2 * P_7B * 1.05 + 2 * P_7B * 1.05 + 8 * 4 * 262_410_240  # 8 fp16 reductions + a gather
    assert calls < 8 * 195  # buckets instead of one collective per parameter


@pytest.fixture(scope="module")
def one_step(tmp_path_factory, tiny_data):
    from mspretrain.train.build import build_trainer as Trainer

    # The 910B config, scaled down: same precision, loss-scale schedule, optimizer, schedule kind,
    # micro-batch 1 with accumulation; global batch 32 = one of the 8 ranks' share of 256.
    small = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=0",
             "model.vocab_size=0", "model.max_seq_len=64", "data.seq_len=32", "train.global_batch=32",
             "train.micro_batch=1", "train.max_steps=1", "train.log_every=1", "device.target=cpu",
             "eval.every=0", "metrics.tensorboard=false"]
    cfg = cfgmod.load(CONFIG, small)
    run = tmp_path_factory.mktemp("step7b") / "run"
    lines: list[str] = []
    trainer = Trainer(cfg, tiny_data, run, log=lines.append)
    summary = trainer.train()
    return trainer, summary, run, lines


@pytest.mark.slow  # `one_step` compiles and runs the scaled-down 7B step (38 s of make test-fast at load ~3)
def test_one_real_fp16_step_of_the_scaled_down_config(one_step, tiny_data):
    trainer, summary, run, lines = one_step
    vocab = json.loads((tiny_data / "manifest.json").read_text())["vocab_size"]
    assert trainer.cfg.model.vocab_size == vocab and trainer.accum_steps == 32 and trainer.loader.batch_size == 1
    assert summary.step == 1 and summary.skipped == 0
    loss = summary.losses[0]
    assert math.isfinite(loss) and abs(loss - math.log(vocab)) < 0.1 * math.log(vocab)  # ~ln V at init
    # The field report's loss-scale schedule: the step ran at 64, the next one warms towards 1,024.
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["loss_scale"] == 64.0
    assert trainer.scaler.scale == pytest.approx(64 + (1024 - 64) / 500)
    import mindspore as ms

    assert trainer.model.dtype == ms.float16 and trainer.model.lm_head.weight.dtype == ms.float32
    assert trainer.model.layers[0].attn.wqkv.weight.dtype == ms.float16  # param_dtype = "compute"
    # the config's memory options are reported at start-up (sharding needs more than one rank)
    assert any(line.endswith("accumulation; fp16 matrices with fp32 masters, layer recompute") for line in lines), lines[:3]


@pytest.mark.slow  # shares `one_step` above
def test_the_step_changed_the_weights_and_checkpointed_masters(one_step):
    trainer, summary, run, lines = one_step
    ckpt = run / "checkpoints" / "step_000001"
    weights = load_file(str(ckpt / "model.safetensors"))
    # param_dtype = "compute": decoder matrices stored (and saved) in fp16, fp32 masters in the optimizer state
    half = {k for k, w in weights.items() if w.dtype == np.float16}
    assert half and all(k.startswith("layers.") and "norm" not in k for k in half)
    assert all(weights[k].dtype == np.float32 for k in set(weights) - half)
    assert all(np.isfinite(w).all() for w in weights.values())
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["step"] == 1 and state["skipped_steps"] == 0
    assert state["loss_scale"]["scale"] == pytest.approx(65.92)
    optim = load_file(str(ckpt / "optimizer.safetensors"))
    moments = [v for k, v in optim.items() if k.startswith("exp_avg.")]
    assert moments and any(np.abs(m).max() > 0 for m in moments)  # AdamW took a step
    for k in half:  # the stored fp16 weight is the rounded fp32 master
        np.testing.assert_array_equal(weights[k], optim[f"master.{k}"].astype(np.float16))
    # "changed the weights": against the initial weights, rebuilt here the way the trainer builds
    # them (same seed). fp32 values: the master of an fp16 weight, the weight itself otherwise.
    import mindspore as ms

    from mspretrain.model.decoder import Decoder, state_numpy

    cfg = trainer.cfg
    ms.set_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed % (2**32))
    initial = state_numpy(Decoder(cfg.model, dtype=cfg.precision.dtype, seed=cfg.train.seed))
    assert set(initial) == set(weights)
    after = {k: optim[f"master.{k}"] if k in half else weights[k] for k in weights}
    for k in sorted(after):
        changed = after[k].astype(np.float32) != initial[k].astype(np.float32)
        if k == "embed.weight":  # rows of tokens absent from the batch get no gradient (and no decay)
            assert 0 < changed.any(axis=1).sum() < changed.shape[0], k
            assert np.array_equal(after[k][~changed.any(axis=1)], initial[k][~changed.any(axis=1)])  # the same init
        else:
            assert changed.mean() > 0.5, (k, changed.mean())
