"""The one data-dir manifest reader: every way a manifest can be wrong is one line naming the file."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mspretrain.data.manifest import check_data_dir, read_manifest
from mspretrain.errors import UserError
from tests.helpers.cli import assert_user_error

GOOD = {"fingerprint": "abc", "tokens": {"train": 10, "valid": 2}, "vocab_size": 512, "special_ids": {"eos": 2}}


def _one_line_error(d: Path) -> UserError:
    return assert_user_error(lambda: read_manifest(d))


def test_reads_a_valid_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({**GOOD, "extra": [1]}), encoding="utf-8")
    assert read_manifest(tmp_path) == {**GOOD, "extra": [1]}
    assert read_manifest(str(tmp_path)) == {**GOOD, "extra": [1]}


def test_missing_dir(tmp_path):
    e = _one_line_error(tmp_path / "nope")
    assert "does not exist" in e.cause and "prepare" in e.fix


def test_a_file_instead_of_a_dir(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"")
    e = _one_line_error(tmp_path / "train.bin")
    assert "is a file" in e.cause


def test_no_manifest(tmp_path):
    e = _one_line_error(tmp_path)
    assert "has no manifest.json" in e.cause


@pytest.mark.parametrize("text", ["{not json", "{\n  \"a\":\n", b"\xff\xfe{}"])
def test_unparsable_manifest(tmp_path, text):
    p = tmp_path / "manifest.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    e = _one_line_error(tmp_path)
    assert str(p) in e.cause and "not valid JSON" in e.cause


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_manifest(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(GOOD))
    p.chmod(0)
    try:
        e = _one_line_error(tmp_path)
    finally:
        p.chmod(0o644)
    assert "cannot read" in e.cause


@pytest.mark.parametrize("value", ["[1, 2]", "3", "null", "\"text\""])
def test_not_an_object(tmp_path, value):
    (tmp_path / "manifest.json").write_text(value)
    e = _one_line_error(tmp_path)
    assert "is not a JSON object" in e.cause


@pytest.mark.parametrize("key", sorted(GOOD))
@pytest.mark.parametrize("how", ["missing", "wrong_type"])
def test_missing_or_mistyped_keys(tmp_path, key, how):
    m = dict(GOOD)
    if how == "missing":
        del m[key]
    else:
        m[key] = True  # not a str, not a dict, and not an int either (bool is refused as a vocab size)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    e = _one_line_error(tmp_path)
    assert f"`{key}`" in e.cause and "not written by `mspretrain prepare`" in e.cause


def test_check_data_dir_passes_a_prepared_dir_and_refuses_a_swapped_tokenizer(tiny_data, tmp_path):
    check_data_dir(tiny_data, read_manifest(tiny_data))
    d = tmp_path / "d"
    shutil.copytree(tiny_data, d)
    tok = next(p for p in (d / "tokenizer.model", d / "tokenizer.json") if p.is_file())
    tok.write_bytes(tok.read_bytes() + b" ")
    with pytest.raises(UserError, match="is not the tokenizer the data was encoded with"):
        check_data_dir(d, read_manifest(d))
