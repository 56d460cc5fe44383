"""The Ascend path of dropless MoE routing (model/moe_kernels.py), checked on CPU: its selection by
device, the inputs it hands MindSpore's kernels (cumulative group_list, (E, in, out) weights, the
permutation), and, with the kernels replaced by their documented contracts in numpy (pinned to the
examples in MindSpore 2.10's own docstrings), that the MoE layer computes what the CPU path does.
All in PyNative: no graph is compiled."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.errors import UserError
from mspretrain.model import moe_kernels
from mspretrain.model.moe import MoE, reference_moe

# ------------------------------------------------------- the kernels' contracts, as their docs define them

def permute_contract(tokens: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """ops.moe_token_permute: rows grouped by expert (stable, token-major), and for each token-major
    assignment the row that holds it. Differentiable in `tokens` (the indices are constants)."""
    e = idx.asnumpy().reshape(tokens.shape[0], -1)
    k = e.shape[1]
    order = np.argsort(e.reshape(-1), kind="stable")
    where = np.empty_like(order)
    where[order] = np.arange(order.size)
    return ops.gather(tokens, Tensor((order // k).astype(np.int32)), 0), Tensor(where.astype(np.int32))


def unpermute_contract(rows: Tensor, sorted_indices: Tensor) -> Tensor:
    return ops.gather(rows, sorted_indices, 0)


def gmm_contract(x: Tensor, weight: Tensor, groups: Tensor) -> Tensor:
    """GroupedMatmul(split_item=3, group_type=0): rows groups[e-1]:groups[e] times weight[e] (E, in, out)."""
    ends = groups.asnumpy()
    assert groups.dtype == ms.int64 and ends[-1] == x.shape[0] and len(ends) == weight.shape[0]
    starts = np.concatenate(([0], ends[:-1]))
    parts = [ops.matmul(x[int(a):int(b)], weight[e]) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]
    return ops.concat(parts, 0)


def test_the_contracts_reproduce_mindsporess_docstring_examples():
    # gen_ops_def.py `moe_token_permute`: indices [5, 0, 3, 1, 2, 4] over six tokens
    tokens = Tensor(np.array([[1] * 3, [7] * 3, [2] * 3, [1] * 3, [2] * 3, [3] * 3], np.float32))
    rows, where = permute_contract(tokens, Tensor(np.array([5, 0, 3, 1, 2, 4], np.int32)))
    np.testing.assert_array_equal(rows.asnumpy()[:, 0], [7, 1, 2, 2, 3, 1])
    np.testing.assert_array_equal(where.asnumpy(), [5, 0, 3, 1, 2, 4])
    np.testing.assert_array_equal(unpermute_contract(rows, where).asnumpy(), tokens.asnumpy())
    # gen_ops_def.py `grouped_matmul`: group_list [1, 3, 4, 6], weight arange(32) as (4, 4, 2)
    x = Tensor(np.repeat(np.array([0, 1, 2, 2, 1, 1], np.float32)[:, None], 4, 1))
    out = gmm_contract(x, Tensor(np.arange(32, dtype=np.float32).reshape(4, 4, 2)), Tensor(np.array([1, 3, 4, 6], np.int64)))
    np.testing.assert_array_equal(out.asnumpy(), [[0, 0], [44, 48], [88, 96], [152, 160], [108, 112], [108, 112]])


# ------------------------------------------------------- selection by device

def test_selection_picks_the_kernels_on_ascend_only():
    assert moe_kernels.select_grouped("auto", "ascend") and not moe_kernels.select_grouped("auto", "cpu")
    assert moe_kernels.select_grouped("grouped", "ascend") and not moe_kernels.select_grouped("sorted", "ascend")
    with pytest.raises(UserError, match="only on Ascend"):
        moe_kernels.select_grouped("grouped", "cpu")
    with pytest.raises(UserError, match="not one of"):
        moe_kernels.select_grouped("fast", "ascend")


def _cfg(**over) -> ModelConfig:
    return resolve_model(ModelConfig(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                                        "max_seq_len": 32, "family": "qwen3_moe", "qk_norm": True, "num_experts": 8,
                                        "experts_per_token": 2, "moe_ffn_dim": 32, **over}))


def test_the_decoder_selects_the_kernel_path_by_device(monkeypatch):
    from mspretrain.model.decoder import Decoder
    from tests.helpers.kernels import rms_norm_reference
    monkeypatch.setattr(ops, "rms_norm", rms_norm_reference)  # nothing runs; built only
    moes = lambda model: [c for _, c in model.cells_and_names() if isinstance(c, MoE)]
    cfg = _cfg()
    assert [m.grouped for m in moes(Decoder(cfg, dtype="bf16", device="ascend"))] == [True, True]
    assert [m.grouped for m in moes(Decoder(cfg, dtype="fp32", device="cpu"))] == [False, False]


# ------------------------------------------------------- the kernels' inputs, against the CPU path's sort

def _layer(cfg: ModelConfig, seed: int = 0) -> MoE:
    from mspretrain.model.decoder import InitStreams

    return MoE(cfg, InitStreams(seed), ms.float32)


def _sorted_by_expert(idx: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The CPU path's counting sort with blocks of one row (model/moe.py): each assignment's row is its
    expert's segment start plus its rank among that expert's assignments in token-major order."""
    e = idx.reshape(-1)
    counts = np.bincount(e, minlength=experts)
    starts = np.cumsum(counts) - counts
    rank = np.array([(e[:i] == e[i]).sum() for i in range(e.size)])
    return starts[e] + rank, counts


def test_the_kernels_inputs_match_the_cpu_paths_sort():
    cfg = _cfg(num_experts=6, experts_per_token=3)
    layer = _layer(cfg)
    x2 = Tensor(np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32))
    idx = layer.route(x2)[2]  # (probs, top, idx, ...)
    dest, counts = _sorted_by_expert(idx.asnumpy(), 6)
    got = moe_kernels.expert_counts(idx, 6)
    np.testing.assert_array_equal(got.asnumpy(), counts)
    groups = moe_kernels.group_list(got)
    assert groups.dtype == ms.int64 and groups.shape == (6,)  # GroupedMatmul: int64, one per expert, cumulative
    np.testing.assert_array_equal(groups.asnumpy(), np.cumsum(counts))
    assert idx.dtype == ms.int32 and idx.shape == (24, 3)  # moe_token_permute: (N, K) int32, K <= 512
    rows, where = permute_contract(x2, idx)
    np.testing.assert_array_equal(where.asnumpy(), dest)  # the kernel's sorted_indices = the CPU path's rows
    # every row of expert e's segment is a token that chose e
    seg = np.repeat(np.arange(6), counts)
    tok = np.array([np.flatnonzero((rows.asnumpy()[r] == x2.asnumpy()).all(1))[0] for r in range(rows.shape[0])])
    assert all(seg[r] in idx.asnumpy()[tok[r]] for r in range(len(seg)))
    # the weights as GroupedMatmul takes them: (E, in, out), the gate's F columns then the up's
    w13 = moe_kernels.expert_layout(layer.w13.weight).asnumpy()
    w2 = moe_kernels.expert_layout(layer.w2.weight).asnumpy()
    assert w13.shape == (6, 64, 2 * 32) and w2.shape == (6, 32, 64)
    np.testing.assert_array_equal(w13[2], layer.w13.weight.asnumpy()[2].T)
    np.testing.assert_array_equal(w2[5], layer.w2.weight.asnumpy()[5].T)


@pytest.fixture
def contracts(monkeypatch):
    monkeypatch.setattr(moe_kernels, "permute", permute_contract)
    monkeypatch.setattr(moe_kernels, "unpermute", unpermute_contract)
    monkeypatch.setattr(moe_kernels, "grouped_matmul", gmm_contract)


@pytest.mark.parametrize("over", [{}, {"family": "qwen2_moe", "qkv_bias": True, "qk_norm": False, "shared_expert_ffn_dim": 48}])
def test_the_kernel_path_computes_what_the_cpu_path_computes(contracts, over):
    """The MoE layer with `grouped` on (the kernels replaced by their contracts) against the same
    layer on the CPU path and against reference_moe; an expert left without tokens included."""
    cfg = _cfg(**over)
    layer = _layer(cfg, seed=2)
    x = Tensor(np.random.default_rng(3).standard_normal((1, 3, 64)).astype(np.float32))
    y_cpu, stats_cpu = layer(x)
    layer.grouped = True
    y_k, stats_k = layer(x)
    np.testing.assert_allclose(y_k.asnumpy(), y_cpu.asnumpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(stats_k.asnumpy(), stats_cpu.asnumpy())
    assert (stats_k.asnumpy()[1] == 0).any()  # 6 assignments over 8 experts: empty groups
    if not over:  # (Qwen2-MoE's shared expert is the same code on both paths)
        want = reference_moe(x.asnumpy().reshape(3, 64).astype(np.float64), layer.router.weight.asnumpy(),
                             layer.w13.weight.asnumpy(), layer.w2.weight.asnumpy(), 2, cfg.norm_topk_prob)
        np.testing.assert_allclose(y_k.asnumpy().reshape(3, 64), want, rtol=0, atol=1e-5)


# ------------------------------------------------------- selftest's `moe kernels` check

def test_the_selftest_check_needs_ascend_on_cpu():
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight import selftest_moe
    from mspretrain.preflight.selftest_result import NEEDS_ASCEND, Context

    check = selftest_moe.check_moe_kernels(Context(cfg=cfgmod.Config(), target="cpu", work=Path("unused")))
    assert check.name == "moe kernels" and check.status == NEEDS_ASCEND and "only on Ascend" in check.detail


def test_the_selftest_check_as_a_910b_runs_it(contracts):
    """check_moe_kernels with target ascend, the kernels replaced by their contracts: fp32 (output and
    the experts' gradients) and fp16 (bf16 has no CPU kernels) pass, with the same routing."""
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight import selftest_moe
    from mspretrain.preflight.selftest_result import PASSED, Context

    ctx = Context(cfg=cfgmod.Config(), target="ascend", work=Path("unused"))
    check = selftest_moe.check_moe_kernels(ctx, ("fp32", "fp16"))
    assert check.status == PASSED, check.detail
    fp32, fp16 = check.data["fp32"], check.data["fp16"]
    assert fp32["same_routing"] and fp16["same_routing"]
    assert fp32["output"]["max_abs_diff"] <= 1e-5 and fp32["grad_w13"]["max_abs_diff"] <= 1e-5 and "grad_w2" in fp32
    assert 0 < fp16["output"]["max_abs_diff"] <= selftest_moe.MOE_TOLERANCE["fp16"]


def test_the_selftest_check_fails_a_kernel_off_its_contract(monkeypatch, contracts):
    """A grouped matmul that pairs the row segments with the wrong experts (off by one) fails the check."""
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight import selftest_moe
    from mspretrain.preflight.selftest_result import FAILED, Context

    def off_by_one(x, weight, groups):
        return gmm_contract(x, ops.concat((weight[1:], weight[:1]), 0), groups)

    monkeypatch.setattr(moe_kernels, "grouped_matmul", off_by_one)
    ctx = Context(cfg=cfgmod.Config(), target="ascend", work=Path("unused"))
    assert selftest_moe.check_moe_kernels(ctx, ("fp32",)).status == FAILED
