"""Low-precision gathers (option gather_dtype): managed parameters keep a bfloat16 copy of their
float32 shard, which the graph's gathers read (half the bytes) and widen; the shard stays the
master the optimizer steps. The recipe in plain torch: compute with `master.to(bf16).float()` for
each managed weight, step the float32 masters with the gradient. zinf must equal it bit for bit
under Inductor, and read half the bytes per gather."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

from zinf_compile.checkpoint import full_state_dict, load_state_dict
from zinf_compile.config import ZinfConfig
from zinf_compile.errors import ZinfConfigError
from zinf_compile.optim import optimizer
from zinf_compile.planner import PERSIST_BYTES
from zinf_compile.runtime.state import STORE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import hf_batch, hf_model  # noqa: E402

HP = dict(lr=1e-2, weight_decay=0.1)
X = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
STEPS = 3


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))  # 64 KiB weights: managed


def big(p: torch.Tensor) -> bool:
    return p.numel() * p.element_size() >= PERSIST_BYTES


def mlp_loss(m) -> torch.Tensor:
    return m(X).pow(2).mean()


def recipe(build=mlp, loss_of=mlp_loss, steps: int = STEPS):
    """The same training in plain torch under Inductor: a compute copy of the model holds each
    managed weight rounded to bfloat16 (and widened back), the masters are stepped by AdamW."""
    masters = build()
    first = copy.deepcopy(masters.state_dict())
    compute = copy.deepcopy(masters)
    cc = torch.compile(compute)
    opt = torch.optim.AdamW(masters.parameters(), **HP)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for pc, pm in zip(compute.parameters(), masters.parameters()):
                pc.copy_(pm.to(torch.bfloat16).float() if big(pm) else pm)
        loss = loss_of(cc)
        loss.backward()
        for pc, pm in zip(compute.parameters(), masters.parameters()):
            pm.grad, pc.grad = pc.grad, None
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch._dynamo.reset()
    return first, losses, copy.deepcopy(masters.state_dict())


def assert_as_recipe(losses, ref_losses, cm, ref_masters) -> None:
    """Losses and float32 masters (not their rounded copies) bit for bit the recipe's."""
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), (i, losses, ref_losses)
    masters = full_state_dict(cm)
    for k, v in ref_masters.items():
        assert masters[k].dtype == torch.float32 and torch.equal(masters[k], v), k


@pytest.fixture(scope="module")
def reference():
    torch.use_deterministic_algorithms(True)
    try:
        return recipe()
    finally:
        torch.use_deterministic_algorithms(False)


def zinf_run(tier: str, offload_root: str, build=mlp, loss_of=mlp_loss, steps: int = STEPS,
             options: dict | None = None, **opt_kw):
    model = build()
    opts = {"params": "offload", "offload": tier, "gather_dtype": "bfloat16",
            "offload_dir": os.path.join(offload_root, "gather-dtype"), **(options or {})}
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = optimizer(cm, torch.optim.AdamW, **HP, **opt_kw)
    opt.chunk_elems = 4096  # each weight is 4 chunks
    losses = []
    for _ in range(steps):
        loss = loss_of(cm)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, cm, losses


@pytest.mark.parametrize("tier,opt_kw", [("nvme", {}), ("cpu", {}), ("nvme", {"step_in_backward": True}),
                                         ("nvme", {"commit": "param"})],
                         ids=["nvme", "cpu", "nvme-step-in-backward", "nvme-commit-param"])
def test_training_equals_the_bf16_gather_recipe(tier, opt_kw, offload_root, reference):
    first, ref_losses, ref_masters = reference
    model, cm, losses = zinf_run(tier, offload_root, **opt_kw)
    entries = [STORE.entry(p) for p in model.parameters() if big(p)]
    assert len(entries) == 2 and all(e is not None and e.gather_dtype == torch.bfloat16 for e in entries)
    assert all(e.copy_ok for e in entries)
    assert_as_recipe(losses, ref_losses, cm, ref_masters)
    w = full_state_dict(cm)["0.weight"]
    assert not torch.equal(w, w.to(torch.bfloat16).float())  # a master, not its rounded copy
    # a write of the masters from outside (a state dict) reaches the copy the gathers read
    load_state_dict(cm, first)
    with torch.no_grad():
        assert torch.equal(cm(X).pow(2).mean(), ref_losses[0])


def test_a_full_disk_while_the_copy_is_written_applies_nothing(offload_root, reference, monkeypatch):
    """The copy is one more record of the all-or-nothing step: a write of it failing (a full disk)
    leaves masters, states and copies as they were; the step retried continues exactly."""
    from zinf_compile.errors import ZinfError

    _, ref_losses, ref_masters = reference
    model = mlp()
    opts = {"params": "offload", "offload": "nvme", "gather_dtype": "bfloat16",
            "offload_dir": os.path.join(offload_root, "gather-dtype")}
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = optimizer(cm, torch.optim.AdamW, **HP)
    opt.chunk_elems = 4096
    losses = []
    for step in range(STEPS):
        loss = mlp_loss(cm)
        loss.backward()
        losses.append(loss.detach())
        if step == 1:
            engine = STORE.entry(model[0].weight).engine
            real = engine.write_file

            copies = []

            def full(fd, t, offset=0):  # the disk fills at the 6th of the 8 copy chunks (2 weights x 4)
                if t.dtype == torch.bfloat16:  # only the copies are bfloat16 here
                    copies.append(offset)
                    if len(copies) >= 6:
                        raise OSError(28, "No space left on device")
                return real(fd, t, offset)

            with monkeypatch.context() as m:
                m.setattr(engine, "write_file", full)
                with pytest.raises(ZinfError, match="nothing was applied"):
                    opt.step()
            with torch.no_grad():  # the gathers still read the copy of the unchanged masters
                assert torch.equal(mlp_loss(cm), losses[-1])
        opt.step()
        opt.zero_grad()
    assert_as_recipe(losses, ref_losses, cm, ref_masters)


def test_hf_llama_trains_as_the_recipe(offload_root):
    """A Hugging Face Llama (hidden 128, from a config) in the NVMe tier with bfloat16 gathers:
    losses and float32 masters bit-identical to the recipe under Inductor."""
    batch = hf_batch("llama")

    def build():
        return hf_model("llama")

    def loss_of(m):
        return m(**batch).loss

    _, ref_losses, ref_masters = recipe(build, loss_of, steps=2)
    model, cm, losses = zinf_run("nvme", offload_root, build, loss_of, steps=2)
    managed = [p for p in model.parameters() if STORE.entry(p) is not None]
    assert len(managed) > 10 and all(STORE.entry(p).gather_dtype == torch.bfloat16 for p in managed)
    assert_as_recipe(losses, ref_losses, cm, ref_masters)


def test_tiles_read_rows_of_the_copy(offload_root):
    """A layer larger than the budget (examples/tiled.py's, 1.37 MiB under 1 MiB) is tiled; each
    tile's rows come from the bfloat16 copy. Against the recipe (untiled, Inductor) to the
    tolerance of tiling's K split (the input gradient, summed in another order)."""
    from tiled import build as tiled

    from zinf_compile import records

    def build():
        return tiled(batch=16, d_in=24, width=600, d_out=10)[0]

    _, (x, y) = tiled(batch=16, d_in=24, width=600, d_out=10)

    def loss_of(m):
        return m(x, y)

    _, ref_losses, ref_masters = recipe(build, loss_of)
    records.reset()
    model, cm, losses = zinf_run("nvme", offload_root, build, loss_of, options={"budget": 1 << 20})
    plan = records.compiles()[-1].plan
    assert {t.param for t in plan.tiles} == {"big.weight"} and STORE.entry(model.big.weight).gather_dtype == torch.bfloat16
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=0)
    # AdamW turns the K split's reassociation into moves of up to ~lr on the rare elements whose
    # gradient is at the rounding level (tests/test_tiling.py measures that spread); a tile lost
    # or doubled would move whole rows by ~lr = 1e-2 a step
    masters, off, total = full_state_dict(cm), 0, 0
    for k, v in ref_masters.items():
        torch.testing.assert_close(masters[k], v, rtol=0, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        off += int(((masters[k] - v).abs() > 1e-6).sum())
        total += v.numel()
    assert off <= 0.001 * total, (off, total)


def test_a_gather_reads_half_the_bytes(offload_root):
    """In the NVMe tier a forward reads each managed weight's bfloat16 copy: 2 bytes per element."""
    model = mlp()
    opts = {"params": "offload", "offload": "nvme", "gather_dtype": "bf16",
            "offload_dir": os.path.join(offload_root, "gather-dtype")}
    cm = torch.compile(model, backend="zinf", options=opts)
    with torch.no_grad():
        cm(X)  # the first call takes the weights over and writes the copies
        entries = [STORE.entry(p) for p in model.parameters() if big(p)]
        engine = entries[0].engine
        before = engine.stats["bytes_read"]
        out = cm(X)
        read = engine.stats["bytes_read"] - before
    assert read == sum(e.numel * 2 for e in entries)  # the float32 shards would be twice this
    ref = mlp()
    with torch.no_grad():
        for p in ref.parameters():
            if big(p):
                p.copy_(p.to(torch.bfloat16).float())
        assert torch.allclose(out, ref(X), rtol=1e-5, atol=1e-6)


def test_a_training_step_moves_two_bytes_less_per_gathered_element(offload_root):
    """Bytes through the swap files per training step, exact counts of the engine: each gather
    (forward and backward) reads 2 bytes per element instead of 4, and the step writes the copy
    (2 bytes per element) besides the float32 master and states."""
    moved = {}
    for gather in (None, "bfloat16"):
        model = mlp()
        opts = {"params": "offload", "offload": "nvme", "gather_dtype": gather,
                "offload_dir": os.path.join(offload_root, "gather-dtype")}
        cm = torch.compile(model, backend="zinf", options=opts)
        opt = optimizer(cm, torch.optim.AdamW, **HP)
        for step in range(2):  # the first compiles, takes over and makes the files
            engine = STORE.entry(model[0].weight).engine if step else None
            before = dict(engine.stats) if step else None
            gathers = STORE.stats["gathers"]
            mlp_loss(cm).backward()
            opt.step()
            opt.zero_grad()
        moved[gather] = {k: engine.stats[k] - before[k] for k in ("bytes_read", "bytes_written")}
        moved[gather]["gathers"] = STORE.stats["gathers"] - gathers
        del cm, opt, model
        torch._dynamo.reset()
    numel = 256 * 64  # both weights
    fp32, bf16 = moved[None], moved["bfloat16"]
    assert fp32["gathers"] == bf16["gathers"] >= 2, moved
    assert fp32["bytes_read"] - bf16["bytes_read"] == fp32["gathers"] * numel * 2, moved
    assert bf16["bytes_written"] - fp32["bytes_written"] == 2 * numel * 2, moved


def test_zero_layout_under_a_bf16_model(offload_root):
    """A bfloat16 model with master_dtype="float32" and gather_dtype="bfloat16" (ZeRO's layout):
    the gathers read the bf16 copy, half of what they read from the float32 masters without it,
    and train bit for bit as the masters alone do (the copy holds what the gather made of them)."""
    runs = {}
    for gather in (None, "bfloat16"):
        torch._dynamo.reset()
        torch.manual_seed(0)  # 128 x 256 bf16 weights: 64 KiB, managed
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(torch.bfloat16)
        opts = {"params": "offload", "offload": "nvme", "master_dtype": "float32", "gather_dtype": gather,
                "offload_dir": os.path.join(offload_root, "gather-dtype")}
        cm = torch.compile(model, backend="zinf", options=opts)
        opt = optimizer(cm, torch.optim.AdamW, **HP)
        losses, read = [], 0
        for step in range(STEPS):
            engine = STORE.entry(model[0].weight).engine if step else None
            before = engine.stats["bytes_read"] if step else 0
            loss = cm(X.repeat(1, 2).to(torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            if step:
                read += engine.stats["bytes_read"] - before  # the gathers' reads (the step's come after)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        e = STORE.entry(model[0].weight)
        assert e.shard_dtype == torch.float32 and e.read_dtype == (torch.bfloat16 if gather else torch.float32)
        runs[gather] = losses, full_state_dict(cm), read
    (l0, m0, r0), (l1, m1, r1) = runs[None], runs["bfloat16"]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)), (l0, l1)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    assert r1 * 2 == r0 > 0, (r0, r1)


def test_bad_gather_dtype_is_a_clear_error():
    with pytest.raises(ZinfConfigError, match="gather_dtype: expected 'bfloat16' or 'float16'"):
        ZinfConfig.from_options({"gather_dtype": "int8"})
    assert ZinfConfig.from_options({"gather_dtype": "fp16"}).gather_dtype == "float16"
