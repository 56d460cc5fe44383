"""The parameter table (model/params.py) against what is built: every parameter of a built Decoder of
each family is exactly the row the table expands to (name, shape, order), every HF name and shape
the table gives is what transformers saves for the same config.json, and the tp roles are what
model/parallel.py cuts. Tiny models, no compile."""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.families import NAMES
from mspretrain.families import family as family_of
from mspretrain.model import params
from mspretrain.model.params import ROWS, Role

BASE = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=32)
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_dim=16, mlp_only_layers=(1,))  # layer 1 dense, 0 and 2 MoE


def tiny(family: str, tied: bool = False) -> ModelConfig:
    extra = MOE if family_of(family).moe else {}
    if family_of(family).shared_expert:
        extra = {**extra, "shared_expert_ffn_dim": 24}
    return resolve_model(ModelConfig(**BASE, **extra, tie_embeddings=tied, **family_of(family).switches()))


# every family, and one tied: each switch of the table (bias, QK-norm, dense and MoE layers, shared expert, tie)
CASES = [(f, False) for f in NAMES] + [("qwen2", True)]


@pytest.mark.parametrize("family,tied", CASES)
def test_every_built_parameter_is_its_row(family, tied):
    """A built model's parameters, in order, are the table's expansion (a parameter no row matches,
    or a row whose shape or switch disagrees with the model, fails here); each name finds its row."""
    from mspretrain.model.decoder import Decoder

    m = tiny(family, tied)
    built = [(p.name, tuple(p.shape)) for p in Decoder(m, seed=0).trainable_params()]
    assert built == params.shapes(m)
    for name, r, _ in params.expand(m):
        assert params.row_of(name, m) is r
    with pytest.raises(ValueError):
        params.row_of("layers.0.attn.wq.weight")


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """{case: {name: shape}} of what transformers' save_pretrained writes for each family's tiny config.json."""
    import torch
    import transformers
    from safetensors import safe_open

    from mspretrain.model.hf import config_to_hf

    out = {}
    for family, tied in CASES:
        m = tiny(family, tied)
        hc = getattr(transformers, f"{family_of(family).label}Config").from_dict(config_to_hf(m))
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp("hf") / f"{family}-{tied}"
        transformers.AutoModelForCausalLM.from_config(hc).save_pretrained(d)
        with safe_open(str(d / "model.safetensors"), framework="np") as f:
            out[family, tied] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return out


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_names_and_shapes_are_what_transformers_saves(hf_saved, family, tied):
    m = tiny(family, tied)
    assert params.hf_shapes(m) == hf_saved[family, tied]
    # both ways: to HF names and back, every value in its place
    rng = np.random.default_rng(0)
    ours = {k: rng.standard_normal(s).astype(np.float32) for k, s in params.shapes(m)}
    theirs = params.to_hf(ours, m)
    assert {k: v.shape for k, v in theirs.items()} == hf_saved[family, tied]
    back = params.from_hf(lambda k: theirs[k], m)
    assert list(back) == list(ours) and all(np.array_equal(back[k], ours[k]) for k in ours)


@pytest.mark.parametrize("family,tied", CASES)
def test_the_roles_the_cells_declare_are_the_tables(family, tied):
    """Every weight cell of a built model declares the tensor-parallel role (model/layers.py
    `WeightCell.role`, which `apply_tp` cuts by) that the table gives its parameters, and
    model/parallel.py's name-only `tp_rows` (tests' references, checkpoint re-cuts) is the table's
    `tp_piece`: replicated and partial ones whole, column and vocabulary ones by rows, row ones by
    columns. A cell declared one way and a row saying another fails here."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.layers import WeightCell
    from mspretrain.model.parallel import tp_rows

    m = tiny(family, tied)
    assert {r.value for r in Role} == {"column", "row", "vocab", "replicated", "partial"}
    declared = {}
    for _, cell in Decoder(m, seed=0).cells_and_names():
        if isinstance(cell, WeightCell):
            for p in cell.get_parameters(expand=False):
                declared[p.name] = cell.role
    assert declared and set(declared) <= {n for n, _ in params.shapes(m)}
    for name, role in declared.items():
        assert params.role_of(name).value == role, (name, role, params.role_of(name))
    if not family_of(family).moe:  # tp refuses MoE today (config.check_moe)
        for name, shape in params.shapes(m):
            where = [tp_rows(name, shape, m, 2, r) for r in (0, 1)]
            want = {None: (Role.REPLICATED, Role.PARTIAL), 0: (Role.COLUMN, Role.VOCAB), 1: (Role.ROW,)}
            assert params.role_of(name) in want[None if where[0] is None else where[0][0]], (name, where)


def test_derived_facts_follow_the_rows(monkeypatch):
    """A row added to the table (here a toy per-layer scale) reaches the parameter list and count,
    the HF names, groups, decay, half precision, tp role and FLOPs with no other edit."""
    from mspretrain.model.groups import param_groups
    from mspretrain.model.hf import expected_hf_shapes
    from mspretrain.model.presets import param_count
    from mspretrain.monitor.mfu import matmul_params

    m = tiny("llama")
    before, flops = param_count(m), matmul_params(m)
    scale = params.Param("layers.{i}.attn.scale", "layer", lambda c: (c.n_heads,), ("model.layers.{i}.self_attn.scale",),
                         "attention", Role.PARTIAL, decay=False, half=False, matmul=False)
    at = next(k for k, r in enumerate(ROWS) if r.name == "layers.{i}.mlp_norm.weight")
    monkeypatch.setattr(params, "ROWS", ROWS[:at] + (scale,) + ROWS[at:])
    names = [n for n, _ in params.shapes(m)]
    assert names.index("layers.1.attn.scale") == names.index("layers.1.mlp_norm.weight") - 1
    assert param_count(m) == before + m.n_layers * m.n_heads and matmul_params(m) == flops
    assert expected_hf_shapes(m)["model.layers.2.self_attn.scale"] == (m.n_heads,)
    assert param_groups("layers.0.attn.scale") == {"attention"} and params.role_of("layers.0.attn.scale") is Role.PARTIAL
    assert not params.decays("layers.0.attn.scale", True) and not params.half_eligible("layers.0.attn.scale")


def test_rows_sharing_a_name_agree_on_what_the_name_alone_decides():
    """`row_of(name)` without the config (groups, decay, half precision, fp16 wire, tp role: the step and
    the trainer know names only) is right for both rows of a name (a dense and an MoE layer's w13, w2)."""
    for r in ROWS:
        for o in ROWS:
            if o.name == r.name:
                assert (o.group, o.decay, o.half, o.fp16_wire, o.role) == (r.group, r.decay, r.half, r.fp16_wire, r.role), r.name
