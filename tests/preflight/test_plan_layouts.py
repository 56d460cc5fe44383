"""`plan`'s layout table (preflight/layouts.py): every DP / ZeRO / TP layout's memory and step time, the
cheapest that fits; the TP accounting against Megatron's by hand; Qwen3-14B on 8 x 910B within the
issue's 52 GB with the recommended layout; the two new presets' counts against transformers'."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from mspretrain.config import schema as cfgmod
from mspretrain.model.presets import param_count, preset

GB = 2**30
# the shape docs/plan.md states the big presets' plans for (the 910B recipe's choices, seq 4096)
BIG = ["data.seq_len=4096", "train.global_batch=256", "train.micro_batch=1", "precision.dtype=bf16",
       "precision.param_dtype=compute", "precision.loss_scale=none", "device.target=ascend", "train.max_steps=1000"]


def _plan(name: str, *overrides: str, devices: int = 8) -> dict:
    from mspretrain.preflight.plan import make_plan

    cfg = replace(cfgmod.load(None, [*BIG, *overrides]), model=preset(name))
    return make_plan(cfg, devices=devices, tokens=None, data_dir=None, tokens_per_s_per_device=None)


def test_qwen3_14b_on_8_910b_fits_52_gb_with_the_recommended_layout():
    plan = _plan("qwen3-14b")
    table = plan["layouts"]
    best = next(r for r in table["rows"] if r["name"] == table["recommended"])
    assert best["fits"] and best["peak_bytes"] <= 52 * GB, (best["name"], best["peak_bytes"] / GB)
    assert not best["unmeasured"]  # a memory model checked against a measurement: ZeRO-3
    rows = {r["name"]: r for r in table["rows"] if "skipped" not in r}
    assert best["name"] == "ZeRO-3" and best["recompute"]
    # whole bf16 weights and gradients on every device: plain DP and ZeRO-1 cannot hold 14.8 B parameters
    assert not rows["DP"]["fits"] and not rows["ZeRO-1"]["fits"]
    assert rows["ZeRO-3"]["fits"]
    assert all(r["unmeasured"] == (r["tp"] > 1) for r in table["rows"])
    assert {"TP2 x DP4", "TP2 x DP4 ZeRO-1", "TP4 x DP2", "TP4 x DP2 ZeRO-1", "TP8 x DP1"} <= set(rows)
    skipped = {r["name"]: r["skipped"] for r in table["rows"] if "skipped" in r}
    assert skipped == {"TP8 x DP1 ZeRO-1": "one data-parallel rank: nothing to shard"}
    # a faster TP layout that fits is named beside it (its memory model not yet measured)
    faster = table["recommended_unmeasured"]
    assert faster is None or (rows[faster]["unmeasured"] and rows[faster]["step_s"] < best["step_s"])


def test_the_layout_table_prints_and_marks_tp_as_unmeasured(capsys):
    from mspretrain.cli import main

    assert main(["plan", "--model", "qwen3-14b", "--devices", "8", *BIG]) == 0
    out = capsys.readouterr().out
    assert "layouts    per device" in out and "<- recommended" in out
    assert "TP: its memory not yet measured" in out and "faster, memory not yet measured: TP8 x DP1" in out
    assert "recommended: ZeRO-3 " in out


def test_tp_memory_is_megatrons_split_of_the_dp_terms():
    """At t = 1 the TP accounting is the DP step's (memory_model); at t = 2 the split terms halve
    and the replicated ones (norms, the residual stream's activations) stay, by hand."""
    from mspretrain.model.presets import param_shapes
    from mspretrain.preflight.layouts import tp_memory
    from mspretrain.preflight.plan import memory_model

    cfg = cfgmod.load(None, ["model.vocab_size=1000", "train.max_steps=10", "device.target=ascend"])
    m = cfgmod.resolve_model(cfg.model)
    kw = dict(micro=8, accum=1, recompute=False, flash=False, target="ascend")
    one, _ = tp_memory(m, cfg, tp=1, dp=1, zero1=False, **kw)
    dp, _ = memory_model(m, cfg, devices=1, zero=False, shard_grads=False, **kw)
    for key in ("weights", "master_weights", "adam_moments", "micro_gradients", "activations"):
        assert one[key] == dp[key], key
    two, grads = tp_memory(m, cfg, tp=2, dp=1, zero1=False, **kw)
    shapes = param_shapes(m)
    norms = sum(math.prod(s) for n, s in shapes if "norm" in n)
    split = sum(math.prod(s) for n, s in shapes if "norm" not in n)
    assert grads == norms + split // 2 and two["weights"] == 4 * grads and two["adam_moments"] == 8 * grads
    e, s, b, h, f, kv, a = 4, 64, 8, 64, 192, 64, 4
    per_layer = e * s * b * (4 * h + (2 * h + 2 * kv + 4 * f) / 2) + 4 * a * s * s * b / 2
    assert two["activations"] == 2 * per_layer + 8 * s * b * 1000 / 2
    zero1, _ = tp_memory(m, cfg, tp=2, dp=4, zero1=True, **kw)
    assert zero1["adam_moments"] == two["adam_moments"] / 4


def test_tp_communication_is_four_activation_all_reduces_per_layer():
    """TP8 x DP1 on 8 devices: per layer and micro-batch 2 forward + 2 backward AllReduces of
    b*s*h bf16 elements over 8 ranks, nothing else (no data-parallel group)."""
    plan = _plan("qwen3-14b", "train.recompute=true")
    m = preset("qwen3-14b")
    row = next(r for r in plan["layouts"]["rows"] if r["name"] == "TP8 x DP1")
    ring = 2 * 7 / 8
    want = 6 * m.n_layers * row["accumulation"] * ring * 2 * 4096 * 1 * m.dim / (100e9)  # recompute: 2 more
    assert row["recompute"] and row["comm_s"] == pytest.approx(want, rel=1e-9)


def test_qwen25_32b_plans_every_layout_and_says_which_fits():
    plan = _plan("qwen2.5-32b")
    table = plan["layouts"]
    assert len([r for r in table["rows"] if "skipped" not in r]) == 9
    if table["recommended"] is not None:
        best = next(r for r in table["rows"] if r["name"] == table["recommended"])
        assert best["fits"] and best["peak_bytes"] <= 58 * GB


@pytest.mark.parametrize("name,count", [("qwen3-14b", 14_768_307_200), ("qwen2.5-32b", 32_763_876_352)])
def test_the_new_presets_count_what_transformers_counts(name, count):
    """Qwen3-14B's and Qwen2.5-32B's published totals, and transformers' own count of the model
    built from the exported config.json on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mspretrain.model.hf import config_from_hf, config_to_hf

    m = preset(name)
    assert param_count(m) == count
    cls = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config"}[m.family]
    with torch.device("meta"):
        n_hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls).from_dict(config_to_hf(m))).num_parameters()
    assert n_hf == count and config_from_hf(config_to_hf(m)) == m


def test_the_table_stops_at_64_devices():
    """Each row builds the step's owner tables, whose cost grows with the world: no table beyond
    MAX_DEVICES (one to a few nodes is the question it answers)."""
    from mspretrain.preflight.layouts import MAX_DEVICES

    assert MAX_DEVICES == 64
    assert "layouts" in _plan("qwen3-14b", devices=64) and "layouts" not in _plan("qwen3-14b", devices=128)


# ---- no layout the table recommends is one `train` refuses

class _Param:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape


class _Model:  # what step/zero3.py `sharded_names` reads of a model
    def __init__(self, params: list[_Param]) -> None:
        self.params = params

    def trainable_params(self) -> list[_Param]:
        return self.params


def _train_checks(cfg, m, row) -> None:
    """`train`'s own checks of a layout (train/build.py's order): the config's cross-section rules,
    the model tp cuts, the mesh over the world, the batch over the data-parallel ranks, ZeRO-3's
    slices; each raises UserError on a refusal."""
    from mspretrain import budget
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.parallel import check_tp
    from mspretrain.model.presets import param_shapes
    from mspretrain.preflight.layouts import layout_config
    from mspretrain.step.tp import make_mesh
    from mspretrain.step.zero3 import sharded_names

    c = layout_config(replace(cfg, model=m), row)
    cfgmod.validate(c, device="ascend")
    world = row["tp"] * row["dp"]
    check_tp(m, row["tp"])
    if row["tp"] > 1:
        make_mesh(0, world, row["tp"], "ascend", create=False)
    budget.derive(c, world=row["dp"])
    if row["zero"] == 3:
        shapes = param_shapes(m)
        trained = trainable_mask([n for n, _ in shapes], c.train.trainable, tied=m.tie_embeddings)
        params = [_Param(n, s) for (n, s), k in zip(shapes, trained) if k]
        sharded_names(_Model(params), [p.name for p in params], world)


@pytest.mark.parametrize("devices", [8, 16, 32])
def test_every_recommended_layout_is_one_train_accepts(devices):
    """Every preset at 8, 16 and 32 devices (the 910B shape, global batch 256): the layout the table
    recommends, and the faster unmeasured one it names, pass `train`'s own checks (ZeRO-3
    for Qwen3 on 16 devices is one `train` refuses: its 128-element QK-norm weights are fewer than
    16²); a row `train` refuses is listed as not possible, with its words."""
    from mspretrain.model.presets import PRESETS
    from mspretrain.preflight.plan import make_plan

    cfg = cfgmod.load(None, BIG)
    seen = 0
    for name in PRESETS:
        m = cfgmod.resolve_model(preset(name), 32000)
        c = replace(cfg, data=replace(cfg.data, seq_len=min(4096, m.max_seq_len)))
        table = make_plan(replace(c, model=m), devices=devices, tokens=None, data_dir=None,
                          tokens_per_s_per_device=None)["layouts"]
        for pick in (table["recommended"], table["recommended_unmeasured"]):
            if pick:
                row = next(r for r in table["rows"] if r["name"] == pick)
                _train_checks(c, m, row)
                seen += 1
        for row in table["rows"]:
            if "skipped" not in row:
                _train_checks(c, m, row)  # every row shown is one `train` runs
    assert seen >= len(PRESETS)
    if devices == 16:  # the case of the issue: ZeRO-3 of Qwen3 is refused by `train`, so not possible here
        m = preset("qwen3-14b")
        rows = make_plan(replace(cfg, model=m), devices=16, tokens=None, data_dir=None, tokens_per_s_per_device=None)["layouts"]["rows"]
        zero3 = next(r for r in rows if r["name"] == "ZeRO-3")
        assert "fewer than world² = 256" in zero3["skipped"]


def test_plan_of_a_preset_alone_is_a_shape_its_table_fits_and_names_it(capsys):
    """`plan --model PRESET` alone plans bf16 on Ascend, a global batch the data-parallel
    ranks divide (the default 8 was refused on 16), and a window that fits (Qwen3-14B's 40,960-token
    context gave 10,891 GB); the warning names the layout its own table recommends; `--devices 16`
    plans host memory for the 8 ranks of a server (its HCCL line says 2 servers)."""
    from mspretrain.cli import main

    for name in ("qwen2.5-32b", "qwen3-14b"):
        assert main(["plan", "--model", name, "--devices", "16", "--json"]) == 0, name
        plan = json.loads(capsys.readouterr().out)
        table = plan["layouts"]
        best = table["recommended"] or table["recommended_unmeasured"]
        assert best, f"{name}: no layout fits the planned shape"
        assert plan["dtype"] == "bf16" and plan["global_batch"] % 16 == 0 and plan["seq_len"] <= 4096
        for w in plan["warnings"]:
            if w.startswith("WILL NOT FIT"):
                assert f"recommended {best} fits" in w or f"(memory not yet measured) {best} fits" in w, w
        assert plan["host_ranks"] == 8 and plan["hccl"]["nodes"] == 2
        per_rank = plan["host_bytes"]["process_baseline"] / 8
        assert plan["host_bytes"]["process_baseline"] == pytest.approx(8 * per_rank)
    assert main(["plan", "--model", "qwen3-14b", "--devices", "16"]) == 0
    out = capsys.readouterr().out
    assert "host memory per node (8 ranks):" in out and "on 2 servers" in out
    # the quickstart's `plan --model 125m --data data` on this machine (one device, its RAM): the
    # preset's 2,048-token window in fp32 said WILL NOT FIT beside a train command that fits
    assert main(["plan", "--model", "125m", "model.vocab_size=8000", "device.target=cpu", "--device-mem-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert "WILL NOT FIT" not in out and "data.seq_len 1024 (the preset's max_seq_len 2,048 halved: the longest that fits)" in out


def test_fits_under_tensor_parallel_splits_the_batch_over_the_data_parallel_ranks():
    """A valid `global_batch=3, tp=2` run on 6 ranks (3 data-parallel) was refused
    because `fits` split the batch over all 6."""
    from mspretrain.preflight.fits import estimate_bytes

    cfg = cfgmod.load(None, ["model.vocab_size=256", "train.global_batch=3", "parallel.tp=2", "model.n_kv_heads=2",
                             "model.n_heads=2", "train.max_steps=1"])
    assert estimate_bytes(cfg, 6) > 0
    from mspretrain.preflight.plan import make_plan

    plan = make_plan(cfg, devices=6, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert (plan["dp"], plan["micro_batch"], plan["accumulation"]) == (3, 1, 1)


def test_qwen25_32b_on_16_devices_starts_with_its_slices_only():
    """ZeRO-3 built the whole fp32 model on each device before slicing it (122 GiB for
    Qwen2.5-32B against 58): the plan recommended a layout that could not start. The model is now
    drawn on the host, one weight at a time as the cut reads it, and each device receives its slices:
    the plan's start-up figure is the slices (within the pool), the host's one whole fp32 weight per
    rank at a time (model initialisation, 8 ranks a server). A layout that is not cut streams the
    whole fp32 model to each device, and the plan warns when that does not fit."""
    plan = _plan("qwen2.5-32b", "optim.shard_parameters=true", "train.recompute=true", devices=16)
    P = plan["params"]
    bb = plan["build_bytes"]
    # the slices as sent, fp32 (the step rounds the bf16 matrices after): the fp32 plan's weights
    fp32 = _plan("qwen2.5-32b", "optim.shard_parameters=true", "train.recompute=true", "precision.param_dtype=fp32", devices=16)
    assert bb["cut"] and bb["device"] == fp32["memory_bytes"]["weights"] > plan["memory_bytes"]["weights"]
    assert abs(bb["device"] - 4 * P / 16) < 0.01 * 4 * P / 16  # about 1/16 of the fp32 model
    largest = 152_064 * 5_120  # the embedding (and the untied lm_head)
    assert bb["device"] / GB <= plan["device_mem_gb"] and bb["host_per_rank"] == 4 * largest
    assert plan["host_bytes"]["model_init"] == 8 * 4 * largest
    assert not any(w.startswith("start-up") for w in plan["warnings"])
    whole = _plan("qwen2.5-32b", "optim.shard_gradients=true", devices=16)
    assert not whole["build_bytes"]["cut"] and whole["build_bytes"]["device"] == 4 * P
    assert any(w.startswith("start-up: the fp32 weights") for w in whole["warnings"])
