"""The optimizer over managed parameters, state dicts and checkpoints.

Two kinds of tests. Store-level ones manage parameters directly (`STORE.manage`, no compile) and
hand them gradients, to check the arithmetic against torch's optimizer on whole tensors: bit for bit,
per tier, with several chunks and a tail on NVMe. End-to-end ones train a compiled MLP
(`params="offload"`: the 64 KiB weights are managed, the biases stay resident) against Inductor +
torch.optim.AdamW: losses, parameters and optimizer state bit-identical, checkpoint resume exact.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import zlib

import pytest
import torch
import torch.nn as nn

from zinf_compile.checkpoint import full_state_dict, load_checkpoint, load_state_dict, save_checkpoint
from zinf_compile.errors import ZinfError
from zinf_compile.optim import ZinfOptimizer, optimizer
from zinf_compile.runtime.state import register_engine
from zinf_compile.runtime.state import STORE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from fault_worker import give, give_grad  # noqa: E402  (this step's gradients, as a backward leaves them)

HP = dict(lr=1e-2, weight_decay=0.1)
LRS = [1e-2, 1e-2, 5e-3, 5e-3]  # the lr of each step: changed between steps, as a scheduler would
CHUNK = 4096  # NVMe optimizer chunk in these tests: a 64x256 weight is 4 chunks


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


# -- store level --------------------------------------------------------------------------------
_KEYS = {"cpu": (1 << 62) + 11, "nvme": (1 << 62) + 12}  # above the backend's keys (62-bit digests)


def manage(model: nn.Module, tier: str, offload_root: str, min_numel: int = 4096) -> None:
    """Take over the model's larger parameters, as the backend does at the first compile."""
    register_engine(_KEYS[tier], tier, os.path.join(offload_root, "optim"), 2, False)
    for name, p in model.named_parameters():
        if p.numel() >= min_numel:
            STORE.manage(STORE.identify(p, name), tier, _KEYS[tier])


def small(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 7))  # 10000 elements: 3 chunks of 4096, a tail


def managed_pair(cls: type, tier: str, offload_root: str, **kw):
    """(ref, model, opt, ref_opt): small() and its copy with the weights managed in `tier`, a zinf
    `cls` optimizer over the copy (CHUNK-element chunks) and torch's over the original."""
    ref = small()
    model = copy.deepcopy(ref)
    manage(model, tier, offload_root)
    opt, ref_opt = optimizer(model, cls, **kw), cls(ref.parameters(), **kw)
    opt.chunk_elems = CHUNK
    return ref, model, opt, ref_opt


def whole(p: torch.Tensor) -> torch.Tensor:
    e = STORE.entry(p)
    return p.detach() if e is None else STORE.full(e)


def assert_same_params(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(whole(p), q.detach()), name


def assert_same_optim_state(sd, ref_sd) -> None:
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert sd["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            assert sd["state"][i][k].dtype == v.dtype and torch.equal(sd["state"][i][k], v), (i, k)


CASES = [
    ("cpu", torch.optim.AdamW, HP),
    ("cpu", torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("nvme", torch.optim.AdamW, HP),
    ("nvme", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    # any other torch.optim optimizer in the NVMe tier: streamed through an instance of its own class
    ("nvme", torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("nvme", torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3, weight_decay=1e-3, initial_accumulator_value=0.1)),
    ("nvme", torch.optim.NAdam, dict(lr=1e-2, weight_decay=1e-3)),  # a scalar state besides step: mu_product
]



def step_both(model, ref, opt, ref_opt, gen) -> None:
    """The same random gradients into both models (the managed one through the store), one step each."""
    grads = [torch.randn(q.shape, generator=gen) for q in ref.parameters()]
    give(model, grads)
    for q, g in zip(ref.parameters(), grads):
        q.grad = g.clone()
    opt.step()
    ref_opt.step()

@pytest.mark.parametrize("tier,cls,kw", CASES, ids=[f"{t}-{c.__name__}-{i}" for i, (t, c, _) in enumerate(CASES)])
def test_shards_step_like_whole_tensors(offload_root, tier, cls, kw):
    ref = small()
    model = copy.deepcopy(ref)
    manage(model, tier, offload_root)
    assert STORE.entry(model[0].weight).tier == tier and STORE.entry(model[0].bias) is None
    opt = optimizer(model, cls, **kw)
    opt.chunk_elems = CHUNK
    ref_opt = cls(ref.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # the facade is an Optimizer
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        step_both(model, ref, opt, ref_opt, gen)
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 2.5e-3
    assert_same_params(model, ref)
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())
    assert not STORE.entry(model[0].weight).has_grad  # zero_grad cleared the shard's gradient


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_follows_parameters_taken_over_and_released(offload_root, tier):
    """The optimizer is made before the first compile: states from steps taken before the take-over
    (or loaded then) move to the tier, and back to the parameter if the store releases it."""
    ref = small()
    model = copy.deepcopy(ref)
    opt, ref_opt = optimizer(model, torch.optim.AdamW, **HP), torch.optim.AdamW(ref.parameters(), **HP)
    opt.chunk_elems = CHUNK
    gen = torch.Generator().manual_seed(4)
    for i in range(6):
        if i == 2:
            manage(model, tier, offload_root)
        if i == 4:
            STORE.release(model[0].weight)
        step_both(model, ref, opt, ref_opt, gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        assert opt._layout.plain == (i not in (2, 3))
    assert_same_params(model, ref)
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())


def test_managed_shards_refuse_optimizers_that_need_whole_parameters(offload_root):
    model = small()
    manage(model, "nvme", offload_root)
    opt = optimizer(model, torch.optim.LBFGS, lr=0.1)
    give(model, [torch.ones_like(p) for p in model.parameters()])
    with pytest.raises(ZinfError, match=r"LBFGS needs whole parameters"):
        opt.step(lambda: torch.zeros(()))


def test_nvme_step_interrupts_and_failures_say_what_they_are(offload_root, monkeypatch):
    """Ctrl-C in the streamed step arrives as KeyboardInterrupt; an I/O error (zinf's own, e.g. a
    full disk) says nothing was applied. Either way, after chunks were already written, every
    parameter (the resident bias too) and state is the previous step's, and a retry continues
    bit-identically to a run that never failed."""
    import zinf_compile.optim as zoptim

    ref, model, opt, ref_opt = managed_pair(torch.optim.AdamW, "nvme", offload_root, **HP)
    gen = torch.Generator().manual_seed(3)
    step_both(model, ref, opt, ref_opt, gen)
    before = [whole(p).clone() for p in model.parameters()]
    before_sd = copy.deepcopy(opt.state_dict())
    grads = [torch.randn(q.shape, generator=gen) for q in ref.parameters()]
    give(model, grads)
    real = zoptim._adam_chunk

    def fail_on_second(exc):
        calls = []

        def chunk(w, v):
            calls.append(1)
            if len(calls) == 2:  # the first chunk's new values are already written
                raise exc
            return real(w, v)
        return chunk

    for exc, match in ((KeyboardInterrupt(), None),
                       (ZinfError("zinf: No space left on device writing to /nvme/zinf"),
                        "No space left on device.*nothing was applied")):
        monkeypatch.setattr(zoptim, "_adam_chunk", fail_on_second(exc))
        with pytest.raises(type(exc), match=match):
            opt.step()
        assert all(torch.equal(whole(p), b) for p, b in zip(model.parameters(), before))
        assert_same_optim_state(opt.state_dict(), before_sd)
    monkeypatch.setattr(zoptim, "_adam_chunk", real)
    opt.step()  # the retry, with the same gradients
    for q, g in zip(ref.parameters(), grads):
        q.grad = g.clone()
    ref_opt.step()
    assert_same_params(model, ref)
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())


def test_nvme_step_overlaps_io_with_compute(offload_root, monkeypatch):
    """The pipelined swapper: chunk i+1's read is in flight while chunk i computes, and chunk i-1's
    write still runs when chunk i computes (each waits for the other, so a serial step would time out)."""
    import threading

    import zinf_compile.optim as zoptim

    ref = small()
    model = copy.deepcopy(ref)
    manage(model, "nvme", offload_root)
    e = STORE.entry(model[0].weight)
    opt = optimizer(model, torch.optim.AdamW, **HP)
    opt.chunk_elems = CHUNK
    n = -(-e.shard_numel // CHUNK)
    chunk_bytes = CHUNK * e.dtype.itemsize
    read_started = [threading.Event() for _ in range(n)]
    computing = [threading.Event() for _ in range(n)]
    seen = {"read_during_compute": [], "write_during_compute": []}
    engine, calls, out_fd = e.engine, [0], [None]
    real_read, real_write, real_chunk = engine.read_file, engine.write_file, zoptim._adam_chunk

    def read_file(fd, t, offset=0):
        if fd == e.fd:
            read_started[offset // chunk_bytes].set()
        return real_read(fd, t, offset)

    def write_file(fd, t, offset=0):
        i = offset // chunk_bytes
        if fd == out_fd[0] and i + 1 < n:  # the parameter's new values (its spare slot)
            seen["write_during_compute"].append(computing[i + 1].wait(10))
        return real_write(fd, t, offset)

    def adam_chunk(w, v):
        i = calls[0]
        calls[0] += 1
        if w.entry is e:
            out_fd[0] = w.out["param"]
            computing[i].set()
            if i + 1 < n:
                seen["read_during_compute"].append(read_started[i + 1].wait(10))
        return real_chunk(w, v)

    monkeypatch.setattr(engine, "read_file", read_file)
    monkeypatch.setattr(engine, "write_file", write_file)
    monkeypatch.setattr(zoptim, "_adam_chunk", adam_chunk)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for _ in range(2):
        calls[0] = 0
        for ev in read_started + computing:
            ev.clear()
        grads = [torch.randn(q.shape) for q in ref.parameters()]
        give(model, grads)
        for q, g in zip(ref.parameters(), grads):
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
    assert n == 3 and seen["read_during_compute"] == [True] * 4 and seen["write_during_compute"] == [True] * 4
    assert_same_params(model, ref)


ROUND_TRIP = [("cpu", torch.optim.AdamW, HP), ("nvme", torch.optim.AdamW, HP),
              ("nvme", torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3))]


@pytest.mark.parametrize("tier,cls,kw", ROUND_TRIP, ids=[f"{t}-{c.__name__}" for t, c, _ in ROUND_TRIP])
def test_state_dict_round_trip_and_torch_interop(offload_root, tier, cls, kw):
    """zinf's state dict is torch's (one process): each loads into the other and training goes on
    bit-identically."""
    ref, model, opt, ref_opt = managed_pair(cls, tier, offload_root, **kw)
    gen = torch.Generator().manual_seed(2)

    def step(pairs):
        grads = [torch.randn(q.shape, generator=gen) for q in ref.parameters()]
        for m, o in pairs:
            if any(STORE.entry(p) for p in m.parameters()):
                give(m, grads)
            else:
                for q, g in zip(m.parameters(), grads):
                    q.grad = g.clone()
            o.step()
            o.zero_grad()

    for _ in range(2):
        step([(model, opt), (ref, ref_opt)])
    sd, ref_sd = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
    assert_same_optim_state(sd, ref_sd)
    # torch's state into a zinf optimizer over other managed parameters, zinf's into torch's
    model2, ref2 = copy.deepcopy(ref), copy.deepcopy(ref)
    manage(model2, tier, offload_root)
    opt2, ref_opt2 = optimizer(model2, cls, **kw), cls(ref2.parameters(), **kw)
    opt2.chunk_elems = CHUNK
    opt2.load_state_dict(ref_sd)
    ref_opt2.load_state_dict(sd)
    opt.load_state_dict(copy.deepcopy(sd))  # and onto itself
    assert_same_optim_state(opt2.state_dict(), ref_sd)
    for _ in range(2):
        step([(model, opt), (ref, ref_opt), (model2, opt2), (ref2, ref_opt2)])
    for m in (model, model2, ref2):
        assert_same_params(m, ref)
    assert_same_optim_state(opt2.state_dict(), ref_opt.state_dict())


def test_checkpoint_of_another_optimizer_on_nvme_resumes_exactly(offload_root, tmp_path):
    """SGD with momentum on NVMe shards: its momentum buffers go through a checkpoint into another
    model's NVMe files, and the next step is torch's."""
    kw = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    ref, model, opt, ref_opt = managed_pair(torch.optim.SGD, "nvme", offload_root, **kw)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        step_both(model, ref, opt, ref_opt, gen)
        opt.zero_grad()
        ref_opt.zero_grad()
    save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    other = small(seed=3)
    manage(other, "nvme", offload_root)
    other_opt = optimizer(other, torch.optim.SGD, **kw)
    other_opt.chunk_elems = CHUNK
    load_checkpoint(str(tmp_path / "ckpt"), other, other_opt)
    assert_same_optim_state(other_opt.state_dict(), ref_opt.state_dict())
    step_both(other, ref, other_opt, ref_opt, gen)
    assert_same_params(other, ref)
    assert_same_optim_state(other_opt.state_dict(), ref_opt.state_dict())


def test_nothing_managed_is_torch_itself():
    ref = small()
    model = copy.deepcopy(ref)
    opt, ref_opt = optimizer(model, torch.optim.AdamW, **HP), torch.optim.AdamW(ref.parameters(), **HP)
    assert isinstance(opt, torch.optim.Optimizer) and opt.state is opt._plain.state
    for _ in range(2):
        for m in (model, ref):
            m(torch.ones(3, 100)).sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())
    assert all(p.grad is None for p in model.parameters())


def test_tied_and_frozen_parameters(offload_root):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(100, 100)
            self.b = self.a  # the same parameters twice
            self.frozen = nn.Linear(100, 100)
            self.frozen.requires_grad_(False)

    torch.manual_seed(0)
    ref = Tied()
    model = copy.deepcopy(ref)
    manage(model, "nvme", offload_root)
    assert STORE.entry(model.frozen.weight) is not None
    opt = optimizer(list(model.parameters()) + [model.a.weight], torch.optim.AdamW, **HP)  # a duplicate too
    assert len(opt.param_groups[0]["params"]) == 4
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    frozen_before = whole(model.frozen.weight).clone()
    for _ in range(2):
        grads = [torch.full(p.shape, 0.5) for p in ref.parameters()]
        for p, q, g in zip(model.parameters(), ref.parameters(), grads):
            if p.requires_grad:
                give_grad(p, g)
                q.grad = g.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_params(model, ref)
    assert torch.equal(whole(model.frozen.weight), frozen_before)
    sd = full_state_dict(model)
    assert list(sd) == list(ref.state_dict()) and sd["a.weight"] is sd["b.weight"]


def test_load_state_dict_is_strict(offload_root):
    model = small()
    manage(model, "cpu", offload_root)
    sd = small(3).state_dict()
    with pytest.raises(ZinfError, match=r"missing key\(s\): '1\.bias'.*unexpected key\(s\): 'extra'"):
        load_state_dict(model, {**{k: v for k, v in sd.items() if k != "1.bias"}, "extra": torch.zeros(1)})
    with pytest.raises(ZinfError, match=r"'0\.weight' has shape \(100, 99\)"):
        load_state_dict(model, {**sd, "0.weight": torch.zeros(100, 99)})
    load_state_dict(model, sd)
    assert all(torch.equal(v, sd[k]) for k, v in full_state_dict(model).items())


def test_failed_save_leaves_nothing(offload_root, tmp_path, monkeypatch):
    model = small()
    manage(model, "nvme", offload_root)
    opt = optimizer(model, torch.optim.AdamW, **HP)
    give(model, [torch.ones_like(p) for p in model.parameters()])
    opt.step()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ZinfError, match="saving the checkpoint"):
        save_checkpoint(str(tmp_path / "a_file" / "ckpt"), model, opt)  # its parent is a file
    with pytest.raises(ZinfError, match="saving the checkpoint"):
        _fail_midway(monkeypatch, str(tmp_path / "new" / "deeper" / "ckpt"), model, opt)  # parents made, then removed
    assert sorted(os.listdir(tmp_path)) == ["a_file"]
    # a failed save over an existing checkpoint leaves the old one whole
    good = str(tmp_path / "good")
    save_checkpoint(good, model, opt)
    before = {f: open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(good) for f in fs}
    give(model, [torch.ones_like(p) for p in model.parameters()])
    opt.step()
    with pytest.raises(ZinfError):
        _fail_midway(monkeypatch, good, model, opt)
    assert {f: open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(good) for f in fs} == before
    assert sorted(os.listdir(tmp_path)) == ["a_file", "good"]
    save_checkpoint(good, model, opt)  # a good save replaces it, leaving nothing aside
    assert sorted(os.listdir(tmp_path)) == ["a_file", "good"]
    assert {f: open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(good) for f in fs} != before
    with pytest.raises(ZinfError, match="not a zinf checkpoint"):
        save_checkpoint(str(tmp_path / "a_file"), model, opt)
    version = open(os.path.join(good, "CURRENT")).read().split()[0]
    manifest = json.load(open(os.path.join(good, version, "manifest.json")))
    manifest["world"] = 2
    text = json.dumps(manifest).encode()
    open(os.path.join(good, version, "manifest.json"), "wb").write(text)
    with pytest.raises(ZinfError, match=r"manifest\.json' is damaged \(its checksum"):
        load_checkpoint(good, model, opt)
    open(os.path.join(good, "CURRENT"), "w").write(f"{version} {zlib.crc32(text)}\n")  # as if saved so
    with pytest.raises(ZinfError, match="saved by 2 process"):
        load_checkpoint(good, model, opt)


def _fail_midway(monkeypatch, path, model, opt):
    real, calls = torch.save, []

    def flaky(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", flaky)
        save_checkpoint(path, model, opt)


# -- end to end: a compiled MLP against Inductor ---------------------------------------------------
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))


def train(model, opt, steps: range) -> list[torch.Tensor]:
    losses = []
    for i in steps:
        for g in opt.param_groups:
            g["lr"] = LRS[i]
        loss = model(X).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


def clone_sd(sd: dict) -> dict:
    return copy.deepcopy(sd)


@pytest.fixture(scope="module")
def reference():
    torch.use_deterministic_algorithms(True)
    try:
        ref = mlp()
        first = clone_sd(ref.state_dict())
        opt = torch.optim.AdamW(ref.parameters(), **HP)
        losses = train(torch.compile(ref), opt, range(4))
        return dict(first=first, losses=losses, params=clone_sd(ref.state_dict()),
                    optim=clone_sd(opt.state_dict()))
    finally:
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()


def zinf_mlp(tier: str, offload_root: str, seed: int = 0, params: str = "offload"):
    model = mlp(seed)
    options = {"params": params, "offload": tier, "offload_dir": os.path.join(offload_root, "optim-e2e")}
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = optimizer(compiled, torch.optim.AdamW, **HP)  # before the first forward: nothing managed yet
    opt.chunk_elems = CHUNK
    return model, compiled, opt


@pytest.fixture(scope="module", params=["cpu", "nvme"])
def run(request, reference, offload_root, tmp_path_factory):
    """Per tier: A trains 2 steps, saves, trains 2 more; B (other initial values) is compiled, loads
    the checkpoint before its first forward and trains the last 2 steps; then B takes the
    reference's initial state dict and computes the first loss again."""
    tier = request.param
    ckpt = str(tmp_path_factory.mktemp(f"ckpt-{tier}") / "ckpt")
    torch.use_deterministic_algorithms(True)
    try:
        torch._dynamo.reset()
        a, ca, opt_a = zinf_mlp(tier, offload_root)
        out = dict(tier=tier, losses=train(ca, opt_a, range(2)), ckpt=ckpt)
        save_checkpoint(ckpt, ca, opt_a)
        out["losses"] += train(ca, opt_a, range(2, 4))
        out["managed"] = {n: STORE.entry(p) is not None for n, p in a.named_parameters()}
        out["freed"] = {n: p.untyped_storage().nbytes() == 0 for n, p in a.named_parameters()}
        out["grad_none"] = all(p.grad is None for p in a.parameters())
        out["params"] = clone_sd(full_state_dict(ca))
        out["optim"] = clone_sd(opt_a.state_dict())
        out["files"] = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)
        torch._dynamo.reset()  # B has the same code: its own compile, not A's graph
        b, cb, opt_b = zinf_mlp(tier, offload_root, seed=7)
        load_checkpoint(ckpt, cb, opt_b)
        out["resumed"] = train(cb, opt_b, range(2, 4))
        out["resumed_params"] = clone_sd(full_state_dict(cb))  # resident tensors are shared, as torch shares them
        out["resumed_optim"] = clone_sd(opt_b.state_dict())
        load_state_dict(cb, reference["first"])  # into managed parameters
        out["reloaded_loss"] = cb(X).pow(2).mean().detach()
        out["b_managed"] = sum(STORE.entry(p) is not None for p in b.parameters())
        return out
    finally:
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()


def test_training_is_bit_identical_to_inductor_adamw(run, reference):
    assert run["managed"] == {"0.weight": True, "0.bias": False, "2.weight": True, "2.bias": False}
    assert run["freed"]["0.weight"] and run["freed"]["2.weight"] and run["grad_none"]
    for i, (a, b) in enumerate(zip(run["losses"], reference["losses"], strict=True)):
        assert torch.equal(a, b), (i, run["losses"], reference["losses"])


def test_full_state_dict_equals_reference(run, reference):
    assert list(run["params"]) == list(reference["params"])
    for k, v in reference["params"].items():
        assert run["params"][k].device.type == "cpu" and torch.equal(run["params"][k], v), k


def test_optimizer_state_dict_equals_torch(run, reference):
    assert_same_optim_state(run["optim"], reference["optim"])


def test_checkpoint_resume_is_exact(run, reference):
    version = open(os.path.join(run["ckpt"], "CURRENT")).read().split()[0]
    assert run["files"] == ["CURRENT"] + [f"{version}/{f}" for f in ["manifest.json", "optim.pt"]] + [
        f"{version}/rank00000/t0000{i}.pt" for i in range(4)]
    for a, b in zip(run["resumed"], reference["losses"][2:], strict=True):
        assert torch.equal(a, b), (run["resumed"], reference["losses"][2:])
    for k, v in reference["params"].items():
        assert torch.equal(run["resumed_params"][k], v), k
    assert_same_optim_state(run["resumed_optim"], reference["optim"])


def test_load_state_dict_into_managed_model(run, reference):
    assert run["b_managed"] == 2
    assert torch.equal(run["reloaded_loss"], reference["losses"][0])


def test_resident_params_is_plain_adamw(offload_root, reference):
    model, compiled, opt = zinf_mlp("nvme", offload_root, params="resident")
    losses = train(compiled, opt, range(4))
    assert len([p for p in model.parameters() if STORE.entry(p) is not None]) == 0
    assert opt._layout.plain and isinstance(opt._plain, torch.optim.AdamW)
    for a, b in zip(losses, reference["losses"], strict=True):
        assert torch.equal(a, b)
    for k, v in reference["params"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert_same_optim_state(opt.state_dict(), reference["optim"])
    assert isinstance(opt, ZinfOptimizer)
