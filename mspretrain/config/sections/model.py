"""The [model] section: architecture only (no batch size, no parallel layout, no paths). The
families (`model.family`'s choices) and the switches each has are the table in mspretrain/families.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mspretrain.config.sections.base import Section, cap, fail, floor
from mspretrain.families import NAMES, family, switch_hint


@dataclass(frozen=True)
class ModelConfig(Section):
    """Architecture only: no batch size, no parallel layout, no paths."""

    SECTION = "model"

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads (no grouped-query attention)
    vocab_size: int = 0  # 0 = take the tokenizer's vocabulary size from the data dir
    ffn_dim: int = 0  # 0 = Llama's rule: 2/3 * 4 * dim rounded up to a multiple of multiple_of
    multiple_of: int = 32
    max_seq_len: int = 2048  # length of the RoPE tables
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    family: Literal[NAMES] = "llama"  # the HF architecture read by `convert` and written by `export` (issue 31)
    head_dim: int = 0  # 0 = dim / n_heads; Qwen3 gives it explicitly
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen2/2.5), never on o
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3)
    sliding_window: int = 0  # 0 = full attention; else a key is visible iff query - key < sliding_window (Mistral)
    rope_scaling: Literal["none", "llama3"] = "none"  # llama3: Llama-3.1's frequency rescaling, as transformers
    rope_factor: float = 8.0  # llama3 scaling: factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low_freq_factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high_freq_factor
    rope_original_max_len: int = 8192  # llama3 scaling: original_max_position_embeddings
    # Mixture of experts (issue 52; model/moe.py): only the MoE families (qwen3_moe) have experts
    num_experts: int = 0  # experts per MoE layer (HF num_experts); 0 = a dense model
    experts_per_token: int = 2  # top-k experts each token is routed to (HF num_experts_per_tok)
    moe_ffn_dim: int = 0  # one expert's SwiGLU width (HF moe_intermediate_size); 0 = ffn_dim
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1 (HF norm_topk_prob)
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (SwiGLU of ffn_dim)
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in the training loss; 0 = off
    shared_expert_ffn_dim: int = 0  # qwen2_moe: the shared expert's SwiGLU width (HF shared_expert_intermediate_size)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss weight: mean over tokens of logsumexp(router logits)^2; 0 = off
    router_bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing: per-expert routing bias step; 0 = off
    capacity_factor: float = 0.0  # expert capacity ceil(factor * tokens * K / E), tokens beyond it dropped; 0 = dropless

    @property
    def head_size(self) -> int:
        """The attention head size: `head_dim`, or dim / n_heads when it is 0."""
        return self.head_dim or self.dim // self.n_heads

    def is_moe_layer(self, i: int) -> bool:
        """Layer i holds experts (transformers' Qwen3MoeDecoderLayer rule), else the dense SwiGLU."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def expert_ffn(self) -> int:
        """One expert's SwiGLU width: moe_ffn_dim, or ffn_dim when it is 0."""
        return self.moe_ffn_dim or self.ffn_dim

    def check(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of", "rope_original_max_len"):
            if getattr(self, name) <= 0:
                fail(f"model.{name}", f"= {getattr(self, name)} must be positive", f"set model.{name} to a positive integer")
        for name in ("n_kv_heads", "vocab_size", "ffn_dim", "head_dim", "sliding_window"):
            if getattr(self, name) < 0:
                fail(f"model.{name}", f"= {getattr(self, name)} must not be negative", f"set model.{name} to 0 (automatic) or a positive integer")
        if self.dim % self.n_heads and not self.head_dim:
            fail("model.n_heads", f"= {self.n_heads} does not divide model.dim = {self.dim}",
                  "choose n_heads so that dim / n_heads is a whole number (e.g. dim 64, n_heads 4), or set model.head_dim")
        if self.head_size % 2:
            fail("model.head_dim" if self.head_dim else "model.dim", f"gives an odd head size {self.head_size}",
                  "RoPE needs an even head size: change dim, n_heads or head_dim")
        # Each family holds exactly what transformers' class of that name builds, so export can write it
        # (the switches of each: families.py).
        fam = family(self.family)
        for key, have, want in (("qkv_bias", self.qkv_bias, fam.qkv_bias), ("qk_norm", self.qk_norm, fam.qk_norm),
                                ("sliding_window", bool(self.sliding_window), None if fam.sliding_window else False)):
            if want is not None and have != want:
                fail(f"model.{key}", f"= {getattr(self, key)!r} is not what model.family = {self.family} has", switch_hint())
        if fam.moe != (self.num_experts > 0):
            fail("model.num_experts", f"= {self.num_experts}: model.family = {self.family} is "
                 + ("a mixture of experts and needs num_experts > 0" if fam.moe else "dense and has no experts"),
                 "set model.num_experts (e.g. 8) with family qwen3_moe, or 0 with a dense family")
        if fam.moe:
            if not 0 < self.experts_per_token <= self.num_experts:
                fail("model.experts_per_token", f"= {self.experts_per_token} is not between 1 and model.num_experts = {self.num_experts}",
                     "route each token to a few experts, e.g. 2 (Qwen3-30B-A3B: 8 of 128)")
            if self.moe_ffn_dim < 0 or self.decoder_sparse_step <= 0:
                fail("model.moe_ffn_dim" if self.moe_ffn_dim < 0 else "model.decoder_sparse_step", "must be positive (moe_ffn_dim: 0 = ffn_dim)",
                     "use HF's values: moe_intermediate_size and decoder_sparse_step = 1")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
            if bad:
                fail("model.mlp_only_layers", f"holds {bad[0]}, not a layer index below model.n_layers = {self.n_layers}",
                     "list dense layers by index, 0-based")
            if fam.shared_expert != (self.shared_expert_ffn_dim > 0):
                fail("model.shared_expert_ffn_dim", f"= {self.shared_expert_ffn_dim}: model.family = {self.family} "
                     + ("has a shared expert (give its width)" if fam.shared_expert else "has no shared expert"),
                     "qwen2_moe: shared_expert_intermediate_size of its config.json; qwen3_moe: 0")
            if self.router_aux_loss_coef < 0:
                fail("model.router_aux_loss_coef", f"= {self.router_aux_loss_coef} is negative", "use Qwen3's 0.001, or 0 for no balancing loss")
            if not self.router_z_loss_coef >= 0:
                fail("model.router_z_loss_coef", f"= {self.router_z_loss_coef} is negative", "use ST-MoE's 0.001, or 0 for no router z-loss")
            if not self.router_bias_update_rate >= 0:
                fail("model.router_bias_update_rate", f"= {self.router_bias_update_rate} is negative",
                     "use DeepSeek-V3's 0.001, or 0 for no auxiliary-loss-free balancing")
            if not (self.capacity_factor == 0 or self.capacity_factor > 0):
                fail("model.capacity_factor", f"= {self.capacity_factor} is negative", "use 1.25 (Switch Transformer), or 0 for dropless routing")
        else:
            for key in ("router_z_loss_coef", "router_bias_update_rate", "capacity_factor"):
                if getattr(self, key):
                    fail(f"model.{key}", f"= {getattr(self, key)} needs a mixture of experts (model.num_experts > 0)",
                         f"set model.{key} = 0 for a dense model")
        if self.rope_scaling == "llama3":
            for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
                if not getattr(self, name) > 0:
                    fail(f"model.{name}", f"= {getattr(self, name)} must be positive", "use Llama-3.1's values: 8, 1, 4")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                fail("model.rope_high_freq_factor", f"= {self.rope_high_freq_factor} must exceed rope_low_freq_factor = {self.rope_low_freq_factor}",
                      "use Llama-3.1's values: low 1, high 4")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            fail("model.n_kv_heads", f"= {kv} does not divide model.n_heads = {self.n_heads}", "choose n_kv_heads among the divisors of n_heads")
        if not self.rope_theta > 0:
            fail("model.rope_theta", f"= {self.rope_theta} must be positive", "the Llama-2 value is 10000")
        if not self.norm_eps > 0:
            fail("model.norm_eps", f"= {self.norm_eps} must be positive", "the Llama-2 value is 1e-5")
        if not self.init_std > 0:
            fail("model.init_std", f"= {self.init_std} must be positive", "the Llama value is 0.02")
        # max_seq_len: the RoPE tables are max_seq_len x head_size; 2^30 positions is 100x the longest
        # context released (10M), and train's memory check judges what a machine holds below that.
        cap(self, {"dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024, "vocab_size": 1 << 22,
                    "ffn_dim": 1 << 18, "multiple_of": 1 << 16, "rope_theta": 1e12, "head_dim": 1 << 12,
                    "max_seq_len": 1 << 30, "rope_original_max_len": 1 << 30, "sliding_window": 1 << 30,
                    "rope_factor": 1e4, "num_experts": 1 << 12, "moe_ffn_dim": 1 << 18,
                    "router_aux_loss_coef": 1e3, "router_z_loss_coef": 1e3, "router_bias_update_rate": 1.0, "capacity_factor": 1e3,
                    "shared_expert_ffn_dim": 1 << 18, "rope_low_freq_factor": 1e4, "rope_high_freq_factor": 1e4,
                    "norm_eps": 1.0, "init_std": 10.0}, "a model shape no device holds")
        floor(self, {"norm_eps": 1e-12, "init_std": 1e-8}, "float32 rounds it to 0, or to weights of 0")
