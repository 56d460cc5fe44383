"""HCCL topology files: formats only (their effect is Ascend's)."""
import json

import pytest

from mspretrain.errors import UserError
from mspretrain.parallel import hccl


def test_rank_table_and_chip_groups(tmp_path):
    servers = [{"host_ip": f"10.0.0.{s + 1}", "device_ips": [f"192.168.{s}.{d + 10}" for d in range(8)]} for s in range(2)]
    paths = hccl.write_topology(tmp_path, servers)
    table = json.loads((tmp_path / "rank_table.json").read_text())
    assert table["version"] == "1.0" and table["server_count"] == "2" and table["status"] == "completed"
    ranks = [int(d["rank_id"]) for s in table["server_list"] for d in s["device"]]
    assert ranks == list(range(16))
    assert table["server_list"][1]["device"][0] == {"device_id": "0", "device_ip": "192.168.1.10", "rank_id": "8"}
    groups = json.loads((tmp_path / "chip_groups.json").read_text())["groups"]
    assert [g["ranks"] for g in groups[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(groups) == 4
    assert json.loads((tmp_path / "hccl_whitelist.json").read_text()) == {"host_ip": ["10.0.0.1", "10.0.0.2"]}
    assert len(paths) == 3


def test_bad_topology_inputs():
    with pytest.raises(UserError, match="not an IP"):
        hccl.rank_table([{"host_ip": "node1", "device_ips": ["1.2.3.4"]}])
    with pytest.raises(UserError, match="same, non-zero"):
        hccl.rank_table([{"host_ip": "1.1.1.1", "device_ips": ["1.2.3.4"]}, {"host_ip": "1.1.1.2", "device_ips": []}])
    with pytest.raises(UserError, match="do not split"):
        hccl.chip_groups(6, 4)


def test_hccl_buffsize_holds_the_largest_collective_within_its_bounds():
    """Within a server a collective crosses the buffer in slices of data / ranks, across servers
    whole (parallel/hccl.py); HCCL's default 200 MB is the floor, 1 GB (2 GB a communicator) the cap."""
    from mspretrain.parallel.hccl import HCCL_BUFFSIZE_DEFAULT_MB, HCCL_BUFFSIZE_MAX_MB, buffsize_mb

    MB = 2**20
    assert (HCCL_BUFFSIZE_DEFAULT_MB, HCCL_BUFFSIZE_MAX_MB) == (200, 1024)
    assert buffsize_mb(768 * MB, 8, 1) == 200  # Llama-2 7B's 768 MB bucket on one server: 96 MB a rank
    assert buffsize_mb(2079 * MB, 8, 1) == 260  # Qwen2.5-7B's split lm_head on one server
    assert buffsize_mb(768 * MB, 8, 2) == 768 and buffsize_mb(768 * MB + 1, 8, 2) == 769  # across servers: whole, rounded up
    assert buffsize_mb(1536 * MB, 8, 2) == 1024  # capped: the rest runs in passes through the buffer
    assert buffsize_mb(0, 8, 1) == 200


def test_every_communicator_is_counted_and_shares_the_room_outside_the_pool():
    """Each communicator takes 2 x its buffer of HBM outside the pool; under tp x dp a
    rank has three (the world's, its tp group's, its dp group's), each capped at a third of the
    room; the groups' sizes reach `create_group` (GroupOptions, Ascend only)."""
    from mspretrain.parallel.hccl import GROUP_BUFFSIZE_ENV, communicators, group_buffsize, group_buffsize_env
    from mspretrain.step.tp import group_options

    MB = 2**20
    one = communicators([("world", 1536 * MB, 8, 2)])
    assert [c["buffsize_mb"] for c in one] == [1024]
    three = communicators([("world", 0, 8, 2), ("tp", 8 * 800 * MB, 8, 1), ("dp", 900 * MB, 1, 2)])
    assert [c["buffsize_mb"] for c in three] == [200, 341, 341]
    env = {GROUP_BUFFSIZE_ENV: group_buffsize_env(three)}
    assert env[GROUP_BUFFSIZE_ENV] == "tp=341,dp=341"
    assert group_buffsize("dp", env) == 341 and group_buffsize("tp", {}) is None
    for bad in ("tp=abc", "tp=0", "tp=99999", "tp", "mp=200", "tp=200,", "tp=²"):  # set by hand: one line, not ignored
        with pytest.raises(UserError, match=GROUP_BUFFSIZE_ENV):
            group_buffsize("tp", {GROUP_BUFFSIZE_ENV: bad})
    assert group_options("tp", "cpu", env) is None  # CPU: no HCCL, no options
    assert group_options("tp", "ascend", env).hccl_config == {"hccl_buffer_size": 341}
    assert group_options("dp", "ascend", {}) is None  # no plan: HCCL_BUFFSIZE applies


def _ascend_plan(config: str, *overrides: str, devices: int) -> dict:
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.plan import make_plan

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / config, list(overrides))
    return make_plan(cfg, devices=devices, tokens=10**9, data_dir=None, tokens_per_s_per_device=None)


def test_the_plans_largest_collective_is_the_gather_when_it_is_larger_than_the_reduction():
    """HCCL_BUFFSIZE must hold the largest collective of either kind. With fp16 gradients
    on the wire (precision.allreduce_dtype) the reductions move 2 bytes an element and the ZeRO
    AllGather of fp32 weights 4: the gather is the largest, and a buffer sized from the reductions
    alone is half of it."""
    plan = _ascend_plan("llama2-7b-910b.toml", "precision.dtype=fp16", "precision.loss_scale=dynamic",
                        "precision.allreduce_dtype=fp16", "precision.param_dtype=fp32", devices=16)
    from mspretrain.preflight.costs import memory_model  # noqa: F401  (the plan's layout is memory_model's)

    hc = plan["hccl"]
    red, gat = _layout_of(plan)
    assert gat > red and hc["largest_collective_bytes"] == gat
    assert hc["buffsize_mb"] == min(1024, -(-gat // 2**20))


def _layout_of(plan: dict) -> tuple[int, int]:
    """(largest reduction, largest gather) of the plan's config, from the step's own tables."""
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.costs import memory_model

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / "llama2-7b-910b.toml",
                      ["precision.dtype=fp16", "precision.loss_scale=dynamic", "precision.allreduce_dtype=fp16",
                       "precision.param_dtype=fp32"])
    _, layout = memory_model(cfgmod.resolve_model(cfg.model), cfg, devices=plan["devices"], micro=plan["micro_batch"],
                             accum=plan["accumulation"], zero=True, shard_grads=cfg.optim.shard_gradients, recompute=False,
                             flash=True, target="ascend")
    return layout.largest_bucket_bytes()


def test_zero3s_largest_collective_is_the_lm_head_gather_and_tp_counts_three_communicators():
    """Under ZeRO-3 the plan counted the largest collective as 0 MB (no bucket), so
    `launch` exported HCCL's default 200; it is the whole lm_head (Qwen2.5-7B: 152,064 x 3,584 in
    fp32, 2,079 MB). Tensor parallel 2 x dp 4 plans three communicators."""
    zero3 = _ascend_plan("qwen2.5-7b-zh-continue-910b.toml", "optim.shard_parameters=true", devices=8)["hccl"]
    assert zero3["largest_collective_bytes"] == 152_064 * 3_584 * 4 and zero3["buffsize_mb"] == 260
    tp = _ascend_plan("qwen2.5-7b-zh-continue-910b.toml", "parallel.tp=2", 'optim.split_mb="auto"', devices=8)
    names = [c["name"] for c in tp["hccl"]["communicators"]]
    assert names == ["world", "tp", "dp"] and tp["hccl"]["hbm_bytes"] == sum(2 * c["buffsize_mb"] * 2**20 for c in tp["hccl"]["communicators"])
    assert all(c["buffsize_mb"] <= 341 for c in tp["hccl"]["communicators"])
