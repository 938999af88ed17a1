"""The offload engine: round trips, reuse of swap files, asynchronous reads, cleanup."""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from zinf_compile.runtime import engine as eng_mod  # the module (OffloadEngine)
from zinf_compile.runtime import ops, register_engine


@pytest.fixture
def nvme(tmp_path):
    e = eng_mod.OffloadEngine(424242, "nvme", str(tmp_path), 2, False)
    yield e
    e.close()
    assert os.listdir(tmp_path) == []


def roundtrip(e, x, order):
    h = e.offload(x, order)
    assert h.shape == x.shape and all(s == 0 for s in h.stride())
    return e.wait(e.prefetch(h, x.device), x.device, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_roundtrip_dtypes(nvme, dtype):
    x = (torch.randn(37, 129) * 100).to(dtype)
    y = roundtrip(nvme, x, [0, 1])
    assert y.dtype == dtype and torch.equal(x, y) and y.stride() == x.stride()


def test_roundtrip_layouts(nvme):
    x = torch.randn(6, 5, 4).permute(2, 0, 1)  # dense, not contiguous
    order = sorted(range(3), key=lambda d: -x.stride()[d])
    y = roundtrip(nvme, x, order)
    assert torch.equal(x, y) and y.stride() == x.stride()
    big = torch.randn(5 * (eng_mod.CHUNK_BYTES // 4) + 3)  # several chunks, odd tail
    assert torch.equal(roundtrip(nvme, big, [0]), big)
    scalar = torch.tensor(3.5)
    assert torch.equal(roundtrip(nvme, scalar, []), scalar)


def test_swap_files_are_reused_and_tickets_released(nvme):
    for _ in range(5):
        x = torch.randn(64, 64)
        y = roundtrip(nvme, x, [0, 1])
        assert torch.equal(x, y)
        del y
        gc.collect()
    assert nvme.swap.file_count() == 1  # one file, rewritten each time
    assert nvme.live_tickets() == 0


def test_prefetch_reads_in_the_background(nvme, monkeypatch):
    """prefetch returns while its read is still blocked; wait joins it."""
    gate = threading.Event()
    started = threading.Event()
    real_read = nvme._read_chunk

    def gated_read(*a):
        started.set()
        assert gate.wait(timeout=30), "the read was never released"
        return real_read(*a)

    monkeypatch.setattr(nvme, "_read_chunk", gated_read)
    x = torch.randn(128, 128)
    h2 = nvme.prefetch(nvme.offload(x, [0, 1]), x.device)  # would hang here if it read inline
    assert started.wait(timeout=30)
    futures = nvme._reads[nvme.ticket_of(h2)].futures
    assert not any(f.done() for f in futures)
    gate.set()
    assert torch.equal(nvme.wait(h2, x.device, [0, 1]), x)


def test_o_direct_roundtrip(tmp_path):
    e = eng_mod.OffloadEngine(424243, "nvme", str(tmp_path), 2, True)
    if not e.swap.o_direct:
        e.close()
        pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs?): zinf falls back to buffered I/O there")
    x = torch.randn(1000, 33)  # a length that is not a multiple of the 4 KiB alignment
    assert torch.equal(roundtrip(e, x, [0, 1]), x)
    big = torch.randn(2 * (eng_mod.CHUNK_BYTES // 4) + 1001)  # several aligned chunks, odd tail
    assert torch.equal(roundtrip(e, big, [0]), big)
    e.close()
    assert os.listdir(tmp_path) == []


def test_o_direct_falls_back_where_refused(tmp_path, monkeypatch):
    """Where opening with O_DIRECT fails, the engine says so and still round-trips."""
    from zinf_compile.runtime import swapdir

    monkeypatch.setattr(swapdir.SwapDir, "_supports_o_direct", lambda self: False)
    e = eng_mod.OffloadEngine(424246, "nvme", str(tmp_path), 1, True)
    assert e.swap.o_direct is False
    x = torch.randn(100, 7)
    assert torch.equal(roundtrip(e, x, [0, 1]), x)
    e.close()


def test_cpu_tier_keeps_a_copy(tmp_path):
    e = eng_mod.OffloadEngine(424244, "cpu", str(tmp_path), 1, False)
    x = torch.randn(16, 16)
    h = e.offload(x, [0, 1])
    x2 = x.clone()
    x.zero_()  # Inductor may reuse the source buffer as soon as offload returns
    assert torch.equal(e.wait(e.prefetch(h, x.device), x.device, [0, 1]), x2)
    e.close()


def test_ops_dispatch_through_registered_engine(tmp_path):
    key = 424245
    register_engine(key, "nvme", str(tmp_path), 1, False)
    x = torch.randn(8, 3)
    h = ops.offload(x, key, [0, 1])
    y = ops.wait(ops.prefetch(h, key, x.device), key, x.dtype, x.device, [0, 1])
    assert torch.equal(x, y)
    with torch._subclasses.FakeTensorMode():
        fx_ = torch.empty(8, 3)
        fh = ops.offload(fx_, key, [0, 1])
        assert fh.shape == fx_.shape and fh.dtype == torch.int64
        fy = ops.wait(ops.prefetch(fh, key, fx_.device), key, torch.float32, fx_.device, [1, 0])
        assert fy.shape == (8, 3) and fy.stride() == (1, 8)


def test_swap_file_is_not_reused_while_a_read_is_in_flight(nvme, monkeypatch):
    """Inductor frees the offload handle right after the prefetch; an offload before the wait
    must then get another file, not the one still being read (found in review: it did)."""
    gate = threading.Event()
    real_read = nvme._read_chunk

    def gated_read(*a):
        assert gate.wait(timeout=30)
        return real_read(*a)

    monkeypatch.setattr(nvme, "_read_chunk", gated_read)
    x = torch.arange(1 << 16, dtype=torch.float32)
    h = nvme.offload(x, [0])
    h2 = nvme.prefetch(h, x.device)
    del h
    gc.collect()
    h3 = nvme.offload(torch.full((1 << 16,), -1.0), [0])  # must not overwrite x's file
    gate.set()
    assert torch.equal(nvme.wait(h2, x.device, [0]), x)
    assert nvme.swap.file_count() == 2
    del h2, h3
    gc.collect()
    assert nvme.live_tickets() == 0
