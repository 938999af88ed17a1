"""Shared fixtures. Compiles are slow on 2 cores: compiled models are built once per module."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def offload_root(tmp_path_factory):
    """One offload folder for the whole suite; at the end no zinf file may remain in it."""
    root = tmp_path_factory.mktemp("offload")
    yield str(root)
    from zinf_compile.runtime import close_all

    close_all()
    left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    assert not left, f"zinf left files behind: {left}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
