"""Runtime state with one owner (`zinf_compile.runtime.state.RUNTIME`): `zinf_compile.reset()` takes
the process back to a fresh one without losing anything, and what one model's compile decided never
sizes another model's optimizer."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import zinf_compile
from zinf_compile.optim import DEFAULT_CHUNK_ELEMS
from zinf_compile.runtime.state import RUNTIME, STORE


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))  # 128 KiB matrices


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def _step(cm, opt, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    loss = cm(torch.randn(8, 128, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def test_reset_gives_everything_back_and_loses_nothing(tmp_path):
    """After two NVMe-tier steps, reset(): every parameter has its data back (the values the shards
    held), the optimizer's states left the files before they went, no swap file is left, and
    training goes on, bit-identical to a run that never reset, through a fresh compile."""
    root = str(tmp_path / "swap")
    opts = {"params": "offload", "offload": "nvme", "offload_dir": root}
    zinf_compile.reset()
    ref, model = _mlp(0), _mlp(0)
    cref = torch.compile(ref, backend="zinf", options=opts)
    ropt = zinf_compile.optimizer(cref, torch.optim.AdamW, lr=1e-2)
    ref_losses = [_step(cref, ropt, s) for s in range(4)]
    ref_values = [STORE.full(STORE.entry(p)).clone() if STORE.is_managed(p) else p.detach().clone()
                  for p in ref.parameters()]
    zinf_compile.reset()

    cm = torch.compile(model, backend="zinf", options=opts)
    opt = zinf_compile.optimizer(cm, torch.optim.AdamW, lr=1e-2)
    losses = [_step(cm, opt, s) for s in range(2)]
    managed = [p for p in model.parameters() if STORE.is_managed(p)]
    assert len(managed) == 2 and _files(root)
    shards = {id(p): STORE.full(STORE.entry(p)).clone() for p in managed}
    state = {id(p): opt.state[p]["exp_avg"].clone() for p in managed}

    zinf_compile.reset()
    assert len(STORE) == 0 and not RUNTIME.engines.values() and not zinf_compile.compiles()
    assert not _files(root), "reset left swap files behind"
    for p in managed:
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        assert torch.equal(p.detach(), shards[id(p)])  # read outside any graph: the value, no crash
        assert torch.equal(opt.state[p]["exp_avg"], state[id(p)])  # carried out of the files

    losses += [_step(cm, opt, s) for s in range(2, 4)]  # Dynamo compiles again: managed again
    assert all(STORE.is_managed(p) for p in managed)
    assert losses == ref_losses
    for p, want in zip(model.parameters(), ref_values):
        got = STORE.full(STORE.entry(p)) if STORE.is_managed(p) else p.detach()
        assert torch.equal(got, want)
    zinf_compile.reset()


def test_optimizer_chunk_follows_its_own_models_budget(tmp_path):
    """The NVMe step's chunk comes from the budget *its* parameters were planned under (or the
    user's `chunk_elems`), not from the smallest budget any compile in the process saw."""
    zinf_compile.reset()
    small, large = _mlp(1), _mlp(2)
    x = torch.randn(8, 128)
    root = str(tmp_path)
    cs = torch.compile(small, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                         "offload_dir": root, "budget": "2MB"})
    cl = torch.compile(large, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                         "offload_dir": root, "budget": "4GB"})
    cs(x).sum().backward()
    cl(x).sum().backward()
    o_small = zinf_compile.optimizer(cs, torch.optim.AdamW)
    o_large = zinf_compile.optimizer(cl, torch.optim.AdamW)
    o_user = zinf_compile.optimizer(cl, torch.optim.AdamW, chunk_elems=8192)
    for o in (o_small, o_large, o_user):
        o._sync()
    assert o_small._chunk() == 2_000_000 // (2 * 3 * 5 * 4) // 4096 * 4096 < DEFAULT_CHUNK_ELEMS
    assert o_large._chunk() == DEFAULT_CHUNK_ELEMS  # before: the small model's budget sized it too
    assert o_user._chunk() == 8192
    with pytest.raises(zinf_compile.ZinfError, match="multiple of 4096"):
        zinf_compile.optimizer(cl, torch.optim.AdamW, chunk_elems=1000)
    zinf_compile.reset()


def test_compile_records_go_with_the_compiled_function():
    """A compile's record (its plan and graph snapshots, ~0.5 MiB each for a small model) lives as
    long as its compiled code: `torch._dynamo.reset()` frees it, without zinf_compile.reset()."""
    import gc
    import weakref

    from zinf_compile import records

    torch._dynamo.reset()
    gc.collect()
    before = len(records.compiles())
    cm = torch.compile(_mlp(3), backend="zinf", options={"budget": "1GB"})
    cm(torch.randn(4, 128)).sum().backward()
    recs = records.compiles()
    assert len(recs) == before + 1 and recs[-1].graphs.keys() == {"forward", "backward"}
    dead = weakref.ref(recs[-1])
    del recs
    gc.collect()
    assert dead() is not None, "the record went while its compiled function lives"
    torch._dynamo.reset()
    gc.collect()
    assert dead() is None, "torch._dynamo.reset() left the record (plan and graph snapshots) alive"
    assert len(records.compiles()) == before


def _threads(prefix: str = "zinf-io") -> int:
    import threading

    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_engines_of_dead_models_close_when_the_next_compile_starts(tmp_path):
    """Three models one after another, each with its own option set (its own engine, I/O threads
    and swap folder), trained one NVMe step and dropped: each next compile closes the engines
    nothing uses any more, so engines, I/O threads, open files and swap folders stay flat."""
    import gc

    zinf_compile.reset()
    seen = []
    for i in range(3):
        root = str(tmp_path / f"swap{i}")
        model = _mlp(i)
        cm = torch.compile(model, backend="zinf",
                           options={"params": "offload", "offload": "nvme", "offload_dir": root})
        opt = zinf_compile.optimizer(cm, torch.optim.AdamW, lr=1e-2)
        _step(cm, opt, i)
        assert _files(root), "the NVMe tier wrote nothing"
        seen.append((len(RUNTIME.engines.values()), _threads(), _fds()))
        del model, cm, opt
        torch._dynamo.reset()
        gc.collect()
    # the first model's engine closed when the second compiled, and so on: one engine at a time
    assert [n for n, _, _ in seen] == [1, 1, 1], seen
    # a pool starts its threads as work comes (up to io_threads, 4): never more than one engine's
    assert all(t <= 4 for _, t, _ in seen) and seen[2][2] <= seen[0][2], f"threads/fds grew: {seen}"
    assert not _files(str(tmp_path / "swap0")) and not _files(str(tmp_path / "swap1"))
    zinf_compile.reset()
    assert not _files(str(tmp_path)) and _threads() == 0
