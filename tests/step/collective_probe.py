"""Compile the real train step for every rank of each given case (world, ZeRO stage, tp, model
family, expert parallel), as the Ascend path builds it, and print each rank's ordered collectives
per graph as JSON, `{"W-Z-TP-FAMILY[-epN]": {rank: {...}}}` (run as a script by tests/step/test_collective_sequence.py, two
processes at once, each for its share of the cases the session selected: MindSpore is imported once per process).

Why a separate process: it replaces `get_rank` / `get_group_size` in MindSpore's
`ops/operations/comm_ops.py` (the collective primitives read the world there at construction:
AllGather's `rank`/`rank_size`, ReduceScatter's `rank_size`), so that rank r of a world of N is
built in one CPU process without `init()`, and it sets MindSpore's IR dump switches, read by the
compiler:
- `MS_DEV_PRECOMPILE_ONLY=1`: `_JitExecutor.__call__` compiles the graph and returns None without
  running it (mindspore/graph/api.py, `__call__` and `compile_frontend`), so no collective kernel is
  launched and no communication library is needed.
- `MS_DEV_SAVE_GRAPHS=1` with `MS_DEV_DUMP_IR_PASSES=backend_pass`: only the IR after the last
  frontend pass (`NN_backend_pass_NNNN.ir`) is written, into `MS_DEV_SAVE_GRAPHS_PATH`, which the
  compiler reads per compilation (one folder per case, rank and graph here). That is the graph the
  backend is handed: every frontend pruning (`jit_opt_a` removes a node whose result nothing uses,
  despite the primitive's `no_eliminate` attribute) has already happened.
The device is "ascend" for the step and the model (ReduceScatter and AllGather instead of the CPU's
AllReduce forms, no chaining of collectives: step/step.py `_chain`), attention is the math path
(the flash kernel's infer needs no NPU, but nothing here is about attention).

Several cases in one process: nothing the step builds is kept per world outside the objects of one
rank (the primitives read `get_rank` / `get_group_size` when they are constructed, which happens
anew for each rank's model and step; the tp and dp group names are fixed strings the replaced
functions map to this rank's sizes; MindSpore's compile cache keys a graph on its object's id and
creation time, and each rank's IR is read from a folder of its own, which a reused graph would
leave empty: `_final_ir` fails then). Each rank's step and model are locals of `probe_rank`,
freed before the next rank (on return, then `gc.collect()` for their reference cycles), and
MindSpore's cache of compiled graphs is emptied (`ms.ms_memory_recycle`), so the memory stays about
that of one rank's compilation and no graph of one rank can be served to another.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
from pathlib import Path

COLLECTIVES = ("AllReduce", "ReduceScatter", "AllGather", "Broadcast", "AlltoAll")
# `  %12(CNode_34$prev) = ReduceScatter(%11) primitive_attrs: {group: "hccl_world_group", ...}`
# followed by `      : (<Tensor[Float32], (32768)>) -> (<Tensor[Float32], (8192)>)`
_NODE = re.compile(r"^\s*%\d+\([^)]*\) = (" + "|".join(COLLECTIVES) + r")\((.*)$")
_GROUP = re.compile(r'group: "([^"]*)"')
_ROOT = re.compile(r"root_rank: I64\((-?\d+)\)")
FAMILIES = {"llama": {}, "qwen2": {"family": "qwen2", "qkv_bias": True},
            "qwen3": {"family": "qwen3", "qk_norm": True, "head_dim": 16},
            # the MoE cases (expert parallel, and ZeRO-3 at ep 1): 4 experts, top-2, the balance loss on
            # (its stats' world sum)
            "qwen3_moe": {"family": "qwen3_moe", "qk_norm": True, "head_dim": 16, "num_experts": 4, "experts_per_token": 2,
                          "moe_ffn_dim": 32, "router_aux_loss_coef": 0.01}}
_TYPES = re.compile(r"^\s*: \((.*)\) -> \((.*)\)\s*$")


def collectives_in_ir(text: str) -> list[list[str]]:
    """[kind, group, input types, output types, root] of every collective node, in the IR's order
    (the order of the graph's node list, which the backend's execution order follows for nodes with
    no data dependency forcing another). `root`: a Broadcast's `root_rank` attribute, which HCCL
    reads as the root's rank inside the group (model/parallel.py `Group.broadcast`); "" for the others."""
    out: list[list[str]] = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        m = _NODE.match(line)
        if not m:
            continue
        group = _GROUP.search(m.group(2))
        types = _TYPES.match(lines[n + 1]) if n + 1 < len(lines) else None
        root = _ROOT.search(m.group(2))
        out.append([m.group(1), group.group(1) if group else "", types.group(1) if types else "?",
                    types.group(2) if types else "?", root.group(1) if root else ""])
    return out


def _final_ir(folder: Path) -> str:
    files = sorted(folder.glob("*backend_pass*.ir"))
    if len(files) != 1:
        raise SystemExit(f"expected one backend_pass IR file in {folder}, found {[f.name for f in files]}")
    return files[0].read_text(encoding="utf-8")


def parse_case(text: str) -> tuple[int, int, int, str] | tuple[int, int, int, str, int]:
    """`W,Z,TP[,FAMILY[,EP]]` (FAMILY llama by default) -> (world, zero, tp, family[, ep]). EP > 1
    (expert parallel, step/ep.py): qwen3_moe, tp 1 and ZeRO 0, 1 or 2 (the plan refuses ZeRO-3 with
    ep). qwen3_moe at ep 1: ZeRO 1-3 over the world, tp 1 (model/block.py refuses tp for an MoE layer)."""
    parts = text.split(",")
    if len(parts) not in (3, 4, 5):
        raise argparse.ArgumentTypeError(f"--case W,Z,TP[,FAMILY[,EP]], not {text!r}")
    world, zero, tp = map(int, parts[:3])
    family = parts[3] if len(parts) >= 4 else "llama"
    ep = int(parts[4]) if len(parts) == 5 else 1
    moe = family == "qwen3_moe"
    if ep > 1:
        if not moe or zero not in (0, 1, 2) or tp != 1 or world % ep:
            raise argparse.ArgumentTypeError(f"--case {text!r}: expert parallel needs qwen3_moe, ZeRO 0-2, tp 1, ep dividing the world")
        return world, zero, tp, family, ep
    if zero not in (1, 2, 3) or family not in FAMILIES or world < 1 or tp < 1 or world % tp or (moe and tp != 1):
        raise argparse.ArgumentTypeError(f"--case {text!r}: ZeRO 1-3, tp dividing the world (1 for qwen3_moe), family in {tuple(FAMILIES)}")
    return world, zero, tp, family


def case_key(world: int, zero: int, tp: int, family: str, ep: int = 1) -> str:
    return f"{world}-{zero}-{tp}-{family}" + (f"-ep{ep}" if ep > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    # (world, ZeRO stage, tensor parallel (step/tp.py: world = tp x dp), model family, expert
    # parallel); family qwen2 / qwen3 for ZeRO-3's gathers anchored on another gather's result (q/k/v
    # bias, QK-norm), qwen3_moe for an MoE layer (ep > 1: step/ep.py; ep 1: ZeRO over the world)
    ap.add_argument("--case", type=parse_case, action="append", required=True, help="W,Z,TP[,FAMILY[,EP]]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ.update({"GLOG_v": "3", "MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "backend_pass",
                       "MS_DEV_PRECOMPILE_ONLY": "1"})
    import mindspore as ms

    _source_lines_once()
    # Python's cyclic collector, run by allocation counts, traversed the whole heap again and
    # again during each compilation (the parser's objects): the imports' objects are frozen out of
    # it, the automatic collections are off, and the probe collects once after each rank (below).
    # Measured with the cache above (both together): rank 0 of 2,2,1 and of 2,0,1,qwen3_moe,2,
    # 32.5 -> 30.3 s of CPU; all 13 cases in two processes side by side with the old probe,
    # 917 -> 886 s (-3 %, at the noise of a shared box), the same collectives in all 150 graphs.
    gc.collect()
    gc.freeze()
    gc.disable()
    result: dict[str, dict[str, dict]] = {}
    for case in args.case:
        world, zero, tp, family, *ep = case
        key = case_key(*case)
        result[key] = {}
        for rank in range(world):
            result[key][str(rank)] = probe_rank(world, zero, tp, family, rank, args.out / key / f"rank{rank}", *ep)
            gc.collect()  # the rank's model and step, in reference cycles (cells, closures)
            # and MindSpore's own cache of every graph compiled so far (`ms_compile_cache`, the graph
            # executor's resources): ~75 MB a rank otherwise (measured, 12 ranks: 0.8 to 1.7 GB)
            ms.ms_memory_recycle()
    json.dump(result, sys.stdout)


def _source_lines_once() -> None:
    """MindSpore's parser reads a function's source with `inspect.getsourcelines` each time it
    parses the function (mindspore/graph/_parse/parser.py `Parser.parse`: every rank's cells are new
    objects, so each rank parses them all again), which re-tokenizes the function's file block by
    block; the lines of one code object never change while the probe runs, so they are read once.
    What the parser gets is the same tuple either way."""
    import inspect

    read = inspect.getsourcelines
    seen: dict = {}

    def getsourcelines(obj):
        # what `inspect.getsourcelines` reads: the unwrapped function's code (a decorator's wrapper
        # shares its code object among every function it wraps)
        try:
            code = getattr(inspect.unwrap(getattr(obj, "__func__", obj)), "__code__", None)
        except ValueError:  # a cycle of __wrapped__
            code = None
        if code is None:  # a class or a module: not cached
            return read(obj)
        if code not in seen:
            seen[code] = read(obj)
        return seen[code]

    inspect.getsourcelines = getsourcelines


def probe_rank(world: int, zero: int, tp: int, family: str, rank: int, out: Path, ep: int = 1) -> dict:
    """Rank `rank` of the case: what its step issues per graph (`traced`) and each compiled graph's
    collectives, the IR dumped under `out` (a folder per case and rank, one per graph below it)."""
    if ep > 1:
        return probe_ep_rank(world, zero, ep, family, rank, out)
    from mindspore.ops.operations import comm_ops

    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.model.parallel import CopyToTP, Group, ReduceFromTP, split_model
    from mspretrain.step.step import TrainStep
    from mspretrain.step.tp import Mesh, TPTrainStep
    from mspretrain.step.zero3 import gathered

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    from dataclasses import replace

    # One layer, not tiny.toml's two: what this checks is per rank and per collective (which
    # bucket, split parameter or gathered weight a rank reads), and a second layer only repeats the
    # first's nodes; one layer compiles in about half the time (50 ranks x 3 graphs). Planted, the
    # bug this file guards (`_reduce` returning its last result without the others behind it) still
    # fails it at world 2: rank 1 kept 3 AllReduces, rank 0 2 (measured).
    m = cfgmod.resolve_model(replace(cfg.model, n_layers=1, **FAMILIES[family]), 512)
    dp = world // tp
    # Tensor parallel: the Ascend path's named groups (step/tp.py `make_mesh`), built without
    # create_group (no HCCL here); a group's size is what the primitives read at construction.
    # Group names differ between groups (tp_0, tp_1), so the lists compare their kind (tp, dp).
    t, d = rank % tp, rank // tp
    sizes, mine = {f"tp_{d}": tp, f"dp_{t}": dp}, {f"tp_{d}": t, f"dp_{t}": d}  # a group's size, this rank's index in it
    # this case's world bound here (a default argument), never read from an enclosing variable later
    comm_ops.get_rank = lambda group=None, rank=rank, mine=mine: mine.get(group, rank)
    comm_ops.get_group_size = lambda group=None, sizes=sizes, world=world: sizes.get(group, world)
    # The shipped Qwen2.5 910B recipe's choices, small: bf16 with half-precision matrices (fp32
    # masters), the embedding frozen, ZeRO; tiny buckets and a low split threshold so that the
    # step has split parameters, several buckets of each kind and unbucketed singletons.
    model = Decoder(m, dtype="bf16", attention="math", device="ascend", seed=0)
    common = dict(global_tokens=64, shard=True, shard_grads=zero >= 2, half_params=half_eligible(model), bucket_mb=0.01,
                  device="ascend", trainable=["attention", "mlp", "norms", "lm_head"])
    if tp > 1:
        named = dp > 1  # dp 1: the tp group is the world
        mesh = Mesh(Group(tuple(d * tp + i for i in range(tp)), t, name=f"tp_{d}" if named else None, device="ascend"),
                    Group(tuple(j * tp + t for j in range(dp)), d, name=f"dp_{t}" if named else None, device="ascend"))
        split_model(model, mesh.tp)
        step = TPTrainStep(model, cfg.optim, mesh=mesh, **common)
    else:
        step = TrainStep(model, cfg.optim, world=world, rank=rank, shard_params=zero == 3, split_mb=0.05, **common)
    # what the step's Python code issues per graph, from its own tables: the reductions
    # (`_reduce`, one per bucket or singleton), the loss AllReduce, the norm's AllReduce of the
    # owners' partial sums (sharded gradients), the gathers (`_gather`)
    sg = int(step.shard_grads)
    reduce, gather = len(step._schedule), len(step._ag) + len(step._ag_single)
    # an MoE (qwen3_moe at ep 1): each micro-batch's routing stats summed over the world in the
    # model's graph (step/objective.py `stats_sum`, before any backward collective)
    stats = int(step._moe_stats and step.world > 1)
    traced = {"fused": reduce + 1 + sg + gather + stats, "accumulate": reduce * sg + stats,
              "apply": reduce * (1 - sg) + 1 + sg + gather}
    if tp > 1:  # the model's f and g (one collective each) and the loss's three, then the norm's tp sum
        in_model = sum(isinstance(c, (CopyToTP, ReduceFromTP)) for _, c in model.cells_and_names()) + 3
        if dp == 1:
            traced = {"fused": 0, "accumulate": 0, "apply": 0}
        traced = {"fused": traced["fused"] + in_model + 1, "accumulate": traced["accumulate"] + in_model,
                  "apply": traced["apply"] + 1}
    if step.zero3:  # in the model's graph: a gather per sharded weight forward, a reduce-scatter backward
        names = [name for name, _, _ in gathered(model)]
        # every trained parameter is sliced and gathered where it is used (an MoE's router and its
        # `Stacked` w13 / w2: model/moe.py `MoE.pull`): one left out of `gathered` would be left out
        # of the count too, and a graph lacking its gather would pass
        if sorted(names) != sorted(step.names):
            raise SystemExit(f"ZeRO-3 gathers {sorted(set(names) ^ set(step.names))} not as trained")
        weights = len(names)
        traced = {"fused": 2 * weights + 2 + stats, "accumulate": 2 * weights + stats, "apply": 2}
    result: dict = {"traced": traced}
    # the world ranks of every group this rank's collectives may name (the world group's and the
    # named tp / dp groups), so the test can check what HCCL reads: that the rank is a member of the
    # group a collective names and that a Broadcast's root is a rank inside that group
    members = {"hccl_world_group": list(range(world)), f"tp_{d}": [d * tp + i for i in range(tp)],
               f"dp_{t}": [j * tp + t for j in range(dp)]}
    result.update(compile_graphs(step, out, members))
    return result  # every object of this rank is a local here: released on return, cycles by the caller's gc


def compile_graphs(step, out: Path, members: dict[str, list[int]]) -> dict[str, list[list]]:
    """Compile the step's three graphs (fused; accumulate / apply), each's IR dumped into a folder
    of its own below `out`, and read each one's collectives (`_compiled`)."""
    import mindspore as ms
    import numpy as np

    tokens = ms.Tensor(np.zeros((2, 33), np.int32))
    one = ms.Tensor(1.0, ms.float32)
    graphs = {"fused": lambda: step._fused(tokens, None, None, one, one, one),
              "accumulate": lambda: step._accumulate(tokens, None, None, one, ms.Tensor(True)),
              "apply": lambda: step._apply(one, one)}
    out_graphs = {}
    for name, compile_graph in graphs.items():
        folder = out / name
        os.environ["MS_DEV_SAVE_GRAPHS_PATH"] = str(folder)
        if name == "accumulate":
            step._ensure_accum()
        compile_graph()
        out_graphs[name] = _compiled(folder, members)
    return out_graphs


def _compiled(folder: Path, members: dict[str, list[int]]) -> list[list]:
    """Each collective of the graph compiled into `folder`: [kind, group kind (tp / dp / ep / edp:
    the names differ between groups), input and output types, root inside the group, the group's
    world ranks]."""
    return [[kind, group.split("_")[0] if group.split("_")[0] in ("tp", "dp", "ep", "edp") else group, t_in, t_out, root,
             members.get(group or "hccl_world_group")]
            for kind, group, t_in, t_out, root in collectives_in_ir(_final_ir(folder))]


def probe_ep_rank(world: int, zero: int, ep: int, family: str, rank: int, out: Path) -> dict:
    """`probe_rank` for expert parallel (step/ep.py): the MoE model cut by `apply_ep` over the ep
    group named as `expert_mesh` names it, the step over the world (ZeRO 0, 1 or 2: the plan refuses
    ZeRO-3 with ep; the experts' state stays with every rank, outside the gathers, and under ZeRO-2
    their gradients in no rank bucket: summed over edp every micro-batch, the rest reduce-scattered).
    In the model's graph per MoE layer, the Ascend form (model/expert_parallel.py `AllToAllRows`):
    the dispatch's AlltoAll of rows and of expert ids and the combine's AlltoAll forward, the two
    reverse AlltoAlls backward (the bprops); the routing stats' world AllReduce; in the step, the buckets (the
    expert stacks' own over the edp group, when it has more than one rank), the loss, the norm's
    ep sum (ZeRO-2: its world sum) and ZeRO-1/2's gathers of the other parameters."""
    from mindspore.ops.operations import comm_ops

    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.parallel.plan import ParallelPlan
    from mspretrain.step.ep import EPTrainStep, expert_mesh

    plan = ParallelPlan(world=world, rank=rank, ep=ep, zero=zero)
    mesh = expert_mesh(plan, "ascend", create=False)
    sizes = {g.name: g.size for g in (mesh.ep, mesh.edp) if g.name}
    mine = {g.name: g.rank for g in (mesh.ep, mesh.edp) if g.name}
    comm_ops.get_rank = lambda group=None, rank=rank, mine=mine: mine.get(group, rank)
    comm_ops.get_group_size = lambda group=None, sizes=sizes, world=world: sizes.get(group, world)
    from dataclasses import replace

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    m = cfgmod.resolve_model(replace(cfg.model, n_layers=1, **FAMILIES[family]), 512)
    model = Decoder(m, dtype="bf16", attention="math", device="ascend", seed=0)
    half = half_eligible(model)
    model.apply_ep(mesh.ep)
    step = EPTrainStep(model, cfg.optim, mesh=mesh, plan=plan, global_tokens=64, half_params=half, bucket_mb=0.01,
                       device="ascend", trainable=["attention", "mlp", "norms", "lm_head"])
    layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    # `_reduce`: the world's buckets and singletons (ZeRO-2: reduce-scattered), the expert stacks'
    # bucket over edp (kind 3) when edp has more than one rank
    reduce = sum(1 for kind, _ in step._schedule if kind != 3 or step.edp_sum is not None)
    in_model = 5 * layers + 1
    gather = len(step._ag) + len(step._ag_single)
    # the loss's world sum and the norm's one sum: over ep of the experts' squares (ZeRO 0/1,
    # `ep_sum`) or over the world of the owned squares (ZeRO-2); ZeRO-2 reduces every micro-batch
    # (in `accumulate`), the others once a step (in `apply`)
    if step.shard_grads and step.ep_sum is not None:
        raise SystemExit("ZeRO-2 with ep: the norm has an ep sum besides the world's")
    sg = int(step.shard_grads)
    traced = {"fused": in_model + reduce + 2 + gather, "accumulate": in_model + reduce * sg,
              "apply": reduce * (1 - sg) + 2 + gather}
    result: dict = {"traced": traced}
    members = {"hccl_world_group": list(range(world))}
    members.update({g.name: list(g.ranks) for g in (mesh.ep, mesh.edp) if g.name})
    result.update(compile_graphs(step, out, members))
    return result


if __name__ == "__main__":
    main()
