"""Compile a tiny ZeRO-3 model's forward and backward as rank 0 of 2 on the Ascend path, in this CPU
process, and print what tests/step/test_zero3.py checks of the prefetch, from the compiled graph's IR:
for each gather (AllGather) in the graph's order, the gathers and matmuls it waits for (its
ancestors), for each matmul the gathers it waits for, and the reduce-scatters' order.

How the graph is had without an NPU or a second process, as tests/step/collective_probe.py does it:
`get_rank` / `get_group_size` replaced in comm_ops (the primitives read the world there);
`MS_DEV_PRECOMPILE_ONLY=1` compiles without running; `MS_DEV_SAVE_GRAPHS=1` with
`MS_DEV_DUMP_IR_PASSES=backend_pass` writes the IR after the last frontend pass, the graph the
backend is handed. Its nodes read `%7(name) = Prim(%3, %5, ...)`: the operands give the data and
Depend edges, from which the ancestors are computed.

Variants: `prefetch` (as shipped), `no-prefetch` (each block's chain from its own input: what the
checks must tell apart), `recompute` (layer recompute on every block, prefetch on).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

COMPUTE = ("MatMul", "BatchMatMul")
COLLECTIVES = ("AllGather", "ReduceScatter", "AllReduce")
_NODE = re.compile(r"^\s*%(\d+)\([^)]*\) = (?:PrimFunc_)?(\w+)\((.*)$")
_TYPES = re.compile(r"^\s*: \(")


def graph_of(text: str) -> tuple[dict[int, str], dict[int, list[int]]]:
    """Node id -> primitive name, node id -> operand node ids, of an IR dump's nodes. A node's
    operands may run over several lines (a constant tensor printed whole), up to its type line."""
    kind, args = {}, {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _NODE.match(line)
        if not m:
            continue
        body = m.group(3)
        for more in lines[i + 1:]:
            if _TYPES.match(more) or _NODE.match(more):
                break
            body += " " + more
        n = int(m.group(1))
        kind[n] = m.group(2)
        args[n] = [int(a) for a in re.findall(r"%(\d+)\b", body.split(" {instance")[0].split(" primitive_attrs")[0])]
    return kind, args


_CONST = re.compile(r"Tensor\(shape=\[([0-9, ]*)\], dtype=(\w+)")


def constants(text: str) -> list[list]:
    """[shape, dtype] of every tensor constant of more than one element in an IR dump (a constant
    is printed where it is used, `Tensor(shape=[64, 64], dtype=Float32, value=...)`)."""
    out = []
    for m in _CONST.finditer(text):
        shape = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
        n = 1
        for d in shape:
            n *= d
        if n > 1:
            out.append([shape, m.group(2)])
    return out


def readiness_order(kind: dict[int, str], args: dict[int, list[int]]) -> list[int]:
    """The nodes in a readiness (breadth-first topological) order: a node as soon as every operand
    has run, ties by the IR's numbering. A reconstruction of ms_backend's default kernel order on
    Ascend (`jit` option exec_order, default "bfs": mindspore/graph/api.py), not the backend's own
    (which needs an NPU to build): it shows what the graph's dependencies allow."""
    import collections

    users: dict[int, list[int]] = collections.defaultdict(list)
    waiting = {}
    for n in kind:
        ops_ = [a for a in args[n] if a in kind]
        waiting[n] = len(ops_)
        for a in ops_:
            users[a].append(n)
    ready = collections.deque(sorted(n for n, k in waiting.items() if k == 0))
    order = []
    while ready:
        n = ready.popleft()
        order.append(n)
        for u in sorted(users[n]):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return order


def summary(text: str) -> dict:
    kind, args = graph_of(text)
    ancestors: dict[int, set[int]] = {}
    for n in sorted(kind):  # the dump lists a node after its operands
        seen: set[int] = set()
        for a in args[n]:
            if a in kind:
                seen |= {a} | ancestors[a]
        ancestors[n] = seen
    gathers = [n for n in sorted(kind) if kind[n] == "AllGather"]
    scatters = [n for n in sorted(kind) if kind[n] == "ReduceScatter"]
    matmuls = [n for n in sorted(kind) if kind[n] in COMPUTE]
    index = {g: i for i, g in enumerate(gathers)}
    return {
        "gathers": [{"after_gathers": sorted(index[a] for a in ancestors[g] if a in index),
                     "after_matmuls": sorted(a for a in ancestors[g] if kind[a] in COMPUTE)} for g in gathers],
        "matmuls": {str(m): sorted(index[a] for a in ancestors[m] if a in index) for m in matmuls},
        "scatters_chained": all(scatters[i] in ancestors[scatters[i + 1]] for i in range(len(scatters) - 1)),
        "scatters": len(scatters),
        # matmuls that wait for a reduce-scatter: the backward's compute held up by the collectives
        "matmuls_after_scatters": sum(1 for m in matmuls if ancestors[m] & set(scatters)),
        # every collective after the one listed before it: one total order
        "total_order": all(c[i] in ancestors[c[i + 1]] for c in [[n for n in sorted(kind) if kind[n] in COLLECTIVES]]
                           for i in range(len(c) - 1)),
        "order": [kind[n] for n in sorted(kind) if kind[n] in COLLECTIVES],
        "constants": constants(text),
        # reduce-scatters placed before the last matmul in a readiness order (`readiness_order`)
        "scatters_before_last_matmul": (lambda o: sum(1 for n in o if kind[n] == "ReduceScatter"
                                                      and o.index(n) < max(o.index(m) for m in matmuls)))(readiness_order(kind, args)),
    }


def _loss_of(model):
    def loss(tokens):
        logits = model(tokens)
        return (logits * logits).sum()  # its gradient depends on the logits, as a loss's does
    return loss


def main(out: Path) -> None:
    os.environ.update({"GLOG_v": "3", "MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "backend_pass",
                       "MS_DEV_PRECOMPILE_ONLY": "1"})
    import mindspore as ms
    import numpy as np
    from mindspore.ops.operations import comm_ops

    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.zero3 import shard_model

    comm_ops.get_rank = lambda group=None: 0
    comm_ops.get_group_size = lambda group=None: 2
    cfg = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16))
    result = {}
    for variant in ("prefetch", "no-prefetch", "recompute"):
        model = Decoder(cfg, dtype="fp32", attention="math", device="ascend", seed=0)
        if variant == "recompute":
            for layer in model.layers:
                layer.recompute()
        shard_model(model, [p.name for p in model.trainable_params()], 2, 0, "ascend")
        if variant == "no-prefetch":
            for layer in model.layers:
                layer.prefetch = False
        step = ms.jit(ms.value_and_grad(_loss_of(model), None, model.trainable_params()))
        folder = out / variant
        os.environ["MS_DEV_SAVE_GRAPHS_PATH"] = str(folder)
        step(ms.Tensor(np.zeros((2, 16), np.int32)))
        (ir,) = folder.glob("*backend_pass*.ir")
        result[variant] = summary(ir.read_text(encoding="utf-8"))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]))
