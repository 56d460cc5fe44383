"""What an operator sees of a mixture of experts (issue 52 item 6): MFU and plan count active
parameters, the trainer logs per-layer expert load, diagnose finds a router collapse."""
from __future__ import annotations

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
