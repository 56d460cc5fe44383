"""What an operator sees of a mixture of experts: MFU and plan count active
parameters, the trainer logs per-layer expert load, diagnose finds a router collapse."""
from __future__ import annotations

import numpy as np
import pytest

from mspretrain.model.moe import load_metrics
from mspretrain.model.presets import param_count, preset
from mspretrain.monitor.mfu import flops_per_token, matmul_params, trained_matmul_params


def test_qwen3_30b_a3b_flops_count_active_parameters():
    m = preset("qwen3-30b-a3b")
    L, D, V, E, K, F = m.n_layers, m.dim, m.vocab_size, m.num_experts, m.experts_per_token, m.moe_ffn_dim
    q, kv = m.n_heads * m.head_size, m.n_kv_heads * m.head_size
    attn = D * q + 2 * D * kv + q * D  # q, k, v, o
    active_mlp = E * D + K * 3 * F * D  # the router, K experts' gate, up, down
    matmul = L * (attn + active_mlp) + D * V  # + lm_head (untied)
    assert matmul_params(m) == matmul
    seq = 4096
    assert flops_per_token(m, seq) == 6.0 * matmul + 12.0 * L * q * seq
    # Qwen publishes 3.3 B activated parameters (of 30.5 B): ours with the embedding and the norms
    active = matmul + D * V + L * (2 * D + 2 * m.head_size) + D
    assert 3.25e9 < active < 3.4e9, active
    assert abs(param_count(m) - 30.5e9) < 0.1e9
    # frozen groups: only the trained groups' active matrices get a weight gradient
    assert trained_matmul_params(m, ["mlp"]) == L * active_mlp
    assert trained_matmul_params(m, ["attention", "lm_head"]) == L * attn + D * V


def test_step_returns_each_layers_expert_load_over_micro_batches():
    """The accumulation path (2 micro-batches, 2 MoE layers): the step's metrics are `load_metrics`
    of each layer's routing stats summed over the micro-batches, as the decoder's forward gives them."""
    import mindspore as ms

    from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.moe import load_metrics
    from mspretrain.step.step import TrainStep

    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, family="qwen3_moe",
                                    qk_norm=True, num_experts=8, experts_per_token=2, moe_ffn_dim=32, router_aux_loss_coef=0.01))
    model = Decoder(cfg, seed=3)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 64, (2, 17)).astype(np.int32) for _ in range(2)]
    per = sum(model(ms.Tensor(b[:, :-1]), None, None, True, True)[1].asnumpy().astype(np.float64) for b in batches)
    assert per.shape == (2, 2, 8)
    want = load_metrics(per, [0, 1], 2)
    step = TrainStep(model, OptimConfig(), global_tokens=2 * 2 * 16, accumulation=2)
    res = step.run([(b, None, None) for b in batches], lr=1e-3, scale=1.0)
    assert res.moe is not None and set(res.moe) == set(want)
    for key, value in want.items():
        assert res.moe[key] == pytest.approx(value, rel=1e-5), key
    assert res.moe["moe/layer_1/max_over_mean"] >= 1.0 and res.moe["moe/dropped_tokens"] == 0.0
    assert per[:, 1].sum() == 2 * 2 * 2 * 16 * 2  # layers x micro-batches x tokens x K assignments


def test_load_metrics_arithmetic():
    # one layer, 4 experts, K=2, 4 tokens: counts (4, 2, 2, 0) of 8 assignments, probabilities summing to 4
    per = np.array([[[2.0, 1.0, 0.5, 0.5], [4.0, 2.0, 2.0, 0.0]]])
    got = load_metrics(per, [3], 2)
    assert got["moe/layer_3/max_over_mean"] == 4 / 2
    assert got["moe/layer_3/top_share"] == 1.0  # every token chose expert 0
    assert got["moe/balance_loss"] == pytest.approx(4 * (4 * 2 + 2 * 1 + 2 * 0.5) / 16)


def _plant(run, shares: dict[int, list[float]], ratio_of=lambda s: s * 4):
    import json

    run.mkdir()
    lines = []
    for step in range(1, 11):
        rec = {"step": step, "loss": 3.0}
        for layer, values in shares.items():
            rec[f"moe/layer_{layer}/top_share"] = values[step - 1]
            rec[f"moe/layer_{layer}/max_over_mean"] = ratio_of(values[step - 1])
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_diagnose_finds_a_router_collapse(tmp_path, capsys):
    from mspretrain.cli import main
    from mspretrain.forensics.diagnose import diagnose

    # layer 1: one expert chosen by 90 % of the tokens at steps 4-8 (5 logged steps); layer 3: 2 steps only
    calm = [0.1] * 10
    _plant(tmp_path / "run", {0: calm, 1: [0.1] * 3 + [0.9] * 5 + [0.1] * 2, 3: [0.1, 0.8, 0.8] + [0.1] * 7})
    found = [f for f in diagnose(tmp_path / "run") if f.kind == "router_collapse"]
    assert len(found) == 1 and found[0].count == 5 and found[0].line == 4, found
    assert "MoE layer 1" in found[0].evidence and "from step 4" in found[0].evidence
    assert "router_aux_loss_coef" in found[0].advice
    assert main(["diagnose", str(tmp_path / "run")]) == 1
    assert "[router_collapse] metrics.jsonl:4" in capsys.readouterr().out
    # two collapsed steps are not a collapse; a tiny model's balanced load (4 experts, 2 per token:
    # every expert's share 1/2, max/mean 1) is not either
    _plant(tmp_path / "short", {1: [0.1, 0.9, 0.9] + [0.1] * 7})
    _plant(tmp_path / "tiny", {0: [0.5] * 10}, ratio_of=lambda s: 1.0)
    for run in ("short", "tiny"):
        assert not [f for f in diagnose(tmp_path / run) if f.kind == "router_collapse"], run


def test_report_plots_expert_load_only_for_moe_runs(tmp_path):
    from mspretrain.forensics.report import render_report

    _plant(tmp_path / "moe", {0: [0.3] * 10, 2: [0.5] * 10})
    _, pngs = render_report(tmp_path / "moe")
    assert pngs["moe"].startswith(b"\x89PNG") and len(pngs["moe"]) > 5000
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    assert "moe" not in render_report(tmp_path / "dense")[1]  # an optional panel: left out, not empty


# ---- the router options: float64 references of the maths, and the bias at work in a compiled step
_OPT_BASE = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, family="qwen3_moe", qk_norm=True,
                 num_experts=4, moe_ffn_dim=32)


def _cfg(**kw):
    from mspretrain.config.schema import ModelConfig, resolve_model

    return resolve_model(ModelConfig(**{**_OPT_BASE, "experts_per_token": 2, **kw}))


@pytest.mark.parametrize("opts", [dict(router_z_loss_coef=0.1), dict(capacity_factor=1.0, router_z_loss_coef=0.1),
                                  dict(capacity_factor=0.5, experts_per_token=1), dict(router_bias_update_rate=0.01)])
def test_router_options_against_float64(opts):
    """Eager MoE layer vs model/moe.py's float64 references: the output with the routing bias choosing
    and capacity dropping (GShard order), the z row = sum over tokens of logsumexp(logits)^2, the
    dropped row = the assignments the reference loop drops, per expert."""
    import mindspore as ms

    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.moe import capacity, reference_capacity, reference_moe, reference_z_loss

    cfg = _cfg(**opts)
    model = Decoder(cfg, seed=3)
    mlp = model.layers[0].mlp
    bias = None
    if cfg.router_bias_update_rate:
        bias = np.array([0.3, 0.0, 0.0, -0.2], np.float32)  # big enough to change choices
        mlp.expert_bias.set_data(ms.Tensor(bias))
    st = {k: v.astype(np.float64) for k, v in state_numpy(model).items()}
    x = np.random.default_rng(0).standard_normal((2, 12, 64)).astype(np.float32)
    y, stats = mlp(ms.Tensor(x))
    y, stats = y.asnumpy().reshape(24, 64), stats.asnumpy()
    x64 = x.reshape(24, 64).astype(np.float64)
    router, K = st["layers.0.mlp.router.weight"], cfg.experts_per_token
    want = reference_moe(x64, router, st["layers.0.mlp.w13.weight"], st["layers.0.mlp.w2.weight"], K, True,
                         bias=bias, capacity_factor=cfg.capacity_factor)
    np.testing.assert_allclose(y, want, atol=1e-6)
    rows = 2
    logits = x64 @ router.T
    if cfg.router_z_loss_coef:
        np.testing.assert_allclose(stats[rows], reference_z_loss(logits) * 24, rtol=1e-5)
        rows += 1
    if cfg.capacity_factor:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        idx = np.argsort(-p, -1, kind="stable")[:, :K]
        keep = reference_capacity(idx, 4, capacity(cfg.capacity_factor, 24, K, 4))
        dropped = np.bincount(idx[~keep], minlength=4)
        assert dropped.sum() > 0  # the case drops something
        np.testing.assert_array_equal(stats[rows], dropped)
        rows += 1
    if bias is not None:  # the bias changed some choice (else this case proves nothing)
        assert np.abs(want - reference_moe(x64, router, st["layers.0.mlp.w13.weight"], st["layers.0.mlp.w2.weight"], K, True)).max() > 1e-3
    assert stats.shape == (rows, 4)


def test_capacity_arithmetic():
    from mspretrain.model.moe import capacity, reference_capacity

    assert capacity(1.0, 24, 2, 4) == 12 and capacity(1.25, 10, 1, 4) == 4 and capacity(100.0, 8, 2, 4) == 8
    # GShard order: every first choice before any second choice
    idx = np.array([[0, 1], [0, 1], [1, 0]])
    assert reference_capacity(idx, 2, 2).tolist() == [[True, True], [True, False], [True, False]]


def test_objective_adds_the_router_z_loss():
    """The objective with router_z_loss_coef c minus the one without is c * mean lse^2 over the
    micro-batch's tokens x MoE layers, times scale / global tokens (eager, one forward each)."""
    import mindspore as ms

    from mspretrain.config.schema import OptimConfig
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.objective import make_objective

    cfg = _cfg(router_z_loss_coef=0.5, router_aux_loss_coef=0.0)
    model = Decoder(cfg, seed=3)
    tokens = ms.Tensor(np.random.default_rng(1).integers(0, 64, (2, 17)).astype(np.int32))
    scale, g = ms.Tensor(2.0, ms.float32), 100.0
    on = make_objective(model, OptimConfig(), global_tokens=g, device="cpu", cfg=cfg)
    off = make_objective(model, OptimConfig(), global_tokens=g, device="cpu", cfg=_cfg(router_aux_loss_coef=0.0))
    a, per = on.fn(tokens, None, None, scale)[0].asnumpy(), on.fn(tokens, None, None, scale)[3].asnumpy()
    b = off.fn(tokens, None, None, scale)[0].asnumpy()
    z_mean = per[0, 2, 0] / 32
    assert 1.0 < z_mean < 3.0  # ~log(E)^2 at initialisation
    assert float(a - b) == pytest.approx(0.5 * z_mean * 32 * 2.0 / g, rel=1e-4)
    assert on.moe_rows.z == 2 and off.moe_rows.z is None


def test_update_expert_bias_arithmetic():
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.moe import update_expert_bias

    model = Decoder(_cfg(router_bias_update_rate=0.01), seed=3)
    update_expert_bias(model, [0], np.array([[10.0, 2.0, 4.0, 0.0]]), 0.01)  # mean 4
    update_expert_bias(model, [0], np.array([[4.0, 4.0, 8.0, 0.0]]), 0.01)
    np.testing.assert_allclose(model.layers[0].mlp.expert_bias.asnumpy(), [-0.01, 0.01, -0.01, 0.02], atol=1e-7)  # sign(0) = 0: a mean load stays
    from mspretrain.model.decoder import half_eligible

    assert "layers.0.mlp.router.weight" in half_eligible(model) and "layers.0.mlp.expert_bias" not in half_eligible(model)  # fp32 state


def test_aux_free_bias_balances_a_frozen_router():
    """One compiled step with all three options, lr 0 (the weights stay; only the biases move):
    step 1 routes as without the bias (it starts at 0) and its max/mean load stays that high without
    it; with it the load flattens within a few steps; z-loss and dropped counts are reported."""
    from mspretrain.config.schema import OptimConfig
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.step import TrainStep

    cfg = _cfg(experts_per_token=1, router_bias_update_rate=0.002, router_z_loss_coef=0.1, capacity_factor=1.5)
    model = Decoder(cfg, seed=3)
    router = model.layers[0].mlp.router.weight.asnumpy().copy()
    step = TrainStep(model, OptimConfig(), global_tokens=4 * 16)
    batch = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)
    ratios, dropped, z = [], [], []
    for _ in range(8):
        res = step.run([(batch, None, None)], lr=0.0, scale=1.0)
        ratios.append(res.moe["moe/layer_0/max_over_mean"])
        dropped.append(res.moe["moe/dropped_tokens"])
        z.append(res.moe["moe/z_loss"])
    np.testing.assert_array_equal(model.layers[0].mlp.router.weight.asnumpy(), router)
    assert ratios[0] >= 1.5 and max(ratios[4:]) <= 1.25, ratios  # measured: 1.5625 -> 1.0625..1.125
    assert dropped[0] > 0 and dropped[-1] == 0, dropped  # capacity 1.5 * 64 / 4 = 24: the busiest expert lost 1
    assert len(set(z)) == 1 and 1.0 < z[0] < 3.0, z  # frozen weights: the same logits every step
    assert model.layers[0].mlp.expert_bias.asnumpy().std() > 0
