"""`doctor`: green on this machine; each check flags what it should (numpy 2, NFS, disk, GLOG, CANN)."""
from __future__ import annotations

import collections

import pytest

from mspretrain import config as cfgmod
from mspretrain.cli import main
from mspretrain.ops import doctor


def by_name(findings):
    return {f.name: f for f in findings}


def test_doctor_runs_green_on_this_machine(tmp_path, capsys):
    findings = doctor.run_checks(tmp_path, cfgmod.Config())
    assert not [f for f in findings if f.status == "fail"], doctor.format_findings(findings)
    names = by_name(findings)
    for name in ("python", "numpy", "mindspore", "ascend", "msrun", "threads", "native logs", "disk", "memory",
                 "run dir filesystem", "cpu isolation", "device memory"):
        assert name in names, name
    assert "CPU" in names["mindspore"].detail
    assert main(["doctor", "--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 fail" in out and "[ ok ] numpy" in out


def test_numpy_2_is_a_fail(monkeypatch):
    import numpy

    monkeypatch.setattr(numpy, "__version__", "2.1.0")
    f = by_name(doctor.check_python_stack())["numpy"]
    assert f.status == "fail" and "numpy<2" in f.fix


def test_network_filesystem_warns(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(f"27 1 254:0 / / rw - ext4 /dev/vda rw\n40 27 0:50 / {tmp_path} rw - nfs4 filer:/x rw\n")
    f = by_name(doctor.check_run_dir(tmp_path / "run", cfgmod.Config(), mountinfo=table))["run dir filesystem"]
    assert f.status == "warn" and "nfs4" in f.detail


def test_disk_too_small_for_one_checkpoint_fails(tmp_path, monkeypatch, capsys):
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: Usage(10, 10, 1000))
    assert by_name(doctor.check_run_dir(tmp_path, cfgmod.Config()))["disk"].status == "fail"
    assert main(["doctor", "--run", str(tmp_path)]) == 1
    assert "[fail] disk" in capsys.readouterr().out


def test_noisy_glog_and_oversubscribed_threads_warn(monkeypatch):
    monkeypatch.setenv("GLOG_v", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "512")
    f = by_name(doctor.check_launcher_and_threads(cfgmod.Config()))
    assert f["native logs"].status == "warn" and f["threads"].status == "warn"


def test_ascend_versions_read_from_install_tree(tmp_path, monkeypatch):
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "version.info").write_text("Version=24.1.rc2\nascendhal_version=7.35.19\n")
    tk = tmp_path / "ascend-toolkit" / "latest" / "aarch64-linux"
    tk.mkdir(parents=True)
    (tk / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    monkeypatch.delenv("ASCEND_OPP_PATH", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    f = by_name(doctor.check_ascend(tmp_path))
    assert f["ascend driver"].detail == "24.1.rc2" and f["CANN toolkit"].detail == "8.0.RC3"
    assert f["CANN environment"].status == "warn"
    assert by_name(doctor.check_ascend(tmp_path / "absent"))["ascend"].status == "ok"


@pytest.mark.parametrize("quota,status", [(0.0, "ok"), (60.0, "warn")])
def test_cgroup_check_warns_only_when_a_quota_is_asked(tmp_path, quota, status):
    cfg = cfgmod.load(None, [f"device.cpu_quota={quota}"])
    assert doctor.check_cgroup(cfg, cgroup_root=tmp_path / "none")[0].status == status


# --------------------------------------------------------------------------- a 910B4 before the pool is set

GiB = 2**30


@pytest.mark.parametrize("hbm, pool, status", [
    (64 * GiB, 0, "ok"),  # a 910B1-B3: the templates' 58 GB (the default) fit
    (32 * GiB, 0, "fail"),  # a 910B4: 58 GB does not
    (32 * GiB, 26, "ok"),  # ... with the pool the fix names
    (None, 0, "warn"),  # npu-smi missing or unreadable: unchecked, said so
])
def test_a_910b4_is_found_before_the_58_gb_pool_is_set(monkeypatch, hbm, pool, status):
    from mspretrain import device

    monkeypatch.setattr(device, "npu_hbm_bytes", lambda npu=0, **kw: hbm)  # the device query, no NPU here
    cfg = cfgmod.load(None, ["device.target=ascend", f"device.max_device_memory={pool}"])
    f = by_name(doctor.check_device_memory(cfg))["device memory"]
    assert f.status == status, f
    if status == "fail":
        assert "58 GB does not fit this NPU's 32.0 GB" in f.detail and "910B4" in f.detail
        assert f.fix.startswith("set device.max_device_memory=26 (GB)")
    # a CPU run has no pool, whatever the device says
    assert by_name(doctor.check_device_memory(cfgmod.load(None, ["device.target=cpu"])))["device memory"].status == "ok"


def test_doctor_runs_the_device_memory_check(tmp_path, monkeypatch):
    from mspretrain import device

    monkeypatch.setattr(device, "npu_hbm_bytes", lambda npu=0, **kw: 32 * GiB)
    f = by_name(doctor.run_checks(tmp_path, cfgmod.load(None, ["device.target=ascend"])))["device memory"]
    assert f.status == "fail" and "910B4" in f.detail


def test_npu_smi_hbm_is_parsed_per_chip(monkeypatch):
    """`npu-smi info -t usages -i 0` as the driver prints it: one "HBM Capacity(MB)" line per chip."""
    import subprocess
    from types import SimpleNamespace

    from mspretrain import device

    seen = []
    out = ("        NPU ID                         : 0\n        Chip Count                     : 1\n\n"
           "        HBM Capacity(MB)               : 32768\n        HBM Usage Rate(%)              : 3\n")

    def run(argv, **kw):
        seen.append(argv[1:])
        return SimpleNamespace(stdout=out, returncode=0)

    monkeypatch.setattr("shutil.which", lambda name, **kw: "/usr/local/bin/npu-smi")
    monkeypatch.setattr(subprocess, "run", run)
    assert device.npu_hbm_bytes() == 32 * GiB and seen == [["info", "-t", "usages", "-i", "0"]]
    out = "no such field"
    assert device.npu_hbm_bytes() is None
    monkeypatch.setattr("shutil.which", lambda name, **kw: None)
    assert device.npu_hbm_bytes() is None  # no npu-smi: a CPU box
