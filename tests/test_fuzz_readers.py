"""Fuzzing the readers of untrusted files (issue 18 item 7): HF safetensors and config.json.

Property: whatever the bytes, the reader gives a correct load or one `UserError` whose message is
one line; never another exception, never a huge allocation. Mutations of a valid file: random
truncation, bit flips (mostly in the header), a rewritten length prefix, and header field swaps
(dtypes, shapes, offsets, the header's JSON type). A load that succeeds is compared with an
independent reference reader written here (plain json + numpy, bf16 widened by bit shift).
Hypothesis runs derandomized, so a failure reproduces on every machine."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mspretrain.config import Config, ModelConfig, validate
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
                                dict(VALID_CFG, hidden_size=66), dict(VALID_CFG, architectures="LlamaForCausalLM"),
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
