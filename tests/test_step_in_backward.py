"""step_in_backward=True: NVMe-tier parameters stepped inside the backward, committed by step().

Store-level tests take parameters over directly (no compile) and run eager forwards through them
(runtime/access.py): their backward reduces each gradient into the store inside autograd's backward,
as a compiled graph's `zinf::reduce_grad` does, so the optimizer steps there. Each compares three
runs on the same data: torch.optim on a plain copy, the zinf optimizer without the option, and with
it -- bit for bit, and bytes moved. The end-to-end test trains a compiled MLP whose hidden layer is
used twice (a tied weight, gathered again in the backward) against Inductor + torch.optim.AdamW.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile.optim as zoptim
from zinf_compile.errors import ZinfError
from zinf_compile.optim import optimizer
from zinf_compile.runtime.state import STORE, register_engine

from test_optim import assert_same_optim_state as assert_same_state  # noqa: E402
from test_optim import assert_same_params as assert_same  # noqa: E402

KEY = (1 << 62) + 21  # above the backend's keys (62-bit digests), apart from test_optim's
CHUNK = 4096  # a 100x100 weight is 3 chunks and a tail
HP = dict(lr=1e-2, weight_decay=0.1)
OPTIMIZERS = [
    (torch.optim.AdamW, HP),  # the pipelined path
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),  # the generic path
    (torch.optim.NAdam, dict(lr=1e-2, weight_decay=1e-3)),  # a scalar state besides step
]


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    zoptim.FAULT_HOOK = None


class Net(nn.Module):
    """Two managed 100x100 weights; `tied`: the first one applied twice (two reduces per backward)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(100, 100)
        self.b = nn.Linear(100, 100)
        self.head = nn.Linear(100, 7)  # 700 elements: stays resident
        self.tied = tied

    def forward(self, x):
        h = F.gelu(self.a(x))
        if self.tied:
            h = F.gelu(self.a(h))
        return self.head(F.gelu(self.b(h)))


def manage(model: nn.Module, root: str) -> None:
    register_engine(KEY, "nvme", os.path.join(root, "sib"), 2, False)
    for name, p in model.named_parameters():
        if p.numel() >= 4096:
            STORE.manage(STORE.identify(p, name), "nvme", KEY)


def trio(root: str, cls=torch.optim.AdamW, kw=HP, tied: bool = False):
    """(ref, ref_opt), (plain zinf model, opt), (in-backward zinf model, opt) from the same Net."""
    ref = Net(tied)
    out = [(ref, cls(ref.parameters(), **kw))]
    for in_backward in (False, True):
        m = copy.deepcopy(ref)
        manage(m, root)
        opt = optimizer(m, cls, step_in_backward=in_backward, **kw)
        opt.chunk_elems = CHUNK
        out.append((m, opt))
    return out


def whole(p: torch.Tensor) -> torch.Tensor:
    e = STORE.entry(p)
    return p.detach().clone() if e is None else STORE.full(e)


def params_of(model) -> list[torch.Tensor]:
    return [whole(p) for p in model.parameters()]


def _intact_then_resumes(sib, sib_opt, ref, ref_opt, before, before_sd, x) -> None:
    """After a failed backward: `sib` and its optimizer as `before`/`before_sd` left them, and the
    step rerun on `x` (stepped in backward) matching the reference stepped on `x`, bit for bit."""
    sib_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(params_of(sib), before))
    assert_same_state(sib_opt.state_dict(), before_sd)
    for model, opt in ((sib, sib_opt), (ref, ref_opt)):
        backward(model, x)
        opt.step()
        opt.zero_grad()
    assert sib_opt.last_step_counts == {"in_backward": 2, "in_step": 0}
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 100, generator=g) for _ in range(n)]


def backward(model, x) -> None:
    model(x).pow(2).mean().backward()


def io(model) -> dict:
    """The I/O counters of the engine `model`'s managed weights use (not whichever entry comes
    first in the store: a model of an earlier test may still be alive, in another engine)."""
    return dict(STORE.entry(model.a.weight).engine.stats)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_bit_identical_to_the_same_optimizer_and_torch_and_the_gradient_skips_its_file(offload_root, cls, kw):
    (ref, ref_opt), (plain, plain_opt), (sib, sib_opt) = trio(offload_root, cls, kw)
    shard = STORE.entry(sib.a.weight).shard_nbytes
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_opt, plain_opt, sib_opt)]
    moved = {}
    for i, x in enumerate(batches(5)):
        for name, (model, opt) in (("ref", (ref, ref_opt)), ("plain", (plain, plain_opt)), ("sib", (sib, sib_opt))):
            before = io(sib)
            backward(model, x)
            opt.step()
            opt.zero_grad()
            after = io(sib)
            moved[name] = {k: after[k] - before[k] for k in ("bytes_read", "bytes_written")}
        for s in sched:
            s.step()
        # the first step counts the reduces (and steps in step()); from the second, both in backward
        assert sib_opt.last_step_counts == ({"in_backward": 0, "in_step": 2} if i == 0 else
                                            {"in_backward": 2, "in_step": 0}), i
        assert plain_opt.last_step_counts == {"in_backward": 0, "in_step": 2}
        if i:  # one step: each managed gradient written once and read once less, nothing else differs
            assert moved["plain"]["bytes_written"] - moved["sib"]["bytes_written"] == 2 * shard, moved
            assert moved["plain"]["bytes_read"] - moved["sib"]["bytes_read"] == 2 * shard, moved
    assert_same(sib, ref)
    assert_same(plain, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())
    assert_same_state(plain_opt.state_dict(), ref_opt.state_dict())
    assert not STORE.entry(sib.a.weight).has_grad


def test_tied_weight_is_stepped_after_its_last_gradient_and_reads_see_the_old_value(offload_root):
    """`a` is applied twice: two reduces per backward; it is stepped at the second only, and until
    step() commits, reading it (a gather later in the same backward would) gives the previous step's
    value."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root, tied=True)
    seen = []

    def check(point):
        if point == "step-in-backward:stepped":
            seen.append([torch.equal(whole(p), b) for p, b in zip(sib.parameters(), committed)])

    zoptim.FAULT_HOOK = check
    for i, x in enumerate(batches(4)):
        committed = params_of(sib)
        backward(sib, x)
        assert STORE.entry(sib.a.weight).reduces == 2
        sib_opt.step()
        sib_opt.zero_grad()
        backward(ref, x)
        ref_opt.step()
        ref_opt.zero_grad()
        assert sib_opt.last_step_counts["in_backward"] == (2 if i else 0)
    assert len(seen) == 6 and all(all(s) for s in seen), seen
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def test_gradient_accumulation_counts_microbatches_and_more_than_counted_is_refused(offload_root):
    """Two backward calls per step: the step happens in the second (the first one's gradient went
    to the file); a step with three refuses at the third, leaving the previous step intact; run
    again, it is stepped in step() and counted anew."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    xs = batches(12)
    for i in range(3):
        for x in xs[2 * i:2 * i + 2]:
            backward(sib, x)
            backward(ref, x)
        sib_opt.step()
        ref_opt.step()
        sib_opt.zero_grad()
        ref_opt.zero_grad()
        assert sib_opt.last_step_counts["in_backward"] == (2 if i else 0)
    assert_same(sib, ref)
    before, before_sd = params_of(sib), copy.deepcopy(sib_opt.state_dict())
    three = xs[6:9]
    backward(sib, three[0])
    backward(sib, three[1])  # stepped here, as counted
    with pytest.raises(ZinfError, match=r"another gradient after step_in_backward stepped it.*abandoned"):
        backward(sib, three[2])
    assert all(torch.equal(a, b) for a, b in zip(params_of(sib), before))
    assert_same_state(sib_opt.state_dict(), before_sd)
    sib_opt.zero_grad()
    for x in three:
        backward(sib, x)
        backward(ref, x)
    sib_opt.step()
    ref_opt.step()
    assert sib_opt.last_step_counts == {"in_backward": 0, "in_step": 2}
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("how", ["raised-in-backward", "disk-full"])
def test_failure_midway_through_backward_leaves_the_previous_step(offload_root, monkeypatch, how):
    """The backward fails after one of the two weights was stepped in it (an exception in the
    backward, or the disk full while the second is stepped): nothing is committed, every parameter
    and state is the previous step's, and the step run again continues bit-identically to torch."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    xs = batches(3)
    for x in xs[:2]:
        for model, opt in ((sib, sib_opt), (ref, ref_opt)):
            backward(model, x)
            opt.step()
            opt.zero_grad()
    before, before_sd = params_of(sib), copy.deepcopy(sib_opt.state_dict())
    eng = STORE.entry(sib.a.weight).engine
    if how == "raised-in-backward":
        def boom(point):
            if point == "step-in-backward:stepped":
                raise RuntimeError("boom")
        zoptim.FAULT_HOOK = boom
        with pytest.raises(RuntimeError, match="boom"):
            backward(sib, xs[2])
        zoptim.FAULT_HOOK = None
        assert len(sib_opt._bw.work) == 1  # b was stepped (its spare slots written), then the backward failed
        with pytest.raises(ZinfError, match=r"did not complete.*Nothing was applied"):
            sib_opt.step()
    else:
        real, calls = eng.write_file, []

        def write_file(fd, t, offset=0):
            calls.append(fd)
            if len(calls) == 14:  # b's 3 records x 3 chunks written, a's under way
                raise ZinfError("zinf: No space left on device writing to /nvme/zinf")
            return real(fd, t, offset)
        monkeypatch.setattr(eng, "write_file", write_file)
        with pytest.raises(ZinfError, match=r"stepping 'a.weight' in backward failed.*No space left on device.*"
                                            r"abandoned.*as the previous step left them"):
            backward(sib, xs[2])
        monkeypatch.setattr(eng, "write_file", real)
        assert not sib_opt._bw.work
    _intact_then_resumes(sib, sib_opt, ref, ref_opt, before, before_sd, xs[2])


class _GatheredLinear(torch.autograd.Function):
    """x @ w.T with the managed weight gathered whole. The backward reduces the weight's gradient in
    row `tiles` (as a tiled graph's reduce_grad_rows; None: whole) and, with `reuse`, then writes
    over that buffer, as Inductor reuses a buffer once its last user (the reduce) has returned."""

    @staticmethod
    def forward(ctx, x, p, tiles, reuse):
        with torch._C.DisableTorchFunctionSubclass():
            w = STORE.full(STORE.entry(p))
        ctx.save_for_backward(x, w)
        ctx.p, ctx.tiles, ctx.reuse = p, tiles, reuse
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.t() @ x
        with torch._C.DisableTorchFunctionSubclass():
            if ctx.tiles is None:
                STORE.reduce_grad(ctx.p, gw)
            for lo, hi in ctx.tiles or ():
                STORE.reduce_grad(ctx.p, gw[lo:hi], rows=(lo, hi))
        if ctx.reuse:
            gw.fill_(1e6)  # the buffer's next use
        return g @ w, None, None, None


class _Plain(torch.autograd.Function):
    """The same arithmetic on a plain tensor: gw whole into p.grad."""

    @staticmethod
    def forward(ctx, x, p, tiles, reuse):
        ctx.save_for_backward(x, p)
        return x @ p.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, None, None


def test_tiled_gradient_is_stepped_at_its_last_tile(offload_root):
    """A weight whose gradient comes in 3 row tiles per backward: stepped in backward at the third
    (the first two went to the gradient file), bit-identical to torch on the whole gradient."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    tiles = ((0, 30), (30, 64), (64, 100))

    def loss(model, fn, x):
        h = fn.apply(x, model.a.weight, tiles, False) + model.a.bias
        return model.head(F.gelu(model.b(F.gelu(h)))).pow(2).mean()

    for i, x in enumerate(batches(4)):
        loss(sib, _GatheredLinear, x).backward()
        assert STORE.entry(sib.a.weight).reduces == 3
        sib_opt.step()
        sib_opt.zero_grad()
        loss(ref, _Plain, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert sib_opt.last_step_counts == ({"in_backward": 2, "in_step": 0} if i else {"in_backward": 0, "in_step": 2})
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def test_zero_grad_before_step_drops_the_steps_taken_in_backward(offload_root):
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    x0, x1 = batches(2)
    for model, opt in ((sib, sib_opt), (ref, ref_opt)):
        backward(model, x0)
        opt.step()
        opt.zero_grad()
        backward(model, x1)
        opt.zero_grad()  # the gradients go, and with them what the backward stepped
        opt.step()  # torch: no gradient, nothing changes (AdamW's weight decay included)
    assert sib_opt.last_step_counts == {"in_backward": 0, "in_step": 0}
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def test_refusals_say_what_to_do(offload_root):
    (_, _), (_, _), (sib, sib_opt) = trio(offload_root)
    with pytest.raises(ZinfError, match=r"LBFGS's update is not elementwise.*step_in_backward=False"):
        optimizer(sib, torch.optim.LBFGS, step_in_backward=True)
    with pytest.raises(ZinfError, match=r"capturable=True are not supported; use step_in_backward=False"):
        optimizer(sib, torch.optim.AdamW, step_in_backward=True, capturable=True)
    x0, x1 = batches(2)
    backward(sib, x0)
    with pytest.raises(ZinfError, match=r"clipping by global norm.*step_in_backward=False to clip"):
        torch.nn.utils.clip_grad_norm_(sib.parameters(), 1.0)  # refused from the first step on
    sib_opt.step()
    sib_opt.zero_grad()
    before, before_sd = params_of(sib), copy.deepcopy(sib_opt.state_dict())
    backward(sib, x1)
    assert sib_opt._bw.work  # stepped in backward, not committed
    sib_opt.param_groups[0]["lr"] = 1e-3  # between the backward and step(): the update used the old one
    with pytest.raises(ZinfError, match=r"\['lr'\] of group 0 changed between the backward and step\(\).*"
                                        r"Nothing was applied"):
        sib_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_of(sib), before))
    assert_same_state({**sib_opt.state_dict(), "param_groups": before_sd["param_groups"]}, before_sd)
    with pytest.raises(ZinfError, match=r"already stepped in backward by another optimizer"):
        optimizer(sib, torch.optim.AdamW, step_in_backward=True).step()


# -- overlap: the steps run on the optimizer's worker thread while the backward continues ---------
def _slow_worker(seconds: float, seen: list | None = None):
    """A FAULT_HOOK: each chunk written by a step sleeps `seconds` on the worker thread (never on
    the backward's), and its thread's name goes to `seen`."""
    import threading
    import time

    def hook(point):
        if point == "nvme-step:chunk-written":
            if seen is not None:
                seen.append(threading.current_thread().name)
            if threading.current_thread() is not threading.main_thread():
                time.sleep(seconds)
    return hook


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_steps_run_on_the_worker_while_the_backward_continues(offload_root, overlap):
    """With overlap, b's step (the first reduce) is held on the worker until the backward has
    reached a's reduce and queued a's step: the backward went on while b was being stepped. With
    overlap=False each step runs in the reduce, on the backward's thread. Both bit-identical."""
    import threading

    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    if not overlap:
        sib = copy.deepcopy(ref)
        manage(sib, offload_root)
        sib_opt = optimizer(sib, torch.optim.AdamW, step_in_backward=True, overlap=False, **HP)
        sib_opt.chunk_elems = CHUNK
    xs = batches(3)
    for model, opt in ((sib, sib_opt), (ref, ref_opt)):
        backward(model, xs[0])
        opt.step()
        opt.zero_grad()
    go, seen, at_take, buffers = threading.Event(), [], [], set()

    def hook(point):
        if point == "nvme-step:chunk-written":
            if threading.current_thread() is not threading.main_thread():
                go.wait(10)  # b's step waits here until the backward has queued a's
            seen.append(threading.current_thread().name)
            buffers.add(tuple(slot["param"].data_ptr() for slot in sib_opt._bw.ring))
        elif point == "step-in-backward:stepped":
            at_take.append(len(seen))  # chunks past their write by then
            if len(at_take) == 2:
                go.set()
    zoptim.FAULT_HOOK = hook
    backward(sib, xs[1])
    zoptim.FAULT_HOOK = None
    assert len(sib_opt._bw.work) == 2 and not sib_opt._bw.open  # both steps done by the backward's end
    assert len(buffers) == 1 and len(next(iter(buffers))) == 3  # one chunk ring for both steps
    assert sib_opt._bw.ring == []  # freed at the backward's end
    if overlap:
        assert at_take == [0, 0]  # a's reduce came while b's step had written nothing yet
        assert set(seen) and all(n.startswith("zinf-step-in-backward") for n in seen), seen
    else:
        assert at_take == [3, 6]  # each 3-chunk step done within its reduce
        assert set(seen) == {threading.main_thread().name}
    backward(ref, xs[1])
    for opt in (sib_opt, ref_opt):
        opt.step()
        opt.zero_grad()
    assert sib_opt.last_step_counts == {"in_backward": 2, "in_step": 0}
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


class Wide(nn.Module):
    """b (100x100, the first reduce) is small, a (100x700) more than the queue holds with b."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(700, 100)
        self.b = nn.Linear(100, 100)
        self.head = nn.Linear(100, 7)

    def forward(self, x):
        return self.head(F.gelu(self.b(F.gelu(self.a(x)))))


def test_queue_of_steps_is_bounded_and_the_backward_waits_for_room(offload_root):
    """The queue holds gradients of at most the chunk ring's size (3 x 5 x 4 bytes x chunk), one
    step always admitted: a's 280 kB gradient waits in the backward until b's step is done."""
    ref = Wide()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    sib = copy.deepcopy(ref)
    manage(sib, offload_root)
    sib_opt = optimizer(sib, torch.optim.AdamW, step_in_backward=True, **HP)
    sib_opt.chunk_elems = CHUNK
    cap = 3 * 5 * 4 * CHUNK
    big, small = STORE.entry(sib.a.weight).shard_nbytes, STORE.entry(sib.b.weight).shard_nbytes
    assert small < cap < big < 2 * cap and small + big > cap
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 700, generator=g) for _ in range(4)]
    zoptim.FAULT_HOOK = _slow_worker(0.1)  # b's 3 chunks: 0.3 s, much longer than the backward from b to a
    for i, x in enumerate(xs):
        for model, opt in ((sib, sib_opt), (ref, ref_opt)):
            backward(model, x)
            opt.step()
            opt.zero_grad()
        assert sib_opt.last_step_counts["in_backward"] == (2 if i else 0)
    q = sib_opt._queue
    assert q.waits == 3  # once per step in backward: a waited for b
    assert q.peak == big  # never b's and a's gradients together
    assert q.held == 0
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def test_gradient_handed_to_the_worker_is_its_own(offload_root):
    """The gradient a reduce hands over aliases the graph's buffer (one rank: a view of it); the
    queued step must not see what the graph writes there afterwards."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)

    def loss(model, fn, x):
        h = fn.apply(x, model.a.weight, None, True) + model.a.bias
        return model.head(F.gelu(model.b(F.gelu(h)))).pow(2).mean()

    zoptim.FAULT_HOOK = _slow_worker(0.02)  # the step reads the gradient well after the reduce returned
    for i, x in enumerate(batches(3)):
        loss(sib, _GatheredLinear, x).backward()
        sib_opt.step()
        sib_opt.zero_grad()
        h = x @ ref.a.weight.t() + ref.a.bias
        ref.head(F.gelu(ref.b(F.gelu(h)))).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert sib_opt.last_step_counts["in_backward"] == (2 if i else 0)
    assert_same(sib, ref)
    assert_same_state(sib_opt.state_dict(), ref_opt.state_dict())


def test_failure_on_the_worker_is_raised_from_the_backward(offload_root, monkeypatch):
    """b's step fails on the worker (disk full) while the backward goes on: the backward raises
    (at a's reduce, or at its end), nothing is applied, and the step run again matches torch."""
    (ref, ref_opt), (_, _), (sib, sib_opt) = trio(offload_root)
    xs = batches(2)
    for model, opt in ((sib, sib_opt), (ref, ref_opt)):
        backward(model, xs[0])
        opt.step()
        opt.zero_grad()
    before, before_sd = params_of(sib), copy.deepcopy(sib_opt.state_dict())
    eng = STORE.entry(sib.a.weight).engine
    real, threads = eng.write_file, set()

    def write_file(fd, t, offset=0):
        import threading

        threads.add(threading.current_thread().name)
        raise ZinfError("zinf: No space left on device writing to /nvme/zinf")
    monkeypatch.setattr(eng, "write_file", write_file)
    with pytest.raises(ZinfError, match=r"stepping 'b.weight' in backward failed.*No space left on device.*"
                                        r"as the previous step left them"):
        backward(sib, xs[1])
    monkeypatch.setattr(eng, "write_file", real)
    assert threads and not any(n == "MainThread" for n in threads)  # written from the I/O pool, for the worker
    assert not sib_opt._bw.work and sib_opt._queue.error is None and sib_opt._queue.held == 0
    _intact_then_resumes(sib, sib_opt, ref, ref_opt, before, before_sd, xs[1])


# -- end to end: a compiled MLP with a tied hidden weight against Inductor --------------------------
class Tied(nn.Module):
    """`mid` is applied twice: its weight is gathered again in the backward after its first use.
    `split`: a graph break between the two uses, so two compiled graphs each reduce a part of its
    gradient in one backward (the second graph's backward runs first, and the first one's gathers
    `mid` again after that reduce)."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.split = split
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.out = nn.Linear(256, 64)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        h = F.gelu(self.mid(h))
        if self.split:
            torch._dynamo.graph_break()
        h = F.gelu(self.mid(h))
        return self.out(h)


LRS = [1e-2, 1e-2, 5e-3, 5e-3]
X = [torch.randn(32, 64, generator=torch.Generator().manual_seed(5 + i)) for i in range(4)]


def train(fn, opt) -> list[torch.Tensor]:
    losses = []
    for i, lr in enumerate(LRS):
        for g in opt.param_groups:
            g["lr"] = lr  # before the forward, as a schedule would
        loss = fn(X[i]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


@pytest.mark.parametrize("split", [False, True], ids=["one-graph", "graph-break"])
def test_compiled_training_is_bit_identical_to_inductor_adamw(offload_root, split):
    ref = Tied(split)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    ref_losses = train(torch.compile(ref), ref_opt)
    torch._dynamo.reset()
    options = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "sib-e2e")}
    fn = torch.compile(model, backend="zinf", options=options)
    opt = optimizer(fn, torch.optim.AdamW, step_in_backward=True, **HP)
    opt.chunk_elems = CHUNK
    counts = []
    losses = []
    for i, lr in enumerate(LRS):
        for g in opt.param_groups:
            g["lr"] = lr
        loss = fn(X[i]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        counts.append(opt.last_step_counts["in_backward"])
    managed = [n for n, p in model.named_parameters() if STORE.entry(p) is not None]
    assert managed == ["inp.weight", "mid.weight", "out.weight"]
    assert counts == [0, 3, 3, 3]
    # mid's gradient comes in two reduces per backward across a graph break (one within one graph)
    assert opt._bw.expect[id(STORE.entry(model.mid.weight))] == (2 if split else 1)
    assert opt._bw.expect[id(STORE.entry(model.inp.weight))] == 1
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), (i, losses, ref_losses)
    assert_same(model, ref)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


# -- two ranks (gloo): each rank steps its own shard in backward ------------------------------------
def _dist_main(out: str, offload_dir: str, steps: int = 3) -> None:
    """Under torchrun: tests/workers/dist_train.py's model on 2 ranks, once stepped in step() and
    once in backward; rank 0 saves both runs' losses, final parameters and in-backward counts."""
    import torch.distributed as dist

    import zinf_compile

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1)
    x, y = torch.randn(32, 65), torch.randn(32, 65)
    runs = {}
    for in_backward in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(65, 257), torch.nn.GELU(), torch.nn.Linear(257, 65))
        fn = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                           "offload_dir": os.path.join(offload_dir, str(in_backward))})
        opt = zinf_compile.optimizer(fn, torch.optim.AdamW, lr=1e-2, step_in_backward=in_backward)
        losses, counts = [], []
        for _ in range(steps):
            loss = F.mse_loss(fn(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            counts.append(opt.last_step_counts["in_backward"])
        runs[in_backward] = dict(losses=losses, counts=counts, params=zinf_compile.full_state_dict(fn))
    if rank == 0:
        torch.save(runs, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_step_their_shards_in_backward(tmp_path, offload_root):
    import subprocess
    import sys

    out = str(tmp_path / "runs.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "test_step_in_backward", out, os.path.join(offload_root, "sib2")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = torch.load(out)
    plain, sib = runs[False], runs[True]
    assert plain["counts"] == [0, 0, 0] and sib["counts"] == [0, 2, 2]
    for a, b in zip(plain["losses"], sib["losses"], strict=True):
        assert torch.equal(a, b)
    assert plain["params"].keys() == sib["params"].keys()
    for k, v in plain["params"].items():
        assert torch.equal(sib["params"][k], v), k


if __name__ == "__main__":
    import sys

    _dist_main(*sys.argv[1:])
