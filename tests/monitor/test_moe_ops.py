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
