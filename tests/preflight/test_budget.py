"""One budget below plan and run: `train`, `plan` and `report` show the same steps, warm-up, lr and
batch split for a config, including a short run whose auto warm-up is capped at a tenth of it
(plan and report take it from the budget, not a warm-up of their own)."""
from __future__ import annotations

import json
import math

import pytest

from mspretrain import budget
from mspretrain.cli import main
from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.forensics.report_summary import summarize
from mspretrain.schedule import auto_warmup_steps
from mspretrain.train.build import build_trainer
from tests.conftest import TINY

AUTO = 'schedule.warmup_steps="auto"'
CASES = {
    "short": [AUTO, "train.max_steps=20"],  # far below a fifth of one pass: the cap decides
    "long": [AUTO, "train.max_steps=100000"],
    "tokens": [AUTO, "train.max_tokens=40000"],  # ceil(40000 / 128) = 313 steps
    "first_of_both": [AUTO, "train.max_steps=50", "train.max_tokens=40000"],
    "accumulation_sqrt": [AUTO, "train.max_steps=30", "train.micro_batch=2", "optim.lr_scaling=sqrt"],
    "explicit": ["schedule.warmup_steps=3", "train.max_steps=20"],
}


@pytest.fixture(scope="module")
def data_tokens(tiny_data) -> int:
    return json.loads((tiny_data / "manifest.json").read_text())["tokens"]["train"]


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_plan_and_report_agree(case, tiny_data, data_tokens, tmp_path, capsys):
    over = CASES[case]
    cfg = cfgmod.load(TINY, over)
    run = tmp_path / "run"
    t = build_trainer(cfg, tiny_data, run, log=lambda s: None)  # built, not trained: config.toml and run_meta.json
    t.close()
    ran = (t.total_steps, t.schedule.warmup, t.schedule.lr, t.loader.batch_size, t.accum_steps)

    assert main(["plan", "--config", str(TINY), "--data", str(tiny_data), "--json", *over]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["steps"], plan["warmup_steps"], plan["lr"], plan["micro_batch"], plan["accumulation"]) == ran
    assert plan["tokens_source"] == "config"

    s = summarize(run)
    assert (s["budget_steps"], s["warmup"]) == ran[:2]

    # and all of them equal the rule, computed here by hand
    steps = min(x for x in (cfg.train.max_steps, math.ceil(cfg.train.max_tokens / 128) if cfg.train.max_tokens else 0) if x)
    rule = math.ceil(0.02 * data_tokens / (4 * 32))
    warmup = min(rule, steps // 10) if cfg.schedule.warmup_steps == "auto" else 3
    lr = 1e-3 * (math.sqrt(4 / 32) if cfg.optim.lr_scaling == "sqrt" else 1)
    assert ran == (steps, warmup, pytest.approx(lr), 2 if cfg.train.micro_batch else 4, 2 if cfg.train.micro_batch else 1)
    if case == "short":  # the case plan and report got wrong: the uncapped rule is longer than the run's tenth
        assert rule > warmup == 2


def test_derive_without_a_budget_and_with_an_explicit_one():
    cfg = cfgmod.load(None, ["model.vocab_size=100"])
    b = budget.derive(cfg, world=2)
    assert (b.steps, b.warmup, b.tokens_source, b.micro_batch, b.accumulation) == (None, None, "none", 4, 1)
    b = budget.derive(cfg, world=1, data_tokens=51200)  # no budget set: one pass over the data
    assert (b.steps, b.tokens, b.tokens_source) == (100, 51200, "data dir")
    b = budget.derive(cfg, tokens=5120, data_tokens=10**9)  # auto warm-up from the data, capped at a tenth of 10
    assert (b.steps, b.warmup, b.tokens_source) == (10, 1, "--tokens") and auto_warmup_steps(10**9, 8 * 64) > 1
    # a budget that is not a whole number of steps rounds up (ceil): the run trains at least the tokens asked for
    assert budget.derive(cfg, tokens=5121, data_tokens=10**9).steps == 11
    assert budget.derive(cfg, world=1, data_tokens=51201).steps == 101
    with pytest.raises(UserError, match="not divisible by 3 ranks"):
        budget.derive(cfg, world=3)
    with pytest.raises(UserError, match="not shorter than the run"):
        budget.derive(cfgmod.load(None, ["train.max_steps=5", "schedule.warmup_steps=5"]))


def test_split_positions_round_trip():
    """Every sample of a step has one (rank, row), and the rows of all ranks cover the step once."""
    for micro, accum, world in ((1, 1, 1), (2, 3, 1), (1, 2, 4), (3, 2, 2)):
        seen = set()
        for rank in range(world):
            for row in range(micro * accum):
                p = budget.position_of_row(row, rank=rank, micro=micro, world=world)
                assert budget.row_of_position(p, micro=micro, world=world) == (rank, row)
                seen.add(p)
        assert seen == set(range(budget.step_samples(micro, accum, world)))
    # micro 2 x 2 ranks: micro-batch 0 is positions 0..3, rank 1 holds 1 and 3
    assert [budget.position_of_row(k, rank=1, micro=2, world=2) for k in range(4)] == [1, 3, 5, 7]


# Tokens per step and the batch split have one home (budget.py). A product of global_batch and
# seq_len, a floor division of global_batch, or micro-batch x world anywhere else rebuilds them.
# data/loader.py: its `world_micro_batch` (batch_size x world) is the loader's own definition.
# preflight/plan.py: the parallel-plan work owns that file (its `gb * seq`); remove the entry with it.
SPLIT_OK = {"mspretrain/data/loader.py": 1, "mspretrain/preflight/plan.py": 1}


def _leaves(node, op) -> list[str]:
    import ast

    if isinstance(node, ast.BinOp) and isinstance(node.op, op):
        return _leaves(node.left, op) + _leaves(node.right, op)
    return [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else []


def test_tokens_per_step_and_the_split_are_derived_only_in_budget():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found: dict[str, list[str]] = {}
    for path in sorted([*(root / "mspretrain").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel == "mspretrain/budget.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.BinOp):
                continue
            names = set(_leaves(node, ast.Mult)) if isinstance(node.op, ast.Mult) else set()
            if isinstance(node.op, ast.FloorDiv) and {"global_batch", "gb"} & set(_leaves(node.left, ast.FloorDiv)) \
                    or {"global_batch", "gb"} & names and {"seq_len", "seq"} & names \
                    or {"micro", "micro_batch", "batch_size", "mb"} & names and "world" in names:
                found.setdefault(rel, []).append(f"{rel}:{node.lineno}")
    assert {k: len(v) for k, v in found.items()} == SPLIT_OK, found
