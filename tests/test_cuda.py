"""The CUDA path: side-stream copies to pinned host memory, parameter shards in host memory or NVMe
gathered onto the GPU, tiles, each checked against Inductor and against the budget as the caching
allocator sees it (torch.cuda.max_memory_allocated: on a GPU every tensor the graph holds is the
plan's). These need a CUDA device: CI has none, so they run where one is lent (bench/device_check.sh
runs them first). Nothing here is faked on the CPU: the CPU path has its own tests.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile
from zinf_compile.runtime.state import STORE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device")

DEV = "cuda"


def _peak_of(fn, model, inputs) -> tuple[object, int]:
    """fn()'s result and the most that `model`'s run held on the GPU while fn ran: the allocator's
    peak less what was there before and is not the model's (the cuBLAS workspaces, tensors of the
    test), so the model's parameters, gradients and inputs count, as in the plan."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    mine = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *inputs) if t.is_cuda)
    mine += sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None and p.grad.is_cuda)
    foreign = torch.cuda.memory_allocated() - mine
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - foreign


def _say(what: str, **facts) -> None:
    """One line of what a test measured (bench/device_check.sh shows the passing tests' output)."""
    print(f"[cuda] {what}: " + ", ".join(f"{k}={v / 2**20:.2f}MiB" if isinstance(v, int) and k != "actions"
                                          and ("peak" in k or k == "budget") else f"{k}={v}"
                                          for k, v in facts.items()))


def _mlp(seed=0, width=1024, layers=4):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods).to(DEV)


def _data(width=1024, batch=256):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g).to(DEV), torch.randn(batch, width, generator=g).to(DEV)


def _train(fn, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(fn(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _last_forward_plan():
    plans = [p for p in zinf_compile.last_plans() if "forward" in p.graphs]
    assert plans, "zinf made no plan for a forward graph"
    return plans[-1]


def test_activations_offloaded_to_pinned_host_memory_stay_under_the_budget(offload_root):
    """Parameters resident, activations offloaded to CPU memory over the side stream: the losses
    of three SGD steps match Inductor's and the allocator's peak stays under the budget."""
    from gpt import build

    ref, inputs = build(batch=8, seq=256, layers=2, hidden=256, heads=4, vocab=512, device=DEV)
    model, _ = build(batch=8, seq=256, layers=2, hidden=256, heads=4, vocab=512, device=DEV)
    cref = torch.compile(ref)
    cm = torch.compile(model, backend="zinf", options={"budget": "80%", "offload": "cpu", "params": "resident",
                                                      "offload_dir": os.path.join(offload_root, "cuda-act")})

    def steps(fn, m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = []
        for _ in range(3):
            loss = fn(*inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
        return torch.stack(out)

    steps(cref, ref), steps(cm, model)  # compiles
    ref_losses, ref_peak = _peak_of(lambda: steps(cref, ref), ref, inputs)
    del cref, ref
    losses, peak = _peak_of(lambda: steps(cm, model), model, inputs)
    plan = _last_forward_plan()
    _say("activations", peak=peak, budget=plan.budget, plan_peak=plan.peak_after, inductor_peak=ref_peak,
         actions=plan.action_counts())
    assert plan.action_counts().get("offload", 0) > 0, plan.action_counts()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    # the plan covers one graph; the step also holds the parameters, the optimizer's temporaries and
    # the other graph's saved tensors, all counted in the plan's inputs: the whole step must fit
    assert peak <= plan.budget, (peak, plan.budget, plan.peak_after, ref_peak)
    assert peak < ref_peak, (peak, ref_peak)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offloaded_parameters_train_like_inductor_and_adamw(tier, offload_root):
    """Every weight sharded to `tier` and gathered onto the GPU around its uses, AdamW stepped by
    zinf's optimizer where the shards live: losses and parameters as Inductor + torch.optim.AdamW
    after three steps; the allocator never holds more than the budget."""
    ref, model = _mlp(), _mlp()
    x, y = _data()
    budget = 12 << 20  # the weights alone are 16 MiB; with gradients and AdamW's states 64 MiB
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    cm = torch.compile(model, backend="zinf", options={"budget": budget, "offload": tier, "params": "offload",
                                                      "offload_dir": os.path.join(offload_root, f"cuda-{tier}")})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_losses = _train(torch.compile(ref), ropt, x, y, 1)
    losses = _train(cm, opt, x, y, 1)  # compiles, takes the weights over
    assert sum(STORE.is_managed(p) for p in model.parameters()) == 4  # the weights; 4 KiB biases stay
    for p in model.parameters():
        if STORE.is_managed(p):
            assert p.untyped_storage().size() == 0  # nothing of it left on the GPU
    r2 = _train(torch.compile(ref), ropt, x, y, 2)
    want = {k: v.cpu() for k, v in ref.state_dict().items()}
    del ref, ropt
    l2, peak = _peak_of(lambda: _train(cm, opt, x, y, 2), model, (x, y))
    _say(f"params-{tier}", peak=peak, budget=budget, plan_peak=_last_forward_plan().peak_after,
         losses=[round(float(v), 6) for v in l2])
    torch.testing.assert_close(torch.cat([losses, l2]), torch.cat([ref_losses, r2]), rtol=1e-5, atol=1e-6)
    full = zinf_compile.full_state_dict(model)
    for k, v in want.items():
        torch.testing.assert_close(full[k].cpu(), v, rtol=1e-4, atol=1e-5, msg=k)
    assert peak <= budget, (peak, budget)


def test_streamed_inference_prefetches_and_matches_eager(offload_root):
    """A forward under no_grad with every weight streamed from NVMe files, fetched ahead into pinned
    host memory and copied on a side stream: outputs as eager's, the peak under the budget."""
    model = _mlp(seed=3, layers=6).eval()
    x, _ = _data()
    with torch.no_grad():
        want = model(x).cpu()
    budget = 10 << 20  # 24 MiB of weights
    cm = torch.compile(model, backend="zinf", options={"budget": budget, "offload": "nvme", "params": "offload",
                                                      "offload_dir": os.path.join(offload_root, "cuda-infer")})
    with torch.no_grad():
        cm(x)
        got, peak = _peak_of(lambda: cm(x), model, (x,))
    plan = zinf_compile.last_plans()[-1]
    _say("inference", peak=peak, budget=budget, plan_peak=plan.peak_after, actions=plan.action_counts())
    assert plan.action_counts().get("fetch", 0) >= 5, plan.action_counts()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    assert peak <= budget, (peak, budget)


def test_a_weight_larger_than_the_budget_is_tiled_on_the_gpu(offload_root):
    """examples/tiled.py's model with a 64 MiB weight under a 40 MiB budget: the plan tiles its
    matmuls, losses match Inductor's and the allocator's peak stays under the budget."""
    from tiled import build

    ref, (x, y) = build(batch=64, d_in=64, width=4096, d_out=16)
    model, _ = build(batch=64, d_in=64, width=4096, d_out=16)
    ref, model, x, y = ref.to(DEV), model.to(DEV), x.to(DEV), y.to(DEV)
    budget = 40 << 20
    cm = torch.compile(model, backend="zinf", options={"budget": budget, "offload": "nvme", "params": "offload",
                                                      "offload_dir": os.path.join(offload_root, "cuda-tiled")})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-4)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    cref = torch.compile(ref)

    def steps(fn, o, n):
        out = []
        for _ in range(n):
            loss = fn(x, y)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            out.append(loss.detach())
        return torch.stack(out)

    first = (steps(cref, ropt, 1), steps(cm, opt, 1))
    assert _last_forward_plan().tiles, "the big weight's matmuls were not tiled"
    rl = steps(cref, ropt, 2)
    del cref, ref, ropt
    zl, peak = _peak_of(lambda: steps(cm, opt, 2), model, (x, y))
    _say("tiled", peak=peak, budget=budget, tiles=[(t.op, t.axis, t.count) for t in _last_forward_plan().tiles])
    torch.testing.assert_close(torch.cat([first[1], zl]), torch.cat([first[0], rl]), rtol=1e-4, atol=1e-5)
    assert peak <= budget, (peak, budget)
