"""Every rank compiles the same sequence of collectives (issue 38, item 1).

HCCL pairs the n-th collective of one rank with the n-th of every other: a rank whose graph lacks
one hangs the job, or sums the wrong tensors where the sizes happen to match. On the Ascend path the
reductions are not chained (train/step.py `_chain`), and MindSpore's frontend pass `jit_opt_a`
removed a collective whose result this rank does not use (a bucket or parameter another rank owns)
in spite of the primitive's `no_eliminate` attribute. Measured here before the fix, ZeRO-2 at world
8: the fused graph traced 30 collectives and kept 21 on ranks 0-5, 22 on ranks 6-7 (accumulate:
14 traced, 5 or 6 kept); at world 2 every rank kept all of them, in another order. The CPU path chains every collective, so no run on CPU
could see it: here the real step is compiled for each rank of worlds 2, 4 and 8 with the Ascend
path's choices (tests/collective_probe.py), and each rank's ordered list of collectives — kind,
group, input and output types and shapes — is compared, for the fused graph and for the
accumulate / apply pair.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.collective_probe import collectives_in_ir

pytestmark = pytest.mark.slow  # 34 rank compilations in subprocesses (24 without tensor parallel: about 4 minutes on 2 cores)

PROBE = Path(__file__).with_name("collective_probe.py")
ROOT = PROBE.parents[1]
# ZeRO-2 (the shipped 910B configs) at every world; ZeRO-1 (whose replicated buckets an owner alone
# reads after the reduction) at one; ZeRO-3 (gathers and reduce-scatters inside the model's graph,
# ordered by the data flow alone on Ascend: train/zero3.py) at two.
# Tensor parallel (train/tp.py): tp 2 alone (the tp group is the world), and tp 2 x dp 2 with ZeRO-1
# and ZeRO-2 (named tp and dp groups, the tp all-reduces inside the model's graph).
# (world, ZeRO stage, tp)
CASES = [(2, 2, 1), (4, 2, 1), (8, 2, 1), (4, 1, 1), (2, 3, 1), (4, 3, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[int, int, int], dict[str, dict[str, list[list[str]]]]]:
    """Each case's compilations, run when a test first asks for them (so `-k` selects cases)."""
    class Cases(dict):
        def __missing__(self, case: tuple[int, int, int]) -> dict[str, dict[str, list[list[str]]]]:
            world, zero, tp = case
            folder = tmp_path_factory.mktemp(f"ir-w{world}-z{zero}-tp{tp}")
            proc = subprocess.run([sys.executable, str(PROBE), "--world", str(world), "--zero", str(zero), "--tp", str(tp),
                                   "--out", str(folder)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            self[case] = json.loads(proc.stdout)
            return self[case]
    return Cases()


@pytest.mark.parametrize("world, zero, tp", CASES)
@pytest.mark.parametrize("graph", ["fused", "accumulate", "apply"])
def test_every_rank_compiles_the_same_collectives_in_the_same_order(compiled, world, zero, tp, graph):
    ranks = compiled[(world, zero, tp)]
    assert sorted(ranks, key=int) == [str(r) for r in range(world)]
    reference = ranks["0"][graph]
    assert reference or (zero == 1 and graph == "accumulate"), f"no collective in rank 0's {graph} graph"
    for r in range(1, world):
        mine = ranks[str(r)][graph]
        kinds = lambda seq: {k: sum(1 for c in seq if c[0] == k) for k in ("AllReduce", "ReduceScatter", "AllGather", "Broadcast")}
        assert kinds(mine) == kinds(reference), f"rank {r} vs rank 0, {graph} graph, world {world}, ZeRO-{zero}"
        assert mine == reference, f"rank {r} issues its collectives in another order than rank 0 ({graph}, world {world})"


@pytest.mark.parametrize("world, zero, tp", CASES)
def test_every_rank_keeps_every_collective_the_step_issues(compiled, world, zero, tp):
    """Identical lists, all pruned alike, would pass the comparison above: each graph must hold
    every collective the step's code issues (counted from its own tables by the probe)."""
    for r, graphs in compiled[(world, zero, tp)].items():
        for graph in ("fused", "accumulate", "apply"):
            kept = [c[0] for c in graphs[graph]]
            assert len(kept) == graphs["traced"][graph], f"rank {r}, {graph} graph, world {world}, ZeRO-{zero}: {kept}"


def test_the_ir_reader_finds_kind_group_and_types():
    text = ('  %7(CNode_1$prev) = ReduceScatter(%6) primitive_attrs: {group: "hccl_world_group", rank_size: I64(4)}\n'
            "      : (<Tensor[Float32], (32768)>) -> (<Tensor[Float32], (8192)>)\n"
            "  %8(CNode_2$x) = AllReduceish(%7)\n"
            '  %9(CNode_3) = AllReduce(%8) primitive_attrs: {group: "g2", op: "sum"}\n'
            "      : (<Tensor[BFloat16], (4)>) -> (<Tensor[BFloat16], (4)>)\n")
    assert collectives_in_ir(text) == [
        ["ReduceScatter", "hccl_world_group", "<Tensor[Float32], (32768)>", "<Tensor[Float32], (8192)>"],
        ["AllReduce", "g2", "<Tensor[BFloat16], (4)>", "<Tensor[BFloat16], (4)>"]]


# ZeRO-3 with the families whose small weights are gathered after another gather's result (Qwen2's
# q/k/v bias after its weight, Qwen3's k_norm after q_norm's output: train/zero3.py), at world 2.
FAMILY_CASES = ["qwen2", "qwen3"]


@pytest.fixture(scope="module")
def compiled_family(tmp_path_factory) -> dict[str, dict[str, dict[str, list[list[str]]]]]:
    class Cases(dict):
        def __missing__(self, family: str) -> dict[str, dict[str, list[list[str]]]]:
            folder = tmp_path_factory.mktemp(f"ir-w2-z3-{family}")
            proc = subprocess.run([sys.executable, str(PROBE), "--world", "2", "--zero", "3", "--family", family, "--out", str(folder)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            self[family] = json.loads(proc.stdout)
            return self[family]
    return Cases()


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_zero3_families_compile_the_same_collectives_on_every_rank_and_keep_them_all(compiled_family, family):
    ranks = compiled_family[family]
    for graph in ("fused", "accumulate", "apply"):
        assert ranks["0"][graph] == ranks["1"][graph], f"{family}, {graph} graph: rank 1 differs from rank 0"
        for r, graphs in ranks.items():
            assert len(graphs[graph]) == graphs["traced"][graph], f"{family}, rank {r}, {graph} graph"
