"""pytest setup for dsa_model: puts python/ on the path and provides the converted model folder
(DSA_MODEL_DIR, default build/models/smollm2-135m, written by scripts/model_setup.sh) and a
session-wide Reference over it."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

PYTHON_DIR = Path(__file__).resolve().parents[2]
REPO_DIR = PYTHON_DIR.parent
sys.path.insert(0, str(PYTHON_DIR))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    path = Path(os.environ.get("DSA_MODEL_DIR", REPO_DIR / "build/models/smollm2-135m"))
    if not path.is_absolute():
        path = REPO_DIR / path
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path}: no converted model (run scripts/model_setup.sh)")
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from dsa_model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def reference(model_dir):
    from dsa_model.reference import Reference

    return Reference.from_dir(model_dir)


@pytest.fixture(scope="session")
def heldout(model_dir) -> np.ndarray:
    from dsa_model.corpus import load_split

    return np.asarray(load_split(model_dir, "heldout"), dtype=np.int64)
