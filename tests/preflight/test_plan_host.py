"""The plan knows host memory, and `auto` plans for the machine it runs on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_auto_plans_for_this_machine_unless_devices_ask_for_a_cluster(capsys):
    from mspretrain.cli import main

    assert main(["plan", "--config", str(ROOT / "configs" / "demo.toml"), "model.vocab_size=8000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"] == "cpu" and "this machine" in plan["target_source"]  # no NPU on this box
    mem = plan["memory_bytes"]
    assert mem["cpu_backend"] > 0 and mem["process_peak"] > mem["peak"]  # the CPU terms are there
    assert main(["plan", "--config", str(ROOT / "configs" / "demo.toml"), "model.vocab_size=8000", "--devices", "8", "--json"]) == 0
    cluster = json.loads(capsys.readouterr().out)
    assert cluster["memory_bytes"]["cpu_backend"] == 0 and "process_peak" not in cluster["memory_bytes"]
    assert main(["plan", "--config", str(ROOT / "configs" / "demo.toml"), "model.vocab_size=8000"]) == 0
    assert "target     cpu (this machine (device.target = auto))" in capsys.readouterr().out
    # a cluster plan without a named target is an assumption, not "this machine"
    assert cluster["target"] == "auto" and cluster["target_source"] == "assumed"


def test_on_cpu_each_rank_is_compared_with_its_share_of_this_machines_ram(capsys):
    """On CPU the host is the device and the ranks on this machine share its RAM: a 24 GB box
    must not be told that two ranks of 9.6 GB fit in "64 GB usable" """
    import os

    from mspretrain.cli import main
    from mspretrain.preflight.plan import GB

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    for devices in (1, 2):
        assert main(["plan", "--config", str(ROOT / "configs" / "demo.toml"), "model.vocab_size=8000", "device.target=cpu",
                     "--devices", str(devices), "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["device_mem_gb"] == round(ram / devices, 1)
    # a model whose rank peak exceeds its share is refused in the plan's words
    assert main(["plan", "--config", str(ROOT / "configs" / "demo.toml"), "model.vocab_size=8000", "device.target=cpu",
                 "--devices", "2", "model.dim=4096", "model.n_layers=32", "model.n_heads=32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["memory_bytes"]["peak"] / GB > ram / 2 and plan["warnings"][0].startswith("WILL NOT FIT")


def test_host_section_of_the_7b_node():
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.presets import is_half_eligible, param_shapes
    from mspretrain.preflight.plan import GB, PROCESS_BASELINE_BYTES, make_plan

    cfg = cfgmod.load(ROOT / "configs" / "llama2-7b-910b.toml")
    plan = make_plan(cfg, devices=8, tokens=120_000_000_000, data_dir=None, tokens_per_s_per_device=None)
    h = plan["host_bytes"]
    shapes = param_shapes(cfgmod.resolve_model(cfg.model))
    sizes = [s[0] * (s[1] if len(s) > 1 else 1) for _, s in shapes]
    P = sum(sizes)
    assert h["model_init"] == 8 * 4 * max(sizes) < 4 * P  # at most one fp32 model per node (here 1/6 of one)
    masters = sum(n for (name, _), n in zip(shapes, sizes) if is_half_eligible(name))
    assert h["checkpoint_snapshot"] == 4 * P + 8 * P + 4 * masters
    assert h["loader_maps"] == 8 * 8 * 120_000_000_000 // 2048
    assert h["process_baseline"] == 8 * PROCESS_BASELINE_BYTES
    assert h["total"] == pytest.approx(sum(v for k, v in h.items() if k != "total"))
    assert 90 * GB < h["total"] < 130 * GB
    # the renamed reserve is still the same figure under its old JSON key
    assert plan["memory_bytes"]["framework_reserve"] == GB
