"""A 7B job reaches its first step quickly. Initialisation streams each weight to
the device on Ascend with the same numbers as on CPU, drawn by threads from per-block streams of
the seed; the largest token id per shard is recorded at
prepare time and checked instead of rescanned; old data dirs are scanned on rank 0 alone; msrun
gets an explicit cluster timeout."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError

BLOCK = 1 << 20  # the scheme's block: a constant of the documented scheme, written here on its own


def _reference_draw(seed: int, k: int, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Weight k as the model docstring specifies it, written independently of InitStreams: block b of
    2^20 values of the row-major flattening from the stream SeedSequence(seed)'s (k+1)-th child's
    (b+1)-th child (= spawn_key (k, b)), one block after another on one thread, then reshaped."""
    n = int(np.prod(shape))
    nblocks = max(1, -(-n // BLOCK))
    children = np.random.SeedSequence(seed).spawn(k + 1)[k].spawn(nblocks)
    parts = [np.random.default_rng(children[b]).standard_normal(min(BLOCK, n - b * BLOCK), dtype=np.float32)
             for b in range(nblocks)]
    return (np.concatenate(parts) * np.float32(std)).reshape(shape)


def _reference_weights(m, seed: int) -> dict[str, np.ndarray]:
    """The initialisation as specified (model/decoder.py docstring), drawn independently: normal(0,
    init_std), weight k in creation order (embedding; per layer wqkv, wo, w13, w2; lm_head) from its
    own streams, the residual projections scaled by 1/sqrt(2 n_layers); norms at one."""
    count = iter(range(1 << 30))
    draw = lambda shape, std: _reference_draw(seed, next(count), shape, std)
    hd = m.dim // m.n_heads
    out_std = m.init_std / np.sqrt(2 * m.n_layers)
    w = {"embed.weight": draw((m.vocab_size, m.dim), m.init_std)}
    for i in range(m.n_layers):
        w[f"layers.{i}.attn.wqkv.weight"] = draw(((m.n_heads + 2 * m.n_kv_heads) * hd, m.dim), m.init_std)
        w[f"layers.{i}.attn.wo.weight"] = draw((m.dim, m.n_heads * hd), out_std)
        w[f"layers.{i}.mlp.w13.weight"] = draw((2 * m.ffn_dim, m.dim), m.init_std)
        w[f"layers.{i}.mlp.w2.weight"] = draw((m.dim, m.ffn_dim), out_std)
        w[f"layers.{i}.attn_norm.weight"] = np.ones(m.dim, np.float32)
        w[f"layers.{i}.mlp_norm.weight"] = np.ones(m.dim, np.float32)
    w["norm.weight"] = np.ones(m.dim, np.float32)
    if not m.tie_embeddings:
        w["lm_head.weight"] = draw((m.vocab_size, m.dim), m.init_std)
    return w


@pytest.mark.parametrize("threads", [1, 3])
def test_the_draw_is_the_documented_streams_whatever_the_thread_count(threads, monkeypatch):
    """Weights larger than one block (a remainder too) are drawn block by block by
    a thread pool; 1 and 3 threads give the reference's bits (the same for every thread count), a
    later weight gets other streams, and a zero-size weight draws nothing. The default thread count
    follows the process's cores (capped) unless MSPRETRAIN_INIT_THREADS says otherwise."""
    from mspretrain.model import decoder

    assert decoder.INIT_BLOCK == BLOCK
    shape, std = (3, BLOCK + 12_345), 0.02  # 3.04 blocks' worth: 4 streams, the last one short
    streams = decoder.InitStreams(11, threads=threads)
    first = streams.draw((5, 7), 0.5)
    big = streams.draw(shape, std)
    empty = streams.draw((0, 4), std)
    assert np.array_equal(first, _reference_draw(11, 0, (5, 7), 0.5))
    assert big.dtype == np.float32 and big.flags.c_contiguous
    assert np.array_equal(big, _reference_draw(11, 1, shape, std))
    assert empty.shape == (0, 4) and streams.count == 3
    assert not np.array_equal(big.reshape(-1)[:35], _reference_draw(11, 0, (35,), std))
    monkeypatch.setenv("MSPRETRAIN_INIT_THREADS", str(threads))
    assert decoder.InitStreams(0).threads == threads
    monkeypatch.delenv("MSPRETRAIN_INIT_THREADS")
    monkeypatch.setattr(decoder.os, "sched_getaffinity", lambda pid: set(range(192)))
    assert decoder.init_threads() == decoder.INIT_THREADS_CAP == 32
    monkeypatch.setattr(decoder.os, "sched_getaffinity", lambda pid: {5})
    assert decoder.init_threads() == 1


def test_a_model_is_the_same_whatever_the_thread_count(tiny_cfg, monkeypatch):
    """The whole model, with blocks shrunk to 1,000 values so that every tiny weight has several:
    1 and 3 threads give the same bits (the block, not the threads, fixes the streams)."""
    from mspretrain.model import decoder

    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    monkeypatch.setattr(decoder, "INIT_BLOCK", 1000)
    built = {}
    for threads in (1, 3):
        monkeypatch.setenv("MSPRETRAIN_INIT_THREADS", str(threads))
        built[threads] = decoder.state_numpy(decoder.Decoder(m, seed=3, device="cpu"))
    assert all(np.array_equal(built[1][k], built[3][k]) for k in built[1])
    monkeypatch.setenv("MSPRETRAIN_INIT_THREADS", "0")
    with pytest.raises(UserError, match="MSPRETRAIN_INIT_THREADS"):
        decoder.Decoder(m, seed=3, device="cpu")


def test_weights_are_bit_identical_and_streamed_to_the_device_on_ascend(tiny_cfg, monkeypatch):
    """Each drawn weight's Parameter holds the very tensor `Tensor.to` returned, not a rebuild of it.

    MindSpore 2.10's Parameter.__new__ copies its input through the host (`data.asnumpy()`) unless
    the input's reference count is exactly 4 (common/parameter.py l.377-394); on a 910B that copy
    brings every streamed weight back to host memory. Here `Tensor.to` stands in for the device
    copy: it returns a new tensor in a new buffer and records only that buffer's address (holding
    the tensor itself would raise its reference count). A Parameter rebuilt from a host copy has
    another address."""
    import mindspore as ms

    from mspretrain.model import decoder

    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    want = _reference_weights(m, seed=7)
    cpu_model = decoder.Decoder(m, seed=7, device="cpu")
    cpu = decoder.state_numpy(cpu_model)
    assert set(cpu) == set(want) and all(np.array_equal(cpu[k], want[k]) for k in want)

    moved: list[tuple[tuple[int, ...], str, int]] = []

    def to(self, device):
        out = ms.Tensor(self.asnumpy().copy())  # the "device" copy: its own buffer
        moved.append((tuple(self.shape), device, out._data_ptr()))
        return out

    monkeypatch.setattr(ms.Tensor, "to", to)
    class _OnNPU:
        device_target = "Ascend"
    decoder.Decoder(m, dtype="fp16", seed=7, device="ascend")  # built on a CPU process: stays on the host
    assert moved == []
    monkeypatch.setattr(ms, "get_current_device", lambda: _OnNPU())  # as in a process bound to an NPU
    model = decoder.Decoder(m, dtype="fp16", seed=7, device="ascend")
    asc = decoder.state_numpy(model)
    assert all(np.array_equal(asc[k], want[k]) for k in want)
    # every drawn weight went to the device as it was drawn, one at a time, in creation order ...
    drawn = [k for k in want if "norm" not in k]
    assert [(s, d) for s, d, _ in moved] == [(want[k].shape, "Ascend") for k in drawn]
    # ... and its Parameter wraps that device tensor: no host copy was made of any of them
    params = dict(model.parameters_and_names())
    held = [params[k]._data_ptr() for k in drawn]
    assert held == [ptr for _, _, ptr in moved], "a weight was rebuilt from a host copy"
    assert decoder._init_device == [None]  # nothing leaks into models built afterwards
    decoder.Decoder(m, seed=7, device="cpu")
    assert len(moved) == len(drawn)


def test_prepare_records_the_largest_token_id_per_shard(tiny_data):
    from mspretrain.data.shards import IndexedDataset
    from mspretrain.paths import DataPaths

    manifest = json.loads((tiny_data / "manifest.json").read_text())
    for split, top in manifest["max_token_id"].items():
        tokens = IndexedDataset(DataPaths(tiny_data).prefix(split)).tokens
        assert top == int(tokens.max()) and top < manifest["vocab_size"]


def _copy(tiny_data, tmp_path):
    d = tmp_path / "data"
    shutil.copytree(tiny_data, d)
    return d, json.loads((d / "manifest.json").read_text())


def test_the_data_check_trusts_recorded_ids_but_verifies_shard_sizes(tiny_data, tmp_path):
    from mspretrain.data.manifest import check_data_dir

    d, manifest = _copy(tiny_data, tmp_path)
    check_data_dir(d, manifest)
    bad = {**manifest, "max_token_id": {**manifest["max_token_id"], "train": manifest["vocab_size"]}}
    with pytest.raises(UserError, match="holds token id .* max_token_id"):
        check_data_dir(d, bad)
    # a shard pair replaced after prepare (another data dir's, consistent in itself): the count differs
    for ext in ("bin", "idx"):
        shutil.copyfile(d / f"valid.{ext}", d / f"train.{ext}")
    with pytest.raises(UserError, match="train.bin holds .* tokens .* but manifest.json says"):
        check_data_dir(d, manifest)


def test_an_old_data_dir_is_scanned_only_where_asked(tiny_data, tmp_path):
    from mspretrain.data.manifest import check_data_dir

    d, manifest = _copy(tiny_data, tmp_path)
    old = {k: v for k, v in manifest.items() if k != "max_token_id"}
    raw = np.fromfile(d / "valid.bin", dtype=np.dtype(manifest["token_dtype"]))
    raw[3] = manifest["vocab_size"] + 1  # an id past the vocabulary, same size
    raw.tofile(d / "valid.bin")
    with pytest.raises(UserError, match="valid.bin holds token id"):
        check_data_dir(d, old)  # rank 0 (or a single process) reads the shards
    check_data_dir(d, old, scan=False)  # the other ranks do not


@pytest.mark.parametrize("env, scans", [({}, True), ({"RANK_ID": "0"}, True), ({"RANK_ID": "3"}, False),
                                        ({"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "1"}, False),
                                        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "1",
                                          "RANK_ID": "1"}, False),
                                        ({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "1",
                                          "RANK_ID": "0"}, True)])
def test_only_rank_0_scans_old_shards(monkeypatch, env, scans):
    from mspretrain.train import build

    for k in ("RANK_ID", "MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert build._scans_data() is scans


def test_msrun_gets_an_explicit_cluster_timeout():
    from mspretrain.parallel import distributed

    line = distributed.msrun_command(8, ["train"])
    assert f"--cluster_time_out={distributed.CLUSTER_TIMEOUT_S}" in line.split()
    assert line.split().index("--cluster_time_out=1200") < line.split().index("mspretrain")


def test_optimizer_state_is_not_rebuilt_from_host_copies(tiny_cfg, monkeypatch):
    """The same trap in TrainStep. Its zeroed moments and gradient accumulators
    come from `ops.zeros` (device memory on an NPU) and the fp32 masters from a host array; a
    Parameter built from any of them at a reference count other than 4 is rebuilt through
    `asnumpy()` by MindSpore 2.10 (common/parameter.py l.377-394). Counted in that branch."""
    from mindspore.common import parameter as P

    from mspretrain.model import decoder
    from mspretrain.step.step import TrainStep

    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    model = decoder.Decoder(m, dtype="fp16", seed=7, device="cpu")
    new_args = P.Parameter._get_parameter_new_args
    rebuilt: list[tuple[tuple[int, ...], int]] = []

    def counted(data, rc, init_param=True):
        import mindspore as ms

        if isinstance(data, ms.Tensor) and not data.has_init and rc != 4 and data.size > 1:  # not the step counters
            rebuilt.append((tuple(data.shape), rc))
        return new_args(data, rc, init_param)

    monkeypatch.setattr(P.Parameter, "_get_parameter_new_args", staticmethod(counted))
    step = TrainStep(model, tiny_cfg.optim, global_tokens=2 * 16, jit=False, half_params=decoder.half_eligible(model),
                     accumulation=2)
    step._ensure_accum()
    assert len(step.exp_avg) == len(step.exp_avg_sq) > 0 and step.accum is not None and len(step.accum) > 0
    assert any(p is not q for p, q in zip(step.own_masters, [step.params[i] for i in step.own]))  # separate masters built
    assert rebuilt == []
