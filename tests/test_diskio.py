"""Disk I/O: damaged swap files are errors that name the file and the parameter (never a SIGBUS
or zeros read as data); the O_DIRECT path round-trips any offset and length; the read path is
chosen from facts (forced either way by the option)."""
from __future__ import annotations

import os

import pytest
import torch

import zinf_compile
from zinf_compile.errors import ZinfError
from zinf_compile.runtime import engine as eng_mod
from zinf_compile.runtime.state import STORE

from hf_models import hf_batch, hf_model  # noqa: E402  (tests/ is on the path under pytest)


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture(scope="module")
def llama_nvme(offload_root):
    """A small HF Llama whose every large weight is a shard file, after one forward."""
    zinf_compile.reset()
    torch.manual_seed(0)
    model = hf_model("llama").eval()
    batch = hf_batch("llama", batch=1, seq=16)
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "diskio")}
    cm = torch.compile(model, backend="zinf", options=opts)
    with torch.no_grad():
        ref = cm(**batch).logits
    yield model, cm, batch, ref
    zinf_compile.reset()


def _entry(model, name):
    p = dict(model.named_parameters())[name]
    e = next(e for e in STORE.entries() if e.name.endswith(name))
    assert STORE.is_managed(p) and e.fd is not None
    return e


@pytest.mark.parametrize("how", ["truncated", "emptied"])
def test_truncated_shard_file_is_an_error_naming_parameter_and_file(llama_nvme, how):
    """A shard file cut short under a running model: the forward raises a ZinfError naming the
    parameter and the file (the mapped gather would otherwise die with SIGBUS); restored, the
    same forward gives the same logits."""
    model, cm, batch, ref = llama_nvme
    name = "model.layers.1.mlp.up_proj.weight"
    e = _entry(model, name)
    path = _path_of(e.fd)
    with open(path, "rb") as f:
        saved = f.read()
    assert len(saved) >= e.shard_nbytes
    os.truncate(path, 0 if how == "emptied" else e.shard_nbytes // 2)
    try:
        with pytest.raises(ZinfError) as info, torch.no_grad():
            cm(**batch)
        msg = str(info.value)
        assert name in msg and path in msg and "truncated" in msg, msg
    finally:
        with open(path, "r+b") as f:
            f.write(saved)
    with torch.no_grad():
        assert torch.equal(cm(**batch).logits, ref)


def test_engine_reads_of_a_truncated_file_name_it(tmp_path):
    e = eng_mod.OffloadEngine(424243, "nvme", str(tmp_path), 2, False)
    try:
        x = torch.randn(1000)
        h = e.offload(x, [0])
        fd = e._stored[e.ticket_of(h)].fd
        os.truncate(_path_of(fd), 100)
        for read in (lambda: e.wait(e.prefetch(h, x.device), x.device, [0]),
                     lambda: e.map_file(fd, 0, 1000, torch.float32),
                     lambda: e.read_file(fd, torch.empty(1000))):
            with pytest.raises(ZinfError, match=r"swap-0\.bin \(an offloaded activation\) holds 100 bytes, 4000"):
                read()
        os.close(fd)  # a file that cannot be read at all
        with pytest.raises(ZinfError, match="cannot be read"):
            e.read_file(fd, torch.empty(10))
        e.swap._fds.clear()
    finally:
        e.close()
