"""`doctor`: green on this machine; each check flags what it should (numpy 2, NFS, disk, GLOG, CANN)."""
from __future__ import annotations

import collections

import pytest

from mspretrain.cli import main
from mspretrain.config import schema as cfgmod
from mspretrain.preflight import doctor


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


def _fake_npu_smi(tmp_path, monkeypatch, body: str, out: bytes = b"") -> None:
    """An `npu-smi` that runs `body` (a shell script; $OUT is a file holding `out`), found by `shutil.which`."""
    (tmp_path / "out").write_bytes(out)
    body = body.replace("$OUT", str(tmp_path / "out"))
    exe = tmp_path / "npu-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    monkeypatch.setattr("shutil.which", lambda name, **kw: str(exe))


CHIP = "        NPU ID                         : 0\n        HBM Capacity(MB)               : {mb}\n        HBM Usage Rate(%)              : 3\n"


def test_npu_smi_hbm_is_parsed_per_chip(tmp_path, monkeypatch):
    """`npu-smi info -t usages -i 0` as the driver prints it: one "HBM Capacity(MB)" line per chip,
    the smallest bounds the pool; the arguments are the ones the docstring names."""
    from mspretrain import device

    _fake_npu_smi(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/argv\ncat $OUT', (CHIP.format(mb=65536) + CHIP.format(mb=32768)).encode())
    assert device.npu_hbm_bytes() == 32 * GiB and (tmp_path / "argv").read_text().split() == ["info", "-t", "usages", "-i", "0"]
    _fake_npu_smi(tmp_path, monkeypatch, "echo no such field")
    assert device.npu_hbm_bytes() is None
    _fake_npu_smi(tmp_path, monkeypatch, "cat $OUT; exit 3", CHIP.format(mb=32768).encode())
    assert device.npu_hbm_bytes() is None  # npu-smi failed: its output is not trusted
    monkeypatch.setattr("shutil.which", lambda name, **kw: None)
    assert device.npu_hbm_bytes() is None  # no npu-smi: a CPU box


@pytest.mark.parametrize("body, out, want", [
    ("cat $OUT", b"\xff\xfe bad bytes\n" + CHIP.format(mb=32768).encode() + b"\x80\n", 32 * GiB),  # not UTF-8: read, not a traceback
    ("exec cat /dev/zero", b"", None),  # endless output: killed at the cap, not gigabytes
    ("exec yes 'HBM Capacity(MB) : 32768'", b"", None),  # endless lines that match
    ("exec sleep 30", b"", None),  # a wedged driver: killed at the timeout
    ("cat $OUT; exec sleep 30", CHIP.format(mb=32768).encode(), None),  # printed, then wedged
    ("cat $OUT", b"HBM Capacity(MB) : 99999999999999999999\n", None),  # digits past any size: no match
])
def test_npu_smi_output_is_read_bounded_in_memory_and_time(tmp_path, monkeypatch, body, out, want):
    import resource
    import time

    from mspretrain import device

    _fake_npu_smi(tmp_path, monkeypatch, body, out)
    t0, rss0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert device.npu_hbm_bytes(timeout_s=2.0) == want
    assert time.monotonic() - t0 < 10  # the 2 s timeout, plus the kill
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 * 1024  # KB: far from gigabytes


@pytest.mark.parametrize("mb", [0, 1, 3000, 5_000_000, 999_999_999])
def test_doctor_and_launch_do_not_call_an_absurd_hbm_ok(tmp_path, monkeypatch, mb):
    """npu-smi reporting 0 MB or 10^9 MB of HBM: a warning naming the figure (the pool cap is
    unchecked), never ok and never a "does not fit" failure that blocks launch."""
    _fake_npu_smi(tmp_path, monkeypatch, "cat $OUT", CHIP.format(mb=mb).encode())
    for cfg in (cfgmod.load(None, ["device.target=ascend"]), cfgmod.load(None, ["device.target=ascend", "device.max_device_memory=26"])):
        f = by_name(doctor.check_device_memory(cfg))["device memory"]
        assert f.status == "warn" and "which no NPU has" in f.detail, f
