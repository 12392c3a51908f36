"""The numpy reference of docs/model.md: the SmolLM2-135M forward (dense causal, or sparse over
given selections), its lightning indexer and index scores, greedy decoding and perplexity.

Written for clarity, not speed. Arithmetic is in the working dtype chosen at construction:
float32 by default (matrix products through numpy's BLAS, fp32 accumulation; RoPE angles computed
in float64 and rounded), or float64 throughout with `dtype=np.float64`; the log-softmax of
`token_nll`/`perplexity` is float64 either way. Attention runs in blocks of ROW_BLOCK query rows
against the keys up to the block's last position, so no layer's full attention matrix is held."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .config import (INDEXER_FORMAT, MODEL_FILE, IndexerConfig, ModelConfig, ModelFileError)

ROW_BLOCK = 256
ROPE_PAIRINGS = ("adjacent", "half")

Selections = Union[Callable[[int, np.ndarray], np.ndarray], Sequence[np.ndarray], np.ndarray]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (docs/model.md)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps)) * weight


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis with biased variance (the indexer's key norm)."""
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + x.dtype.type(eps)) * gamma + beta


def rope(x: np.ndarray, positions: np.ndarray, base: float, rope_dims: Optional[int] = None,
         pairing: str = "adjacent") -> np.ndarray:
    """Rotary position embedding on dims [0, rope_dims) of the last axis; the rest pass through.

    x: [n, heads, dim] (or [n, dim]); positions: int [n]. With pairing "adjacent" (docs/model.md,
    the layout of the GGUF's Q and K), pair j is dims (2j, 2j+1); with "half" (the NeoX/HF
    layout, kept to show that the pairing matters) it is dims (j, j + rope_dims/2). Both rotate
    pair j by positions * theta_j, theta_j = base^(-2j / rope_dims). Returns an array of x's
    dtype and shape. Raises ValueError on an unknown pairing or odd rope_dims."""
    dim = x.shape[-1]
    rope_dims = dim if rope_dims is None else rope_dims
    if pairing not in ROPE_PAIRINGS:
        raise ValueError(f"pairing {pairing!r}, expected one of {ROPE_PAIRINGS}")
    if rope_dims % 2 or not 0 < rope_dims <= dim:
        raise ValueError(f"rope_dims {rope_dims} must be even and in (0, {dim}]")
    half = rope_dims // 2
    theta = float(base) ** (-2.0 * np.arange(half, dtype=np.float64) / rope_dims)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]
    shape = (len(angle),) + (1,) * (x.ndim - 2) + (half,)
    cos = np.cos(angle).astype(x.dtype).reshape(shape)
    sin = np.sin(angle).astype(x.dtype).reshape(shape)
    out = x.copy()
    if pairing == "adjacent":
        a, b = x[..., 0:rope_dims:2], x[..., 1:rope_dims:2]
        out[..., 0:rope_dims:2] = a * cos - b * sin
        out[..., 1:rope_dims:2] = a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:rope_dims]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dims] = a * sin + b * cos
    return out


def topk_selection(scores: np.ndarray, k: int) -> np.ndarray:
    """The top-K rule of DESIGN.md 4.1 on index scores [n, num_slots]: per row the k highest
    scores, best first, ties to the lower slot; -inf and NaN never selected; fewer than k
    selectable slots -> the rest is -1. Returns int32 [n, k]."""
    scores = np.where(np.isnan(scores), -np.inf, scores)
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(scores, order, axis=-1)
    out = np.full((scores.shape[0], k), -1, dtype=np.int32)
    width = order.shape[1]
    out[:, :width] = np.where(np.isneginf(chosen), -1, order)
    return out


def random_indexer_weights(seed: int, config: IndexerConfig = IndexerConfig(),
                           d_model: int = 576) -> Dict[str, np.ndarray]:
    """Seeded random indexer weights for tests: every matrix N(0, 1/fan_in), k_norm gamma
    1 + N(0, 0.1), beta N(0, 0.1); values rounded to fp16 (the file's dtype) and returned as fp32
    arrays in `config.tensor_shapes(d_model)`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in config.tensor_shapes(d_model).items():
        if name.endswith("k_norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("k_norm.bias"):
            values = 0.1 * rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = values.astype(np.float16).astype(np.float32)
    return out


def write_indexer_weights(weights: Mapping[str, np.ndarray], config: IndexerConfig,
                          path: os.PathLike, base_model_sha256: str, d_model: int = 576,
                          settings: Optional[Mapping[str, str]] = None) -> None:
    """Writes the indexer file of docs/model.md: every tensor fp16, metadata dsa.format =
    "dsa-indexer/1", the shape fields, base_model_sha256 and `settings` (the training run's,
    string values). Raises ModelFileError when a tensor is missing, unexpected or misshapen."""
    from safetensors.numpy import save_file

    from .convert import sort_metadata

    path = Path(path)
    shapes = config.tensor_shapes(d_model)
    if set(weights) != set(shapes):
        raise ModelFileError(f"{path}: indexer weights differ from the expected tensors: missing "
                             f"{sorted(set(shapes) - set(weights))[:3]}, unexpected "
                             f"{sorted(set(weights) - set(shapes))[:3]}")
    tensors = {}
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ModelFileError(f"{path}: tensor {name} has shape {list(weights[name].shape)}, "
                                 f"expected {list(shape)}")
        tensors[name] = np.ascontiguousarray(weights[name], dtype=np.float16)
    metadata = {str(k): str(v) for k, v in (settings or {}).items()}
    metadata.update({"dsa.format": INDEXER_FORMAT, "base_model_sha256": base_model_sha256,
                     **config.to_metadata()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    sort_metadata(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_indexer_weights(path: os.PathLike, d_model: int = 576,
                         base_model_sha256: Optional[str] = None
                         ) -> Tuple[Dict[str, np.ndarray], IndexerConfig]:
    """Loads the indexer file (docs/model.md, "The lightning indexer"): checks the size against
    the header, dsa.format, the shape fields, base_model_sha256 (when given), and every tensor's
    presence, dtype (F16) and shape. Returns (weights as fp32 arrays, IndexerConfig).
    Raises ModelFileError naming the file and what was expected."""
    from safetensors.numpy import load_file

    from .convert import check_tensors, read_safetensors_header

    path = Path(path)
    header, metadata = read_safetensors_header(path)
    if metadata.get("dsa.format") != INDEXER_FORMAT:
        raise ModelFileError(f"{path}: metadata dsa.format is {metadata.get('dsa.format')!r}, "
                             f"expected {INDEXER_FORMAT!r}")
    config = IndexerConfig.from_metadata(metadata, str(path))
    if base_model_sha256 is not None and metadata.get("base_model_sha256") != base_model_sha256:
        raise ModelFileError(f"{path}: base_model_sha256 is {metadata.get('base_model_sha256')!r},"
                             f" expected {base_model_sha256!r} (trained for another backbone)")
    check_tensors(path, header, config.tensor_shapes(d_model), "F16",
                  "the metadata's shape fields")
    return {name: a.astype(np.float32) for name, a in load_file(str(path)).items()}, config


class Reference:
    """The forward pass of docs/model.md over fp32 weights (`convert.load_model`'s dict).

    weights: name -> array in `config.tensor_shapes()`; indexer_weights: None, a dict in
    `indexer_config.tensor_shapes(d_model)` or the path of an indexer safetensors file;
    dtype: the working dtype (np.float32 or np.float64); rope_pairing: "adjacent" (the model's)
    or "half" (wrong for this file; only for showing that it matters).
    Not thread-safe. Raises ModelFileError on missing or misshapen weights."""

    def __init__(self, weights: Mapping[str, np.ndarray], config: ModelConfig,
                 indexer_weights: Union[None, Mapping[str, np.ndarray], os.PathLike, str] = None,
                 indexer_config: IndexerConfig = IndexerConfig(), dtype=np.float32,
                 rope_pairing: str = "adjacent"):
        if rope_pairing not in ROPE_PAIRINGS:
            raise ValueError(f"rope_pairing {rope_pairing!r}, expected one of {ROPE_PAIRINGS}")
        self.config = config
        self.dtype = np.dtype(dtype)
        self.rope_pairing = rope_pairing
        self.weights = self._checked(weights, config.tensor_shapes(), "model weights")
        self.indexer_config = indexer_config
        self.indexer_weights = None
        if isinstance(indexer_weights, (str, os.PathLike)):
            indexer_weights, self.indexer_config = load_indexer_weights(
                indexer_weights, config.d_model)
        if indexer_weights is not None:
            self.indexer_weights = self._checked(
                indexer_weights, self.indexer_config.tensor_shapes(config.d_model),
                "indexer weights")

    @classmethod
    def from_dir(cls, model_dir: os.PathLike, indexer_path: Optional[os.PathLike] = None,
                 **kwargs) -> "Reference":
        """A Reference over `model_dir/model.safetensors` (`convert.load_model`'s checks) and,
        when given, the indexer file."""
        from .convert import load_model

        weights, config = load_model(Path(model_dir) / MODEL_FILE)
        return cls(weights, config, indexer_path, **kwargs)

    def _checked(self, weights, shapes, what):
        out = {}
        for name, shape in shapes.items():
            if name not in weights:
                raise ModelFileError(f"{what}: tensor {name} missing")
            if tuple(weights[name].shape) != shape:
                raise ModelFileError(f"{what}: tensor {name} has shape "
                                     f"{list(weights[name].shape)}, expected {list(shape)}")
            out[name] = np.ascontiguousarray(weights[name], dtype=self.dtype)
        return out

    def _tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D integer array, got shape "
                             f"{tokens.shape} dtype {tokens.dtype}")
        if tokens.size > self.config.context_length:
            raise ValueError(f"{tokens.size} tokens exceed the context of "
                             f"{self.config.context_length}")
        bad = (tokens < 0) | (tokens >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token {tokens[bad][0]} at position {int(np.argmax(bad))} is "
                             f"outside [0, {self.config.vocab_size})")
        return tokens.astype(np.int64)

    def _selection_mask(self, layer: int, selection, n: int) -> np.ndarray:
        selection = np.asarray(selection)
        if selection.ndim != 2 or selection.shape[0] != n \
                or not np.issubdtype(selection.dtype, np.integer):
            raise ValueError(f"layer {layer}: selection must be an integer array [{n}, K], got "
                             f"shape {selection.shape} dtype {selection.dtype}")
        rows = np.broadcast_to(np.arange(n)[:, None], selection.shape)
        used = selection != -1
        bad = used & ((selection < 0) | (selection > rows))
        if bad.any():
            t, j = np.argwhere(bad)[0]
            raise ValueError(f"layer {layer}: row {t} selects slot {selection[t, j]}, outside "
                             f"[0, {t}] (-1 marks an unused entry)")
        mask = np.zeros((n, n), dtype=bool)
        mask[rows[used], selection[used]] = True
        counts = mask.sum(axis=1)
        if (counts != used.sum(axis=1)).any():
            t = int(np.argmax(counts != used.sum(axis=1)))
            raise ValueError(f"layer {layer}: row {t} selects a slot twice")
        if (counts == 0).any():
            raise ValueError(f"layer {layer}: row {int(np.argmin(counts))} selects no slot")
        return mask

    def _attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                   mask: Optional[np.ndarray]) -> np.ndarray:
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        m = q.shape[0]
        scale = self.dtype.type(1.0 / np.sqrt(cfg.head_dim))
        keys = np.ascontiguousarray(k.transpose(1, 0, 2))
        values = np.ascontiguousarray(v.transpose(1, 0, 2))
        out = np.empty((m, cfg.num_heads, cfg.head_dim), dtype=self.dtype)
        for r0 in range(0, m, ROW_BLOCK):
            r1 = min(m, r0 + ROW_BLOCK)
            rows = r1 - r0
            n_kv = int(q_positions[r1 - 1]) + 1
            if mask is None:
                allowed = np.arange(n_kv)[None, :] <= q_positions[r0:r1, None]
            else:
                allowed = mask[r0:r1, :n_kv]
            allowed = np.tile(allowed, (group, 1))
            for g in range(cfg.num_kv_heads):
                qg = q[r0:r1, g * group:(g + 1) * group].transpose(1, 0, 2)
                qg = qg.reshape(group * rows, cfg.head_dim)
                scores = (qg @ keys[g, :n_kv].T) * scale
                scores = np.where(allowed, scores, -np.inf)
                scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
                probs = scores / scores.sum(axis=-1, keepdims=True)
                og = (probs @ values[g, :n_kv]).reshape(group, rows, cfg.head_dim)
                out[r0:r1, g * group:(g + 1) * group] = og.transpose(1, 0, 2)
        return out

    def _layers(self, tokens: np.ndarray, selections: Optional[Selections],
                visit: Optional[Callable[[int, np.ndarray], None]] = None,
                cache: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None) -> np.ndarray:
        cfg, w = self.config, self.weights
        start = 0 if cache is None or not cache else cache[0][0].shape[0]
        n = len(tokens)
        positions = np.arange(start, start + n)
        h = w["token_embd.weight"][tokens]
        if selections is not None and not callable(selections) and len(selections) != cfg.num_layers:
            raise ValueError(f"selections has {len(selections)} layers, expected {cfg.num_layers}")
        for layer in range(cfg.num_layers):
            p = f"blk.{layer}."
            x = rms_norm(h, w[p + "attn_norm.weight"], cfg.rms_eps)
            if visit is not None:
                visit(layer, x)
            mask = None
            if selections is not None:
                chosen = selections(layer, x) if callable(selections) else selections[layer]
                mask = self._selection_mask(layer, chosen, n)
            q = (x @ w[p + "attn_q.weight"].T).reshape(n, cfg.num_heads, cfg.head_dim)
            k = (x @ w[p + "attn_k.weight"].T).reshape(n, cfg.num_kv_heads, cfg.head_dim)
            v = (x @ w[p + "attn_v.weight"].T).reshape(n, cfg.num_kv_heads, cfg.head_dim)
            q = rope(q, positions, cfg.rope_base, pairing=self.rope_pairing)
            k = rope(k, positions, cfg.rope_base, pairing=self.rope_pairing)
            if cache is not None:
                if len(cache) <= layer:
                    cache.append((k, v))
                else:
                    cache[layer] = (np.concatenate([cache[layer][0], k]),
                                    np.concatenate([cache[layer][1], v]))
                k, v = cache[layer]
            o = self._attention(q, k, v, positions, mask)
            h = h + o.reshape(n, -1) @ w[p + "attn_output.weight"].T
            y = rms_norm(h, w[p + "ffn_norm.weight"], cfg.rms_eps)
            gate = y @ w[p + "ffn_gate.weight"].T
            up = y @ w[p + "ffn_up.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        return rms_norm(h, w["output_norm.weight"], cfg.rms_eps)

    def hidden(self, tokens, selections: Optional[Selections] = None) -> np.ndarray:
        """The final normalized hidden states RMSNorm(h_final) * output_norm: [n, d_model] of the
        working dtype. `selections` as in `forward`."""
        return self._layers(self._tokens(tokens), selections)

    def forward(self, tokens, selections: Optional[Selections] = None) -> np.ndarray:
        """Logits [n, vocab_size] (float32) of every position (docs/model.md, "The forward pass").

        tokens: int [n], 1 <= n <= context_length, ids in [0, vocab_size).
        selections: None for dense causal attention (row t attends slots 0..t); otherwise, per
        layer l, an int array [n, K] whose row t lists the slots row t attends (-1 = unused
        entry): either a callable selections(l, x_l) -> [n, K] that is given the layer's input
        x_l = RMSNorm(h) * attn_norm [n, d_model] (so it can run the indexer), or a sequence of
        num_layers such arrays (a [num_layers, n, K] array included). With every slot 0..t
        selected the result equals the dense one bit for bit (the same masked computation).
        Raises ValueError on bad tokens or a selection with a slot outside [0, t], a repeated
        slot, or no slot in a row."""
        h = self.hidden(tokens, selections)
        return (h @ self.weights["token_embd.weight"].T).astype(np.float32)

    def layer_inputs(self, tokens, selections: Optional[Selections] = None) -> np.ndarray:
        """Every layer's input x_l = RMSNorm(h_l) * attn_norm (what the attention and the
        indexer read): [num_layers, n, d_model] of the working dtype."""
        tokens = self._tokens(tokens)
        out = np.empty((self.config.num_layers, len(tokens), self.config.d_model), self.dtype)

        def visit(layer, x):
            out[layer] = x

        self._layers(tokens, selections, visit)
        return out

    def token_nll(self, tokens, selections: Optional[Selections] = None) -> np.ndarray:
        """Negative log-likelihood (nats, float64) of tokens[1:] given their prefixes: [n - 1].
        Logits are formed ROW_BLOCK rows at a time, never all at once."""
        tokens = self._tokens(tokens)
        h = self._layers(tokens, selections)
        emb = self.weights["token_embd.weight"]
        out = np.empty(len(tokens) - 1, dtype=np.float64)
        for r0 in range(0, len(tokens) - 1, ROW_BLOCK):
            r1 = min(len(tokens) - 1, r0 + ROW_BLOCK)
            logits = (h[r0:r1] @ emb.T).astype(np.float64)
            peak = logits.max(axis=-1)
            logz = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=-1))
            out[r0:r1] = logz - logits[np.arange(r1 - r0), tokens[r0 + 1:r1 + 1]]
        return out

    def perplexity(self, tokens, selections: Optional[Selections] = None) -> float:
        """exp(mean token_nll): the perplexity of tokens[1:] (n >= 2), dense or sparse."""
        if len(tokens) < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        return float(np.exp(self.token_nll(tokens, selections).mean()))

    def greedy(self, tokens, n: int, stop_token: Optional[int] = None) -> List[int]:
        """Greedy decoding, dense: the n next token ids after the prompt `tokens` (fewer if
        stop_token is produced, which is included). Uses a per-layer K/V cache."""
        prompt = self._tokens(tokens)
        if len(prompt) + n > self.config.context_length:
            raise ValueError(f"{len(prompt)} + {n} tokens exceed the context of "
                             f"{self.config.context_length}")
        emb = self.weights["token_embd.weight"]
        cache: List[Tuple[np.ndarray, np.ndarray]] = []
        out: List[int] = []
        step = prompt
        for _ in range(n):
            h = self._layers(step, None, cache=cache)
            nxt = int(np.argmax(h[-1] @ emb.T))
            out.append(nxt)
            if stop_token is not None and nxt == stop_token:
                break
            step = np.array([nxt], dtype=np.int64)
        return out

    def indexer(self, layer: int, x: np.ndarray, positions: Optional[np.ndarray] = None
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The lightning indexer of `layer` on its layer input x [n, d_model] (docs/model.md,
        "The lightning indexer"; DeepSeek-V3.2 report, section 2.1):

            q = RoPE(Wqb (Wqa x))            [n, H, D]
            k = RoPE(LayerNorm(Wk x))        [n, D]
            w = (Ww x) * H^-0.5 * D^-0.5     [n, H]

        RoPE on dims [0, rope_dims) (adjacent pairs, base indexer rope_base) at `positions`
        (default 0..n-1). Returns (q, w, k) of the working dtype. Raises ValueError when no
        indexer weights were given or the layer is out of range."""
        if self.indexer_weights is None:
            raise ValueError("no indexer weights (pass indexer_weights to Reference)")
        icfg = self.indexer_config
        if not 0 <= layer < icfg.num_layers:
            raise ValueError(f"layer {layer} outside [0, {icfg.num_layers})")
        x = np.asarray(x, dtype=self.dtype)
        n = x.shape[0]
        positions = np.arange(n) if positions is None else np.asarray(positions)
        wi = self.indexer_weights
        p = f"blk.{layer}.indexer."
        q = ((x @ wi[p + "q_a.weight"].T) @ wi[p + "q_b.weight"].T)
        q = rope(q.reshape(n, icfg.num_heads, icfg.head_dim), positions, icfg.rope_base,
                 icfg.rope_dims)
        k = layer_norm(x @ wi[p + "k.weight"].T, wi[p + "k_norm.weight"], wi[p + "k_norm.bias"],
                       icfg.k_norm_eps)
        k = rope(k, positions, icfg.rope_base, icfg.rope_dims)
        w = (x @ wi[p + "weights_proj.weight"].T) * self.dtype.type(
            icfg.num_heads ** -0.5 * icfg.head_dim ** -0.5)
        return q, w, k

    def index_scores(self, layer: int, q: np.ndarray, w: np.ndarray, k: np.ndarray
                     ) -> np.ndarray:
        """Index scores z[t, i] = sum_h w[t, h] ReLU(q[t, h] . k[i]) for i <= t, -inf for i > t
        (DESIGN.md 2, unquantized keys): q [n, H, D], w [n, H], k [n, D] -> [n, n] of the
        working dtype. `layer` only labels errors. Raises ValueError on inconsistent shapes."""
        n, heads, dim = q.shape
        if w.shape != (n, heads) or k.shape != (n, dim):
            raise ValueError(f"layer {layer}: q {q.shape}, w {w.shape}, k {k.shape}; expected "
                             f"w [{n}, {heads}] and k [{n}, {dim}]")
        out = np.full((n, n), -np.inf, dtype=self.dtype)
        for r0 in range(0, n, ROW_BLOCK):
            r1 = min(n, r0 + ROW_BLOCK)
            logits = np.maximum(np.matmul(q[r0:r1], k[:r1].T), 0)
            z = np.einsum("th,thi->ti", w[r0:r1], logits)
            causal = np.arange(r1)[None, :] <= np.arange(r0, r1)[:, None]
            out[r0:r1, :r1] = np.where(causal, z, -np.inf)
        return out
