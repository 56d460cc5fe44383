"""Adam moments stored in bf16 (optim.moment_dtype = "bf16", step/update.py `_adamw_rounded`):
the update against torch.optim.AdamW with its moments rounded to bf16 after every step (ml_dtypes'
round to nearest even), an overflowed step a bit-exact no-op, a resume equal to the uninterrupted
run bit for bit, and checkpoints of either moment dtype read by a run of the other. One Bigram
(tests/helpers/bigram.py's), three small compiled steps. The default (fp32) path is the
unchanged `AdamWeightDecay` kernel: test_train_step.py::test_adamw_matches_torch still holds it."""
from dataclasses import replace

import mindspore as ms
import ml_dtypes
import numpy as np
import pytest

from mspretrain.config.schema import OptimConfig
from mspretrain.step.step import TrainStep
from tests.conftest import assert_close_rel, assert_unchanged, snapshot
from tests.helpers.bigram import Bigram, D, V

LR = 1e-2
OPTIM = OptimConfig(lr=LR, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=0.05, moment_dtype="bf16")


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture(scope="module")
def start():
    rng = np.random.default_rng(0)
    emb = rng.normal(0, 0.5, (V, D)).astype(np.float32)
    w = rng.normal(0, 0.5, (D, V)).astype(np.float32)
    return emb, w, [rng.integers(0, V, (4, 9)).astype(np.int32) for _ in range(3)]


@pytest.fixture(scope="module")
def uninterrupted(start):
    """Three steps with bf16 moments, and what each returned."""
    emb, w, batches = start
    model = Bigram(emb, w)
    step = TrainStep(model, OPTIM, global_tokens=4 * 8)
    return model, step, [step.run([(b, None, None)], lr=LR, scale=1.0) for b in batches]


def test_bf16_moments_match_torch_adamw_with_rounded_moments(start, uninterrupted):
    import torch

    emb, w, batches = start
    model, step, results = uninterrupted
    te, tw = torch.tensor(emb, requires_grad=True), torch.tensor(w, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [te], "weight_decay": 0.0}, {"params": [tw], "weight_decay": 0.1}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for b, res in zip(batches, results):
        tb = torch.tensor(b, dtype=torch.long)
        loss = torch.nn.functional.cross_entropy((te[tb[:, :-1]] @ tw).reshape(-1, V), tb[:, 1:].reshape(-1), reduction="sum") / 32
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([te, tw], 0.05)
        opt.step()
        with torch.no_grad():  # the moments kept in bf16: rounded after the step that used them in fp32
            for p in (te, tw):
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key].copy_(opt.state[p][key].bfloat16().float())
        assert res.finite and res.loss == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(model.embed.asnumpy(), te.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(model.w.asnumpy(), tw.detach().numpy(), atol=1e-6)
    state = step.optimizer_state()
    assert int(state["opt_step"]) == 3 and step.exp_avg[0].dtype == ms.float32  # CPU: fp32 Parameters holding bf16 values
    for ours, p in (("lm_head.weight", tw), ("embed.weight", te)):
        for key in ("exp_avg", "exp_avg_sq"):
            got = state[f"{key}.{ours}"]
            assert got.dtype == np.float32 and np.array_equal(got, _bf16(got)), f"{key}.{ours} holds values bf16 cannot"
            # one bf16 unit (2^-8 relative) where the fp32 sums round across a bf16 midpoint
            assert_close_rel(got, opt.state[p][key].numpy(), 2**-8, f"{key}.{ours}")


@pytest.fixture(scope="module")
def resumed(start):
    """One step, its weights and optimizer state handed to a fresh model and step, two more."""
    emb, w, batches = start
    first = Bigram(emb, w)
    s1 = TrainStep(first, OPTIM, global_tokens=4 * 8)
    s1.run([(batches[0], None, None)], lr=LR, scale=1.0)
    model = Bigram(first.embed.asnumpy().copy(), first.w.asnumpy().copy())
    step = TrainStep(model, OPTIM, global_tokens=4 * 8)
    step.load_optimizer_state(snapshot(s1.optimizer_state()))
    return model, step, [step.run([(b, None, None)], lr=LR, scale=1.0) for b in batches[1:]]


def test_a_resume_with_bf16_moments_equals_the_uninterrupted_run(uninterrupted, resumed):
    a_model, a_step, a_res = uninterrupted
    b_model, b_step, b_res = resumed
    assert [r.loss for r in b_res] == [r.loss for r in a_res[1:]]
    assert np.array_equal(a_model.w.asnumpy(), b_model.w.asnumpy()) and np.array_equal(a_model.embed.asnumpy(), b_model.embed.asnumpy())
    a, b = a_step.optimizer_state(), b_step.optimizer_state()
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_checkpoints_cross_moment_dtypes(start, resumed):
    """fp32 moments resumed with bf16 ones are rounded to bf16 on load (nearest even); bf16 ones
    resumed with fp32 moments are read exactly (a bf16 value is an fp32 one). No compile: loads only."""
    emb, w, _ = start
    _, step, _ = resumed
    rng = np.random.default_rng(3)
    fp32 = {k: (v if k == "opt_step" else rng.standard_normal(v.shape).astype(np.float32) * 1e-3)
            for k, v in snapshot(step.optimizer_state()).items()}
    fresh = TrainStep(Bigram(emb, w), OPTIM, global_tokens=4 * 8, jit=False)
    fresh.load_optimizer_state(fp32)
    got = fresh.optimizer_state()
    for k in fp32:
        if k != "opt_step":
            assert np.array_equal(got[k], _bf16(fp32[k])) and not np.array_equal(got[k], fp32[k]), k
    plain = TrainStep(Bigram(emb, w), replace(OPTIM, moment_dtype="fp32"), global_tokens=4 * 8, jit=False)
    plain.load_optimizer_state(snapshot(got))
    back = plain.optimizer_state()
    assert all(np.array_equal(back[k], got[k]) for k in got)


def test_an_overflowed_step_leaves_bf16_moments_and_weights_bit_identical(start, uninterrupted):
    """An inf loss scale overflows the gradients: weights, moments and the step counter stay as
    they were (the kernel runs with b1 = b2 = 1 and lr = 0). Same compiled graph as above, run last."""
    batches = start[2]
    model, step, _ = uninterrupted
    before_w = snapshot({"e": model.embed.asnumpy(), "w": model.w.asnumpy()})
    before = snapshot(step.optimizer_state())
    res = step.run([(batches[0], None, None)], lr=LR, scale=float("inf"))
    assert not res.finite
    assert_unchanged(before_w, {"e": model.embed.asnumpy(), "w": model.w.asnumpy()})
    assert_unchanged(before, step.optimizer_state())


def test_plan_counts_what_the_cpu_step_holds(uninterrupted):
    """On CPU the bf16 moments are fp32 Parameters (8 bytes an element, as `plan` counts for a CPU
    target); an NPU's are bf16 (4: tests/preflight/test_plan_moe.py counts an Ascend step's)."""
    from mspretrain.config.schema import Config
    from mspretrain.preflight.costs import moment_bytes

    _, step, _ = uninterrupted
    cfg = replace(Config(), optim=OPTIM)
    assert step.buffer_bytes()["adam_moments"] == moment_bytes(cfg, "cpu") * step.owned_elements() == 8 * (V * D * 2)
    assert moment_bytes(cfg, "ascend") == 4 and moment_bytes(replace(cfg, optim=replace(OPTIM, moment_dtype="fp32")), "ascend") == 8
