"""The Ascend path of dropless MoE routing (issue 52 item 2): MindSpore 2.10's fused token
permutation and grouped expert matmul in place of the CPU path's padded blocks (model/moe.py).

`grouped_experts` takes what the CPU path's dispatch takes (the tokens x2 (N, D), the top-k expert
ids (N, K) int32 and weights (N, K), the stacked expert weights w13 (E, 2F, D) and w2 (E, D, F)) and
returns what it returns: the weighted output of each assignment ya (A = N*K, D), token-major, and
the assignments per expert counts (E,). The kernels, as MindSpore 2.10 defines them (read in its
Python sources, mindspore/ops/auto_generate/gen_ops_def.py and gen_ops_prim.py; all three say
"Supported Platforms: Ascend"):

- `ops.moe_token_permute(tokens (N, D), indices (N, K) int32)` (gen_ops_def.py `moe_token_permute`;
  K <= 512; tokens fp16/bf16/fp32) -> (permuted (A, D): rows grouped by expert in expert order,
  sorted_indices (A,) int32). Its docstring's example (indices [5, 0, 3, 1, 2, 4] returns
  sorted_indices [5, 0, 3, 1, 2, 4] and token 1's row first) fixes what sorted_indices is: for the
  token-major assignment i = n*K + k, the row of the permuted buffer that holds it (the inverse of
  the stable sort by expert), i.e. the CPU path's `dest` without padding.
- `ops.moe_token_unpermute(permuted (A, D), sorted_indices)` (gen_ops_def.py `moe_token_unpermute`):
  row i of the result is permuted[sorted_indices[i]]; with `probs` (N, K) it also weights and sums
  the K rows of each token. We call it without probs (MindSpore Transformers' `_ffn_unresort`,
  mindformers/modules/transformer/moev3.py, uses it so) and weight afterwards, so that the result is
  the CPU path's ya and the rest of model/moe.py (the sum over K, the shared expert) is one code.
- `GroupedMatmul(split_item=3, group_type=0)([x (M, k)], [w (E, k, n)], None x 5, group_list)`
  (gen_ops_prim.py `GroupedMatmul`, the function's doc at gen_ops_def.py `grouped_matmul`): rows
  group_list[e-1]:group_list[e] of x times w[e]. group_list is int64 (E,) and CUMULATIVE: the doc's
  example, group_list [1, 3, 4, 6] over 6 rows and 4 experts, multiplies row 0 by w[0], rows 1-2 by
  w[1], row 3 by w[2], rows 4-5 by w[3]. The weight is (E, in, out), so our (E, out, in) stacks are
  transposed (`expert_layout`; the primitive's transpose_b would avoid the copy, but MindSpore
  Transformers never uses it and its backward is not documented). The doc: "Only when bias, scale,
  offset, antiquant_scale and antiquant_offset are all None, group_type is 0, and split_item is 3,
  the reverse derivative is supported": exactly our call. Dtypes: fp16 and fp32 in its table; bf16
  is what MindSpore Transformers trains with through the same primitive
  (mindformers/parallel_core/training_graph/transformer/moe/ffn.py `FFNGroupedGEMM.experts_forward`,
  weights cast to the compute dtype) and what 2.10's newer `ops.function.math_func.gmm` lists.

Selection (`select_grouped`), like FlashAttentionScore's (device.py `select_attention`): "auto" runs
the kernels on Ascend and the CPU path elsewhere, "sorted" always the CPU path, "grouped" on a CPU
is an error. The Decoder sets `MoE.grouped` on Ascend (model/decoder.py, with the other fused kernels).

What a CPU proves (tests/model/test_moe_kernels.py): the selection; the inputs handed to the kernels (the
cumulative group_list, the (E, in, out) weight layout, the token ids and expert ids in the kernels'
shapes and dtypes); and, with stand-ins that implement the documented contracts above in numpy
(checked against the docstrings' own examples), that this module's glue gives the CPU path's output.
What only a 910B verifies (selftest's `moe kernels` check, preflight/selftest_moe.py): that the real
kernels keep those contracts (sorted_indices' meaning, the cumulative group_list, the weight layout),
their backward, bf16 through GroupedMatmul, and an expert that receives no token (MindSpore
Transformers' `enable_gmm_safe_tokens` in modules/transformer/moe.py guards against gmm erroring
then on some CANN versions; not guarded here).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops.auto_generate import GroupedMatmul  # imported here: no import inside a graph

from mspretrain.errors import UserError

DISPATCH_KINDS = ("auto", "sorted", "grouped")


def select_grouped(dispatch: str, device: str) -> bool:
    """True when the MoE layers should run MindSpore's fused permutation and grouped matmul."""
    if dispatch not in DISPATCH_KINDS:
        raise UserError(f"MoE dispatch {dispatch!r} is not one of {', '.join(DISPATCH_KINDS)}",
                        "use auto (the fused kernels on Ascend, the sorted blocks elsewhere)")
    if dispatch == "sorted":
        return False
    if dispatch == "grouped" and device != "ascend":
        raise UserError(f"the MoE grouped-matmul kernels run only on Ascend (device {device})",
                        "use the MoE dispatch auto or sorted on this device")
    return device == "ascend"


def expert_counts(idx: Tensor, experts: int) -> Tensor:
    """idx (N, K) int32 -> (E,) int32: the assignments of each expert (the CPU path's `counts`)."""
    onehot = ops.one_hot(idx.reshape(-1), experts, Tensor(1, ms.int32), Tensor(0, ms.int32))
    return onehot.sum(0)


def group_list(counts: Tensor) -> Tensor:
    """GroupedMatmul's group_list from per-expert counts: the cumulative ends, int64 (E,)."""
    return ops.cumsum(counts, 0).astype(ms.int64)


def expert_layout(stacked: Tensor) -> Tensor:
    """Our stacked (E, out, in) expert weight as GroupedMatmul takes it: (E, in, out)."""
    return stacked.transpose(0, 2, 1)


# The kernels, one function each so that the CPU tests can put the documented contracts in their
# place (as tests/preflight/test_selftest.py does for the flash kernel).

def permute(tokens: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """(N, D), (N, K) int32 -> rows grouped by expert (A, D), each assignment's row (A,) int32."""
    return ops.moe_token_permute(tokens, idx)


def unpermute(rows: Tensor, sorted_indices: Tensor) -> Tensor:
    """(A, D) rows grouped by expert -> (A, D) token-major: row i = rows[sorted_indices[i]]."""
    return ops.moe_token_unpermute(rows, sorted_indices)


def grouped_matmul(x: Tensor, weight: Tensor, groups: Tensor) -> Tensor:
    """x (M, in) with its rows in expert segments ending at `groups`, weight (E, in, out) -> (M, out)."""
    return GroupedMatmul(split_item=3, group_type=0)([x], [weight], None, None, None, None, None, groups)[0]


def grouped_experts(x2: Tensor, idx: Tensor, top: Tensor, w13: Tensor, w2: Tensor,
                    dtype: ms.Type) -> tuple[Tensor, Tensor]:
    """The dropless expert computation on the fused kernels: x2 (N, D) tokens, idx (N, K) int32
    experts, top (N, K) weights, w13 (E, 2F, D) and w2 (E, D, F) stacked as model/moe.py holds them
    -> (ya (N*K, D) each assignment's weighted expert output, token-major; counts (E,) int32)."""
    E, F = w13.shape[0], w13.shape[1] // 2
    A = x2.shape[0] * idx.shape[1]
    counts = ops.stop_gradient(expert_counts(idx, E))
    groups = ops.stop_gradient(group_list(counts))
    if dtype != ms.float32:
        w13, w2 = w13.astype(dtype), w2.astype(dtype)
    rows, where = permute(x2, ops.stop_gradient(idx))  # (A, D) by expert; (A,) each assignment's row
    h = grouped_matmul(rows, expert_layout(w13), groups)  # (A, 2F): gate | up
    out = grouped_matmul(ops.silu(h[:, :F]) * h[:, F:], expert_layout(w2), groups)  # (A, D)
    ya = unpermute(out, ops.stop_gradient(where)) * top.reshape(A, 1)
    return ya, counts
