"""PyTorch side of the real model (docs/model.md): the frozen SmolLM2-135M backbone, built from the
dequantized GGUF weights, that yields each layer's input and head-summed attention distribution,
and the lightning indexer (DeepSeek-V3.2 report, section 2.1) with its fp16 safetensors file."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Iterator, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import IndexerConfig, ModelConfig, ModelFileError


def rope_tables(num_positions: int, rotated_dims: int, base: float,
                device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles t * theta_j, theta_j = base^(-2j / rotated_dims), for
    positions t in [0, num_positions) and pairs j in [0, rotated_dims / 2).

    Returns two fp32 tensors [num_positions, rotated_dims / 2] (angles computed in fp64).
    docs/model.md ("The backbone", "The lightning indexer")."""
    j = torch.arange(rotated_dims // 2, dtype=torch.float64)
    theta = base ** (-2.0 * j / rotated_dims)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * theta[None, :]
    return (angles.cos().to(torch.float32).to(device),
            angles.sin().to(torch.float32).to(device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the adjacent pairs (2j, 2j + 1) of x's first 2 * cos.shape[-1] dims by the angles
    of `cos`/`sin`; the remaining dims pass unchanged.

    x: [..., D] any float dtype; cos, sin: fp32, broadcastable to x[..., :R/2] (e.g. [T, R/2] for
    x [B, H, T, D], [T, 1, R/2] for x [B, T, H, D]). Returns fp32 of x's shape.
    docs/model.md: adjacent pairs, out_2j = x_2j cos - x_2j+1 sin, out_2j+1 = x_2j sin +
    x_2j+1 cos."""
    rotated = 2 * cos.shape[-1]
    xr = x[..., :rotated].float().unflatten(-1, (rotated // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    if rotated == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotated:].float()), dim=-1)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(h) * weight in fp32: h * rsqrt(mean(h^2) + eps) * weight.

    h: [..., d_model]; weight: [d_model]. Returns fp32 [..., d_model]."""
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_upper_mask(num_positions: int, device: torch.device) -> torch.Tensor:
    """bool [T, T], True where slot j > position t (not visible to row t)."""
    return torch.ones(num_positions, num_positions, dtype=torch.bool,
                      device=device).triu(diagonal=1)


@dataclasses.dataclass
class LayerTarget:
    """One layer's view of a batch, as `SmolLM2Backbone.iter_layers` yields it.

    layer: 0-based layer index.
    x: fp32 [B, T, d_model], detached: RMSNorm(h_l) * attn_norm, the input of the layer's
       attention and of its indexer.
    attn_probs: fp32 [B, T, T] or None: the layer's causal attention distribution summed over
       its query heads and divided by their number (rows sum to 1 over slots 0..t, 0 above)."""

    layer: int
    x: torch.Tensor
    attn_probs: Optional[torch.Tensor]


class SmolLM2Backbone(nn.Module):
    """The frozen SmolLM2-135M forward pass of docs/model.md ("The forward pass"): RMSNorm, RoPE on
    adjacent pairs over all head dims, GQA (query head h reads KV head h / (H / H_kv)), SwiGLU,
    the tied head. Weights are buffers (never trained); on CUDA the matrix products run under bf16
    autocast, norms, RoPE and the attention target in fp32."""

    def __init__(self, weights: Mapping[str, np.ndarray], config: ModelConfig,
                 amp_dtype: Optional[torch.dtype] = None):
        """weights: name -> fp32 numpy array in numpy's [out, in] shape, the GGUF's names
        (`convert.load_gguf`); config: the backbone's shape; amp_dtype: the autocast dtype of the
        matrix products and of the attention (torch.bfloat16 on CUDA), None for fp32 throughout.
        Raises ModelFileError naming the tensor when one is missing or has another shape."""
        super().__init__()
        self.config = config
        self.amp_dtype = amp_dtype
        expected = config.tensor_shapes()
        for name, shape in expected.items():
            if name not in weights:
                raise ModelFileError(f"backbone weights: no tensor '{name}' (expected {shape})")
            if tuple(weights[name].shape) != tuple(shape):
                raise ModelFileError(f"backbone weights: '{name}' has shape "
                                     f"{tuple(weights[name].shape)}, expected {shape}")

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(weights[name], dtype=np.float32, copy=True))

        def stack(names) -> torch.Tensor:
            return torch.stack([torch.cat([t(f"blk.{l}.{n}.weight") for n in names])
                                for l in range(config.num_layers)])

        self.register_buffer("token_embd", t("token_embd.weight"))
        self.register_buffer("output_norm", t("output_norm.weight"))
        self.register_buffer("attn_norm", stack(["attn_norm"]))
        self.register_buffer("w_qkv", stack(["attn_q", "attn_k", "attn_v"]))
        self.register_buffer("w_o", stack(["attn_output"]))
        self.register_buffer("ffn_norm", stack(["ffn_norm"]))
        self.register_buffer("w_gate_up", stack(["ffn_gate", "ffn_up"]))
        self.register_buffer("w_down", stack(["ffn_down"]))
        self.requires_grad_(False)

    def _autocast(self, device: torch.device):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def _attention_probs(self, q: torch.Tensor, k: torch.Tensor,
                         upper: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        scale = 1.0 / math.sqrt(cfg.head_dim)
        total = None
        batch, _, length, _ = q.shape
        for g in range(cfg.num_kv_heads):
            qg = q[:, g * group:(g + 1) * group].float().reshape(batch, group * length, -1)
            kg = k[:, g].float()
            scores = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale).unflatten(1, (group, length))
            scores.masked_fill_(upper, float("-inf"))
            probs = torch.softmax(scores, dim=-1).sum(1)
            total = probs if total is None else total.add_(probs)
            del scores
        return total.div_(cfg.num_heads)

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        cfg = self.config
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, T], got {tuple(tokens.shape)}")
        if tokens.shape[1] > cfg.context_length:
            raise ValueError(f"tokens: T = {tokens.shape[1]} exceeds context_length "
                             f"{cfg.context_length}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
            raise ValueError(f"tokens: ids must lie in [0, {cfg.vocab_size})")

    def _attention_inputs(self, h: torch.Tensor, l: int, cos: torch.Tensor, sin: torch.Tensor):
        cfg = self.config
        hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        with self._autocast(h.device):
            x = rms_norm(h, self.attn_norm[l], cfg.rms_eps)
            qkv = F.linear(x, self.w_qkv[l])
            q = qkv[..., :hq * dh].unflatten(-1, (hq, dh)).transpose(1, 2)
            k = qkv[..., hq * dh:(hq + hkv) * dh].unflatten(-1, (hkv, dh)).transpose(1, 2)
            v = qkv[..., (hq + hkv) * dh:].unflatten(-1, (hkv, dh)).transpose(1, 2)
            return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_layer(self, h: torch.Tensor, l: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        dtype = self.amp_dtype or torch.float32
        with self._autocast(h.device):
            o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                               is_causal=True, enable_gqa=True)
            h = h + F.linear(o.transpose(1, 2).flatten(-2), self.w_o[l]).float()
            y = rms_norm(h, self.ffn_norm[l], cfg.rms_eps)
            gate, up = F.linear(y, self.w_gate_up[l]).chunk(2, dim=-1)
            return h + F.linear(F.silu(gate) * up, self.w_down[l]).float()

    @torch.no_grad()
    def iter_layers(self, tokens: torch.Tensor, with_targets: bool = True,
                    num_layers: Optional[int] = None) -> Iterator[LayerTarget]:
        """Runs the backbone on a batch and yields, layer by layer, the layer input and (if
        with_targets) its head-summed attention distribution, computed per layer so that only one
        layer's [B, T, T] target is alive at a time (drop the yielded one before asking for the
        next). The caller's code between yields runs with its own grad mode.

        tokens: int64 [B, T] on the backbone's device, ids < vocab_size, T <= context_length.
        num_layers: stop after this many layers (default: all). Yields LayerTarget.
        Raises ValueError on a bad shape or id. docs/model.md, "The forward pass"; the target is
        DeepSeek-V3.2 section 2.1.1's dense warm-up target summed over heads and renormalized."""
        self._check_tokens(tokens)
        cfg = self.config
        length = tokens.shape[1]
        layers = cfg.num_layers if num_layers is None else num_layers
        cos, sin = rope_tables(length, cfg.head_dim, cfg.rope_base, tokens.device)
        upper = causal_upper_mask(length, tokens.device)
        h = self.token_embd[tokens].float()
        for l in range(layers):
            x, q, k, v = self._attention_inputs(h, l, cos, sin)
            probs = self._attention_probs(q, k, upper) if with_targets else None
            yield LayerTarget(layer=l, x=x, attn_probs=probs)
            del probs, x
            if l + 1 < layers:
                h = self._finish_layer(h, l, q, k, v)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the dense forward: fp32 [B, T, vocab_size] for int64 tokens
        [B, T]: token_embd @ (RMSNorm(h_final) * output_norm), docs/model.md. Raises ValueError
        as iter_layers does."""
        self._check_tokens(tokens)
        cfg = self.config
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_base, tokens.device)
        h = self.token_embd[tokens].float()
        for l in range(cfg.num_layers):
            _, q, k, v = self._attention_inputs(h, l, cos, sin)
            h = self._finish_layer(h, l, q, k, v)
        h = rms_norm(h, self.output_norm, cfg.rms_eps)
        with self._autocast(tokens.device):
            return F.linear(h, self.token_embd).float()


class LightningIndexer(nn.Module):
    """One layer's lightning indexer (docs/model.md, "The lightning indexer"; DeepSeek-V3.2
    section 2.1): q = RoPE(Wqb Wqa x) [H x D], k = RoPE(LayerNorm(Wk x)) [D],
    w = (Ww x) * H^-0.5 * D^-0.5, z_t[i] = sum_h w_h ReLU(q_h . k_i), RoPE on dims [0, rope_dims)
    of each head and of the key (adjacent pairs, theta_j = base^(-2j / rope_dims)). Head h of q
    is rows [h * D, (h + 1) * D) of Wqb's output."""

    def __init__(self, config: IndexerConfig, d_model: int):
        super().__init__()
        self.config = config
        h, d, r = config.num_heads, config.head_dim, config.query_rank
        self.q_a = nn.Linear(d_model, r, bias=False)
        self.q_b = nn.Linear(r, h * d, bias=False)
        self.k = nn.Linear(d_model, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=config.k_norm_eps)
        self.weights_proj = nn.Linear(d_model, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer query, key and head weights of every position.

        x: fp32 [B, T, d_model]; cos, sin: fp32 [T, rope_dims / 2] (`rope_tables`).
        Returns q fp32 [B, T, H, D], k fp32 [B, T, D], w fp32 [B, T, H] (scale folded in)."""
        cfg = self.config
        q = self.q_b(self.q_a(x)).unflatten(-1, (cfg.num_heads, cfg.head_dim))
        q = apply_rope(q, cos[:, None, :], sin[:, None, :])
        k = apply_rope(self.k_norm(self.k(x)), cos, sin)
        w = self.weights_proj(x) * (cfg.num_heads ** -0.5 * cfg.head_dim ** -0.5)
        return q, k, w

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                upper: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Index scores of every position over every slot.

        x: fp32 [B, T, d_model]; cos, sin: fp32 [T, rope_dims / 2]; upper: bool [T, T] causal
        mask (`causal_upper_mask`), built if None. Returns fp32 z [B, T, T], z[b, t, i] =
        sum_h w_h ReLU(q_h . k_i) for i <= t and -inf for i > t."""
        length = x.shape[1]
        q, k, w = self.project(x, cos, sin)
        logits = torch.matmul(q.flatten(1, 2), k.transpose(1, 2))
        logits = torch.relu_(logits).unflatten(1, (length, self.config.num_heads))
        z = torch.matmul(w.unsqueeze(-2), logits).squeeze(-2)
        if upper is None:
            upper = causal_upper_mask(length, x.device)
        return z.masked_fill(upper, float("-inf"))


class IndexerStack(nn.Module):
    """The lightning indexers of all layers, `layers[l]` for layer l, with the fp16 safetensors
    file of docs/model.md (`save`, `load`)."""

    def __init__(self, config: IndexerConfig, d_model: int):
        super().__init__()
        self.config = config
        self.d_model = d_model
        self.layers = nn.ModuleList(LightningIndexer(config, d_model)
                                    for _ in range(config.num_layers))

    def tensors(self) -> Dict[str, torch.Tensor]:
        """docs/model.md's tensor names -> this stack's parameters (no copy)."""
        out: Dict[str, torch.Tensor] = {}
        for l, ix in enumerate(self.layers):
            p = f"blk.{l}.indexer."
            out[p + "q_a.weight"] = ix.q_a.weight
            out[p + "q_b.weight"] = ix.q_b.weight
            out[p + "k.weight"] = ix.k.weight
            out[p + "k_norm.weight"] = ix.k_norm.weight
            out[p + "k_norm.bias"] = ix.k_norm.bias
            out[p + "weights_proj.weight"] = ix.weights_proj.weight
        return out

    def save(self, path: str, base_model_sha256: str,
             settings: Optional[Mapping[str, object]] = None) -> None:
        """Writes `path` with `reference.write_indexer_weights` (the one writer of the format):
        every tensor fp16 [out, in], metadata dsa.format = "dsa-indexer/1", the shape fields,
        base_model_sha256 (hex SHA-256 of the GGUF the backbone came from) and `settings` (the
        training run's values as strings). Raises ValueError when a weight is not finite in fp16,
        ModelFileError as the writer does."""
        from .reference import write_indexer_weights

        arrays = {}
        for name, p in self.tensors().items():
            a = p.detach().float().cpu().numpy()
            if not np.isfinite(a.astype(np.float16)).all():
                raise ValueError(f"{path}: tensor '{name}' is not finite in fp16")
            arrays[name] = a
        text = {str(k): v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)
                for k, v in (settings or {}).items()}
        write_indexer_weights(arrays, self.config, path, base_model_sha256, self.d_model, text)

    @classmethod
    def load(cls, path: str, d_model: int = 576, device: str = "cpu",
             base_model_sha256: Optional[str] = None) -> "IndexerStack":
        """Reads an indexer file with `reference.load_indexer_weights` (which checks the size,
        dsa.format, the shape fields, base_model_sha256 when given, every tensor's presence, dtype
        and shape, raising ModelFileError naming the file). Returns the stack, fp32 parameters on
        `device`."""
        from .reference import load_indexer_weights

        arrays, config = load_indexer_weights(path, d_model, base_model_sha256)
        stack = cls(config, d_model)
        with torch.no_grad():
            for name, p in stack.tensors().items():
                p.copy_(torch.from_numpy(arrays[name]))
        return stack.to(device)


def kl_to_indexer(attn_probs: torch.Tensor, scores: torch.Tensor,
                  upper: torch.Tensor) -> torch.Tensor:
    """KL(p_t || softmax_i z_t[i]) per position, in fp32.

    attn_probs: fp32 [B, T, T] target rows (0 above the diagonal); scores: fp32 [B, T, T]
    index scores with -inf above the diagonal; upper: bool [T, T]. Returns fp32 [B, T].
    DeepSeek-V3.2 section 2.1.1 (dense warm-up loss); docs/model.md, "Training"."""
    log_q = torch.log_softmax(scores.float(), dim=-1).masked_fill(upper, 0.0)
    p = attn_probs.float()
    return (torch.xlogy(p, p) - p * log_q).sum(-1)
