"""Qwen3-MoE and Qwen2-MoE: the MoE MLP against a float64 reference in graph mode, and the HF bridge
both ways against transformers' Qwen3MoeForCausalLM (logits within 1e-5 in fp32, the same top-k
experts for every token at every MoE layer; the export loads in transformers with the same logits)."""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import numpy as np
import pytest
import torch
import transformers

from mspretrain.config.schema import ModelConfig
from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
from mspretrain.model.hf import read_hf_dir, write_hf_dir
from mspretrain.model.moe import reference_moe
from tests.helpers.cli import assert_user_error

V = 256


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def hf_moe(request, tmp_path_factory):
    """A tiny random Qwen3MoeForCausalLM (norm_topk_prob) or Qwen2MoeForCausalLM (not normalised, a
    shared expert): 3 layers, layer 1 dense (mlp_only_layers), 8 experts, top-2."""
    torch.manual_seed(0)
    shape = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=64, mlp_only_layers=[1], rope_theta=10000.0)
    if request.param == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, **shape))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(shared_expert_intermediate_size=48, **shape))
    model = model.eval()
    with torch.no_grad():  # transformers 5 may start the router at zero (every token would tie), biases at zero
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "proj.bias", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    d = tmp_path_factory.mktemp("moe") / request.param
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def ours(hf_moe):
    d, _ = hf_moe
    cfg, tensors, _ = read_hf_dir(d)
    model = Decoder(cfg, seed=0)
    load_numpy(model, tensors)
    return cfg, model


TOKENS = np.random.default_rng(1).integers(0, V, (2, 24)).astype(np.int64)


def hf_run(model) -> tuple[np.ndarray, list[np.ndarray]]:
    with torch.no_grad():
        out = model(torch.tensor(TOKENS), output_router_logits=True)
    k = model.config.num_experts_per_tok
    chosen = [torch.topk(torch.softmax(r.float(), -1), k, -1).indices.sort(-1).values.numpy() for r in out.router_logits]
    return out.logits.float().numpy(), chosen


def test_config_read(ours):
    cfg, _ = ours
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.mlp_only_layers) == (8, 2, 32, (1,))
    assert (cfg.norm_topk_prob, cfg.shared_expert_ffn_dim) == ((True, 0) if cfg.family == "qwen3_moe" else (False, 48))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]


def test_moe_mlp_matches_reference_in_graph_mode(ours):
    """The sort/gather dropless path, compiled, equals expert-by-expert float64 numpy."""
    cfg, model = ours
    moe = model.layers[0].mlp
    st = state_numpy(model)
    x = np.random.default_rng(2).standard_normal((2, 24, 64)).astype(np.float32)

    @ms.jit
    def run(a):
        return moe(a)

    y, stats = run(ms.Tensor(x))
    x2 = x.reshape(-1, 64).astype(np.float64)
    ref = reference_moe(x2, *(st[f"layers.0.mlp.{n}.weight"] for n in ("router", "w13", "w2")), 2, cfg.norm_topk_prob)
    if cfg.shared_expert_ffn_dim:  # Qwen2-MoE: + sigmoid(x Wg^T) * the shared SwiGLU
        S, w13 = cfg.shared_expert_ffn_dim, st["layers.0.mlp.shared_w13.weight"]
        g, u = x2 @ w13[:S].T, x2 @ w13[S:].T
        gate = 1 / (1 + np.exp(-(x2 @ st["layers.0.mlp.shared_gate.weight"].T)))
        ref += gate * ((g / (1 + np.exp(-g)) * u) @ st["layers.0.mlp.shared_w2.weight"].T)
    np.testing.assert_allclose(y.asnumpy().reshape(-1, 64), ref, atol=1e-5, rtol=1e-5)
    assert stats.asnumpy()[1].sum() == 2 * 48  # every token routed to exactly K experts


def test_convert_logits_and_expert_choices_match_transformers(hf_moe, ours):
    _, hf = hf_moe
    cfg, model = ours
    want, hf_chosen = hf_run(hf)
    seen = []
    for i in (0, 2):  # record our top-k choices (pynative: route runs as Python)
        moe = model.layers[i].mlp
        route = moe.route

        def recording(x2, route=route):
            out = route(x2)  # (probs, top, idx, z or None)
            seen.append(np.sort(out[2].asnumpy(), -1))
            return out
        moe.route = recording
    try:
        got = model(ms.Tensor(TOKENS.astype(np.int32))).asnumpy()
    finally:
        for i in (0, 2):
            del model.layers[i].mlp.route
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert len(hf_chosen) == len(seen) == 2
    for a, b in zip(seen, hf_chosen):
        np.testing.assert_array_equal(a, b)


def test_export_loads_in_transformers_with_same_logits(tmp_path, hf_moe, ours):
    _, hf = hf_moe
    cfg, model = ours
    out = write_hf_dir(tmp_path / "export", cfg, state_numpy(model))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    got, _ = hf_run(back)
    want, _ = hf_run(hf)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    cfg2, tensors, _ = read_hf_dir(out)  # and back again: the same config and tensors
    assert cfg2 == cfg
    for name, arr in state_numpy(model).items():
        np.testing.assert_array_equal(tensors[name], arr)


def test_moe_config_refusals():
    assert_user_error(lambda: ModelConfig(family="qwen3_moe", qk_norm=True), "num_experts")
    assert_user_error(lambda: ModelConfig(num_experts=4), "num_experts")
    assert_user_error(lambda: ModelConfig(family="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=5), "experts_per_token")
    assert_user_error(lambda: ModelConfig(family="qwen3_moe", qk_norm=True, num_experts=4, mlp_only_layers=(7,)), "mlp_only_layers")


def test_preset_is_qwen3_30b_a3b_as_transformers_counts_it():
    from mspretrain.model.presets import param_count, preset

    m = preset("qwen3-30b-a3b")
    hc = transformers.Qwen3MoeConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                                     moe_intermediate_size=m.moe_ffn_dim, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                                     num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, num_experts=m.num_experts,
                                     num_experts_per_tok=m.experts_per_token, tie_word_embeddings=False)
    with torch.device("meta"):  # shapes only, no memory
        hf = transformers.Qwen3MoeForCausalLM(hc)
    assert param_count(m) == hf.num_parameters() == 30_532_122_624


def test_balance_loss_per_micro_batch_and_per_step_against_transformers(hf_moe, ours):
    """What the load-balancing loss is counted over (issue 52.1), against transformers'
    `load_balancing_loss_func` of the router logits: the objective's term of a micro-batch is that
    micro-batch's loss (under data parallel the micro-batch is the world's: its stats are summed over
    the ranks, tests/train/test_moe_ep.py), so with accumulation the step trains on the token-weighted
    mean of the micro-batches' losses; the `moe/balance_loss` metric, from the stats summed over the
    step's micro-batches, is the loss of the concatenated batch (docs/design.md says why the
    objective cannot be that one in one step's graphs)."""
    from dataclasses import replace

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from mspretrain.config.sections.train import OptimConfig
    from mspretrain.model.moe import load_metrics, moe_layers
    from mspretrain.step.objective import make_objective

    _, hf = hf_moe
    cfg, model = ours
    E, K = cfg.num_experts, cfg.experts_per_token
    tokens = np.random.default_rng(4).integers(0, V, (2, 25)).astype(np.int32)
    micro = [tokens[:1], tokens[1:]]
    T = 2 * 24  # the step's tokens

    def objective(coef: float):
        return make_objective(model, OptimConfig(), global_tokens=T, device="cpu", cfg=replace(cfg, router_aux_loss_coef=coef)).fn

    with_loss, without = objective(1000.0), objective(0.0)  # a large weight: the term stands out of the NLL in fp32
    ones = ms.Tensor(1.0, ms.float32)
    per, terms = 0, []
    for m in micro:
        obj, _, _, stats = with_loss(ms.Tensor(m), None, None, ones)
        terms.append((float(obj.asnumpy()) - float(without(ms.Tensor(m), None, None, ones)[0].asnumpy())) * T / (1000.0 * 24))
        per = per + stats.asnumpy()
    with torch.no_grad():
        logits = [hf(torch.tensor(m[:, :-1].astype(np.int64)), output_router_logits=True).router_logits for m in micro]
    for term, lg in zip(terms, logits):
        assert term == pytest.approx(float(load_balancing_loss_func(lg, E, K)), rel=1e-4)
    whole = tuple(torch.cat([lg[i] for lg in logits]) for i in range(len(logits[0])))
    want = float(load_balancing_loss_func(whole, E, K))
    got = load_metrics(per, moe_layers(cfg), K)["moe/balance_loss"]
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(sum(terms) / 2 - want) > 1e-4 * want  # the objective's mean of micro-batches is not the step's
