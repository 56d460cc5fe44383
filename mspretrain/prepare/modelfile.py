"""The quality models' files (`quality.py`): `.npz` written without pickle, their zip entries
dated alike (the same model, the same bytes), a `NAME.sha256` beside each, and the guards a
model file is read through (a regular file, at most MODEL_CAP bytes, its zip's members checked
before numpy inflates any of them)."""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from mspretrain.errors import UserError

CLASSIFIER_KIND = "mspretrain-quality-classifier"
LM_KIND = "mspretrain-char-lm"
FORMAT = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_bytes(kind: str, meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A model file's bytes (`np.savez`, no pickle; its zip entries carry a fixed date: the same
    model, the same bytes)."""
    import io

    buf = io.BytesIO()
    head = json.dumps({"kind": kind, "format": FORMAT, **meta}, ensure_ascii=False, sort_keys=True).encode()
    np.savez(buf, meta=np.frombuffer(head, dtype=np.uint8), **arrays)
    return buf.getvalue()


def write_model(path: Path, data: bytes) -> str:
    """Write a model's bytes and `PATH.sha256`; returns the SHA-256."""
    from mspretrain.fsutil import atomic_write

    digest = hashlib.sha256(data).hexdigest()
    atomic_write(path, data)
    atomic_write(path.with_name(path.name + ".sha256"), f"{digest}  {path.name}\n".encode())
    return digest


def save_model(path: Path, kind: str, meta: dict, arrays: dict[str, np.ndarray]) -> str:
    return write_model(path, model_bytes(kind, meta, arrays))


MODEL_CAP = 64 << 20  # a model file's bytes, and its members' inflated bytes (the LM's counts: 25 MB)
META_CAP = 1 << 20  # the JSON head of a model file
MEMBERS = {CLASSIFIER_KIND: ("meta", "weights", "bias"), LM_KIND: ("meta", "counts", "total")}


def _members(data: bytes, what: str, p: Path, hint: str) -> None:
    """Check a model file's zip before numpy inflates any of it: only the members its kind has,
    each a plain numeric .npy whose header's shape fits, all of them at most MODEL_CAP bytes
    inflated (a zip bomb of 2 MB declaring 1.5 GB is refused before a byte is inflated)."""
    import io

    from numpy.lib import format as npformat

    bad = f"{what} {p} is corrupt or not a model file"
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            names = sorted(i.filename for i in infos)
            if names not in (sorted(m + ".npy" for m in ms) for ms in MEMBERS.values()):
                raise UserError(f"{bad} (its members are not a quality model's)", hint)
            total = 0
            for i in infos:
                total += i.file_size
                if total > MODEL_CAP or i.file_size > (META_CAP if i.filename == "meta.npy" else MODEL_CAP):
                    raise UserError(f"{what} {p} inflates to more than the {MODEL_CAP:,} bytes a model file holds", hint)
                with z.open(i) as f:
                    version = npformat.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise UserError(bad, hint)
                    read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
                    shape, _, dtype = read(f, max_header_size=1 << 12)
                    count = 1
                    for d in shape:
                        count *= int(d)
                    if dtype.kind not in "fiu" or dtype.hasobject or count * dtype.itemsize > i.file_size:
                        raise UserError(f"{bad} (member {i.filename})", hint)
    # RuntimeError: zipfile's refusals of an encrypted member or an unknown compression method
    # (zipfile raises the latter as a subclass of RuntimeError)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError, TypeError, OverflowError):
        raise UserError(bad, hint) from None


def load_model(path: str | Path, kind: str, what: str, names: tuple[str, ...]) -> tuple[dict, dict[str, np.ndarray], str]:
    """(meta, arrays, sha256) of a model file; one-line UserError when it is missing or not one.
    Read with the guards of every input (a regular file, at most MODEL_CAP bytes: a directory, a
    FIFO or /dev/zero is named as what it is), and its zip checked before numpy inflates it."""
    import io

    from mspretrain.fsutil import file_kind, loads_json, read_regular_bytes, read_regular_text, why_not

    p = Path(path).expanduser()
    hint = f"train it with `mspretrain quality {'train' if kind == CLASSIFIER_KIND else 'lm'}`, or fix the path in the config"
    if file_kind(p) != "a file":
        raise UserError(f"{what} {p} {why_not(p)}", hint)
    data = read_regular_bytes(p, MODEL_CAP, what, hint)
    digest = hashlib.sha256(data).hexdigest()
    side = p.with_name(p.name + ".sha256")
    if os.path.lexists(side):
        want = read_regular_text(side, 1 << 12, "checksum file", hint, errors="replace").split()[:1]
        if want != [digest]:
            raise UserError(f"{what} {p} is corrupt: its SHA-256 is not the one in {side.name}", hint)
    _members(data, what, p, hint)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        head = arrays.pop("meta")
        if head.dtype != np.uint8 or head.ndim != 1:
            raise ValueError
        meta = loads_json(head.tobytes().decode(), f"{what} {p}'s head", hint)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError, TypeError):
        raise UserError(f"{what} {p} is corrupt or not a model file", hint) from None
    if not isinstance(meta, dict) or meta.get("kind") != kind or meta.get("format") != FORMAT or set(names) - set(arrays):
        raise UserError(f"{what} {p} is not a {kind} file (format {FORMAT})", hint)
    for k in names:
        if not np.all(np.isfinite(arrays[k])):
            raise UserError(f"{what} {p} is corrupt: {k} holds non-finite numbers", hint)
    return meta, arrays, digest
