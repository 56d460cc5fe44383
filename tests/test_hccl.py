"""HCCL topology files: formats only (their effect is Ascend's)."""
import json

import pytest

from mspretrain.errors import UserError
from mspretrain.train import hccl


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
    whole (train/hccl.py); HCCL's default 200 MB is the floor, 1 GB (2 GB a communicator) the cap."""
    from mspretrain.train.hccl import HCCL_BUFFSIZE_DEFAULT_MB, HCCL_BUFFSIZE_MAX_MB, buffsize_mb

    MB = 2**20
    assert (HCCL_BUFFSIZE_DEFAULT_MB, HCCL_BUFFSIZE_MAX_MB) == (200, 1024)
    assert buffsize_mb(768 * MB, 8, 1) == 200  # Llama-2 7B's 768 MB bucket on one server: 96 MB a rank
    assert buffsize_mb(2079 * MB, 8, 1) == 260  # Qwen2.5-7B's split lm_head on one server
    assert buffsize_mb(768 * MB, 8, 2) == 768 and buffsize_mb(768 * MB + 1, 8, 2) == 769  # across servers: whole, rounded up
    assert buffsize_mb(1536 * MB, 8, 2) == 1024  # capped: the rest runs in passes through the buffer
    assert buffsize_mb(0, 8, 1) == 200
