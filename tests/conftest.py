import os
import sys

# Tests import the root files (topology.py, ...) and the helper beside this file.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import gc

import pytest
import torch

# Every process forked from this one (multirank's ranks, chapter_core.run_program's, benchmarks/report.py's) starts
# with this process's heap, about 300,000 objects of pytest, torch and the tests. Frozen there (gc.freeze: moved to
# the permanent generation, which no collection scans), a rank's collections, the explicit gc.collect() of the memory
# measurements and the automatic full ones, walk only the objects the rank itself created, and do not write into
# (copy) every inherited page. What a rank creates is collected as before; garbage it inherited is not (a rank lives
# for one call of one test).
os.register_at_fork(after_in_child=gc.freeze)


def pytest_collection_finish(session):
    """The same for this process: what exists once the tests are collected (the modules, the tests, pytest) is
    frozen, so that a collection here (the memory measurements' gc.collect(), ~0.2 s each over the whole heap)
    walks only what the tests create from then on."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    """Some tests work in float64 via torch.set_default_dtype; never let that leak into the next test."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
