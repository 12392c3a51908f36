"""pytest setup for dsa_kernels: finds an in-place build (python/dsa_kernels/_C*.so) before any
installed copy, and skips every test where no CUDA GPU is visible."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        item.add_marker(skip)
