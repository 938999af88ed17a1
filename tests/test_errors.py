"""Bad input: one clear error each, and no files left behind."""
from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from zinf_compile.errors import BudgetError, ZinfConfigError
from zinf_compile.units import format_bytes

from mlp import build as build_mlp


def compile_and_step(options):
    model, inputs = build_mlp(batch=64, width=64, depth=2)
    compiled = torch.compile(model, backend="zinf", options=options)
    compiled(*inputs).sum().backward()


def inner(excinfo):
    """Dynamo wraps what a backend raises, but re-raises zinf's user-facing errors (ShortenTraceback
    subclasses) unchanged: those must arrive as they are."""
    err = excinfo.value
    assert not isinstance(err, BackendCompilerFailed), err
    return err


def files_under(path):
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] + \
        [os.path.join(d, s) for d, ss, _ in os.walk(path) for s in ss]


def test_impossible_budget_names_the_lower_bound(tmp_path):
    with pytest.raises(BudgetError) as e:
        compile_and_step({"budget": "10KB", "offload": "nvme", "offload_dir": str(tmp_path)})
    err = inner(e)
    assert isinstance(err, BudgetError)
    assert err.lower_bound > err.budget == 10_000
    assert f"lower bound on peak device memory is {format_bytes(err.lower_bound)}" in str(err)
    assert "budget 9.77 KiB is impossible" in str(err)
    assert files_under(tmp_path) == []  # the swap folder made for the compile is gone


def test_unwritable_offload_dir_names_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "swap"
    with pytest.raises(ZinfConfigError) as e:
        compile_and_step({"budget": "1GB", "offload": "nvme", "offload_dir": str(bad)})
    err = inner(e)
    assert isinstance(err, ZinfConfigError)
    assert str(bad) in str(err) and "cannot be used" in str(err)
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_missing_offload_dir_is_made_and_removed(tmp_path):
    """Parents zinf had to create are removed again when it is done."""
    from zinf_compile.runtime.swapdir import SwapDir

    deep = tmp_path / "x" / "y"
    swap = SwapDir(str(deep))
    n, fd = swap.acquire()
    os.write(fd, b"data")
    assert os.path.isdir(swap.path)
    swap.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("options,message", [
    ({"budjet": "1GB"}, "unknown zinf option(s) 'budjet'"),
    ({"budget": "a lot"}, "budget: cannot parse 'a lot'"),
    ({"budget": "150%"}, "budget: a share of the unplanned peak must be in"),
    ({"offload": "floppy"}, "offload: expected 'cpu', 'nvme' or 'auto'"),
])
def test_bad_options(options, message, tmp_path):
    with pytest.raises(ZinfConfigError) as e:
        compile_and_step({**options, "offload_dir": str(tmp_path)})
    assert isinstance(inner(e), ZinfConfigError)
    assert message in str(inner(e))
    assert files_under(tmp_path) == []


def test_write_failure_is_reported_with_the_folder(tmp_path, monkeypatch):
    """A full disk (ENOSPC) surfaces as one zinf error naming the swap folder."""
    import errno

    from zinf_compile.runtime import engine as eng_mod  # the module: the function is get_engine

    e = eng_mod.OffloadEngine(12345, "nvme", str(tmp_path), 1, False)

    def full(fd, mv, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eng_mod.os, "pwrite", full)
    with pytest.raises(eng_mod.ZinfError, match="No space left on device") as err:
        e.offload(torch.randn(8, 8), [0, 1])
    assert e.swap.path in str(err.value)
    e.close()
    assert files_under(tmp_path) == []
