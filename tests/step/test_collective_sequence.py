"""Every rank compiles the same sequence of collectives.

HCCL pairs the n-th collective of one rank with the n-th of every other: a rank whose graph lacks
one hangs the job, or sums the wrong tensors where the sizes happen to match. On the Ascend path the
reductions are not chained (step/step.py `_chain`), and MindSpore's frontend pass `jit_opt_a`
removed a collective whose result this rank does not use (a bucket or parameter another rank owns)
in spite of the primitive's `no_eliminate` attribute. Measured here before the fix, ZeRO-2 at world
8: the fused graph traced 30 collectives and kept 21 on ranks 0-5, 22 on ranks 6-7 (accumulate:
14 traced, 5 or 6 kept); at world 2 every rank kept all of them, in another order. The CPU path
chains every collective, so no run on CPU could see it: here the real step is compiled for each
rank of every case in CASES (world, ZeRO stage, tensor parallel, model family, expert parallel:
worlds 2, 4 and 8; ZeRO-1/2/3, tp 2, ep 2 and 4 with ZeRO 0-2, ZeRO-3 on an MoE; one layer:
tests/step/collective_probe.py says why) with the Ascend path's choices (two probe processes share
the cases the session selected), and each rank's ordered list of collectives — kind, group, input
and output types and shapes — is compared, for the fused graph and for the accumulate / apply pair, and
counted against what the step's code issues.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.step.collective_probe import COLLECTIVES, case_key, collectives_in_ir

pytestmark = pytest.mark.slow  # 50 rank compilations (3 graphs each, 1 layer) in two subprocesses

PROBE = Path(__file__).with_name("collective_probe.py")
ROOT = PROBE.parents[2]
# A case is (world, ZeRO stage, tp, model family, ep); each is here for a graph structure no other
# case has (the cases another one covers are left out).
# - ZeRO-2, the shipped 910B configs: world 8, where the bug showed (ranks 6-7 kept one collective
#   more than ranks 0-5), and world 2, where every rank kept all of them but in another order.
#   World 4 is dropped: the same buckets, split parameters and singletons, cut among a number of
#   owners between those two; no kind of node or of ordering that worlds 2 and 8 lack.
# - ZeRO-1 at world 4: replicated buckets, which an owner alone reads after the reduction.
# - ZeRO-3 (gathers and reduce-scatters inside the model's graph, ordered by the data flow alone on
#   Ascend: step/zero3.py): Qwen2 at world 2, whose q/k/v bias is gathered after its weight (a
#   gather anchored on another gather's result: llama's graph plus those links, so llama at world
#   2 is dropped), and Qwen3 at world 4, whose k_norm is gathered after q_norm's output, with a
#   head_dim of its own (QK-norm at llama's other world: llama at world 4 is dropped, its graph
#   less the QK-norm links, and Qwen3 at world 2, the same graph on fewer ranks).
# - Tensor parallel (step/tp.py): tp 2 alone (the tp group is the world), and tp 2 x dp 2 with
#   ZeRO-1 and ZeRO-2 (named tp and dp groups, the tp all-reduces inside the model's graph).
CASES = [(2, 2, 1, "llama", 1), (8, 2, 1, "llama", 1), (4, 1, 1, "llama", 1), (2, 3, 1, "qwen2", 1), (4, 3, 1, "qwen3", 1),
         (2, 1, 2, "llama", 1), (4, 1, 2, "llama", 1), (4, 2, 2, "llama", 1),
         # - Expert parallel (step/ep.py, a Qwen3-MoE layer): ep 2 alone (the ep group is the world,
         #   ZeRO 0), ep 2 x 2 expert-data-parallel ranks with ZeRO-1 (named ep and edp groups, the
         #   experts' buckets over edp), ep 4 x 2 at world 8 (four ranks in each dispatch), and ep 2 x
         #   edp 2 with ZeRO-2 (step/update.py: every micro-batch, so in `accumulate` too, the experts'
         #   edp AllReduce among the world's reduce-scatters, and the norm's world sum instead of the
         #   ep sum; edp 2 is the cheapest world where that AllReduce exists, ep 2 the cheapest cut).
         (2, 0, 1, "qwen3_moe", 2), (4, 1, 1, "qwen3_moe", 2), (8, 1, 1, "qwen3_moe", 4), (4, 2, 1, "qwen3_moe", 2),
         # - ZeRO-3 on an MoE at ep 1 (model/moe.py `MoE.pull`: the router and the `Stacked` w13 / w2
         #   gathered one after the other, their gradients reduce-scattered; the routing stats' world
         #   AllReduce between the forward's gathers and the backward's reduce-scatters), world 2: the
         #   gathers' chain is per layer as for Qwen2 / Qwen3, more ranks add no kind of node.
         (2, 3, 1, "qwen3_moe", 1)]
PARAMS = ("world", "zero", "tp", "family", "ep")
Case = tuple[int, int, int, str, int]
Ranks = dict[str, dict[str, list[list[str]]]]  # rank -> graph (and "traced") -> its collectives


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory) -> dict[Case, Ranks]:
    """The cases of the tests this session runs (`-k` selects fewer), compiled when a test first asks
    for them by two probe processes at once, the cases dealt between them by rank count (MindSpore's
    compilation is one thread: one process alone left a core idle for ~6 minutes of `make test`);
    none selected, no process."""
    selected = {tuple(item.callspec.params[k] for k in PARAMS) for item in request.session.items
                if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
                and all(k in item.callspec.params for k in PARAMS)}
    cases = [c for c in CASES if c in selected]
    if not cases:
        return {}
    folder = tmp_path_factory.mktemp("ir")  # each probe writes a folder per case and rank below it
    procs = [subprocess.Popen([sys.executable, str(PROBE), "--out", str(folder),
                               *(arg for c in part for arg in ("--case", ",".join(map(str, c))))],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for part in deal(cases, 2) if part]
    out: dict = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900 * len(cases))
        assert proc.returncode == 0, stderr[-3000:]
        out.update(json.loads(stdout))
    assert sorted(out) == sorted(case_key(*c) for c in cases)
    return {c: out[case_key(*c)] for c in cases}


def deal(cases: list[Case], n: int) -> list[list[Case]]:
    """`cases` in n parts of about equal rank counts (a case compiles one rank after another):
    largest first, each to the part with the fewest ranks so far."""
    parts: list[list[Case]] = [[] for _ in range(n)]
    for case in sorted(cases, key=lambda c: -c[0]):
        min(parts, key=lambda p: sum(c[0] for c in p)).append(case)
    return parts


def test_the_cases_are_dealt_into_parts_of_about_equal_rank_counts():
    parts = deal(CASES, 2)
    assert sorted(c for p in parts for c in p) == sorted(CASES)
    ranks = [sum(c[0] for c in p) for p in parts]
    assert max(ranks) - min(ranks) <= 2, ranks


@pytest.mark.parametrize(",".join(PARAMS), CASES)
@pytest.mark.parametrize("graph", ["fused", "accumulate", "apply"])
def test_every_rank_compiles_the_same_collectives_in_the_same_order(compiled, world, zero, tp, family, ep, graph):
    ranks = compiled[(world, zero, tp, family, ep)]
    assert sorted(ranks, key=int) == [str(r) for r in range(world)]
    reference = ranks["0"][graph]
    assert reference or (zero == 1 and graph == "accumulate"), f"no collective in rank 0's {graph} graph"
    case = f"world {world}, ZeRO-{zero}, tp {tp}, ep {ep}, {family}"
    for r in range(1, world):
        mine = ranks[str(r)][graph]
        kinds = lambda seq: {k: sum(1 for c in seq if c[0] == k) for k in COLLECTIVES}
        assert kinds(mine) == kinds(reference), f"rank {r} vs rank 0, {graph} graph, {case}"
        # kind, group kind, types and root inside the group (not the group's members: a dp group's
        # world ranks differ between tp ranks), in order
        assert [c[:5] for c in mine] == [c[:5] for c in reference], \
            f"rank {r} issues its collectives in another order, or with other roots, than rank 0 ({graph}, {case})"


@pytest.mark.parametrize(",".join(PARAMS), CASES)
def test_every_collective_names_a_group_of_its_rank_and_a_root_inside_it(compiled, world, zero, tp, family, ep):
    """What HCCL reads of each collective besides its kind: the group (this rank must be one of its
    members) and a Broadcast's root, the root's rank inside the group (the owner's world
    rank, `root_rank: 6` in a 4-member dp group, is HCCL_E_PARA, or a broadcast from the
    wrong member). A world-rank root fails here at tp 2 x dp 2 (dp_1 is ranks 1 and 3: root 3)."""
    for r, graphs in compiled[(world, zero, tp, family, ep)].items():
        for graph in ("fused", "accumulate", "apply"):
            for kind, group, _, _, root, members in graphs[graph]:
                where = f"rank {r}, {graph} graph, {kind} in {group}, world {world}, ZeRO-{zero}, tp {tp}, ep {ep}"
                assert members is not None and int(r) in members, f"{where}: a group this rank is not in"
                if kind == "Broadcast":
                    assert 0 <= int(root) < len(members), f"{where}: root_rank {root} outside a group of {len(members)}"
                else:
                    assert root == "", where


@pytest.mark.parametrize(",".join(PARAMS), CASES)
def test_every_rank_keeps_every_collective_the_step_issues(compiled, world, zero, tp, family, ep):
    """Identical lists, all pruned alike, would pass the comparison above: each graph must hold
    every collective the step's code issues (counted from its own tables by the probe)."""
    for r, graphs in compiled[(world, zero, tp, family, ep)].items():
        for graph in ("fused", "accumulate", "apply"):
            kept = [c[0] for c in graphs[graph]]
            assert len(kept) == graphs["traced"][graph], f"rank {r}, {graph} graph, world {world}, ZeRO-{zero}, tp {tp}, ep {ep}, {family}: {kept}"


def test_the_ir_reader_finds_kind_group_and_types():
    text = ('  %7(CNode_1$prev) = ReduceScatter(%6) primitive_attrs: {group: "hccl_world_group", rank_size: I64(4)}\n'
            "      : (<Tensor[Float32], (32768)>) -> (<Tensor[Float32], (8192)>)\n"
            "  %8(CNode_2$x) = AllReduceish(%7)\n"
            '  %9(CNode_3) = AllReduce(%8) primitive_attrs: {group: "g2", op: "sum"}\n'
            "      : (<Tensor[BFloat16], (4)>) -> (<Tensor[BFloat16], (4)>)\n")
    text += ('  %10(CNode_4) = Broadcast(%9) primitive_attrs: {root_rank: I64(1), group: "dp_1", no_eliminate: Bool(1)}\n'
             "      : (<Tuple[Tensor[Float32]]>) -> (<Tuple[Tensor[Float32]]>)\n")
    assert collectives_in_ir(text) == [
        ["ReduceScatter", "hccl_world_group", "<Tensor[Float32], (32768)>", "<Tensor[Float32], (8192)>", ""],
        ["AllReduce", "g2", "<Tensor[BFloat16], (4)>", "<Tensor[BFloat16], (4)>", ""],
        ["Broadcast", "dp_1", "<Tuple[Tensor[Float32]]>", "<Tuple[Tensor[Float32]]>", "1"]]
