"""The compiled train step against independent references.

- loss normalisation, clipping and AdamW against PyTorch autograd + torch.optim.AdamW;
- k micro-batches == one batch of k*b (loss, grad norm, weights and Adam moments after 3 steps);
- an overflowed fp16 step changes no weight and no moment, and does not advance AdamW.
"""
import numpy as np
import pytest

from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model
from mspretrain.model.decoder import Decoder, state_numpy
from mspretrain.step.step import TrainStep, decay_mask
from tests.conftest import assert_close_rel, assert_unchanged, assert_unshared, snapshot
from tests.helpers.bigram import Bigram, Bigram16, D, V


def test_decay_mask():
    names = ["embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.wqkv.bias", "layers.0.attn.wqkv.weight"]
    assert decay_mask(names, False) == [False, False, False, True]
    assert decay_mask(["embed.weight"], True) == [True]


# fp16 with a real loss scale and clipping active: a step that clips the *scaled* norm, or unscales
# after clipping, gives moments 1024x off (Adam's g/sqrt(v) hides most of it from the weights).
# PyTorch does it the documented way (torch.amp: backward of loss*scale, unscale, then clip).
@pytest.mark.parametrize("dtype,scale,clip", [("fp32", 1.0, 0.0), ("fp32", 1.0, 0.05), ("fp16", 1024.0, 0.05), ("fp16", 4096.0, 0.0)])
def test_adamw_matches_torch(dtype, scale, clip):
    import torch  # a pinned test dependency: missing must fail, not skip (pyproject [test])
    rng = np.random.default_rng(0)
    emb = rng.normal(0, 0.5, (V, D)).astype(np.float32)
    w = rng.normal(0, 0.5, (D, V)).astype(np.float32)
    batches = [rng.integers(0, V, (4, 9)).astype(np.int32) for _ in range(3)]
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=clip)
    half = dtype == "fp16"
    model = (Bigram16 if half else Bigram)(emb, w)
    step = TrainStep(model, optim, global_tokens=4 * 8, jit=True)
    ours = [step.run([(b, None, None)], lr=1e-2, scale=scale) for b in batches]

    te = torch.tensor(emb, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [te], "weight_decay": 0.0}, {"params": [tw], "weight_decay": 0.1}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for b, res in zip(batches, ours):
        tb = torch.tensor(b, dtype=torch.long)
        logits = (te[tb[:, :-1]].half() @ tw.half()).float() if half else te[tb[:, :-1]] @ tw
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tb[:, 1:].reshape(-1), reduction="sum") / (4 * 8)
        opt.zero_grad()
        (loss * scale).backward()
        for p in (te, tw):
            p.grad /= scale  # unscale first ...
        norm = torch.sqrt(te.grad.pow(2).sum() + tw.grad.pow(2).sum())
        if clip:
            torch.nn.utils.clip_grad_norm_([te, tw], clip)  # ... then clip the true norm
        opt.step()
        assert res.finite
        assert res.loss == pytest.approx(loss.item(), rel=1e-3 if half else 1e-5)
        assert res.grad_norm == pytest.approx(norm.item(), rel=1e-3 if half else 1e-4)
    # fp16 rounds the logits differently on the two sides: the weights agree to ~lr/100
    atol = 1e-4 if half else 1e-6
    np.testing.assert_allclose(model.embed.asnumpy(), te.detach().numpy(), atol=atol)
    np.testing.assert_allclose(model.w.asnumpy(), tw.detach().numpy(), atol=atol)
    opt_state = step.optimizer_state()
    assert int(opt_state["opt_step"]) == 3
    # relative over the whole tensor: an absolute 1e-7 would pass moments 1000x too small
    for ours_key, torch_p in (("lm_head.weight", tw), ("embed.weight", te)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_rel(opt_state[f"{key}.{ours_key}"], opt.state[torch_p][key].numpy(), 1e-2 if half else 1e-5, f"{key}.{ours_key}")


def _tiny(dtype="fp32", n_layers=1):
    """One layer for the compiled-step tests: what they check (accumulation, frozen groups, an
    overflow) is per parameter, and a second layer only repeats the first's nodes at ~2.5 s of
    CPU per compilation (docs/benchmarks.md); tests/model/test_model.py checks the layers' stacking."""
    cfg = resolve_model(ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=64), vocab_size=128)
    return Decoder(cfg, dtype=dtype, seed=7)


def test_accumulation_equals_one_big_batch():
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 128, (8, 17)).astype(np.int32) for _ in range(3)]
    # Adam turns a last-bit difference in a near-zero gradient into up to +-lr: keep lr small so
    # that the 1e-6 weight tolerance tests the accumulation, not Adam's sign sensitivity.
    # No clipping: both sides clipped to the same norm would have the same moments whatever the
    # accumulated scale (the grad norm, compared below, is taken before clipping either way).
    optim = OptimConfig(lr=1e-4, grad_clip=0.0)
    a, b = _tiny(), _tiny()
    sa = TrainStep(a, optim, global_tokens=8 * 16)
    sb = TrainStep(b, optim, global_tokens=8 * 16)
    for batch in data:
        ra = sa.run([(batch, None, None)], lr=1e-4, scale=1.0)
        rb = sb.run([(batch[i:i + 2], None, None) for i in range(0, 8, 2)], lr=1e-4, scale=1.0)
        assert abs(ra.loss - rb.loss) <= 1e-6
        # Clipping at 1.0 and Adam's g/sqrt(v) both hide a gradient scale from the weights (a 4x
        # accumulated gradient moved them by 4e-7): the grad norm and the moments do not hide it.
        assert rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-5)
    wa, wb = state_numpy(a), state_numpy(b)
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], atol=1e-6, err_msg=k)
    oa, ob = sa.optimizer_state(), sb.optimizer_state()
    assert set(oa) == set(ob) and int(oa["opt_step"]) == int(ob["opt_step"]) == 3
    for k in sorted(set(oa) - {"opt_step"}):
        assert_close_rel(ob[k], oa[k], 1e-5, k)  # measured <= 6e-7; a 4x gradient gives 3 (exp_avg) and 15 (exp_avg_sq)


def test_a_loss_scale_changes_nothing_but_the_backward_pass():
    """fp32, no overflow: a run at loss scale 1024 with clipping active, fused and accumulated over
    2 micro-batches, equals the run at scale 1 (losses, unscaled grad norms, weights, moments), so
    the scale is removed exactly once and before the norm is clipped, on both graphs. (The bigram
    model: four compilations of the tiny model cost ~10x more and prove nothing more here.)"""
    rng = np.random.default_rng(4)
    emb = rng.normal(0, 0.5, (V, D)).astype(np.float32)
    w = rng.normal(0, 0.5, (D, V)).astype(np.float32)
    data = [rng.integers(0, V, (4, 9)).astype(np.int32) for _ in range(3)]
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.05)
    runs = {}
    for scale in (1.0, 1024.0):
        for micro in (4, 2):
            model = Bigram(emb, w)
            step = TrainStep(model, optim, global_tokens=4 * 8)
            res = [step.run([(b[i:i + micro], None, None) for i in range(0, 4, micro)], lr=1e-2, scale=scale) for b in data]
            runs[scale, micro] = res, {"embed": snapshot(model.embed.asnumpy()), "w": snapshot(model.w.asnumpy())}, \
                snapshot(step.optimizer_state())
    ref_res, ref_w, ref_o = runs[1.0, 4]
    assert all(r.grad_norm > 0.05 for r in ref_res), [r.grad_norm for r in ref_res]  # the clip is active
    for key, (res, w, o) in runs.items():
        for got, want in zip(res, ref_res):
            assert got.finite and got.loss == pytest.approx(want.loss, rel=1e-6) and got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5), key
        for k in ref_w:
            np.testing.assert_allclose(w[k], ref_w[k], rtol=0, atol=1e-6, err_msg=f"{key} {k}")
        for k in sorted(set(ref_o) - {"opt_step"}):
            assert_close_rel(o[k], ref_o[k], 1e-5, f"{key} {k}")


def test_fp16_overflow_skips_the_update_bit_exactly():
    model = _tiny("fp16")
    step = TrainStep(model, OptimConfig(lr=1e-3), global_tokens=4 * 16)
    batch = np.random.default_rng(2).integers(0, 128, (4, 17)).astype(np.int32)
    first = step.run([(batch, None, None)], lr=1e-3, scale=64.0)
    assert first.finite
    # copies: state_numpy() and optimizer_state() are views of the live buffers on CPU
    before_w, before_o = snapshot(state_numpy(model)), snapshot(step.optimizer_state())
    res = step.run([(batch, None, None)], lr=1e-3, scale=3e38)  # scaled grads overflow fp32 -> inf
    assert not res.finite
    after_w, after_o = state_numpy(model), step.optimizer_state()
    assert_unchanged(before_w, after_w)
    assert_unchanged(before_o, after_o)
    assert int(after_o["opt_step"]) == 1
    again = step.run([(batch, None, None)], lr=1e-3, scale=64.0)  # buffers were cleared: a normal step
    assert again.finite and int(step.optimizer_state()["opt_step"]) == 2


def test_frozen_groups_stay_bit_identical_and_hold_no_optimizer_state():
    """train.trainable = ["embeddings", "lm_head"] (stage 1 of the Chinese-LLaMA recipe): after 3
    steps, with and without accumulation, every other parameter is bit-identical, the optimizer
    state and the accumulation buffers hold only the trained parameters, and the first update of
    the trained ones equals a step that trains everything (AdamW is per parameter; no clipping)."""
    from mspretrain.model.groups import param_groups

    rng = np.random.default_rng(5)
    data = [rng.integers(0, 128, (4, 17)).astype(np.int32) for _ in range(3)]
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.0)
    groups = ["embeddings", "lm_head"]
    full_model = _tiny()
    full = TrainStep(full_model, optim, global_tokens=4 * 16)
    full.run([(data[0], None, None)], lr=1e-3, scale=1.0)
    after_one = state_numpy(full_model)
    for micro in (4, 2):  # fused graph; two micro-batches accumulated
        model = _tiny()
        before = snapshot(state_numpy(model))
        step = TrainStep(model, optim, global_tokens=4 * 16, trainable=groups)
        trained = {"embed.weight", "lm_head.weight"}
        assert set(step.names) == trained and {p.name for p in step.frozen} == set(before) - trained
        for k, batch in enumerate(data):
            res = step.run([(batch[i:i + micro], None, None) for i in range(0, 4, micro)], lr=1e-3, scale=1.0)
            assert res.finite and np.isfinite(res.loss)
            if k == 0:
                for name in trained:
                    np.testing.assert_allclose(state_numpy(model)[name], after_one[name], rtol=0, atol=1e-6, err_msg=name)
        after = state_numpy(model)
        assert_unshared(before, after)
        for name, value in before.items():
            if name in trained:
                assert not np.array_equal(after[name], value), f"{name} was not trained"
            else:
                assert np.array_equal(after[name], value), f"frozen {name} changed"
        state = step.optimizer_state()
        assert set(state) == step.state_keys() == {"opt_step"} | {f"{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in trained}
        assert int(state["opt_step"]) == 3
        if micro < 4:
            assert sorted(p.name for p in step.accum) == sorted(f"accum.{n}" for n in trained)
        have = step.buffer_bytes()
        n_trained = sum(int(np.prod(p.shape)) for p in step.params)
        assert have["adam_moments"] == 8 * n_trained and have["weights"] == 4 * sum(v.size for v in before.values())
    assert param_groups("embed.weight", tied=True) == {"embeddings", "lm_head"}


def test_resuming_with_other_trainable_groups_is_one_line():
    from mspretrain.errors import UserError

    model = _tiny(n_layers=2)
    stage1 = TrainStep(model, OptimConfig(), global_tokens=64, trainable=["embeddings", "lm_head"], jit=False)
    state = stage1.optimizer_state()
    everything = TrainStep(model, OptimConfig(), global_tokens=64, jit=False)
    with pytest.raises(UserError, match="train.trainable differs") as exc:
        everything.load_optimizer_state(state)
    assert exc.value.cause.endswith("it has no optimizer state for 13 of the 15 parameters trained now")
    with pytest.raises(UserError, match="optimizer state for 13 parameters frozen now"):
        stage1.load_optimizer_state(everything.optimizer_state())
    stage1.load_optimizer_state(state)  # the same groups: loads
