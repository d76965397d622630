import os
import sys

# Tests import the root files (topology.py, ...) and the helper beside this file.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    """Some tests work in float64 via torch.set_default_dtype; never let that leak into the next test."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
