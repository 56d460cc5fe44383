"""`train --init-from` a checkpoint at scale: its weights mapped, not read (checkpoint/tensor_file.py
`mapped_tensors`), and on an NPU a model built for a cut (ZeRO-3, tp, ep) takes each weight from
the file only when its cut reads it (model/lazy.py `LazyLoad`, `load_when_read`): each rank's host
holds one whole weight at a time, not the whole fp32 model (Qwen3-30B-A3B: 122 GB a rank)."""
from __future__ import annotations

import weakref

import mindspore as ms
import numpy as np
import pytest

from mspretrain.checkpoint.tensor_file import mapped_tensors, save_tensors
from mspretrain.config import schema as cfgmod
from mspretrain.model import decoder, lazy


def test_mapped_tensors_are_views_of_the_file_in_their_stored_dtype(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
               "c": np.arange(4, dtype=np.int64), "empty": np.zeros((0, 3), np.float32)}
    save_tensors(tensors, tmp_path / "m.safetensors", {"format": "mspretrain", "step": "1"})
    got = mapped_tensors(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), k
    assert isinstance(got["a"], np.memmap) and not got["a"].flags.writeable  # a view, and read-only
    raw = bytearray((tmp_path / "m.safetensors").read_bytes())
    (tmp_path / "cut.safetensors").write_bytes(bytes(raw[:-8]))  # data shorter than the header says
    with pytest.raises(ValueError, match="does not fit"):
        mapped_tensors(tmp_path / "cut.safetensors")


def test_init_from_reads_a_checkpoint_mapped(reference_run):
    from mspretrain.checkpoint import store

    ref = store.resolve_checkpoint(reference_run)
    mapped, read = store.read_model_tensors(ref, mapped=True), store.read_model_tensors(ref)
    assert sorted(mapped) == sorted(read) and all(isinstance(v, np.memmap) for v in mapped.values())
    for k, v in read.items():
        assert np.array_equal(np.asarray(mapped[k], np.float32), v), k


def test_an_expert_parallel_cut_takes_each_weight_from_the_file_when_it_reads_it(monkeypatch, world_of, tmp_path):
    """A model built for expert parallel on an NPU (undrawn, `host_weights`) initialised from a
    mapped checkpoint: nothing is drawn or read until `apply_ep`, which reads each weight from the
    file once, one whole at a time, and keeps this rank's experts of the checkpoint's values."""
    from mspretrain.model.parallel import Group, cut
    from mspretrain.model.params import ep_piece

    class _OnNPU:
        device_target = "Ascend"

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, family="qwen3_moe", qk_norm=True,
                                                head_dim=16, num_experts=4, experts_per_token=2, moe_ffn_dim=32), 96)
    source = decoder.state_numpy(decoder.Decoder(m, seed=7, device="ascend", dtype="fp16"))  # the checkpoint: seed 7
    save_tensors(source, tmp_path / "model.safetensors")
    real_to = ms.Tensor.to
    monkeypatch.setattr(ms.Tensor, "to", lambda self, where, *a, **k: self if where == "Ascend" else real_to(self, where, *a, **k))
    monkeypatch.setattr(ms, "get_current_device", lambda: _OnNPU())
    alive: list = []
    most, drawn = [0], [0]
    real_load, real_draw = lazy.LazyLoad._initialize, lazy.LazyDraw._initialize

    def load(self, arr):  # no gc.collect(): each whole weight is freed by its reference count once cut
        most[0] = max(most[0], sum(r() is not None for r in alive))
        real_load(self, arr)
        alive.append(weakref.ref(arr))

    def draw(self, arr):
        drawn[0] += 1
        real_draw(self, arr)

    monkeypatch.setattr(lazy.LazyLoad, "_initialize", load)
    monkeypatch.setattr(lazy.LazyDraw, "_initialize", draw)
    for rank in (0, 1):
        world_of(rank, 2)
        alive.clear()
        most[0] = drawn[0] = 0
        model = decoder.Decoder(m, seed=3, device="ascend", dtype="fp16", host_weights=True)
        assert lazy.undrawn(model)
        lazy.load_when_read(model, mapped_tensors(tmp_path / "model.safetensors"))
        assert not alive and not lazy.undrawn(model)  # nothing read yet, nothing left to draw
        model.apply_ep(Group((0, 1), rank, device="ascend"))
        assert len(alive) == len(source) and most[0] <= 1 and drawn[0] == 0  # each weight read once, one at a time
        assert not any(p.has_init for p in model.get_parameters())
        for p in model.get_parameters():
            assert np.array_equal(p.asnumpy(), cut(source[p.name], ep_piece(p.name, m, 2, rank))), p.name


def test_a_lazy_load_is_strict(tmp_path):
    """The names and shapes are checked before anything is read, with load_numpy's one-line errors."""
    from mspretrain.errors import UserError

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2), 96)
    model = decoder.Decoder(m, seed=3)
    tensors = decoder.state_numpy(model)
    with pytest.raises(UserError, match="checkpoint has no tensor embed.weight"):
        lazy.load_when_read(model, {k: v for k, v in tensors.items() if k != "embed.weight"})
    with pytest.raises(UserError, match=r"tensor embed.weight has shape \(95, 64\), the model expects \(96, 64\)"):
        lazy.load_when_read(model, dict(tensors, **{"embed.weight": tensors["embed.weight"][:95]}))
