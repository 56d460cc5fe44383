"""Fuzzing the readers of untrusted files: HF safetensors and config.json.

Property: whatever the bytes, the reader gives a correct load or one `UserError` whose message is
one line; never another exception, never a huge allocation. Mutations of a valid file: random
truncation, bit flips (mostly in the header), a rewritten length prefix, and header field swaps
(dtypes, shapes, offsets, the header's JSON type). A load that succeeds is compared with an
independent reference reader written here (plain json + numpy, bf16 widened by bit shift).
Hypothesis runs derandomized, so a failure reproduces on every machine."""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mspretrain.config.schema import Config, ModelConfig, validate
from mspretrain.errors import UserError
from mspretrain.model.hf import config_from_hf, config_to_hf, read_safetensors

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_NP = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U8": np.uint8}


def _valid_file() -> bytes:
    """A small safetensors file with fp32, fp16, bf16 and int tensors, built by hand."""
    rng = np.random.default_rng(0)
    tensors = {"a.f32": ("F32", rng.standard_normal((3, 4)).astype(np.float32).tobytes(), [3, 4]),
               "b.f16": ("F16", rng.standard_normal(5).astype(np.float16).tobytes(), [5]),
               "c.bf16": ("BF16", (rng.standard_normal((2, 3)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(), [2, 3]),
               "d.i32": ("I32", np.arange(4, dtype=np.int32).tobytes(), [2, 2])}
    header, data, off = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, (dtype, raw, shape) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


VALID = _valid_file()


def _reference(blob: bytes) -> dict[str, np.ndarray]:
    """Independent reader for a file the library accepted: the header's word, taken literally."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, meta in header.items():
        b, e = meta["data_offsets"]
        raw = data[b:e]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, _NP[meta["dtype"]])
            arr = arr.astype(np.float32) if arr.dtype.kind == "f" else arr
        out[name] = arr.reshape(meta["shape"])
    return out


def _check(tmp_path: Path, blob: bytes) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(blob)
    try:
        got = read_safetensors(p)
    except UserError as exc:
        assert "\n" not in exc.cause and "\n" not in exc.fix and exc.cause and exc.fix
        return
    ref = _reference(blob)
    assert got.keys() == ref.keys()
    for k in got:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        assert np.array_equal(got[k], ref[k], equal_nan=True), k


def test_the_valid_file_loads_exactly(tmp_path):
    got = read_safetensors(_write(tmp_path, VALID))
    assert got.keys() == _reference(VALID).keys() and got["c.bf16"].dtype == np.float32
    _check(tmp_path, VALID)


def _write(tmp_path: Path, blob: bytes) -> Path:
    p = tmp_path / "model.safetensors"
    p.write_bytes(blob)
    return p


@pytest.mark.parametrize("prefix", [2**62, 2**34, 2**64 - 1, 0, 7, len(VALID), len(VALID) - 8 + 1])
def test_lying_header_lengths(tmp_path, prefix):
    with pytest.raises(UserError):
        read_safetensors(_write(tmp_path, struct.pack("<Q", prefix) + VALID[8:]))


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b"7", b'"text"', b"null", b"{", b'{"x": 5}',
                                    b'{"x": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 16]}}',
                                    b'{"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4611686018427387904]}}',
                                    b'{"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}',
                                    b'{"x": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}',
                                    b'{"x": {"dtype": "Q9", "shape": [2, 2], "data_offsets": [0, 16]}}',
                                    b'{"x": {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]}}',
                                    b'{"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "__metadata__": [1]}'])
def test_malformed_headers(tmp_path, header):
    blob = struct.pack("<Q", len(header)) + header + bytes(16)
    with pytest.raises(UserError) as exc:
        read_safetensors(_write(tmp_path, blob))
    assert "\n" not in str(exc.value)


@SETTINGS
@given(cut=st.integers(0, len(VALID) - 1))
def test_fuzz_truncation(tmp_path, cut):
    _check(tmp_path, VALID[:cut])


@SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 7)), min_size=1, max_size=4),
       in_header=st.booleans())
def test_fuzz_bit_flips(tmp_path, flips, in_header):
    n = struct.unpack("<Q", VALID[:8])[0]
    b = bytearray(VALID)
    for pos, bit in flips:
        pos = pos % (8 + n) if in_header else pos  # most damage where the parser looks
        b[pos] ^= 1 << bit
    _check(tmp_path, bytes(b))


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=8), st.lists(st.integers(-2**63, 2**63), max_size=4),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                  st.sampled_from(["F32", "F16", "BF16", "I32", "U8", "F64", "I64", "BOOL", "F8_E4M3"]))


@SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(["a.f32", "b.f16", "c.bf16", "d.i32", "__metadata__"]),
                                st.sampled_from(["dtype", "shape", "data_offsets", "swap:dtype", "swap:shape", "swap:data_offsets",
                                                 "drop", "whole"]), _JUNK),
                      min_size=1, max_size=3),
       pad=st.integers(-3, 3))
def test_fuzz_header_field_swaps(tmp_path, edits, pad):
    n = struct.unpack("<Q", VALID[:8])[0]
    header = json.loads(VALID[8:8 + n])
    for name, field, junk in edits:
        entry = header.get(name)
        if field == "drop":
            header.pop(name, None)
        elif field == "whole" or not isinstance(entry, dict):
            header[name] = junk
        elif field.startswith("swap:"):  # the field of another tensor: right type, wrong place
            other = header.get("d.i32" if name != "d.i32" else "a.f32")
            key = field[5:]
            if isinstance(other, dict):
                entry[key] = other.get(key)
        else:
            entry[field] = junk
    h = json.dumps(header).encode()
    data = VALID[8 + n:]
    data = data[:len(data) + pad] if pad < 0 else data + bytes(pad)
    _check(tmp_path, struct.pack("<Q", len(h)) + h + data)


# --------------------------------------------------------------------------- config.json

VALID_CFG = config_to_hf(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=96,
                                     max_seq_len=128))
_KEYS = sorted(VALID_CFG) + ["rope_scaling", "rope_parameters", "head_dim", "num_key_value_heads"]
_CFG_JUNK = st.one_of(_JUNK, st.floats(min_value=-1e6, max_value=1e6), st.integers(-5, 5),
                      st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta"]),
                                      st.one_of(st.text(max_size=6), st.floats(), st.integers(-3, 3), st.none()), max_size=3))


def _check_cfg(hf: object) -> None:
    try:
        m = config_from_hf(hf, "config.json")
    except UserError as exc:
        assert "\n" not in exc.cause and "\n" not in exc.fix and exc.cause
        return
    # a correct load: a model config our own schema accepts, with the fields config.json gave
    validate(Config(model=m, train=Config().train.__class__(max_steps=1)))
    assert isinstance(hf, dict) and m.dim == hf["hidden_size"] and m.vocab_size == hf["vocab_size"]
    assert all(math.isfinite(x) and x > 0 for x in (m.rope_theta, m.norm_eps, m.init_std))


@SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(_KEYS), st.one_of(st.just("<drop>"), _CFG_JUNK)), min_size=1, max_size=4))
def test_fuzz_config_json_fields(edits):
    hf = json.loads(json.dumps(VALID_CFG))
    for key, value in edits:
        if value == "<drop>":
            hf.pop(key, None)
        else:
            hf[key] = value
    _check_cfg(hf)


@pytest.mark.parametrize("hf", [[], [VALID_CFG], "llama", 7, None,
                                dict(VALID_CFG, hidden_size=True), dict(VALID_CFG, num_hidden_layers=-2),
                                dict(VALID_CFG, vocab_size=0), dict(VALID_CFG, num_key_value_heads=3),
                                dict(VALID_CFG, rope_theta=float("nan")), dict(VALID_CFG, rms_norm_eps=-1e-6),
                                dict(VALID_CFG, rope_scaling=["linear"]), dict(VALID_CFG, rope_scaling={"type": "linear", "factor": 2.0}),
                                dict(VALID_CFG, rope_parameters="default"), dict(VALID_CFG, tie_word_embeddings="yes"),
                                {k: v for k, v in dict(VALID_CFG, hidden_size=66).items() if k != "head_dim"},  # 66 / 4 heads, no head_dim
                                dict(VALID_CFG, architectures="LlamaForCausalLM"),
                                dict(VALID_CFG, max_position_embeddings=1.5), dict(VALID_CFG, initializer_range=float("inf"))])
def test_bad_config_json_is_one_line(hf):
    with pytest.raises(UserError) as exc:
        config_from_hf(hf, "config.json")
    assert "\n" not in str(exc.value)


def test_valid_config_json_round_trips():
    m = config_from_hf(json.loads(json.dumps(VALID_CFG)))
    assert config_to_hf(m) == VALID_CFG
    _check_cfg(json.loads(json.dumps(VALID_CFG)))


@pytest.mark.parametrize("case", ["header_2^62", "header_2^34", "offsets_past_end", "config_list", "config_nan_theta", "index_escapes"])
def test_convert_refuses_hostile_hf_folders_in_one_line(tmp_path, capsys, case):
    from mspretrain.cli import main

    d = tmp_path / "hf"
    d.mkdir()
    cfg: object = dict(VALID_CFG)
    blob = VALID
    if case == "header_2^62":
        blob = struct.pack("<Q", 2**62) + VALID[8:]
    elif case == "header_2^34":
        blob = struct.pack("<Q", 2**34) + VALID[8:]
    elif case == "offsets_past_end":
        h = b'{"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}'
        blob = struct.pack("<Q", len(h)) + h + bytes(8)
    elif case == "config_list":
        cfg = [VALID_CFG]
    elif case == "config_nan_theta":
        cfg = dict(VALID_CFG, rope_theta=float("nan"), rope_parameters=None)
    else:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(blob)
    rc = main(["convert", "--from-hf", str(d), "--out", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert not (tmp_path / "ck").exists()


# --------------------------------------------------------------------------- batches.jsonl
# Every reader of a run's batch record (audit, spike's step lookup, the resume-time truncation,
# the records() iterator replay and spike use) gives a result or one one-line UserError on any
# damage: named kinds first, then hypothesis edits of a valid history.

@pytest.fixture(scope="module")
def batch_run(tmp_path_factory, tiny_data):
    """A run dir that audit can read (config, run_meta, the data dir's plan) with a valid history
    of 6 steps written by BatchLog itself; no training needed."""
    from mspretrain.budget import derive
    from mspretrain.config import schema as cfgmod
    from mspretrain.forensics.audit import plan_of_run
    from mspretrain.monitor.batch_log import BatchLog
    from tests.conftest import TINY

    run = tmp_path_factory.mktemp("batches") / "run"
    run.mkdir()
    cfg = cfgmod.apply_overrides(cfgmod.load(TINY), ["train.max_steps=6"])
    cfgmod.save(cfg, run / "config.toml")
    (run / "run_meta.json").write_text(json.dumps({"data_dir": str(tiny_data), "world_size": 1}))
    plan, tokens = plan_of_run(run, cfg)
    b = derive(cfg, data_tokens=tokens)
    g = cfg.train.global_batch
    log = BatchLog(run, plan=plan, global_batch=g, enabled=True, total=b.steps, warmup=b.warmup, schedule=b.schedule)
    pos = [0] * len(plan.windows)
    for s in range(1, 7):
        log.step(s, pos, world=1, lr=b.schedule(s - 1), scale=1.0, finite=True)
        pos = plan.advance(pos, g)
    log.close()
    return run


def _readers_hold(run: Path) -> None:
    from mspretrain.forensics.audit import audit_run, format_audit
    from mspretrain.forensics.spike import step_record
    from mspretrain.monitor.batch_log import records, truncate

    def one_line(fn):
        try:
            return fn()
        except UserError as exc:
            assert "\n" not in exc.cause and "\n" not in exc.fix and exc.cause, str(exc)
            return None

    a = one_line(lambda: audit_run(run))
    if a is not None:
        format_audit(a, run)
    list(one_line(lambda: list(records(run))) or [])
    one_line(lambda: step_record(run, 2))
    one_line(lambda: truncate(run / "batches.jsonl", 3))


def _edit(rec_line: str, **changes) -> str:
    rec = json.loads(rec_line)
    rec.update(changes)
    return json.dumps(rec)


def _damaged(lines: list[str]) -> dict[str, bytes]:
    """Named damage of a valid history (`lines`: its session marker and six steps)."""
    s, steps = lines[0], lines[1:]
    out = {
        "truncated line": "\n".join(lines)[:-7],
        "empty": "", "blank lines": "\n\n  \n",
        "step as string": "\n".join([s, _edit(steps[0], step="1"), *steps[1:]]),
        "step as float": "\n".join([s, _edit(steps[0], step=1.0), *steps[1:]]),
        "step as bool": "\n".join([s, _edit(steps[0], step=True), *steps[1:]]),
        "negative step": "\n".join([s, _edit(steps[0], step=-4), *steps[1:]]),
        "huge step": "\n".join([s, steps[0].replace('"step": 1', '"step": ' + "9" * 400), *steps[1:]]),
        "missing pos": "\n".join([s, steps[0], json.dumps({k: v for k, v in json.loads(steps[1]).items() if k != "pos"}), *steps[2:]]),
        "pos not a list": "\n".join([s, _edit(steps[0], pos=5), *steps[1:]]),
        "negative pos": "\n".join([s, _edit(steps[0], pos=[-3]), *steps[1:]]),
        "pos of 3 sources": "\n".join([s, _edit(steps[0], pos=[0, 0, 0]), *steps[1:]]),
        "huge pos": "\n".join([s, _edit(steps[0], pos=[2**62]), *steps[1:]]),
        "hash missing": "\n".join([s, json.dumps({k: v for k, v in json.loads(steps[0]).items() if k != "hash"}), *steps[1:]]),
        "hash as int": "\n".join([s, _edit(steps[0], hash=7), *steps[1:]]),
        "lr NaN": "\n".join([s, steps[0].replace('"lr": ', '"lr": NaN, "x": '), *steps[1:]]),
        "lr Infinity": "\n".join([s, steps[0].replace('"lr": ', '"lr": Infinity, "x": '), *steps[1:]]),
        "lr as string": "\n".join([s, _edit(steps[0], lr="high"), *steps[1:]]),
        "scale zero": "\n".join([s, _edit(steps[0], scale=0), *steps[1:]]),
        "finite as string": "\n".join([s, _edit(steps[0], finite="yes"), *steps[1:]]),
        "duplicate step": "\n".join([s, steps[0], steps[0], *steps[1:]]),
        "NUL bytes": "\n".join([s, steps[0][:10] + "\x00\x00" + steps[0][10:], *steps[1:]]),
        "nested JSON": "\n".join([s, "[" * 100_000 + "]" * 100_000, *steps]),
        "nested object": "\n".join([s, '{"step": ' + "[" * 50_000 + "]" * 50_000 + "}", *steps]),
        "array line": "\n".join([s, "[1, 2, 3]", *steps]),
        "null line": "\n".join([s, "null", *steps]),
        "session with string total": "\n".join([_edit(s, session={"step": 0, "world": 1, "total": "6"}), *steps]),
        "session not an object": "\n".join([_edit(s, session=[0]), *steps]),
        "session with a huge plan": "\n".join([_edit(s, session={**json.loads(s)["session"], "plan": {
            "windows": [2**50], "weights": [1.0], "seed": 1}, "global_batch": 8}), *steps]),
        "rewind forward": "\n".join([s, *steps[:3], json.dumps({"rewind": {"from": 3, "to": 5, "skip": 0, "pos": [0]}}), *steps[3:]]),
        "rewind huge skip": "\n".join([s, *steps[:3], json.dumps({"rewind": {"from": 3, "to": 1, "skip": 10**9, "pos": [0]}}), *steps[3:]]),
        "step and session at once": "\n".join([s, _edit(steps[0], session={"step": 0}), *steps[1:]]),
        "CRLF": "\r\n".join(lines),
    }
    blobs = {k: v.encode() for k, v in out.items()}
    blobs["not UTF-8"] = "\n".join(lines[:3]).encode() + b"\n\xff\xfe\x80{}\n" + "\n".join(lines[3:]).encode()
    return blobs


def test_named_damage_of_batches_jsonl(batch_run, tmp_path):
    lines = (batch_run / "batches.jsonl").read_text().splitlines()
    damaged = _damaged(lines)
    assert len(damaged) >= 22
    for name, blob in damaged.items():
        run = tmp_path / name.replace(" ", "_")
        shutil.copytree(batch_run, run)
        (run / "batches.jsonl").write_bytes(blob)
        try:
            _readers_hold(run)
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the case
            raise AssertionError(f"{name}: {type(exc).__name__}: {exc}") from exc


def test_a_clean_history_is_exact_and_damage_is_never_exact(batch_run, tmp_path):
    from mspretrain.forensics.audit import audit_run

    assert audit_run(batch_run).exact
    lines = (batch_run / "batches.jsonl").read_text().splitlines()
    for name, blob in _damaged(lines).items():
        if name in ("CRLF", "blank lines"):
            continue
        run = tmp_path / name.replace(" ", "_")
        shutil.copytree(batch_run, run)
        (run / "batches.jsonl").write_bytes(blob)
        try:
            a = audit_run(run)
        except UserError:
            continue
        assert not a.exact, name


_LINE_JUNK = st.one_of(_JUNK, st.just(float("nan")), st.integers(-2**70, 2**70),
                       st.lists(st.integers(-5, 2**40), max_size=3), st.text(max_size=5))


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["step", "pos", "hash", "world", "lr", "scale", "finite",
                                                                    "session", "rewind", "<cut>", "<dup>", "<drop>"]),
                                _LINE_JUNK), min_size=1, max_size=4))
def test_fuzz_batches_jsonl(batch_run, tmp_path, edits):
    lines = (batch_run / "batches.jsonl").read_text().splitlines()
    for i, field, junk in edits:
        i = min(i, len(lines) - 1) if lines else 0
        if not lines:
            break
        if field == "<cut>":
            lines[i] = lines[i][: len(lines[i]) // 2]
        elif field == "<dup>":
            lines.insert(i, lines[i])
        elif field == "<drop>":
            lines.pop(i)
        else:
            try:
                rec = json.loads(lines[i])
            except ValueError:
                continue
            if isinstance(rec, dict):
                rec[field] = junk
                lines[i] = json.dumps(rec)
    run = tmp_path / "run"
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(batch_run, run)
    (run / "batches.jsonl").write_text("\n".join(lines) + "\n")
    _readers_hold(run)


@pytest.mark.parametrize("reader", ["read_json", "read_metrics", "heartbeats", "choices", "metrics_truncate", "diagnose"])
def test_deeply_nested_json_is_one_line_in_every_reader(tmp_path, reader):
    """`[[[[...` of 100k brackets makes json.loads raise RecursionError: each reader of a user
    file turns it into a one-line error or skips the line, as for any other damaged JSON."""
    from mspretrain.config.schema import SpikeConfig
    from mspretrain.eval.choices import read_choices
    from mspretrain.forensics.diagnose import scan_metrics_file
    from mspretrain.forensics.report_summary import read_metrics
    from mspretrain.fsutil import read_json
    from mspretrain.monitor.heartbeat import read_heartbeats
    from mspretrain.monitor.metrics import truncate_metrics

    deep = "[" * 100_000 + "]" * 100_000
    ok = '{"step": 1, "loss": 2.0}'
    if reader == "read_json":
        (tmp_path / "x.json").write_text(deep)
        with pytest.raises(UserError, match="nested too deeply"):
            read_json(tmp_path / "x.json", "fix it")
    elif reader == "read_metrics":
        (tmp_path / "m.jsonl").write_text(ok + "\n" + deep + "\n")
        records, bad = read_metrics(tmp_path / "m.jsonl")
        assert len(records) == 1 and bad == 1
    elif reader == "heartbeats":
        (tmp_path / "heartbeat").mkdir()
        (tmp_path / "heartbeat" / "rank_00000.json").write_text(deep)
        assert read_heartbeats(tmp_path) == []
    elif reader == "choices":
        (tmp_path / "c.jsonl").write_text(deep + "\n")
        with pytest.raises(UserError):
            read_choices(tmp_path / "c.jsonl")
    elif reader == "metrics_truncate":
        (tmp_path / "m.jsonl").write_text(ok + "\n" + deep + "\n")
        assert truncate_metrics(tmp_path / "m.jsonl", 5) == 1
    else:
        (tmp_path / "m.jsonl").write_text(ok + "\n" + deep + "\n")
        scan_metrics_file(tmp_path / "m.jsonl", tmp_path, SpikeConfig())
