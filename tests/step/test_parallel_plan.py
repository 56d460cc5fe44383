"""The parallel plan (mspretrain/parallel/plan.py) and the shard key's one writer and one reader
(mspretrain/parallel/shard_key.py): pure, no MindSpore, milliseconds. The source scans at the end
fail when a second writer or reader of `NAME@START:STOP` appears, or a `getattr`/`hasattr` probe of
a layout attribute comes back."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from mspretrain.errors import UserError
from mspretrain.parallel.plan import COLUMN, PARTIAL, REPLICATED, ROLES, ROW, VOCAB, ParallelPlan, tp_where
from mspretrain.parallel.shard_key import is_slice, parse_shard_key, shard_key

PKG = Path(__file__).resolve().parents[2] / "mspretrain"


def test_ranks_of_a_tp_x_dp_plan():
    # world 8 = tp 2 x dp 4: tp groups of adjacent ranks, dp groups strided by tp (Megatron's order)
    p = ParallelPlan(world=8, rank=5, tp=2, zero=2)
    assert (p.dp, p.tp_rank, p.dp_rank) == (4, 1, 2)
    assert p.tp_ranks == (4, 5) and p.dp_ranks == (1, 3, 5, 7)
    assert p.sharded and not p.zero3 and p.gathers_for_save and not p.writes_files and not p.publishes
    assert ParallelPlan(world=8, rank=4, tp=2).writes_files
    # every rank is in exactly one tp group and one dp group, at its own index
    for r in range(8):
        q = ParallelPlan(world=8, rank=r, tp=2)
        assert q.tp_ranks[q.tp_rank] == r and q.dp_ranks[q.dp_rank] == r
    # ZeRO acts over the dp group: with one dp rank nothing is sharded
    assert not ParallelPlan(world=2, rank=0, tp=2, zero=3).zero3
    assert ParallelPlan(world=2, rank=1, zero=3).zero3 and ParallelPlan(world=2, rank=1, zero=3).writes_model_slices
    one = ParallelPlan()
    assert (one.dp, one.sharded, one.gathers_for_save, one.writes_files, one.publishes) == (1, False, False, True, True)
    assert not (one.per_rank_files or one.holds_pieces or ParallelPlan(world=4, rank=1).per_rank_files)  # plain dp: rank 0 writes


def test_plan_from_a_config_and_its_refusals():
    from mspretrain.config import schema as cfgmod

    cfg = cfgmod.load(None, ["parallel.tp=2", "optim.shard_gradients=true"])
    p = ParallelPlan.for_config(cfg, world=4, rank=3)
    assert (p.tp, p.dp, p.zero, p.ep, p.cp) == (2, 2, 2, 1, 1)
    with pytest.raises(UserError, match="parallel.tp = 2 does not divide the 3 ranks"):
        ParallelPlan.for_config(cfg, world=3, rank=0)
    with pytest.raises(UserError, match="parallel.cp = 2: .* not supported yet"):
        ParallelPlan(world=4, cp=2)
    with pytest.raises(UserError, match="does not divide model.n_kv_heads = 2"):
        ParallelPlan(world=4, tp=4).check_model(8, 2, 64, 256)


def test_ranks_of_an_expert_parallel_plan():
    # world 8, ep 2: ep groups of adjacent ranks split the experts; the edp groups hold the same ones
    p = ParallelPlan(world=8, rank=5, ep=2)
    assert (p.dp, p.ep_rank, p.edp, p.edp_rank) == (8, 1, 4, 2)
    assert p.ep_ranks == (4, 5) and p.edp_ranks == (1, 3, 5, 7)
    assert p.expert_span(4) == (2, 4) and p.expert_span(128) == (64, 128)
    # a save gathers nothing: every dp rank writes its own files, its experts' slices among them
    assert not p.gathers_for_save and p.per_rank_files and p.writes_model_slices and p.holds_pieces
    assert p.writes_files and not p.publishes
    for r in range(8):  # every rank in one ep group and one edp group, at its own index
        q = ParallelPlan(world=8, rank=r, ep=4)
        assert q.ep_ranks[q.ep_rank] == r and q.edp_ranks[q.edp_rank] == r and len(set(q.ep_ranks) & set(q.edp_ranks)) == 1
    two = ParallelPlan(world=2, rank=1, ep=2)  # ep = the world: the ep group is the world, the edp group one rank
    assert two.ep_ranks == (0, 1) and two.edp_ranks == (1,) and "ep 2 x expert-dp 1" in two.describe()
    assert ParallelPlan().expert_span(4) == (0, 4)
    for kw, says in (({"world": 6, "ep": 4}, "parallel.ep = 4 does not divide the 6 data-parallel ranks"),
                     ({"world": 1, "ep": 2}, "parallel.ep = 2 does not divide the 1 data-parallel ranks"),
                     ({"world": 4, "ep": 2, "tp": 2}, "expert parallel with tensor parallel is not supported yet"),
                     ({"world": 4, "ep": 2, "zero": 3}, "ZeRO-3 with parallel.ep = 2 is not supported yet")):
        with pytest.raises(UserError, match=says):
            ParallelPlan(**kw)
    from mspretrain.config import schema as cfgmod

    cfg = cfgmod.load(None, ["parallel.ep=2", "model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4"])
    assert ParallelPlan.for_config(cfg, world=4, rank=2).ep_ranks == (2, 3)
    assert ParallelPlan(world=4, rank=0, ep=2, zero=1).sharded  # ZeRO-1 composes with ep


def test_zero1_leaves_the_expert_stacks_local():
    """ZeRO-1 under expert parallel (parallel/layout.py `LOCAL`): the expert stacks (each rank its own
    experts) are owned by every rank whole, never split, in no gather; the others are sharded as ever."""
    from mspretrain.parallel.layout import LOCAL, plan_layout

    sizes, local = [1000, 50_000, 50_000, 1000], [False, True, True, False]
    lay = plan_layout(sizes, [False] * 4, [False] * 4, 2, shard=True, shard_grads=False, cap=10_000, split=20_000, local=local)
    assert lay.owner[1] == lay.owner[2] == LOCAL and not lay.is_split(1)
    assert {lay.owner[0], lay.owner[3]} == {0, 1}
    for r in (0, 1):
        assert {1, 2} <= set(lay.owned(r)) and lay.unit(1, r) == (0, 50_000)
    gathered = {i for b in lay.gather_rank for seg in b.segments for i in seg} | set(lay.gather_single)
    assert gathered == {0, 3}


def test_tp_where_by_role():
    # a fused column weight (q | k | v rows: 8, 4, 4) on tp rank 1 of 2: the second half of each block
    assert tp_where(COLUMN, (16, 8), (8, 4, 4), 2, 1) == (0, [(4, 8), (10, 12), (14, 16)])
    assert tp_where(ROW, (8, 16), None, 2, 0) == (1, [(0, 8)])
    assert tp_where(VOCAB, (100, 8), None, 4, 3) == (0, [(75, 100)])
    assert tp_where(REPLICATED, (8,), None, 2, 1) is None and tp_where(PARTIAL, (8,), None, 2, 1) is None
    assert tp_where(COLUMN, (16, 8), None, 1, 0) is None
    assert ROLES == ("column", "row", "vocab", "replicated", "partial")  # model/params.py's Role values


def test_shard_key_round_trip_and_hostile_keys():
    key = shard_key("exp_avg.lm_head.weight", 0, 68108288)
    assert key == "exp_avg.lm_head.weight@0:68108288"
    assert parse_shard_key(key) == ("exp_avg.lm_head.weight", (0, 68108288)) and is_slice(key)
    assert parse_shard_key("layers.0.attn.wqkv.weight") == ("layers.0.attn.wqkv.weight", None)
    for bad in ("w@5:3", "w@a:b", "w@1:", "w@-1:2", "w@" + "9" * 20 + ":1"):
        with pytest.raises(UserError, match="names no element range"):
            parse_shard_key(bad)


@functools.lru_cache(maxsize=1)
def _py_files() -> list[tuple[Path, ast.AST]]:
    """Every module of the package, parsed once for both scans."""
    return [(p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(PKG.rglob("*.py"))]


def test_the_shard_key_has_one_writer_and_one_reader():
    """No f-string `...@{start}:{stop}` and no split at "@" outside parallel/shard_key.py
    (checkpoint/store.py's fault-injection delay `SECONDS@STEP` is not a shard key; prepare/ and
    data/ handle text, whose "@" is an e-mail's or a package's)."""
    home = PKG / "parallel" / "shard_key.py"
    writers, readers = [], []
    for path, tree in _py_files():
        if path == home or path.relative_to(PKG).parts[0] in ("prepare", "data"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = node.values
                for a, b, c in zip(parts, parts[1:], parts[2:]):
                    if (isinstance(a, ast.Constant) and str(a.value).endswith("@") and isinstance(b, ast.FormattedValue)
                            and isinstance(c, ast.Constant) and str(c.value).startswith(":")):
                        writers.append(f"{path.relative_to(PKG)}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("partition", "rpartition", "split", "rsplit")
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "@"):
                if not (path.name == "store.py" and ast.unparse(node.func.value) == "delay"):
                    readers.append(f"{path.relative_to(PKG)}:{node.lineno}")
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value == "@"
                    and isinstance(node.ops[0], ast.In)):
                readers.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not writers, f"a second writer of NAME@START:STOP (use parallel/shard_key.py shard_key): {writers}"
    assert not readers, f"a second reader of NAME@START:STOP (use parallel/shard_key.py parse_shard_key): {readers}"


# attributes that say how a model or a step is laid out across ranks: read them from the plan or
# from the cell that declares them, never probed with getattr/hasattr
LAYOUT_ATTRS = {"tp", "tp_size", "tp_shapes", "tp_partial", "tp_loss", "tp_out", "tp_split", "zero3", "zero_setup",
                "sharded", "writes", "gather", "bias_gather", "plan", "mesh", "split", "local_heads",
                "weights_digest"}


def test_no_probe_of_a_layout_attribute():
    probes = []
    for path, tree in _py_files():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in LAYOUT_ATTRS):
                probes.append(f"{path.relative_to(PKG)}:{node.lineno} {ast.unparse(node)}")
    assert not probes, "a getattr/hasattr probe of a layout attribute (declare it, or hand the plan): " + "; ".join(probes)


def test_fits_and_plan_model_the_micro_batch_of_the_data_parallel_size():
    """World 4 under tp 2 is 2 data-parallel ranks: `fits` (preflight/fits.py) and `plan` model the micro-
    batch train runs, global_batch / dp, not global_batch / world (half of it: another micro-batch)."""
    from mspretrain import budget
    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.fits import estimate_bytes
    from mspretrain.preflight.plan import make_plan

    over = ["model.vocab_size=256", "model.n_heads=4", "model.n_kv_heads=2", "train.global_batch=8", "train.max_steps=1"]
    cfg = cfgmod.load(None, over + ["parallel.tp=2"])
    run = budget.derive(cfg, world=ParallelPlan.for_config(cfg, world=4).dp, data_tokens=None)  # what train/build.py derives
    plan = make_plan(cfg, devices=4, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    assert (plan["dp"], plan["micro_batch"], plan["accumulation"]) == (2, run.micro_batch, run.accumulation)
    assert run.micro_batch * run.accumulation == 4 != budget.derive(cfg, world=4, data_tokens=None).micro_batch
    # the memory check is the plan's figure of that micro-batch (+ the RoPE tables), and a bigger
    # micro-batch is a bigger figure: the estimate follows the split
    m = cfg.model
    assert estimate_bytes(cfg, 4) == int(plan["memory_bytes"]["peak"]) + m.max_seq_len * m.head_size * 24
    wide = cfgmod.load(None, over[:-2] + ["train.global_batch=16", "train.max_steps=1", "parallel.tp=2"])
    assert estimate_bytes(wide, 4) > estimate_bytes(cfg, 4)
