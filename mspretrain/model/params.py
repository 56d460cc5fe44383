"""The parameter table: one row per kind of parameter the decoder builds (model/decoder.py), and
everything the project knows about each kind, derived from the rows.

families.py says which switches a family has; this table says what each parameter is. A row
(`Param`) gives a parameter pattern's
- name (`{i}`: the layer index) and where it exists (once, every layer, a dense layer's MLP, an
  MoE layer's MLP) and under which switch (`when`);
- shape as a function of the resolved ModelConfig;
- HF name(s) and fuse rule, as transformers' and torchtitan's state-dict maps give them: several
  HF tensors are concatenated along axis 0 in the order given (`parts`: their row counts), and a
  stacked-experts row (`experts`) holds one such set per expert `{e}` along a new leading axis;
- its `train.trainable` group, whether AdamW decays it, whether it may be stored in the compute
  dtype (half precision), whether its gradient may travel as fp16, whether it is a matmul weight a
  token goes through (the FLOP count), and its tensor-parallel `Role`.

Read from it: the parameter list and count (model/presets.py), the HF bridge's names and shapes
both ways (model/hf.py), the trainable groups (model/groups.py), the decay mask (step/step.py),
the half-eligible set (model/decoder.py), the memory model's per-parameter rules (preflight/costs.py,
preflight/layouts.py), the FLOPs (monitor/mfu.py), upcycling (model/upcycle.py) and vocabulary growth
(model/resize.py). A new kind of parameter is one row here (and the cell that holds it).

The rows are in the order the decoder creates its Parameters (`Decoder.trainable_params()`):
the rows before the first layer row, then every layer's rows layer by layer, then the rest.
Pure Python: no MindSpore import (plan, presets and mfu read it).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, Mapping

import numpy as np

from mspretrain.config.schema import ModelConfig
from mspretrain.parallel import plan as plan_roles

Shape = Callable[[ModelConfig], tuple[int, ...]]


class Role(str, Enum):
    """How tensor parallel treats a parameter (model/parallel.py, Megatron-LM's terms). The values
    are the role names the cells declare (mspretrain/parallel/plan.py `ROLES`, one vocabulary)."""
    COLUMN = plan_roles.COLUMN  # rows split over tp (output features: q/k/v heads, ffn units)
    ROW = plan_roles.ROW  # columns split over tp (input features); the output summed over tp
    VOCAB = plan_roles.VOCAB  # rows split over tp by vocabulary (embedding, lm_head)
    REPLICATED = plan_roles.REPLICATED  # whole on every rank, its gradient whole too
    PARTIAL = plan_roles.PARTIAL  # whole on every rank, its gradient a partial sum over tp (shared by split heads)


@dataclass(frozen=True)
class Param:
    name: str  # our name; "{i}" the layer index
    where: str  # "model": once; "layer": every layer; "dense" / "moe": a dense / an MoE layer's MLP
    shape: Shape
    hf: tuple[str, ...]  # HF name(s): "{i}" the layer, "{e}" the expert; several: fused along axis 0
    group: str  # its train.trainable group (model/groups.py GROUPS)
    role: Role
    when: Callable[[ModelConfig], bool] = lambda m: True  # a family switch it needs
    parts: Callable[[ModelConfig], tuple[int, ...]] | None = None  # rows of each fused HF tensor
    # (E, ...): the HF tensors once per expert `{e}`, stacked; expert parallel (parallel.ep) cuts
    # such a row along that leading axis, each ep rank holding E/ep whole experts (`ep_piece`)
    experts: bool = False
    decay: bool | None = True  # AdamW weight decay; None: optim.decay_embeddings decides
    half: bool = True  # may be stored in the compute dtype (precision.param_dtype = compute)
    fp16_wire: bool = True  # its gradient may be all-reduced in fp16 (precision.allreduce_dtype)
    matmul: bool = True  # a weight a token multiplies by (FLOPs); an MoE expert stack counts K of E
    tie: str | None = None  # tied embeddings: this row is absent and that parameter plays its part

    def exists(self, m: ModelConfig, i: int | None = None) -> bool:
        if not self.when(m) or (self.tie is not None and m.tie_embeddings):
            return False
        if self.where in ("dense", "moe"):
            return m.is_moe_layer(i) == (self.where == "moe")
        return True


def _q(m: ModelConfig) -> int:
    return m.n_heads * m.head_size


def _kv(m: ModelConfig) -> int:
    return m.n_kv_heads * m.head_size


_L, _A, _M = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
_QKV = lambda m: (_q(m), _kv(m), _kv(m))  # noqa: E731  (q heads | k heads | v heads)
_GATE_UP = lambda m: (m.ffn_dim, m.ffn_dim)  # noqa: E731
_EXPERT_GATE_UP = lambda m: (m.expert_ffn, m.expert_ffn)  # noqa: E731
_SHARED_GATE_UP = lambda m: (m.shared_expert_ffn_dim, m.shared_expert_ffn_dim)  # noqa: E731

ROWS: tuple[Param, ...] = (
    Param("embed.weight", "model", lambda m: (m.vocab_size, m.dim), ("model.embed_tokens.weight",), "embeddings", Role.VOCAB,
          decay=None, half=False, matmul=False),  # a gather, not a matmul
    Param("layers.{i}.attn_norm.weight", "layer", lambda m: (m.dim,), (_L + "input_layernorm.weight",), "norms", Role.REPLICATED,
          decay=False, half=False, matmul=False),
    Param("layers.{i}.attn.wqkv.weight", "layer", lambda m: (sum(_QKV(m)), m.dim),
          (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), "attention", Role.COLUMN, parts=_QKV),
    Param("layers.{i}.attn.wqkv.bias", "layer", lambda m: (sum(_QKV(m)),),
          (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), "attention", Role.COLUMN, parts=_QKV,
          when=lambda m: m.qkv_bias, decay=False, matmul=False),  # Qwen2
    Param("layers.{i}.attn.wo.weight", "layer", lambda m: (m.dim, _q(m)), (_A + "o_proj.weight",), "attention", Role.ROW),
    Param("layers.{i}.attn.q_norm.weight", "layer", lambda m: (m.head_size,), (_A + "q_norm.weight",), "attention", Role.PARTIAL,
          when=lambda m: m.qk_norm, decay=False, half=False, matmul=False),  # Qwen3
    Param("layers.{i}.attn.k_norm.weight", "layer", lambda m: (m.head_size,), (_A + "k_norm.weight",), "attention", Role.PARTIAL,
          when=lambda m: m.qk_norm, decay=False, half=False, matmul=False),
    Param("layers.{i}.mlp_norm.weight", "layer", lambda m: (m.dim,), (_L + "post_attention_layernorm.weight",), "norms",
          Role.REPLICATED, decay=False, half=False, matmul=False),
    # a dense layer's SwiGLU (model/block.py MLP)
    Param("layers.{i}.mlp.w13.weight", "dense", lambda m: (2 * m.ffn_dim, m.dim), (_M + "gate_proj.weight", _M + "up_proj.weight"),
          "mlp", Role.COLUMN, parts=_GATE_UP),
    Param("layers.{i}.mlp.w2.weight", "dense", lambda m: (m.dim, m.ffn_dim), (_M + "down_proj.weight",), "mlp", Role.ROW),
    # an MoE layer's MLP (model/moe.py): router, stacked experts (transformers' in-memory layout;
    # on disk one tensor per expert), a Qwen2-MoE shared expert and its sigmoid gate. The expert
    # roles are Megatron's expert tensor parallel; tp refuses MoE models today (config.check_moe).
    Param("layers.{i}.mlp.router.weight", "moe", lambda m: (m.num_experts, m.dim), (_M + "gate.weight",), "mlp", Role.REPLICATED),
    Param("layers.{i}.mlp.w13.weight", "moe", lambda m: (m.num_experts, 2 * m.expert_ffn, m.dim),
          (_M + "experts.{e}.gate_proj.weight", _M + "experts.{e}.up_proj.weight"), "mlp", Role.COLUMN, parts=_EXPERT_GATE_UP,
          experts=True),
    Param("layers.{i}.mlp.w2.weight", "moe", lambda m: (m.num_experts, m.dim, m.expert_ffn), (_M + "experts.{e}.down_proj.weight",),
          "mlp", Role.ROW, experts=True),
    Param("layers.{i}.mlp.shared_w13.weight", "moe", lambda m: (2 * m.shared_expert_ffn_dim, m.dim),
          (_M + "shared_expert.gate_proj.weight", _M + "shared_expert.up_proj.weight"), "mlp", Role.COLUMN, parts=_SHARED_GATE_UP,
          when=lambda m: m.shared_expert_ffn_dim > 0),
    Param("layers.{i}.mlp.shared_w2.weight", "moe", lambda m: (m.dim, m.shared_expert_ffn_dim), (_M + "shared_expert.down_proj.weight",),
          "mlp", Role.ROW, when=lambda m: m.shared_expert_ffn_dim > 0),
    Param("layers.{i}.mlp.shared_gate.weight", "moe", lambda m: (1, m.dim), (_M + "shared_expert_gate.weight",), "mlp",
          Role.REPLICATED, when=lambda m: m.shared_expert_ffn_dim > 0),
    Param("norm.weight", "model", lambda m: (m.dim,), ("model.norm.weight",), "norms", Role.REPLICATED,
          decay=False, half=False, matmul=False),
    # fp32 island (model/decoder.py), its gradient reduced in fp32 too
    Param("lm_head.weight", "model", lambda m: (m.vocab_size, m.dim), ("lm_head.weight",), "lm_head", Role.VOCAB,
          half=False, fp16_wire=False, tie="embed.weight"),
)

_LAYER_PREFIX = re.compile(r"^layers\.(\d+)\.")


def expand(m: ModelConfig) -> Iterator[tuple[str, Param, int | None]]:
    """(name, row, layer index or None) of every parameter of a resolved config, in the decoder's order."""
    per_layer = [k for k, r in enumerate(ROWS) if r.where != "model"]
    first, last = per_layer[0], per_layer[-1]
    for r in ROWS[:first]:
        if r.exists(m):
            yield r.name, r, None
    for i in range(m.n_layers):
        for r in ROWS[first:last + 1]:
            if r.exists(m, i):
                yield r.name.format(i=i), r, i
    for r in ROWS[last + 1:]:
        if r.exists(m):
            yield r.name, r, None


def shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the decoder's order."""
    return [(name, tuple(r.shape(m))) for name, r, _ in expand(m)]


def row_of(name: str, m: ModelConfig | None = None) -> Param:
    """The row of one of our parameter names; with the config, the very row (a dense and an MoE
    layer's `mlp.w13.weight` are two rows that agree on everything but shape and HF names).
    An unknown name is a ValueError: no silent default."""
    found = _LAYER_PREFIX.match(name)
    pattern = _LAYER_PREFIX.sub("layers.{i}.", name) if found else name
    rows = [r for r in ROWS if r.name == pattern]
    if m is not None and found:
        rows = [r for r in rows if r.where == "layer" or m.is_moe_layer(int(found.group(1))) == (r.where == "moe")]
    if not rows:
        raise ValueError(f"parameter {name!r} matches no row of the parameter table (model/params.py)")
    return rows[0]


def role_of(name: str) -> Role:
    """The tensor-parallel role of one of our parameter names."""
    return row_of(name).role


def groups_of(name: str, tied: bool = False) -> frozenset[str]:
    """Its train.trainable groups: its row's, and with tied embeddings the groups of the rows it stands in for."""
    r = row_of(name)
    return frozenset({r.group} | {o.group for o in ROWS if tied and o.tie == name})


def decays(name: str, decay_embeddings: bool) -> bool:
    """Whether AdamW decays it (norms and biases never; the embedding with optim.decay_embeddings)."""
    d = row_of(name).decay
    return decay_embeddings if d is None else d


def half_eligible(name: str) -> bool:
    """May be stored in the compute dtype: the decoder layers' matrices and biases, not the norms,
    embedding or lm_head (fp32 islands: model/decoder.py `half_eligible`)."""
    return row_of(name).half


def fp16_wire(name: str) -> bool:
    """Its gradient may be all-reduced in fp16 when precision.allreduce_dtype = fp16."""
    return row_of(name).fp16_wire


def tp_split(name: str) -> bool:
    """Tensor parallel gives each rank a piece of it (column, row, vocab), else the whole."""
    return row_of(name).role not in (Role.REPLICATED, Role.PARTIAL)


def tp_piece(name: str, m: ModelConfig, tp: int, rank: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where tp rank `rank`'s piece of parameter `name` lies, from its role: (axis, [start, stop)
    ranges along it, concatenated in order), or None for a whole one. A column row is cut in each
    of its fused parts (q | k | v, gate | up), a row one along its input features, a vocab one by
    rows; an expert stack the same within each expert (model/parallel.py `tp_rows` cuts so today)."""
    r = row_of(name, m)
    if tp == 1 or r.role in (Role.REPLICATED, Role.PARTIAL):
        return None
    shape, lead = tuple(r.shape(m)), 1 if r.experts else 0
    span = lambda n, at=0: (at + rank * n // tp, at + (rank + 1) * n // tp)  # noqa: E731
    if r.role is Role.ROW:
        return lead + 1, [span(shape[lead + 1])]
    out, at = [], 0
    for n in r.parts(m) if r.parts else (shape[lead],):
        out.append(span(n, at))
        at += n
    return lead, out


def expert_parallel(name: str, m: ModelConfig) -> bool:
    """Expert parallel cuts it (a stacked-experts row; the config tells a dense layer's `mlp.w13`
    from an MoE layer's): its gradient is reduced over the expert-data-parallel group, not the
    world, and its squared norm summed over the ep group."""
    return row_of(name, m).experts


def ep_piece(name: str, m: ModelConfig, ep: int, rank: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where ep rank `rank`'s piece of parameter `name` lies (model/parallel.py `cut`'s form): an
    expert stack's experts [rank*E/ep, (rank+1)*E/ep) along axis 0, or None for a whole one
    (everything else is replicated over the ep group: the router too)."""
    r = row_of(name, m)
    if ep == 1 or not r.experts:
        return None
    n = m.num_experts // ep
    return 0, [(rank * n, (rank + 1) * n)]


def matmul_sizes(m: ModelConfig) -> list[tuple[str, float]]:
    """(name, parameters a token multiplies by) of every matmul weight (monitor/mfu.py): a dense
    matrix whole, an expert stack K of its E experts, and with tied embeddings the embedding once
    more as the output projection (under its own name, after the rest)."""
    out: list[tuple[str, float]] = []
    for name, r, _ in expand(m):
        if r.matmul:
            shape = r.shape(m)
            out.append((name, math.prod(shape[1:]) * float(m.experts_per_token) if r.experts else float(math.prod(shape))))
    out += [(r.tie, float(math.prod(r.shape(m)))) for r in ROWS if r.tie and r.matmul and m.tie_embeddings and r.when(m)]
    return out


# --------------------------------------------------------------------------- the HF bridge

def _hf_parts(r: Param, m: ModelConfig, name: str, i: int | None) -> list[tuple[str, tuple[int, ...], int | None, slice]]:
    """(HF name, HF shape, expert or None, rows of ours) of each HF tensor of our parameter `name`."""
    shape = tuple(r.shape(m))
    inner = shape[1:] if r.experts else shape
    rows = r.parts(m) if r.parts else (inner[0],)
    out = []
    for e in range(m.num_experts) if r.experts else (None,):
        at = 0
        for pattern, n in zip(r.hf, rows):
            out.append((pattern.format(i=i, e=e), (n,) + tuple(inner[1:]), e, slice(at, at + n)))
            at += n
    return out


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a resolved config (transformers' on-disk state dict)."""
    return {hf: s for name, r, i in expand(m) for hf, s, _, _ in _hf_parts(r, m, name, i)}


def from_hf(f32: Callable[[str], np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """Our tensors from HF's (`f32(hf_name)`: the tensor as fp32; names and shapes already checked):
    fused parts concatenated along axis 0, experts stacked."""
    out: dict[str, np.ndarray] = {}
    for name, r, i in expand(m):
        pieces = _hf_parts(r, m, name, i)
        if r.experts:
            per = len(r.hf)
            out[name] = np.stack([_join([f32(h) for h, *_ in pieces[k:k + per]]) for k in range(0, len(pieces), per)])
        else:
            out[name] = _join([f32(h) for h, *_ in pieces])
    return out


def _join(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def to_hf(tensors: Mapping[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """HF's tensors (views into ours) from ours: fused ones split along axis 0, experts unstacked."""
    out: dict[str, np.ndarray] = {}
    for name, r, i in expand(m):
        t = tensors[name]
        for hf, _, e, rows in _hf_parts(r, m, name, i):
            out[hf] = (t[e] if r.experts else t)[rows]
    return out
