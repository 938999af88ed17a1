"""The benchmark harness's own logic: the alternating order, the memory readings, the runner."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _harness  # noqa: E402


def test_alternate_rotates_the_order_each_repeat_and_rejects_unknown_contenders(capsys):
    seen = []
    after = []
    runs = _harness.alternate(["a", "b", "c"], ("a", "b", "c"), 3, lambda n: seen.append(n) or [{"n": n}],
                              lambda: after.append(len(seen)))
    assert seen == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # nobody always first, or always after one
    assert [r["n"] for r in runs] == seen and after == [3, 6, 9]
    with pytest.raises(SystemExit, match="unknown contender 'd'"):
        _harness.alternate(["a", "d"], ("a", "b"), 1, lambda n: [])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS/VmHWM are Linux's")
def test_the_cpu_meter_sees_a_peak_that_is_gone_again():
    meter = _harness.Meter("cpu")
    held = meter.baseline()
    t = torch.ones(64 << 18)  # 64 MiB, touched
    del t
    peak = meter.peak()
    assert peak - held >= 60 << 20, (peak, held)
    assert meter.now() - held < 32 << 20  # freed: its own mapping (or trimmed) leaves the RSS


def test_device_auto_is_the_cpu_without_cuda():
    assert _harness.device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            _harness.device("cuda")
