"""The memory options the 7B recipe needs give the same numbers as the plain step.

- precision.param_dtype=compute: half-precision parameters + fp32 masters == fp32 parameters cast
  at use (the matmuls read the same rounded weights), loss for loss and master for weight;
- train.recompute: recomputing each layer in the backward pass == keeping its activations;
- a run with half parameters resumes exactly (the masters travel in the optimizer state).
"""
import json

import numpy as np
import pytest

from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model
from mspretrain.model.decoder import Decoder, half_eligible, state_numpy
from mspretrain.step.step import TrainStep
from tests.conftest import NO_EVAL, ONE_LAYER, TINY, snapshot

# one layer: recompute and half parameters are per layer and per parameter; a second layer would
# only repeat the first's nodes in each of the four compilations (~2.5 s of CPU each)
CFG = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256))
OPT = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
B, T, STEPS = 2, 32, 3


def _batches() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (B, T + 1)).astype(np.int32) for _ in range(STEPS)]


def _run(dtype: str, *, half: bool = False, recompute: bool = False) -> tuple[list[float], dict, TrainStep]:
    model = Decoder(CFG, dtype=dtype, seed=3)
    if recompute:
        for layer in model.layers:
            layer.recompute()
    step = TrainStep(model, OPT, global_tokens=B * T, half_params=half_eligible(model) if half else None)
    losses = [step.run([(b, None, None)], lr=1e-3, scale=1024.0 if dtype == "fp16" else 1.0).loss for b in _batches()]
    return losses, snapshot(state_numpy(model)), step


@pytest.fixture(scope="module")
def fp16_reference():
    return _run("fp16")


@pytest.mark.slow  # fp16 and fp32 training runs of its own (63 s of make test-fast with its fixture at load ~3)
def test_half_parameters_with_masters_equal_fp32_parameters(fp16_reference):
    ref_losses, ref_weights, _ = fp16_reference
    losses, weights, step = _run("fp16", half=True)
    assert losses == ref_losses
    half = set(half_eligible(step.model))
    assert half and "lm_head.weight" not in half and not any("norm" in n for n in half)
    state = step.optimizer_state()
    for name, ref in ref_weights.items():
        if name in half:
            assert step.params[step.names.index(name)].dtype != np.float32
            np.testing.assert_array_equal(state[f"master.{name}"], ref)  # masters are the fp32 weights
            np.testing.assert_array_equal(weights[name], ref.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(weights[name], ref)
    assert step.state_keys() == set(state)  # unsharded: this rank holds all of it


@pytest.mark.slow  # two training runs of its own (36 s of make test-fast at load ~3)
def test_recompute_equals_stored_activations():
    ref_losses, ref_weights, _ = _run("fp32")
    losses, weights, _ = _run("fp32", recompute=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
    for name, ref in ref_weights.items():
        np.testing.assert_allclose(weights[name], ref, rtol=0, atol=1e-6)


@pytest.mark.slow  # three fp16 training runs of its own (22 s of make test-fast)
def test_half_parameter_run_resumes_exactly(tmp_path, tiny_data):
    from mspretrain.cli import main

    args = ["--config", str(TINY), "--data", str(tiny_data), "precision.dtype=fp16", "precision.param_dtype=compute",
            "checkpoint.every=2", "schedule.warmup_steps=1",
            "schedule.kind=constant", "--quiet", NO_EVAL, ONE_LAYER]  # constant: the 2-step leg has the 4-step run's lr
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["train", *args, "--run", str(whole), "train.max_steps=4"]) == 0
    assert main(["train", *args, "--run", str(split), "train.max_steps=2"]) == 0
    assert main(["train", *args, "--run", str(split), "train.max_steps=4"]) == 0

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}

    assert losses(whole)[3] == losses(split)[3] and losses(whole)[4] == losses(split)[4]
    from safetensors.numpy import load_file

    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(str(r / "checkpoints" / "step_000004" / name)) for r in (whole, split))
        assert any(k.startswith("master.") for k in a) or name == "model.safetensors"
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
