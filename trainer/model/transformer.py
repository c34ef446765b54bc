"""The decoder: embedding -> [attention + (dense | MoE) FFN] x L -> RMSNorm -> LM head -> loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moespec.params import count_params, model_flops_per_token  # noqa: F401  (re-exported)
from trainer.model.experts import kernels_can_run, record_use
from trainer.model.layers import Attention, MLAttention, RMSNorm, SwiGLU, rope_cache
from trainer.model.moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, ep_group=None, ep_size=1, ep_rank=0, placement=None):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg["d_model"], cfg["rms_eps"])
        self.attn = MLAttention(cfg) if cfg["attn_type"] == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg["d_model"], cfg["rms_eps"])
        self.is_moe = layer_id >= cfg["first_k_dense"]
        self.ffn = MoE(cfg, ep_group, ep_size, ep_rank, placement) if self.is_moe else SwiGLU(cfg["d_model"], cfg["d_ff"])
        self.recompute = layer_id in cfg["recompute_layer_ids"]
        # compile=dense (trainer/compiling.py): torch.compile'd versions of the dense halves below, else None
        self.compiled_attn = None
        self.compiled_dense = None

    def _forward(self, x, cos, sin):
        # one trace range per block forward ("layer/<i>"; a recomputed block shows it again inside the
        # backward): what tracelens' what-if model reads a layer's forward cost from
        with torch.profiler.record_function(f"layer/{self.layer_id}"):
            return self._block(x, cos, sin)

    def _block(self, x, cos, sin):
        if not self.is_moe:
            return (self.compiled_dense or self.dense_block)(x, cos, sin)
        x, h = (self.compiled_attn or self.attn_half)(x, cos, sin)
        y, aux = self.ffn(h)  # MoE: routing, permutation, dispatch and experts stay eager (moe/<stage> ranges)
        return x + y, aux

    def attn_half(self, x, cos, sin):
        """The block's dense first half: attention residual and the FFN's input norm -> (x, ffn_norm(x))."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x, self.ffn_norm(x)

    def dense_block(self, x, cos, sin):
        """A dense layer's whole block (attention half + SwiGLU residual) -> (x, aux = 0)."""
        x, h = self.attn_half(x, cos, sin)
        return x + self.ffn(h), x.new_zeros((), dtype=torch.float32)

    def forward(self, x, cos, sin):
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


def cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, fused: bool, chunk: int) -> torch.Tensor:
    """Mean token cross-entropy of ``h @ w.T``.

    ``fused``: logits are produced, upcast and reduced one chunk of ``chunk`` tokens at a time under
    activation checkpointing, so neither full logits nor full fp32 logits are ever alive (backward
    recomputes each chunk's logits).
    """
    if not fused:
        return F.cross_entropy(F.linear(h, w).float(), targets)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(_chunk_ce, h[i:i + chunk], w, targets[i:i + chunk], use_reentrant=False)
    return total / h.shape[0]


def _chunk_ce(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")


def kernel_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """``loss_fusion`` with ``use_triton_kernels``: ``kernels.linear_cross_entropy``, which computes the
    logits ``chunk`` tokens at a time and turns them into their gradient in place, so neither full logits
    nor a recomputation in backward exist. Under autocast it runs on the autocast dtype, as the unfused
    ``F.linear`` would."""
    from kernels import linear_cross_entropy  # noqa: PLC0415

    record_use("loss", "kernels.linear_cross_entropy")
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return linear_cross_entropy(h.to(dt), w.to(dt), targets, chunk=chunk)
    return linear_cross_entropy(h, w, targets, chunk=chunk)


class Transformer(nn.Module):
    def __init__(self, cfg: dict, ep_group=None, ep_size: int = 1, ep_rank: int = 0, placement=None):
        """``placement``: a `moespec.placement.PlacementPlan` (``ep_placement: balanced``) or None (contiguous)."""
        super().__init__()
        self.cfg = cfg
        d, V = cfg["d_model"], cfg["vocab_size"]
        self.embed = nn.Embedding(V, d)
        slots = {lid: lp.slots for lid, lp in placement.layers.items()} if placement is not None else {}
        self.layers = nn.ModuleList(Block(cfg, i, ep_group, ep_size, ep_rank, slots.get(i))
                                    for i in range(cfg["n_layers"]))
        self.norm = RMSNorm(d, cfg["rms_eps"])
        self.head = None if cfg["tie_embeddings"] else nn.Linear(d, V, bias=False)
        rope_dim = cfg["qk_rope_head_dim"] if cfg["attn_type"] == "mla" else (cfg["head_dim"] or d // cfg["n_heads"])
        cos, sin = rope_cache(cfg["seq_len"], rope_dim, cfg["rope_theta"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int, device: torch.device | str | None = None):
        """Deterministic init: identical dense weights on every rank, expert slices of one global init.
        The random numbers come from a generator on ``device`` (default: the CPU's); the same seed and device
        give the same weights for any EP size. A CUDA generator draws the 2.3B parameters of the GPU proxy in
        well under a second where the CPU's takes ~30 s per run (a trial's start-up cost in a sweep)."""
        std = self.cfg["init_std"]
        g = torch.Generator(device=device or "cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if ".experts." in name:
                continue
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.copy_(torch.empty(p.shape, device=g.device).normal_(0, std, generator=g))
        for layer in self.layers:
            if layer.is_moe:
                layer.ffn.init_weights(std, generator=g)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """Returns (lm_loss, aux_loss) when targets are given, else logits."""
        S = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        aux_total = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            aux_total = aux_total + aux
        h = self.norm(x)
        w = self.output_weight()
        if targets is None:
            return F.linear(h, w)
        return lm_loss(h, w, targets, self.cfg), aux_total


def lm_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Mean token cross-entropy of the normed hidden states ``h`` [B, S, D] through the LM head ``w``, as
    the config asks (fused chunks, Triton kernels). Shared by the model and its last pipeline stage."""
    h2 = h.reshape(-1, h.shape[-1])
    if cfg["loss_fusion"] and cfg["use_triton_kernels"] and kernels_can_run(h2):
        return kernel_cross_entropy(h2, w.to(h2.dtype), targets.reshape(-1), cfg["loss_chunk_size"])
    return cross_entropy(h2, w.to(h2.dtype), targets.reshape(-1), cfg["loss_fusion"], cfg["loss_chunk_size"])
