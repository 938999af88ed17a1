"""The plan's lower bound is the floor with every lever: with parameters managed and every saved
activation movable (offloads of storages read through several views), the largest single-step
working set. It must not grow with depth (issue 13: 3.13x from 4 to 16 layers before)."""
from __future__ import annotations

import os
import sys

import pytest

from zinf_compile.capture import plan_offline
from zinf_compile.cost import BUILTIN

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def _gpt(layers):
    from gpt import build

    return build, dict(batch=4, seq=64, layers=layers, hidden=128, heads=4, vocab=512)


def _llama(layers):
    import hf_models

    return hf_models.build, dict(name="llama", layers=layers)


@pytest.mark.parametrize("model", [_gpt, _llama], ids=["gpt", "llama"])
def test_lower_bound_does_not_grow_with_depth(model):
    bounds = {}
    for layers in (4, 16):
        factory, kwargs = model(layers)
        off = plan_offline(factory, kwargs, 1 << 30, BUILTIN["cpu"], "nvme", params="offload")
        assert len(off.managed) == len([p for p in off.params if p.nbytes >= 64 << 10])
        bounds[layers] = off.plan.lower_bound
        assert off.plan.lower_bound < off.plan.peak_before / 2
    assert bounds[16] <= 1.25 * bounds[4], bounds
