"""The model (`Decoder`): a decoder-only transformer in MindSpore with the switches the families
of families.py name (Llama-2/3, Qwen2/2.5, Qwen3, Mistral), its seeded initialisation and its
state as numpy.

The parts live below it: model/layers.py (the numerics, Linear, Embedding, RMSNorm),
model/attention.py (RoPE, Attention), model/block.py (MLP, Block, ZeRO-3's prefetch).

Design choices (and the trade-off taken):
- HF tensor layout, fused: the query/key/value projections are one parameter `wqkv` (rows: the H
  query heads, then the KV key heads, then the KV value heads) and the SwiGLU gate/up projections
  one parameter `w13` (gate rows, then up rows): one tensor to load, save, decay and clip each. At
  compute time the *weight* is split into row blocks (q+k | v, gate | up), not the activation,
  because MindSpore's CPU Split/Concat copy and the activation is the larger tensor (measured in
  docs/benchmarks/train.md). Weights are (out, in) like PyTorch, so the bridge never transposes.
- RoPE uses HF's rotate-half convention (not Meta's interleaved pairs), so HF checkpoints load
  without permuting q/k rows. cos/sin tables are built once in float64, stored as float32 `Tensor`
  constants: not Parameters, not in the state dict, not seen by the optimizer.
- Grouped-query attention never repeats K/V: the G = H / KV query heads that share a KV head are
  folded into the query-length axis, so one batched MatMul per KV head does the work.
- Masks are additive fp32 biases built once per forward and shared by all layers: causal, and,
  when `segments` is given, block-diagonal by document so attention never crosses a document.
- Precision policy: parameters are fp32 master weights; `dtype` (fp32/fp16/bf16) is the compute
  dtype weights and activations are cast to. fp32 islands: RMSNorm statistics, attention softmax,
  the lm_head (input, weight and logits). Logits are always fp32. With fp32 no cast is emitted.
- Attention kernel by device: the math path everywhere; Ascend's fused `FlashAttentionScore`
  (fp16/bf16 only, BNSD layout, native GQA) when device is ascend. The flash path's argument
  layout is unit-tested on CPU against a reference of the documented semantics; the kernel
  itself is verified only on Ascend.
- CPU speed (math path): no elementwise op takes a broadcast operand where it can be avoided,
  because MindSpore's CPU Mul/Add/Sub are ~2.5x slower then (docs/benchmarks/train.md, issue 16
  section). RoPE tables and the causal bias are broadcast to full shape once per forward and
  shared by all layers; per-row statistics (RMSNorm's 1/rms, the softmax backward's row sum) are
  spread to full rows by an outer-product GEMM (`spread`). Both are exact: the numbers are
  bit-identical to the broadcasting form.
- Initialisation is Llama's, explicit and seeded: normal(0, init_std) for embedding and linear
  weights, the residual projections (wo, w2) scaled by 1/sqrt(2 * n_layers), norms at one, q/k/v
  biases at zero. The numbers (issue 38, counter-based, `InitStreams`): the drawn weights are
  numbered k = 0, 1, ... in creation order (embedding; per layer wqkv, wo, w13, w2; lm_head if
  untied); block b of INIT_BLOCK = 2^20 values of weight k's row-major flattening is
  `Generator(PCG64(SeedSequence(seed, spawn_key=(k, b)))).standard_normal(n_b, dtype=float32)`
  times float32(std), the last block shorter. Blocks are drawn by a thread pool; the weights are
  bit-identical whatever the thread count, and on every rank.
- Families (issue 31), each a switch in ModelConfig read from the HF config by model/hf.py, with
  transformers' numerics: q/k/v bias (Qwen2: `wqkv.bias`, zeros at init, never on o); QK-norm
  (Qwen3: an RMSNorm over head_dim on q and on k, before RoPE); an explicit head_dim (Qwen3);
  Llama-3.1's `llama3` RoPE frequency rescaling (transformers' `_compute_llama3_parameters`); a
  sliding window (Mistral: key j visible from query i iff i - j < window, transformers'
  `sliding_window_overlay`), applied only when the sequence is longer than the window (on the
  flash path as the kernel's band, sparse_mode 4: see Attention). A model with none of them
  (Llama-2) builds exactly the graph it built before they existed.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.config.schema import ModelConfig
from mspretrain.device import select_attention  # the kernel choice is the device's
from mspretrain.errors import UserError, env_number
from mspretrain.model import params
from mspretrain.model.attention import Attention, rope_tables
from mspretrain.model.block import Block
from mspretrain.model.layers import (
    COMPUTE_DTYPES,
    FLASH_MASK_SIZE,
    NEG,
    Embedding,
    Linear,
    RMSNorm,
    SoftmaxPlain,
    WeightCell,
    one,
    relay,
    use_fused_kernels,
)
from mspretrain.model.lazy import LazyDraw, check_names_and_shapes, send_undrawn
from mspretrain.model.moe import MoE
from mspretrain.model.moe_kernels import select_grouped

# Where `_normal` puts each new weight while a Decoder is being built: None (host memory, CPU), or a
# MindSpore device name. On Ascend each weight goes into device memory as soon as it is drawn, so a
# rank's host holds one parameter at a time, not the fp32 model (27 GB for 7B, 216 GB for 8 ranks).
# `Tensor.to(device)` is 2.10's API for it (mindspore/common/tensor.py documents `to("Ascend")`;
# `move_to` is deprecated there). The numbers are drawn on the host, the same on every device.
_init_device: list[str | None] = [None]

# Values per random stream in the weight draw (issue 38, item 2): a constant of the scheme, never
# derived from the thread count or the machine, so the weights are the same wherever they are
# drawn. 2^20 values (4 MB of float32) is ~9 ms of drawing per stream against ~25 us to seed one,
# and Qwen2.5-7B's largest weight still splits into 520 pieces for the threads to share.
INIT_BLOCK = 1 << 20
INIT_THREADS_CAP = 32


def init_threads() -> int:
    """Threads that draw the weights: `$MSPRETRAIN_INIT_THREADS` if set, else the cores this process
    may run on (`os.sched_getaffinity`: a rank that msrun or taskset binds to its share of the host
    gets that share; an unbound rank sees every core, so 8 unbound ranks run up to 8 x 32 threads
    at once), at most INIT_THREADS_CAP. Only the speed depends on it, never a value."""
    if os.environ.get("MSPRETRAIN_INIT_THREADS", "").strip():
        return int(env_number("MSPRETRAIN_INIT_THREADS", 0, kind=int, minimum=1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, INIT_THREADS_CAP))


class InitStreams:
    """The random streams of one model's initialisation, all from the run seed (counter-based).

    Weight k (0, 1, ... in creation order) is drawn in blocks of INIT_BLOCK values of its row-major
    flattening; block b comes from its own stream, PCG64 seeded by
    `SeedSequence(seed, spawn_key=(k, b))` (the same stream as `SeedSequence(seed).spawn(k + 1)[k]
    .spawn(b + 1)[b]`): `standard_normal(n_b, dtype=float32) * float32(std)`. No stream depends on
    another, so the blocks are drawn by `threads` threads (numpy's fill methods release the GIL)
    into one preallocated array, and the result is bit-identical for any thread count and on every
    rank. (Across CPU architectures it is as identical as numpy's float32 ziggurat is: its rare
    tail and wedge paths call the C library's expf/log1pf.)"""

    def __init__(self, seed: int, threads: int | None = None) -> None:
        self.seed = int(seed)
        self.threads = threads if threads is not None else init_threads()
        self.count = 0  # weights drawn so far: the next weight's index k

    def parameter(self, shape: tuple[int, ...], std: float) -> Parameter:
        """The next weight as a Parameter (`_normal`): what the cells of model/layers.py draw."""
        return _normal(self, shape, std)

    def draw(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        """The next weight: normal(0, std) float32 of `shape`, as specified in the class docstring."""
        k, self.count = self.count, self.count + 1
        x = np.empty(shape, np.float32)
        self.fill(k, x, std)
        return x

    def fill(self, k: int, x: np.ndarray, std: float) -> None:
        """Weight k's values into `x` (float32, C-contiguous, its shape): `draw`'s numbers, at any
        time after the weight's index was taken (`LazyDraw`)."""
        flat = x.reshape(-1)  # a view: C-contiguous, so every block is a contiguous slice
        scale = np.float32(std)

        def block(b: int) -> None:
            piece = flat[b * INIT_BLOCK:(b + 1) * INIT_BLOCK]
            gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(k, b))))
            gen.standard_normal(out=piece, dtype=np.float32)
            piece *= scale  # in place: the same float32 products as `piece * std`

        blocks = range(-(-flat.size // INIT_BLOCK))
        if self.threads == 1 or len(blocks) <= 1:
            for b in blocks:
                block(b)
        else:
            with ThreadPoolExecutor(min(self.threads, len(blocks))) as pool:
                list(pool.map(block, blocks))  # list(): re-raises a block's exception here


def _draw(streams: InitStreams, shape: tuple[int, ...], std: float) -> Tensor:
    """normal(0, std) float32 of `shape`, the next weight of `streams` (InitStreams: the streams of
    the run seed, drawn in parallel, docs/operators.md start-up), as a Tensor on `_init_device[0]`
    (host memory if None; "lazy": drawn when first read, `LazyDraw`)."""
    if _init_device[0] == "lazy":
        k, streams.count = streams.count, streams.count + 1
        return Tensor(shape=shape, dtype=ms.float32, init=LazyDraw(streams, k, std))
    x = streams.draw(shape, std)
    if _init_device[0] is None:
        return Tensor(x)
    # ms.from_numpy (ops/function/array_func.py; `Tensor.from_numpy` is the deprecated spelling) shares
    # `x`, no host copy, and holds a reference to it (measured: the array's refcount + 1), so the
    # buffer outlives any queued copy; `to` copies it to the device (non_blocking=False by default)
    return ms.from_numpy(x).to(_init_device[0])


def _normal(streams: InitStreams, shape: tuple[int, ...], std: float) -> Parameter:
    # The drawn tensor is passed as a temporary and the name positionally, on purpose. MindSpore
    # 2.10's Parameter.__new__ (mindspore/common/parameter.py l.257-273) takes
    # rc = sys.getrefcount(default_input), and `_get_parameter_new_args` (l.377-394) wraps the tensor
    # without a copy only if rc == 4 ("the input data is not referenced in other place"); otherwise
    # it rebuilds the Parameter from `data.asnumpy()`: a device tensor comes back to the host and is
    # copied again. Measured on CPython 3.11 (and, with a pure-Python stand-in of that __new__, the
    # same on 3.9, 3.10 and 3.12): `Parameter(Tensor(x), "w")` gives 4; a local variable
    # holding the tensor adds 1 and passing `name=` as a keyword adds 1 more, so the former
    # `t = ...; Parameter(t, name="weight")` gave 6 (the probe's number), and so does any caller
    # that keeps a reference. The count is the interpreter's, not an API:
    # tests/train/test_startup.py checks the Parameter holds the very buffer `Tensor.to` returned.
    if _init_device[0] == "lazy":
        # left uninitialised: Parameter.__new__ fills a lazy tensor at once unless the class's
        # `init_param` is False (common/parameter.py `_get_parameter_new_args`; what 2.10's
        # deprecated `nn.utils.no_init_parameters` sets), and reading it draws it (LazyDraw)
        Parameter.init_param = False
        try:
            return Parameter(_draw(streams, shape, std), "weight")
        finally:
            Parameter.init_param = True
    return Parameter(_draw(streams, shape, std), "weight")


class Decoder(nn.Cell):
    """The decoder. construct(tokens (B,T) int32, positions=None, segments=None) -> logits (B,T,V) fp32.

    `positions` (B, T) restart RoPE at document starts; `segments` (B, T) (document id per token) keep
    attention inside a document. `dtype` is the compute dtype, `attention` auto|math|flash, `device`
    cpu|ascend (picks the kernel), `seed` the initialisation (numpy PCG64 streams, `InitStreams`, independent of MindSpore).
    """

    def __init__(self, cfg: ModelConfig, *, dtype: str = "fp32", attention: str = "auto", device: str = "cpu",
                 seed: int = 0, host_weights: bool = False) -> None:
        super().__init__()
        if dtype not in COMPUTE_DTYPES:
            raise UserError(f"precision dtype {dtype!r} is not one of fp32, fp16, bf16", "set precision.dtype=fp32 (CPU) or fp16/bf16 (Ascend)")
        if dtype == "bf16" and device == "cpu":
            raise UserError("precision.dtype = bf16 is not supported on CPU (MindSpore has no CPU bf16 kernels)",
                            "use precision.dtype=fp32 (or fp16) on CPU; bf16 is for Ascend")
        if cfg.vocab_size <= 0 or cfg.n_kv_heads <= 0 or cfg.ffn_dim <= 0:
            raise UserError("model config is not resolved (vocab_size, n_kv_heads or ffn_dim is 0)",
                            "call mspretrain.config.schema.resolve_model(cfg.model, tokenizer.vocab_size) first")
        self.cfg = cfg
        self.dtype_name = dtype
        self.dtype = COMPUTE_DTYPES[dtype]
        self.use_flash = select_attention(attention, device, dtype, cfg.head_size)
        # One compressed causal mask for all layers (a per-layer copy was 32 x 4 MB for 7B).
        self.flash_causal_mask = (Tensor(np.triu(np.ones((FLASH_MASK_SIZE, FLASH_MASK_SIZE), np.uint8), 1))
                                  if self.use_flash else None)
        rng = InitStreams(seed)  # each weight's streams from the seed (see InitStreams); passed down as `rng`
        # see `_normal`; only where this process runs on an NPU (a model built for Ascend on a CPU box,
        # as the tests and `selftest` do, stays in host memory)
        on_npu = use_fused_kernels(device) and ms.get_current_device().device_target == "Ascend"
        # host_weights: drawn into host memory even on an NPU, for a model that will be cut (ZeRO-3,
        # tensor parallel: only each rank's pieces go to the device, model/parallel.py `piece_tensor`)
        # (on an NPU drawn when first read, "lazy": the cut then holds one whole weight at a time)
        _init_device[0] = ("lazy" if host_weights else "Ascend") if on_npu else None
        try:
            self.embed = Embedding(cfg.vocab_size, cfg.dim, cfg.init_std, rng)
            self.layers = nn.CellList([Block(cfg, rng, self.dtype, self.use_flash, cfg.is_moe_layer(i))
                                         for i in range(cfg.n_layers)])
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.dtype)
            self.tied = cfg.tie_embeddings
            if not self.tied:
                self.lm_head = Linear(cfg.dim, cfg.vocab_size, cfg.init_std, rng, ms.float32, role="vocab")  # fp32 island
        finally:
            _init_device[0] = None
        llama3 = ((cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len)
                  if cfg.rope_scaling == "llama3" else None)
        cos, sin = rope_tables(cfg.head_size, cfg.max_seq_len, cfg.rope_theta, llama3)
        self.rope_cos, self.rope_sin = Tensor(cos), Tensor(sin)  # constants, (S, hd) fp32
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.window = cfg.sliding_window  # 0 = full attention
        self.local_heads = (cfg.n_heads, cfg.n_kv_heads)  # (q, kv) heads of this rank: fewer under tensor parallel
        self.fused_kernels = use_fused_kernels(device)
        self.sharded = False  # ZeRO-3: the trained Parameters are this rank's slices (step/zero3.py shard_model)
        # tensor parallel (`apply_tp`): what the cut made (model/parallel.py TPSplit) and the loss over
        # this rank's vocabulary columns the train step and eval use instead of `token_nll`
        self.tp_split: Any = None
        self.tp_loss: Any = None
        self.ep_split: Any = None  # expert parallel (`apply_ep`): model/expert_parallel.py ExpertSplit
        if self.fused_kernels:  # one model definition: the norm and softmax cells switch kernel
            for _, cell in self.cells_and_names():
                if isinstance(cell, RMSNorm):
                    cell.fused = True
                elif isinstance(cell, Attention):
                    cell.softmax = SoftmaxPlain()
                elif isinstance(cell, MoE):  # the fused permutation and grouped matmul
                    cell.grouped = select_grouped("auto", device)

    def construct(self, tokens: Tensor, positions: Tensor | None = None, segments: Tensor | None = None,
                  routing: bool = False, per_layer: bool = False, logits: bool = True) -> Tensor | tuple[Tensor, Tensor]:
        """`routing` (MoE, model/moe.py; a constant): (logits, routing stats (2, E) summed over the MoE
        layers) for the load-balancing loss of the train step; with `per_layer` (a constant) the
        stats of each MoE layer, (L_moe, 2, E), for the expert-load metrics (issue 52.6).
        `logits` False (a constant): (h (B*T, D) fp32, head weight (V, D)) in place of the logits, for
        the chunked loss (optim.loss_chunk_tokens, model/loss.py `ChunkedNLL`)."""
        T = tokens.shape[1]
        token = None
        if self.sharded:  # ZeRO-3 (step/zero3.py): the embedding gathered, the first block's gathers after it
            e, token = self.embed.pull(one(tokens))
            x = self.embed(tokens, e)
            token = relay(token, tokens)
        else:
            x = self.embed(tokens)  # (B, T, D) fp32
        if self.dtype != ms.float32:
            x = x.astype(self.dtype)
        cos, sin = self._rope(positions, T)
        bias, discard = self._mask(segments, T, x.shape[0])
        if not self.use_flash:
            # Broadcast once per forward, used by every layer forward and backward in same-shape ops
            # (a broadcast operand makes MindSpore's CPU Mul/Add 2.5x slower; see spread()). The full
            # bias is one more (B, H, T, T) fp32 tensor per step, next to the L saved probabilities.
            (B, hd), (H, KV) = (x.shape[0], self.cfg.head_size), self.local_heads
            cos = ops.broadcast_to(cos, (B, T, H + KV, hd))  # q and k heads get RoPE in one call
            sin = ops.broadcast_to(sin, (B, T, H + KV, hd))
            bias = ops.broadcast_to(bias, (B, H, T, T))
        stats = None
        each = []
        for layer in self.layers:
            if token is None:
                x = layer(x, cos, sin, bias, discard)
                if layer.sparse:  # MoE: (x, routing stats)
                    x, s = x
                    stats = s if stats is None else stats + s
                    each.append(s)
            elif layer.sparse:  # ZeRO-3: each block's gathers start from the previous block's token
                x, token, s = layer(x, cos, sin, bias, discard, token)
                stats = s if stats is None else stats + s
                each.append(s)
            else:
                x, token = layer(x, cos, sin, bias, discard, token)
        out = self._head(x, token, logits)
        if routing and per_layer:
            return out, ops.stack(each)
        if routing:
            return out, stats
        return out

    def apply_tp(self, group: Any) -> Any:
        """Cut this whole model into tp rank `group.rank`'s piece, in place (model/parallel.py has the
        design): every weight cell by its declared role (model/layers.py), each block to its heads
        and ffn units, the loss to this rank's vocabulary columns. Returns (and keeps as `tp_split`)
        the cut's record, model/parallel.py `TPSplit`. The weights must be whole (a fresh Decoder or
        one with whole weights loaded); a tied embedding is cut once (the head uses its rows)."""
        from mspretrain.model.parallel import TPSplit, VocabParallelNLL, check_tp

        check_tp(self.cfg, group.size)
        n = group.size
        cut: dict[str, Any] = {}
        for layer in self.layers:
            cut.update(layer.apply_tp(group))
        cut.update(self.norm.apply_tp(group))  # the final norm feeds the vocabulary-parallel head only
        cut.update(self.embed.apply_tp(group))
        if not self.tied:
            cut.update(self.lm_head.apply_tp(group))
        self.local_heads = (self.cfg.n_heads // n, self.cfg.n_kv_heads // n)
        V = self.cfg.vocab_size // n
        self.tp_loss = VocabParallelNLL(group.rank * V, V, group, plain_sum=self.fused_kernels)
        partial = frozenset(c.weight.name for _, c in self.cells_and_names() if isinstance(c, WeightCell) and c.role == "partial")
        self.tp_split = TPSplit(group, {k: shape for k, (shape, _) in cut.items()}, {k: where for k, (_, where) in cut.items()}, partial)
        return self.tp_split

    def apply_ep(self, group: Any) -> Any:
        """Expert parallel: each MoE layer keeps ep rank `group.rank`'s experts, dispatching over `group`
        (model/moe.py `MoE.apply_ep`); returns (and keeps as `ep_split`) model/expert_parallel.py `ExpertSplit`.
        A model built for the cut (`host_weights`, on an NPU: each weight drawn when first read,
        `LazyDraw`): each expert stack is drawn on the host, cut, and only this rank's E/ep experts
        go to the device; then every weight the cut did not read (attention, router, embedding,
        lm_head: replicated over the ep group) is drawn and sent whole, one at a time (model/lazy.py `send_undrawn`),
        so neither the host nor the device ever holds the whole model (train/build.py `builds_on_host`)."""
        from mspretrain.model.expert_parallel import ExpertSplit

        cut: dict[str, Any] = {}
        for layer in self.layers:
            if layer.sparse:
                cut.update(layer.mlp.apply_ep(group, self.cfg))
        send_undrawn(self, group.device)
        self.ep_split = ExpertSplit(group, {k: s for k, (s, _) in cut.items()}, {k: w for k, (_, w) in cut.items()})
        return self.ep_split

    def _head(self, x: Tensor, token: Tensor | None = None, logits: bool = True) -> Tensor | tuple[Tensor, Tensor]:
        B, T = x.shape[0], x.shape[1]
        if token is None:
            h = self.norm(x).astype(ms.float32).reshape(B * T, -1)  # (B*T, D) fp32: lm_head is an fp32 island
            w = self.embed.weight if self.tied else self.lm_head.weight
        else:  # ZeRO-3: the norm's and the head's gathers after the last block's (model/block.py)
            wn, token = self.norm.pull(token if self.layers[0].prefetch else one(x))
            h = self.norm(x, wn).astype(ms.float32).reshape(B * T, -1)
            w = self.embed.pull(token)[0] if self.tied else self.lm_head.pull(token)[0]
        if not logits:  # the chunked loss takes the head's input and weight
            return h, w
        return self.head_matmul(h, w).reshape(B, T, -1)  # (B, T, V) fp32

    # ----------------------------------------------------------------- incremental decoding
    def init_cache(self, batch: int, max_len: int) -> tuple[Tensor, ...]:
        """A zeroed K/V cache: (k_0, v_0, k_1, v_1, ...), each (batch, n_kv_heads, max_len, head_dim)."""
        if not 0 < max_len <= self.cfg.max_seq_len:
            raise UserError(f"cache length {max_len} is outside 1..model.max_seq_len = {self.cfg.max_seq_len}",
                            "generate fewer tokens or use a model with a longer context")
        shape = (batch, self.cfg.n_kv_heads, max_len, self.cfg.head_size)
        return tuple(ops.zeros(shape, self.dtype) for _ in range(2 * self.cfg.n_layers))

    def prefill(self, tokens: Tensor, cache: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Run a prompt (B, T) from position 0: (logits (B, T, V) fp32, cache holding positions 0..T-1)."""
        T, S = tokens.shape[1], cache[0].shape[2]
        x = self.embed(tokens).astype(self.dtype)
        cos, sin = self._rope(None, T)
        idx_q, idx_k = ops.arange(T).expand_dims(1), ops.arange(S).expand_dims(0)
        visible = idx_k <= idx_q
        if self.window and T > self.window:
            visible = ops.logical_and(visible, idx_k > idx_q - self.window)
        bias = ops.stop_gradient((visible.astype(ms.float32) - 1.0) * -NEG).reshape(1, 1, T, S)
        new = ()
        for i, layer in enumerate(self.layers):
            x, kc, vc = layer.cached(x, cos, sin, bias, cache[2 * i], cache[2 * i + 1], None)
            new = new + (kc, vc)
        return self._head(x), new

    def decode_step(self, token: Tensor, pos: Tensor, cache: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One token per row, token (B, 1) at position `pos` (int32 scalar tensor, same for all rows):
        (logits (B, 1, V) fp32, updated cache). Static shapes, so one compiled graph serves every step."""
        S = cache[0].shape[2]
        x = self.embed(token).astype(self.dtype)  # (B, 1, D)
        p = pos.reshape(1, 1)
        cos, sin = self._rope(p, 1)  # (1, 1, 1, hd)
        idx = ops.arange(S)
        visible = idx <= pos  # keys 0..pos visible
        if self.window and S > self.window:
            visible = ops.logical_and(visible, idx > pos - self.window)
        bias = ((visible.astype(ms.float32) - 1.0) * -NEG).reshape(1, 1, 1, S)
        slot = (idx == pos).astype(self.dtype).reshape(1, 1, S, 1)
        new = ()
        for i, layer in enumerate(self.layers):
            x, kc, vc = layer.cached(x, cos, sin, bias, cache[2 * i], cache[2 * i + 1], slot)
            new = new + (kc, vc)
        return self._head(x), new

    def _rope(self, positions: Tensor | None, T: int) -> tuple[Tensor, Tensor]:
        if positions is None:
            cos, sin = self.rope_cos[:T].expand_dims(1), self.rope_sin[:T].expand_dims(1)  # (T, 1, hd)
        else:
            cos = ops.gather(self.rope_cos, positions, 0).expand_dims(2)  # (B, T, 1, hd)
            sin = ops.gather(self.rope_sin, positions, 0).expand_dims(2)
        if self.dtype != ms.float32:
            cos, sin = cos.astype(self.dtype), sin.astype(self.dtype)
        # Constants: stop_gradient spares the backward pass the reductions of d(loss)/d(cos, sin).
        return ops.stop_gradient(cos), ops.stop_gradient(sin)

    def _mask(self, segments: Tensor | None, T: int, B: int = 1) -> tuple[Tensor, Tensor | None]:
        """Additive fp32 bias (B|1, 1, T, T) for the math path; bool discard mask for flash. `B` is
        unused since a flash mask exists only with documents (kept: callers pass it)."""
        idx = ops.arange(T)
        allowed = idx.expand_dims(0) <= idx.expand_dims(1)  # (T, T): key j visible from query i iff j <= i
        windowed = bool(self.window) and T > self.window  # static: decided when the graph is compiled
        if windowed:  # Mistral: and i - j < window
            allowed = ops.logical_and(allowed, idx.expand_dims(0) > idx.expand_dims(1) - self.window)
        if segments is not None:
            same = segments.expand_dims(2) == segments.expand_dims(1)  # (B, T, T)
            allowed = ops.logical_and(allowed.expand_dims(0), same)  # (B, T, T)
        else:
            allowed = allowed.expand_dims(0)  # (1, T, T)
        allowed = allowed.expand_dims(1)  # (B|1, 1, T, T)
        bias = ops.stop_gradient((allowed.astype(ms.float32) - 1.0) * -NEG)  # 0 where visible, NEG where masked
        discard = None
        if self.use_flash:
            if segments is None:  # causal (sparse_mode 2) or, windowed, the band (sparse_mode 4): see Attention
                discard = self.flash_causal_mask
            else:  # sparse_mode 0 (see Attention): the full mask, window included, already in the
                discard = ops.logical_not(allowed)  # kernel's (B, 1, S, S) layout, B the segments' batch
        return bias, discard


# --------------------------------------------------------------------------- state <-> numpy

def state_numpy(model: Decoder, keep_fp16: bool = False) -> dict[str, np.ndarray]:
    """Every parameter by name as fp32 numpy (RoPE tables are constants and not included).

    fp32 parameters come back as views of live memory on CPU (copy before handing them to a
    thread); parameters stored in fp16/bf16 (precision.param_dtype=compute) as fp32 copies, or
    fp16 ones as they are with `keep_fp16` (checkpoints: half the bytes, loading upcasts)."""
    def value(p: Parameter) -> np.ndarray:
        if p.dtype == ms.float32 or (keep_fp16 and p.dtype == ms.float16):
            return p.asnumpy()
        return p.astype(ms.float32).asnumpy()

    return {p.name: value(p) for p in model.get_parameters()}


def half_eligible(model: Decoder) -> list[str]:
    """Parameters that may be stored in the compute dtype: the decoder layers' matrices. Norm
    weights and the lm_head stay fp32 (fp32 islands); so does the embedding, whose gradient is a
    scatter-add over repeated tokens that would round differently in half precision (measured:
    5e-6 in the loss after two steps) — the embedding is 2 % of a 7B model."""
    # the table's `half` column; an MoE routing bias (requires_grad False, model/moe.py) is model state, fp32
    return [p.name for p in model.get_parameters() if p.requires_grad and params.half_eligible(p.name)]


def load_numpy(model: Decoder, tensors: dict[str, np.ndarray]) -> None:
    """Strict load: a missing, unexpected or mis-shaped tensor raises UserError naming it."""
    params = {p.name: p for p in model.get_parameters()}
    check_names_and_shapes(params, tensors)
    for name, p in params.items():
        t = Tensor(np.ascontiguousarray(tensors[name], dtype=np.float32))
        p.set_data(t if p.dtype == ms.float32 else t.astype(p.dtype))
