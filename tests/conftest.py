"""Shared fixtures: a small Chinese corpus written by the tests themselves (no network), a data
dir prepared from it once per session, and the tiny config. Expensive things are session-scoped
because MindSpore compiles each new graph in seconds."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("GLOG_v", "3")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"

# ~150 common characters; "poems" are lines of 5 or 7 characters drawn with a bias so that
# there is structure to learn (each character prefers a few successors).
CHARS = ("春风明月江南山水花落日夜秋云天地人心来去长空白雪青松流年故乡归路远清香红叶梦中"
         "千里万家门前桥边柳色鸟声寒烟孤舟独坐高楼望断相思无限时光何处见君知我不同一生"
         "西东北上下古今朝暮雨晴寒暖冬夏新旧老少金玉石竹林泉溪湖海波浪星河宫阙城关")


def make_poems(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    chars = list(dict.fromkeys(CHARS))
    succ = {c: rng.choice(len(chars), 4, replace=False) for c in chars}
    poems = []
    for i in range(n):
        width = 5 if i % 2 else 7
        lines = []
        c = chars[rng.integers(len(chars))]
        for _ in range(4):
            line = []
            for _ in range(width):
                line.append(c)
                c = chars[succ[c][rng.integers(4)]]
            lines.append("".join(line))
        poems.append(f"第{i}首\n" + "，".join(lines[:2]) + "。\n" + "，".join(lines[2:]) + "。")
    return poems


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    p = d / "poems.txt"
    p.write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_cfg():
    from mspretrain import config as cfgmod

    return cfgmod.load(TINY)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_file, tiny_cfg) -> Path:
    from mspretrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare([str(corpus_file)], out, tiny_cfg.prepare, workers=1, log=lambda s: None)
    return out
