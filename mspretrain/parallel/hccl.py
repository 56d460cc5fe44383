"""HCCL topology files for Ascend clusters (written here, consumed only on Ascend).

Two files, both plain JSON:
- a **rank table** (HCCL's `RANK_TABLE_FILE`, version 1.0): the servers, their NPUs, each NPU's
  device IP and global rank. msrun builds its cluster dynamically and does not need it; the
  classic `mindspore.communication.init()` launch without msrun does.
- a **chip-group plan** after the field report: ranks grouped by chip (2 chips × 4 devices on a
  board), so a two-level all-reduce can reduce inside a chip over the on-chip links first.
  That 2 × 4 grouping describes the older Atlas training servers (first-generation Ascend 910,
  two groups of four NPUs on HCCS). We found no source confirming it for the Atlas 800T A2
  (910B): there the grouping is unverified and may buy nothing. Use `per_chip` to match your
  server's documented topology.
  The field report feeds such a file to HCCL as a "whitelist"; HCCL's real `HCCL_WHITELIST_FILE`
  is an IP allow-list (`{"host_ip": [...]}`), so we write the groups as a plan for
  `mindspore.communication.create_group` and the IP list separately, under their true names.
Only the file formats are tested on CPU; their effect is Ascend's.
"""
from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from mspretrain.errors import UserError


def _check_ip(ip: str, what: str) -> str:
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise UserError(f"{what} {ip!r} is not an IP address", "give dotted IPv4 addresses, e.g. 192.168.100.101") from None
    return ip


def rank_table(servers: list[dict]) -> dict:
    """servers = [{"host_ip": "...", "device_ips": ["...", ...]}, ...] in rank order."""
    if not servers:
        raise UserError("no servers given for the rank table", "list at least one server with its device IPs")
    per = {len(s.get("device_ips", [])) for s in servers}
    if len(per) != 1 or 0 in per:
        raise UserError("every server must list the same, non-zero number of device IPs", "e.g. 8 device IPs per 910B server")
    rank = 0
    out = []
    for s in servers:
        devices = []
        for dev_id, ip in enumerate(s["device_ips"]):
            devices.append({"device_id": str(dev_id), "device_ip": _check_ip(ip, "device IP"), "rank_id": str(rank)})
            rank += 1
        host = _check_ip(s["host_ip"], "host IP")
        out.append({"server_id": host, "device": devices, "host_nic_ip": "reserve"})
    return {"version": "1.0", "server_count": str(len(servers)), "server_list": out, "status": "completed"}


def chip_groups(n_devices: int = 8, per_chip: int = 4) -> list[dict]:
    """The field report's grouping: consecutive ranks share a chip (2 chips x 4 devices per board,
    as on older Atlas training servers; unverified for the Atlas 800T A2, see the module doc)."""
    if n_devices <= 0 or per_chip <= 0 or n_devices % per_chip:
        raise UserError(f"{n_devices} devices do not split into chips of {per_chip}", "use e.g. 8 devices with 4 per chip")
    return [{"group_name": f"chip{c}", "ranks": list(range(c * per_chip, (c + 1) * per_chip)), "group_type": "chip"}
            for c in range(n_devices // per_chip)]


def write_topology(out_dir: str | Path, servers: list[dict], per_chip: int = 4) -> list[Path]:
    """rank_table.json, chip_groups.json and hccl_whitelist.json (host IPs) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = rank_table(servers)
    n = sum(len(s["device_ips"]) for s in servers)
    files = {
        "rank_table.json": table,
        "chip_groups.json": {"groups": chip_groups(n, per_chip)},
        "hccl_whitelist.json": {"host_ip": [s["host_ip"] for s in servers]},
    }
    paths = []
    for name, obj in files.items():
        p = out / name
        p.write_text(json.dumps(obj, indent=2), encoding="utf-8")
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------- HCCL_BUFFSIZE
# CANN (environment variable reference, HCCL_BUFFSIZE): "the buffer size shared between two NPUs,
# unit MB, default 200"; each communicator holds 2 x HCCL_BUFFSIZE of HBM used by HCCL alone (send and
# receive); "for collective communication operators, when the data size exceeds HCCL_BUFFSIZE
# performance may degrade; set HCCL_BUFFSIZE larger than the data size". Ascend's PyTorch tuning guide
# (hccl_buffer_size) sizes it per communicator as the largest collective / rank size for pure SDMA
# traffic (the NPUs of one server) and the whole largest collective with RDMA (across servers).
# `mspretrain launch` sets it from the plan's largest collective (parallel/layout.py
# `largest_bucket_bytes`), which bucket sizes alone cannot bound: a ZeRO bucket holds at least one
# parameter per rank (768 MB for Llama-2 7B at 8 ranks whatever the cap) and a split parameter
# crosses in one collective (Qwen2.5-7B's lm_head: 2,079 MB). Unverified on a 910B: the speed-up, and
# whether MindSpore 2.10's HCCL communicators read the variable in graph mode (CANN lists dynamic
# shapes and HCCL's C API as its scenarios).
HCCL_BUFFSIZE_ENV = "HCCL_BUFFSIZE"
HCCL_BUFFSIZE_DEFAULT_MB = 200
# At most 1 GB (2 GB a communicator with send and receive): what the 910B templates' pool cap (58 of
# 64 GB) leaves beside the driver's 4 GB (device.py HBM_RESERVE_GB). Larger collectives still run,
# in several passes through the buffer.
HCCL_BUFFSIZE_MAX_MB = 1024
# The HBM outside the pool that HCCL's buffers share: 64 GB less the 58 GB pool and the driver's 4 GB.
HCCL_ROOM_MB = 2 * HCCL_BUFFSIZE_MAX_MB
NPUS_PER_SERVER = 8  # Atlas 800T A2: a plan of more devices crosses servers (RDMA)


def buffsize_mb(largest_bytes: int, ranks_per_node: int, nodes: int, cap_mb: int = HCCL_BUFFSIZE_MAX_MB) -> int:
    """HCCL_BUFFSIZE (MB = 2^20 bytes) for a step whose largest collective moves `largest_bytes`:
    that divided by the ranks of a server within one server, whole across servers; never below
    HCCL's default, never above `cap_mb`."""
    per = largest_bytes if nodes > 1 else largest_bytes / max(1, ranks_per_node)
    need = -(-int(per) // 2**20)  # ceil
    return min(max(need, HCCL_BUFFSIZE_DEFAULT_MB), max(cap_mb, HCCL_BUFFSIZE_DEFAULT_MB))


def communicators(comms: list[tuple[str, int, int, int]]) -> list[dict]:
    """Each communicator's buffer, from (name, largest collective in bytes, its ranks in one server,
    the servers it spans), the world's first. Every communicator takes 2 x its buffer of HBM
    outside the pool (CANN, HCCL_BUFFSIZE), so the room (HCCL_ROOM_MB) is shared: each is capped
    at HCCL_ROOM_MB / (2 x the communicators), never below HCCL's default. The world's is what
    `launch` exports as HCCL_BUFFSIZE (the default of every communicator); the tp and dp groups'
    go to `create_group` (step/tp.py make_mesh; the ep and edp groups', step/ep.py expert_mesh;
    `GROUP_BUFFSIZE_ENV`)."""
    cap = HCCL_ROOM_MB // (2 * max(1, len(comms)))
    return [{"name": name, "largest_bytes": int(largest), "buffsize_mb": buffsize_mb(largest, per_node, nodes, cap)}
            for name, largest, per_node, nodes in comms]


# `launch` passes the groups' buffers to the workers: "tp=MB,dp=MB" (tensor parallel), "ep=MB,edp=MB"
# (expert parallel, preflight/plan.py `ep_communicators`)
GROUP_BUFFSIZE_ENV = "MSPRETRAIN_HCCL_GROUP_MB"
GROUP_KINDS = ("tp", "dp", "ep", "edp")


def group_buffsize_env(comms: list[dict]) -> str:
    return ",".join(f"{c['name']}={c['buffsize_mb']}" for c in comms if c["name"] != "world")


def group_buffsize(kind: str, env: dict[str, str]) -> int | None:
    """The buffer (MB) `launch` planned for the `kind` ("tp" / "dp" / "ep" / "edp") group, or None when it is not
    set (the group then takes HCCL_BUFFSIZE, HCCL's default for every communicator). A value that
    is not `launch`'s "tp=MB,dp=MB" or "ep=MB,edp=MB" (set by hand) is one line naming the variable, as every other
    MSPRETRAIN_* hook (errors.env_number), not a silent fallback to another buffer."""
    text = env.get(GROUP_BUFFSIZE_ENV, "").strip()
    found: int | None = None
    for part in text.split(",") if text else []:
        name, eq, value = (x.strip() for x in part.partition("="))
        if not (eq and name in GROUP_KINDS and value.isascii() and value.isdigit() and 0 < int(value) <= HCCL_ROOM_MB):
            raise UserError(f"{GROUP_BUFFSIZE_ENV}={text!r}: {part.strip()!r} is not tp=MB, dp=MB, ep=MB or edp=MB with MB in 1..{HCCL_ROOM_MB}",
                            f"unset {GROUP_BUFFSIZE_ENV} (`mspretrain launch` sets it from the plan) or give e.g. tp=200,dp=200")
        if name == kind:
            found = int(value)
    return found
