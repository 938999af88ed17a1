"""Parameters of any storage: a memory-mapped file (safetensors, torch.from_file), numpy memory.

Such storages cannot be resized, so the store cannot free them in place; it gives the parameter a
resizable storage of its own (same object, shape, stride: Dynamo's guards pass) and frees that.
The file or the array is never written. The store-level tests need no Inductor compile; the
end-to-end and weight-shape tests run their compiles in a subprocess (a kernel reading a freed
parameter kills the interpreter).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn

from zinf_compile.errors import ZinfError
from zinf_compile.runtime import ops
from zinf_compile.runtime.state import register_engine
from zinf_compile.runtime.state import STORE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (64, 96)
ENGINE = 515151


@pytest.fixture
def engine_key(offload_root):
    register_engine(ENGINE, "nvme", os.path.join(offload_root, "storage"), 2, False)
    return ENGINE


def _values():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))


def _from_file(tmp_path):
    """A parameter over a private mapping of a raw file (torch.from_file, shared=False)."""
    path = tmp_path / "raw.bin"
    _values().numpy().tofile(path)
    t = torch.from_file(str(path), shared=False, size=SHAPE[0] * SHAPE[1], dtype=torch.float32)
    return nn.Parameter(t.view(SHAPE)), lambda: path.read_bytes()


def _safetensors(tmp_path):
    """A parameter loaded from a safetensors file, as from_pretrained does (safe_open)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": _values()}, str(path))
    with safe_open(str(path), framework="pt") as f:
        t = f.get_tensor("w")
    return nn.Parameter(t), lambda: path.read_bytes()


def _numpy(tmp_path):
    """A parameter sharing numpy's memory (torch.from_numpy)."""
    arr = _values().numpy().copy()
    return nn.Parameter(torch.from_numpy(arr)), lambda: arr.tobytes()


SOURCES = {"from_file": _from_file, "safetensors": _safetensors, "numpy": _numpy}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_parameter_of_an_unresizable_storage_is_taken_over_and_given_back(source, tier, engine_key, tmp_path):
    p, original = SOURCES[source](tmp_path)
    assert not p.untyped_storage().resizable()  # what made resize_(0) fail
    before, want = original(), p.detach().clone()
    shape, stride, dtype, rg = p.shape, p.stride(), p.dtype, p.requires_grad

    e = STORE.manage(STORE.identify(p, source), tier, engine_key)
    assert p.untyped_storage().nbytes() == 0  # freed: the parameter holds no data
    assert (p.shape, p.stride(), p.dtype, p.requires_grad) == (shape, stride, dtype, rg)
    assert isinstance(p, nn.Parameter) and STORE.entry(p) is e  # found by its new storage
    assert torch.equal(STORE.gather(p), want)
    assert torch.equal(ops.gather(p, engine_key, ""), want)  # the graph's op
    assert torch.equal(STORE.gather_from(p, STORE.fetch(p)), want)
    assert original() == before

    STORE.release(p)
    assert not STORE.is_managed(p)
    assert p.detach().view(torch.int32).equal(want.view(torch.int32))  # bit-identical
    assert (p.shape, p.stride(), p.dtype, p.requires_grad) == (shape, stride, dtype, rg)
    with torch.no_grad():
        p.add_(1)  # the parameter's storage is its own now: the file/array stays as it was
    assert original() == before


def test_a_graph_adopts_an_unresizable_parameter(engine_key, tmp_path):
    """Another instance of a model reaching a compiled graph's gather: taken over there."""
    p, original = _numpy(tmp_path)
    before, want = original(), p.detach().clone()
    assert torch.equal(ops.gather(p, engine_key, "nvme"), want)
    assert STORE.is_managed(p) and p.untyped_storage().nbytes() == 0
    STORE.release(p)
    assert torch.equal(p.detach(), want) and original() == before


def test_views_of_one_mapped_buffer_are_each_taken_over(engine_key, tmp_path):
    """Two parameters over one unresizable buffer (a loader's mapping, not the user's tying):
    each gets its own storage; the other, and the buffer, are untouched."""
    arr = _values().numpy().copy()
    base = torch.from_numpy(arr)
    a, b = nn.Parameter(base[:32]), nn.Parameter(base[32:])
    want_a, want_b = a.detach().clone(), b.detach().clone()
    STORE.manage(STORE.identify(b, "b"), "nvme", engine_key)
    assert torch.equal(a.detach(), want_a) and torch.equal(STORE.gather(b), want_b)
    STORE.manage(STORE.identify(a, "a"), "cpu", engine_key)
    assert torch.equal(STORE.gather(a), want_a)
    STORE.release(a)
    STORE.release(b)
    assert torch.equal(a.detach(), want_a) and torch.equal(b.detach(), want_b)
    assert np.array_equal(arr, _values().numpy())


def test_a_strided_view_with_gaps_of_an_unresizable_storage_is_refused_by_name(engine_key):
    arr = _values().numpy().copy()
    p = nn.Parameter(torch.from_numpy(arr)[:, ::2])
    with pytest.raises(ZinfError, match="'gappy'.*p.data = p.data.contiguous"):
        STORE.manage(STORE.identify(p, "gappy"), "nvme", engine_key)
    assert not STORE.is_managed(p) and np.array_equal(arr, _values().numpy())


def test_a_failed_free_after_the_swap_keeps_the_values_and_says_why(engine_key, tmp_path, monkeypatch):
    p, original = _numpy(tmp_path)
    before, want = original(), p.detach().clone()
    real = torch.UntypedStorage.resize_

    def refuse_to_free(self, n):
        if n == 0:
            raise RuntimeError("refused")
        return real(self, n)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", refuse_to_free)
    with pytest.raises(ZinfError, match="'stuck'.*refused"):
        STORE.manage(STORE.identify(p, "stuck"), "nvme", engine_key)
    monkeypatch.undo()
    assert not STORE.is_managed(p) and torch.equal(p.detach(), want)  # refilled from the shard
    assert original() == before


def test_a_dead_swapped_parameter_hands_its_files_back(engine_key, tmp_path):
    """The store follows the parameter to its new storage, to the end of its life."""
    from zinf_compile.runtime.state import get_engine

    swap = get_engine(engine_key).swap
    p, _ = _numpy(tmp_path)
    pid = STORE.identify(p, "dies")
    STORE.manage(pid, "nvme", engine_key)
    free_before = len(swap._free)
    del p
    gc.collect()
    assert STORE.entry_by_id(pid) is None and pid not in STORE._keys
    assert len(swap._free) == free_before + 1  # its shard's file, ready for reuse


def test_taking_over_keeps_dynamo_guards(engine_key, tmp_path):
    """The storage swap passes Dynamo's guards: no recompile (a counting backend, no Inductor)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = nn.Linear(96, 8)
    m.weight = nn.Parameter(torch.from_numpy(torch.randn(8, 96).numpy()))
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    cm = torch.compile(m, backend=backend)
    x = torch.randn(4, 96)
    y0 = cm(x)
    STORE.manage(STORE.identify(m.weight, "w"), "nvme", engine_key)
    STORE.release(m.weight)  # the counting backend's graph reads the weight directly
    assert m.weight.untyped_storage().resizable()
    assert torch.equal(cm(x), y0)
    assert len(calls) == 1 and not counters["recompiles"]


# -- compiled end to end, in a subprocess ----------------------------------------------------------

def _run(code: str, tmp_path, timeout=900) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, f"worker exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


TRAIN = """
import json, os, sys, tempfile
import torch, torch.nn as nn
import zinf_compile
from zinf_compile.runtime.state import STORE

torch.use_deterministic_algorithms(True)
tmp = sys.argv[1]

def train(make, batches, backend):
    model = make()
    if backend == "zinf":
        cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                          "offload_dir": tempfile.mkdtemp(dir=tmp)})
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-2)
    else:
        cm = torch.compile(model, backend="inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(cm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    managed = sorted(n for n, p in model.named_parameters() if STORE.is_managed(p))
    return losses, managed
"""


def _weights_case(make: str, batch: str) -> str:
    return TRAIN + textwrap.dedent(f"""
        def make():
            torch.manual_seed(0)
            return {make}

        g = torch.Generator().manual_seed(1)
        batches = [{batch} for _ in range(2)]
        ref, _ = train(make, batches, "inductor")
        got, managed = train(make, batches, "zinf")
        print(json.dumps(dict(ref=ref, got=got, managed=managed)))
    """)


def test_a_managed_conv2d_weight_trains_like_inductor(tmp_path):
    out = _run(_weights_case(
        "nn.Sequential(nn.Conv2d(3, 128, 8, stride=8), nn.Flatten(), nn.Linear(128 * 2 * 2, 10))",
        "(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))"), tmp_path)
    assert "0.weight" in out["managed"]
    torch.testing.assert_close(out["got"], out["ref"], rtol=1e-5, atol=1e-6)


def test_managed_conv1d_and_embedding_weights_train_like_inductor(tmp_path):
    """A 3-d weight (Conv1d) and an embedding read by index, both managed."""
    out = _run(_weights_case(
        "Net()", "(torch.randint(0, 1000, (4, 16), generator=g), torch.randint(0, 10, (4,), generator=g))"
    ).replace("def make():", textwrap.dedent("""
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(1000, 128)
                self.conv = nn.Conv1d(128, 128, 4, stride=4)
                self.head = nn.Linear(128 * 4, 10)

            def forward(self, idx):
                h = self.conv(self.emb(idx).transpose(1, 2))
                return self.head(h.flatten(1))

        def make():""")), tmp_path)
    assert {"emb.weight", "conv.weight"} <= set(out["managed"])
    torch.testing.assert_close(out["got"], out["ref"], rtol=1e-5, atol=1e-6)


def test_a_from_pretrained_llama_trains_on_nvme_like_inductor(tmp_path):
    """transformers loads safetensors into storages that cannot be resized: zinf takes them over
    (params='offload', NVMe tier) and trains exactly as Inductor with torch's AdamW does."""
    out = _run(TRAIN + """
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(os.path.join(tmp, "llama"))
        g = torch.Generator().manual_seed(1)
        idx = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
        result = {}
        for backend in ("inductor", "zinf"):
            model = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "llama"))
            model.train()
            unresizable = sum(not p.untyped_storage().resizable() for p in model.parameters())
            if backend == "zinf":
                cm = torch.compile(model, backend="zinf", options={
                    "params": "offload", "offload": "nvme", "offload_dir": os.path.join(tmp, "swap")})
                opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
            else:
                cm = torch.compile(model, backend="inductor")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for x in idx:
                loss = cm(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            managed = sum(STORE.is_managed(p) for p in model.parameters())
            result[backend] = dict(losses=losses, managed=managed, unresizable=unresizable)
        print(json.dumps(result))
    """.replace("\n        ", "\n"), tmp_path)
    ref, got = out["inductor"], out["zinf"]
    assert got["unresizable"] == ref["unresizable"] > 0  # what made resize_(0) fail
    assert got["managed"] > 0 and ref["managed"] == 0
    assert got["losses"] == ref["losses"]
