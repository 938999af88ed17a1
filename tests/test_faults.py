"""Faults: a full disk at each write site, kills at chosen points, damaged checkpoints.

Each test asserts that no state is lost (the previous step's parameters and states, the old or the
new checkpoint), that nothing is silently wrong (an error naming what failed; a retry continues
bit-identically) and that nothing is left behind.

The small file system is a tmpfs mounted for the test (root only); where mounting is not allowed
(CI as a normal user) the same tests run on a quota that an injection hook enforces on `os.pwrite`
and `os.write` (the calls zinf's swap files and checkpoints write through): `SmallFS.mode` says
which, and `test_the_quota_hook_fills_up_like_a_small_disk` runs the hook everywhere.
"""
from __future__ import annotations

import copy
import errno
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

import zinf_compile
from zinf_compile.checkpoint import CURRENT, full_state_dict, load_checkpoint, save_checkpoint
from zinf_compile.errors import ZinfError
from zinf_compile.optim import optimizer
from zinf_compile.runtime.state import STORE, register_engine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from fault_worker import HP, build, give, give_grad, grads, manage  # noqa: E402
from test_optim import assert_same_optim_state  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "fault_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 4096


# -- a small file system ------------------------------------------------------------------------
class SmallFS:
    """`size` bytes at `path`: a tmpfs mount, or (mode "hook") a quota on the bytes of the files
    under `path`, enforced where zinf writes (os.pwrite, os.write)."""

    def __init__(self, path: str, size: int, monkeypatch, mode: str | None = None) -> None:
        self.path, self.size = path, size
        os.makedirs(path, exist_ok=True)
        self.mode = mode or ("tmpfs" if self._mount() else "hook")
        if self.mode == "hook":
            real_pwrite, real_write = os.pwrite, os.write

            def pwrite(fd, data, offset):
                self._check(fd, memoryview(data).nbytes, offset)
                return real_pwrite(fd, data, offset)

            def write(fd, data):
                self._check(fd, memoryview(data).nbytes, os.lseek(fd, 0, os.SEEK_CUR))
                return real_write(fd, data)

            def posix_fallocate(fd, offset, length):
                self._check(fd, length, offset)
                return real_fallocate(fd, offset, length)

            real_fallocate = os.posix_fallocate
            monkeypatch.setattr(os, "pwrite", pwrite)
            monkeypatch.setattr(os, "write", write)
            monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)

    def _mount(self) -> bool:
        if os.environ.get("ZINF_TEST_FS") == "hook":
            return False
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", self.path],
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def used(self) -> int:
        if self.mode == "tmpfs":
            st = os.statvfs(self.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.path) for f in fs)

    def free(self) -> int:
        return self.size - self.used()

    def _check(self, fd: int, n: int, offset: int) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if not target.startswith(self.path + os.sep):
            return
        grow = max(0, offset + n - os.fstat(fd).st_size)
        if grow and grow > self.free():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fill(self, leave: int = 0) -> None:
        """Take all the free space but `leave` bytes."""
        n = max(0, (self.free() - leave) // 4096 * 4096)
        with open(os.path.join(self.path, "filler"), "ab") as f:
            while n:
                step = min(n, 1 << 20)
                f.write(bytes(step))
                n -= step

    def unfill(self) -> None:
        os.remove(os.path.join(self.path, "filler"))

    def files(self) -> list[str]:
        return sorted(os.path.relpath(os.path.join(d, f), self.path) for d, _, fs in os.walk(self.path) for f in fs)

    def close(self) -> None:
        if self.mode == "tmpfs":
            if subprocess.run(["umount", self.path], capture_output=True).returncode:
                subprocess.run(["umount", "-l", self.path], capture_output=True)


@pytest.fixture
def small_fs(tmp_path, monkeypatch):
    """small_fs(size) -> SmallFS; at the end zinf's state is reset (swap folders closed) and the
    file system unmounted."""
    made = []

    def make(size: int, mode: str | None = None) -> SmallFS:
        fs = SmallFS(str(tmp_path / f"fs{len(made)}"), size, monkeypatch, mode)
        made.append(fs)
        return fs

    yield make
    zinf_compile.reset()
    for fs in made:
        fs.close()


@pytest.fixture(autouse=True)
def python_sigint():
    """Ctrl-C as Python's default handler raises it, also where the suite was started with SIGINT
    ignored (a background job: `cmd &` in a script, nohup)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


_keys = iter(range((1 << 62) + 1000, (1 << 62) + 2000))


def nvme_model(offload_dir: str):
    """`build()` with its weights in the NVMe tier under offload_dir, its optimizer, and the same
    model and torch.optim.AdamW as the reference."""
    ref = build()
    model = copy.deepcopy(ref)
    manage(model, offload_dir, key=next(_keys))
    assert all(STORE.entry(m.weight).tier == "nvme" for m in (model[0], model[2]))
    opt = optimizer(model, torch.optim.AdamW, chunk_elems=CHUNK, **HP)
    return ref, model, opt, torch.optim.AdamW(ref.parameters(), **HP)


def stepped_once(offload_dir: str):
    """`nvme_model` after one step (the reference too), with step 2's gradients given."""
    ref, model, opt, ref_opt = nvme_model(offload_dir)
    give(model, grads(1, model))
    opt.step()
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(1, ref))
    give(model, grads(2, model))
    return ref, model, opt, ref_opt


def whole(p: torch.Tensor) -> torch.Tensor:
    e = STORE.entry(p)
    return p.detach().clone() if e is None else STORE.full(e).clone()


def snapshot(model, opt) -> tuple[list, dict]:
    return [whole(p) for p in model.parameters()], copy.deepcopy(opt.state_dict())


def assert_snapshot(model, opt, snap) -> None:
    params, sd = snap
    for (name, p), b in zip(model.named_parameters(), params, strict=True):
        assert torch.equal(whole(p), b), name
    assert_same_optim_state(opt.state_dict(), sd)


def assert_like_ref(model, opt, ref, ref_opt) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(whole(p), q.detach()), name
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())


def step_ref(ref, ref_opt, gs) -> None:
    for q, g in zip(ref.parameters(), gs):
        q.grad = g.clone()
    ref_opt.step()
    ref_opt.zero_grad()


# -- a full disk at each write site --------------------------------------------------------------
def _full_disk_during_the_step(fs):
    ref, model, opt, ref_opt = nvme_model(fs.path)
    give(model, grads(1, model))
    before = snapshot(model, opt)
    fs.fill(leave=64 << 10)  # step 1 makes the states' files (and the parameters' second slots)
    with pytest.raises(ZinfError, match=r"(?i)no space left on device.*nothing was applied"):
        opt.step()
    assert_snapshot(model, opt, before)
    fs.unfill()
    opt.step()
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(1, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    give(model, grads(2, model))
    before = snapshot(model, opt)
    fs.fill(leave=64 << 10)  # step 2 needs new files for the states' second slots: 2 x 2 x 128 KiB
    with pytest.raises(ZinfError, match=r"(?i)no space left on device.*nothing was applied"):
        opt.step()
    assert_snapshot(model, opt, before)  # the resident biases too
    with pytest.raises(ZinfError, match=r"(?i)no space left on device.*nothing was applied"):
        opt.step()  # still full: still nothing
    assert_snapshot(model, opt, before)
    fs.unfill()
    opt.step()  # the retry, after space is freed: as if it had never failed
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(2, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    fs.fill(leave=0)  # both slots of every record exist now: a step needs no new space
    give(model, grads(3, model))
    opt.step()
    step_ref(ref, ref_opt, grads(3, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    fs.unfill()


def test_full_disk_during_the_optimizer_step_applies_nothing(small_fs):
    fs = small_fs(4 << 20)
    _full_disk_during_the_step(fs)
    assert [f.split(os.sep)[0] for f in fs.files()] and all(f.startswith("zinf-") for f in fs.files())
    zinf_compile.reset()
    assert fs.files() == []  # the swap folder goes with the engine


def test_the_quota_hook_fills_up_like_a_small_disk(small_fs):
    """The fallback where no tmpfs can be mounted (not root) passes the same test."""
    fs = small_fs(4 << 20, mode="hook")
    assert fs.mode == "hook"
    _full_disk_during_the_step(fs)


# -- commit="param": one parameter's spare records on disk, not every one's -------------------------
KIB128 = 128 << 10  # each weight of build(), and each of its gradient and AdamW states


def test_per_parameter_commit_trains_where_the_spare_slots_do_not_fit(small_fs):
    """build()'s two 128 KiB weights with AdamW: from step 2 on, all or nothing needs 2 x
    (parameter + 2 states) + gradient = 7 x 128 KiB per weight (1.75 MiB); committing per
    parameter needs 4 x 128 KiB per weight plus one weight's 3 spare records (1.375 MiB). On a
    1.5 MiB disk the first fails at step 2 (nothing applied), the second trains 3 steps
    bit-identically to torch's AdamW, never holding more than predicted."""
    fs = small_fs(1536 << 10)
    ref, model, opt, ref_opt = nvme_model(fs.path)
    for step in (1, 2):
        give(model, grads(step, model))
        if step == 2:
            with pytest.raises(ZinfError, match=r"(?i)no space left on device.*nothing was applied"):
                opt.step()
            break
        opt.step()
        opt.zero_grad()
    zinf_compile.reset()
    assert fs.files() == []

    ref, model, opt, ref_opt = nvme_model(fs.path)
    opt.commit = "param"
    import zinf_compile.optim as zoptim

    peak = []
    real = zoptim._adam_chunk
    try:  # the disk's use after each chunk's arithmetic: the records written so far
        zoptim._adam_chunk = lambda w, v: (peak.append(fs.used()), real(w, v))[1]
        for step in (1, 2, 3):
            give(model, grads(step, model))
            opt.step()
            opt.zero_grad()
            step_ref(ref, ref_opt, grads(step, ref))
            assert_like_ref(model, opt, ref, ref_opt)
            assert opt.last_step_counts == {"in_backward": 0, "in_step": 2}
    finally:
        zoptim._adam_chunk = real
    held = fs.used()
    assert max(peak) <= 11 * KIB128 + (64 << 10), max(peak)  # 8 records + one weight's 3 spares, with slack
    assert held <= 8 * KIB128 + (64 << 10), held  # between steps: the spares are empty
    spares = [fd for sp in opt._spare.values() for fd in sp.values()]
    assert len(spares) == 6 and all(os.fstat(fd).st_size == 0 for fd in spares)


def test_per_parameter_commit_failing_part_way_keeps_what_it_committed_and_the_retry_ends_the_step(small_fs,
                                                                                                   monkeypatch):
    """A full disk at the second weight of step 1: the first weight is stepped and committed, the
    second and the resident biases are as before, and the error says so; a gradient added to the
    committed weight before the retry is refused; after space is freed the retry steps only the
    rest, and the result is torch's AdamW bit for bit. Ctrl-C between the weights of step 2:
    KeyboardInterrupt as itself, and the retry ends the step the same way."""
    import zinf_compile.optim as zoptim

    fs = small_fs(4 << 20)
    ref, model, opt, ref_opt = nvme_model(fs.path)
    opt.commit = "param"
    before = snapshot(model, opt)
    give(model, grads(1, model))
    fs.fill(leave=3 * KIB128)  # the first weight's new shard and states (its old shard then emptied), not the second's
    with pytest.raises(ZinfError, match=r"(?i)at parameter '2.weight' \(.*no space left on device.*\).* 1 NVMe-tier "
                                        r"parameter\(s\) before it in this step are stepped and committed"):
        opt.step()
    ref1 = copy.deepcopy(ref)
    step_ref(ref1, torch.optim.AdamW(ref1.parameters(), **HP), grads(1, ref1))
    assert torch.equal(whole(model[0].weight), ref1[0].weight.detach())  # committed
    for (name, p), b in zip(model.named_parameters(), before[0]):
        if name != "0.weight":
            assert torch.equal(whole(p), b), name  # as they were
    fs.unfill()
    give_grad(model[0].weight, torch.ones(256, 128))
    with pytest.raises(ZinfError, match=r"'0.weight' was stepped by a step\(\) that failed part-way"):
        opt.step()
    opt.zero_grad()  # gives the half step up...
    give(model, grads(1, model))
    opt.step()  # ...so this steps every weight again: the first one twice in all
    assert opt.last_step_counts["in_step"] == 2
    zinf_compile.reset()

    ref, model, opt, ref_opt = nvme_model(fs.path)
    opt.commit = "param"
    give(model, grads(1, model))
    fs.fill(leave=3 * KIB128)
    with pytest.raises(ZinfError, match=r"(?i)no space left on device"):
        opt.step()
    fs.unfill()
    opt.step()  # the retry: only the second weight and the biases
    assert opt.last_step_counts["in_step"] == 1
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(1, ref))
    assert_like_ref(model, opt, ref, ref_opt)

    give(model, grads(2, model))
    monkeypatch.setattr(zoptim, "FAULT_HOOK",
                        lambda name: os.kill(os.getpid(), signal.SIGINT) if name == "step:param-committed" else None)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(zoptim, "FAULT_HOOK", None)
    opt.step()
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(2, ref))
    assert_like_ref(model, opt, ref, ref_opt)


def test_per_parameter_commit_is_refused_with_steps_in_backward_and_by_another_name():
    model = build()
    with pytest.raises(ZinfError, match=r"commit='param'.*step_in_backward=True"):
        optimizer(model, torch.optim.AdamW, step_in_backward=True, commit="param", **HP)
    with pytest.raises(ZinfError, match=r"commit must be 'step'.*or 'param'.*got 'each'"):
        optimizer(model, torch.optim.AdamW, commit="each", **HP)


def test_full_disk_while_accumulating_a_gradient_keeps_the_previous_sum(small_fs):
    fs = small_fs(4 << 20)
    ref, model, opt, ref_opt = nvme_model(fs.path)
    w = model[0].weight
    e = STORE.entry(w)
    g1, g2 = (torch.randn(w.shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    STORE.reduce_grad(w, g1)  # the first micro-batch
    fs.fill(leave=0)
    with pytest.raises(ZinfError, match=r"(?i)no space left on device"):
        STORE.reduce_grad(w, g2)  # the second: its sum cannot be written
    assert e.has_grad and torch.equal(e.read_grad(), g1.reshape(-1))  # the first one's, whole
    fs.unfill()
    STORE.reduce_grad(w, g2)
    assert torch.equal(e.read_grad(), (g1 + g2).reshape(-1))
    fs.fill(leave=0)  # both gradient files exist now: accumulating needs no new space
    STORE.reduce_grad(w, g1)
    assert torch.equal(e.read_grad(), (g1 + g2 + g1).reshape(-1))
    fs.unfill()



# -- a write failing half way through a tiled gradient or a pending clip's settling ---------------
class FailingWrites:
    """Writes to files under `path` fail once `after` bytes went through: the write that crosses
    the mark stops short there (as a disk filling up in the middle of a write does) and the next
    raises OSError `err`. Monkeypatches `os.pwrite`, the call zinf's swap files write through."""

    def __init__(self, path: str, after: int, monkeypatch, err: int = errno.ENOSPC) -> None:
        self.path, self.left, self.err, self.failed = path, after, err, 0
        real = os.pwrite

        def pwrite(fd, data, offset):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if not target.startswith(self.path + os.sep):
                return real(fd, data, offset)
            n = memoryview(data).nbytes
            if self.left <= 0:
                self.failed += 1
                raise OSError(self.err, os.strerror(self.err))
            done = real(fd, memoryview(data).cast("B")[:min(n, self.left)], offset)
            self.left -= done
            return done

        monkeypatch.setattr(os, "pwrite", pwrite)


TILES = [(0, 40), (40, 150), (150, 256)]  # rows of 0.weight (256x128 fp32: 512 B a row, one 256 KiB
# checksum block holds them all, so a tile's failed write shares its block with the other tiles)


def grad_so_far(e) -> tuple[list, torch.Tensor] | None:
    """The NVMe gradient as the store holds it, read without completing it (complete_grad would
    change how the next tile is written): the tiles written so far and their values (zeros
    elsewhere); None without a gradient."""
    if not e.has_grad:
        return None
    parts = sorted(e.grad_parts) or [(0, e.shard_numel)]
    out = torch.zeros(e.shard_numel)
    for lo, hi in parts:
        e.read_grad_into(out[lo:hi], lo)
    return parts, out


def same_grad(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (a[0] == b[0] and torch.equal(a[1], b[1])))


@pytest.mark.parametrize("at", [0.0, 0.3, 0.9])
def test_a_write_failing_half_way_through_a_tiled_gradient_keeps_the_previous_sum(tmp_path, monkeypatch, at):
    """Two micro-batches reduce 0.weight's gradient in three row tiles (the first writes each
    tile where nothing of the gradient is yet, the second adds to it). Each tile's write fails
    after `at` of its bytes: the error names the parameter, its rows and the file and says
    nothing was added; the tiles written before read back unchanged (the failed write shared
    their checksum block). Retried, each tile goes on; the sum, and the AdamW step taken on it,
    are torch's bit for bit."""
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    w = model[0].weight
    e = STORE.entry(w)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    gs = [torch.randn(w.shape, generator=g) for g in gens]
    for g in gs:
        for lo, hi in TILES:
            before = grad_so_far(e)
            with monkeypatch.context() as m:
                fail = FailingWrites(e.engine.swap.path, int(at * (hi - lo) * 128 * 4), m)
                with pytest.raises(ZinfError) as info:
                    STORE.reduce_grad(w, g[lo:hi], rows=(lo, hi))
            msg = str(info.value)
            assert fail.failed and f"rows {lo}:{hi} of the gradient of parameter '0.weight'" in msg, msg
            assert "no space left on device" in msg.lower() and e.engine.swap.path in msg, msg
            assert "nothing was added" in msg and "gradient is as it was" in msg, msg
            assert same_grad(grad_so_far(e), before)
            STORE.reduce_grad(w, g[lo:hi], rows=(lo, hi))  # the retry
    assert torch.equal(e.read_grad(), (gs[0] + gs[1]).reshape(-1))
    others = grads(1, model)[1:]
    for p, g in zip(list(model.parameters())[1:], others):
        give_grad(p, g)
    opt.step()
    step_ref(ref, ref_opt, [gs[0] + gs[1]] + others)
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()


def test_a_full_disk_while_adding_a_tile_keeps_the_previous_sum(small_fs):
    """On a real small disk: the second micro-batch's tiles are summed beside the first's (a new
    file's worth of space); with the disk full each fails and changes nothing; with space again
    the sums are exact, and with both files there a full disk no longer stops them."""
    fs = small_fs(4 << 20)
    ref, model, opt, ref_opt = nvme_model(fs.path)
    w = model[0].weight
    e = STORE.entry(w)
    g1, g2, g3 = (torch.randn(w.shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    for lo, hi in TILES:
        STORE.reduce_grad(w, g1[lo:hi], rows=(lo, hi))
    fs.fill(leave=0)
    for lo, hi in TILES:
        before = grad_so_far(e)
        with pytest.raises(ZinfError, match=rf"(?i)rows {lo}:{hi} of the gradient of parameter '0.weight'.*"
                                            r"no space left on device.*nothing was added"):
            STORE.reduce_grad(w, g2[lo:hi], rows=(lo, hi))
        assert same_grad(grad_so_far(e), before)
    fs.unfill()
    for lo, hi in TILES:
        STORE.reduce_grad(w, g2[lo:hi], rows=(lo, hi))
    fs.fill(leave=0)  # the spare gradient file is whole now: adding needs no new space
    for lo, hi in TILES:
        STORE.reduce_grad(w, g3[lo:hi], rows=(lo, hi))
    assert torch.equal(e.read_grad(), (g1 + g2 + g3).reshape(-1))
    fs.unfill()


@pytest.mark.parametrize("rows", [None, (40, 150)], ids=["whole", "tile"])
@pytest.mark.parametrize("at", [0.3, 0.7])
def test_a_write_failing_half_way_through_settling_a_clip_keeps_the_gradient_and_its_scale(tmp_path, monkeypatch,
                                                                                         rows, at):
    """A clip leaves its coefficient pending on the NVMe gradients; a gradient added after it first
    writes the scaled gradient (`_settle_grad_scales`). That write fails after `at` of it: the
    gradient reads as before (scaled once, the coefficient still pending: the failure was in the
    settling), the error says nothing was added; the retry's sum and the AdamW step taken on it
    are torch's (clip_grad_norm_, then accumulate) bit for bit."""
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    w = model[0].weight
    e = STORE.entry(w)
    give(model, grads(1, model))
    for q, g in zip(ref.parameters(), grads(1, ref)):
        q.grad = g.clone()
    assert torch.equal(zinf_compile.clip_grad_norm_(model.parameters(), 1.0),
                       torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    assert e.grad_scales
    before = e.read_grad().clone()
    g2 = torch.randn(w.shape, generator=torch.Generator().manual_seed(9))
    part, add = (g2, g2) if rows is None else (g2[rows[0]:rows[1]], torch.zeros_like(g2))
    if rows is not None:
        add[rows[0]:rows[1]] = part
    with monkeypatch.context() as m:
        FailingWrites(e.engine.swap.path, int(at * e.shard_nbytes), m)
        with pytest.raises(ZinfError, match=r"(?i)gradient of parameter '0.weight' failed.*no space left on device"
                                            r".*nothing was added"):
            STORE.reduce_grad(w, part, rows=rows)
    assert e.grad_scales, "the failure was not in the settling"
    assert torch.equal(e.read_grad(), before)
    STORE.reduce_grad(w, part, rows=rows)  # the retry
    assert not e.grad_scales
    ref[0].weight.grad += add
    assert torch.equal(e.read_grad(), ref[0].weight.grad.reshape(-1))
    opt.step()
    ref_opt.step()
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()




def test_a_step_failing_while_it_completes_a_tiled_gradient_applies_nothing(tmp_path, monkeypatch):
    """Two of the three tiles of 0.weight's gradient came (the middle rows got none: zeros). The
    step first writes those zeros into the gradient file, in the checksum block the two tiles
    share; that write fails half way: the step applies nothing and says so, the tiles read back
    unchanged, and the retried step is torch's AdamW on the gradient with zero middle rows."""
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    w = model[0].weight
    e = STORE.entry(w)
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    for lo, hi in (TILES[0], TILES[2]):
        STORE.reduce_grad(w, g[lo:hi], rows=(lo, hi))
    others = grads(1, model)[1:]
    for p, q in zip(list(model.parameters())[1:], others):
        give_grad(p, q)
    before, snap = grad_so_far(e), snapshot(model, opt)
    gap = (TILES[1][1] - TILES[1][0]) * 128 * 4
    with monkeypatch.context() as m:
        fail = FailingWrites(e.engine.swap.path, gap // 2, m)
        with pytest.raises(ZinfError, match=r"(?i)gradient of parameter '0.weight'.*no space left on device.*"
                                            r"nothing was applied"):
            opt.step()
    assert fail.failed
    assert same_grad(grad_so_far(e), before)
    assert_snapshot(model, opt, snap)
    opt.step()
    g[TILES[1][0]:TILES[1][1]] = 0
    step_ref(ref, ref_opt, [g] + others)
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()



def test_a_first_gradient_failing_while_an_in_place_shard_moves_to_its_own_file(tmp_path, monkeypatch):
    """A shard read in place from a file zinf does not own (a checkpoint) moves to a swap file of
    its own before its first gradient. That copy fails half way: the shard still reads from the
    checkpoint, the half-written file is handed back (no file kept per failed try), the checkpoint
    is untouched; the retry moves it and adds the gradient."""
    value = torch.randn(256, 128, generator=torch.Generator().manual_seed(4))
    source = str(tmp_path / "weights.bin")
    with open(source, "wb") as f:
        f.write(b"\0" * 64 + value.numpy().tobytes())
    raw = open(source, "rb").read()
    key = next(_keys)
    register_engine(key, "nvme", str(tmp_path / "swap"), 2, False)
    w = torch.nn.Parameter(torch.empty(256, 128))
    w.untyped_storage().resize_(0)
    e = STORE.manage_in_place(STORE.identify(w, "w"), key, source, 64, torch.float32)
    g = torch.randn(256, 128, generator=torch.Generator().manual_seed(6))
    in_use = e.engine.swap.files_in_use() if e.engine._swap is not None else 0
    for _ in range(2):
        with monkeypatch.context() as m:
            fail = FailingWrites(str(tmp_path / "swap"), e.shard_nbytes // 2, m)
            with pytest.raises(ZinfError, match=r"(?i)gradient of parameter 'w' failed.*shard of parameter 'w'.*"
                                                r"no space left on device.*nothing was added"):
                STORE.reduce_grad(w, g)
        assert fail.failed and e.source == source and not e.has_grad
        assert e.engine.swap.files_in_use() == in_use
        assert torch.equal(STORE.full(e), value)
    STORE.reduce_grad(w, g)
    assert e.source is None and torch.equal(STORE.full(e), value) and torch.equal(e.read_grad(), g.reshape(-1))
    assert open(source, "rb").read() == raw
    zinf_compile.reset()


def test_the_moved_ranges_of_a_gradient_toggle_like_a_mask():
    """`_pieces` and `_toggle` (which ranges of a gradient are in its spare file) against a
    boolean mask, over random toggles."""
    from zinf_compile.runtime.params import _pieces, _toggle

    gen = torch.Generator().manual_seed(3)
    n = 64
    moved, mask = [], torch.zeros(n, dtype=torch.bool)
    for _ in range(400):
        lo, hi = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
        if lo == hi:
            continue
        pieces = _pieces(moved, lo, hi)
        assert pieces[0][0] == lo and pieces[-1][1] == hi
        assert all(a < b and b == c for (a, b, _), (c, _, _) in zip(pieces, pieces[1:]))
        assert all(bool(mask[a:b].all()) if inside else not bool(mask[a:b].any()) for a, b, inside in pieces)
        moved = _toggle(moved, lo, hi)
        mask[lo:hi] = ~mask[lo:hi]
        assert all(a < b < c for (a, b), (c, _) in zip(moved, moved[1:]))  # sorted, disjoint, merged
        again = torch.zeros(n, dtype=torch.bool)
        for a, b in moved:
            again[a:b] = True
        assert torch.equal(again, mask)


def test_any_sequence_of_gradient_writes_failing_half_way_keeps_the_gradient(tmp_path, monkeypatch):
    """A random sequence of what reaches an NVMe gradient -- row tiles (some overlapping, some
    repeated), whole gradients, clips left pending, zero_grad -- each first failing after a random
    part of its bytes, then retried. After each failure the gradient reads as before it; after
    each retry it is torch's arithmetic on whole tensors, bit for bit."""
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    w = model[0].weight
    e = STORE.entry(w)
    gen = torch.Generator().manual_seed(11)
    tiles = TILES + [(0, 256), (100, 200), (40, 150), (255, 256)]
    expect, failures = None, 0
    for i in range(40):
        op = ["tile", "tile", "tile", "whole", "clip", "zero"][int(torch.randint(0, 6, (), generator=gen))]
        if op == "zero":
            STORE.zero_grad([e])
            expect = None
            continue
        if op == "clip":
            coef = torch.rand((), generator=gen) + 0.25
            e.scale_grad(coef)
            if expect is not None:
                expect = expect.mul_(coef)
            continue
        g = torch.randn(w.shape, generator=gen)
        rows = tiles[int(torch.randint(0, len(tiles), (), generator=gen))] if op == "tile" else None
        part = g if rows is None else g[rows[0]:rows[1]]
        before = grad_so_far(e)
        with monkeypatch.context() as m:
            fail = FailingWrites(e.engine.swap.path, int(torch.randint(0, part.numel() * 4, (), generator=gen)), m)
            try:
                STORE.reduce_grad(w, part, rows=rows)
            except ZinfError as err:
                assert "nothing was added" in str(err), str(err)
                failures += 1
        if fail.failed:
            assert same_grad(grad_so_far(e), before), (i, op, rows)
            STORE.reduce_grad(w, part, rows=rows)
        add = torch.zeros(w.shape) if rows is not None else g.clone()
        if rows is not None:
            add[rows[0]:rows[1]] = part
        expect = add if expect is None else expect.add_(add)
        assert torch.equal(grad_so_far(e)[1], expect.reshape(-1)), (i, op, rows)  # zeros where no tile wrote
    assert failures >= 15
    if expect is not None:
        assert torch.equal(e.read_grad(), expect.reshape(-1))
    zinf_compile.reset()


def test_full_disk_during_a_save_keeps_the_old_checkpoint(small_fs, tmp_path):
    fs = small_fs(2 << 20)
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    give(model, grads(1, model))
    opt.step()
    ckpt = os.path.join(fs.path, "ckpt")
    save_checkpoint(ckpt, model, opt)
    old = sorted(os.listdir(ckpt))
    old_files = {f: open(os.path.join(fs.path, f), "rb").read() for f in fs.files()}
    saved = snapshot(model, opt)
    give(model, grads(2, model))
    opt.step()
    fs.fill(leave=200 << 10)  # room for a few files of the new version, not for all
    with pytest.raises(ZinfError) as err:
        save_checkpoint(ckpt, model, opt)
    msg = str(err.value)
    assert "no space left on device" in msg and ckpt in msg and "the checkpoint that was there" in msg, msg
    assert "unexpected pos" not in msg
    fs.unfill()
    assert sorted(os.listdir(ckpt)) == old  # nothing of the failed save is left
    assert {f: open(os.path.join(fs.path, f), "rb").read() for f in fs.files()} == old_files
    ref2, model2, opt2, _ = nvme_model(str(tmp_path / "swap"))
    load_checkpoint(ckpt, model2, opt2)
    assert_snapshot(model2, opt2, saved)
    save_checkpoint(ckpt, model, opt)  # with space again: the new one replaces it, nothing aside
    assert len(os.listdir(ckpt)) == 2 and sorted(os.listdir(ckpt)) != old


def test_ctrl_c_during_the_commit_arrives_after_it(tmp_path, monkeypatch):
    """The switch to the new slots (and the in-memory steps) is not interrupted half-way: a
    SIGINT there is delivered right after it, the step applied whole."""
    import zinf_compile.optim as zoptim

    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "swap"))
    give(model, grads(1, model))

    def interrupt(name):
        if name == "step:commit":
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(zoptim, "FAULT_HOOK", interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    step_ref(ref, ref_opt, grads(1, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()


def test_ctrl_c_in_the_middle_of_the_nvme_step_is_itself_and_the_retry_continues_exactly(tmp_path, monkeypatch):
    """A real SIGINT (Python's default handler: KeyboardInterrupt) after the first, a middle and
    the last but one chunk of step 2 has been written: KeyboardInterrupt reaches the caller as
    itself (not wrapped in a ZinfError), step 1's parameters and states are intact, and the retry
    gives torch's AdamW result bit for bit."""
    import zinf_compile.optim as zoptim

    ref, model, opt, ref_opt = stepped_once(str(tmp_path / "swap"))
    before = snapshot(model, opt)
    chunks = sum(STORE.entry(m.weight).shard_numel // CHUNK for m in (model[0], model[2]))
    assert chunks == 16
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for n in (1, chunks // 2, chunks - 1):
        written = []

        def interrupt(name, n=n):
            if name == "nvme-step:chunk-written":
                written.append(name)
                if len(written) == n:
                    os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(zoptim, "FAULT_HOOK", interrupt)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        monkeypatch.setattr(zoptim, "FAULT_HOOK", None)
        assert len(written) == n
        assert_snapshot(model, opt, before)
    opt.step()
    opt.zero_grad()
    step_ref(ref, ref_opt, grads(2, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()


@pytest.mark.parametrize("mode", ["tmpfs", "hook"])
def test_full_disk_while_loading_optimizer_states_changes_nothing(small_fs, tmp_path, mode):
    """A fresh optimizer has no state files yet: loading a checkpoint makes them. On a full disk
    the load fails before the model or optimizer changed."""
    ref, model, opt, _ = nvme_model(str(tmp_path / "swap"))
    give(model, grads(1, model))
    opt.step()
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, model, opt)
    saved = snapshot(model, opt)
    fs = small_fs(4 << 20, mode=None if mode == "tmpfs" else "hook")
    fresh = build()
    torch.nn.init.normal_(fresh[0].weight)
    manage(fresh, fs.path, key=next(_keys))
    fresh_opt = optimizer(fresh, torch.optim.AdamW, chunk_elems=CHUNK, **HP)
    fresh_opt.zero_grad()  # lays the optimizer out over the managed parameters
    before = snapshot(fresh, fresh_opt)
    assert before[1]["state"] == {}
    fs.fill(leave=0)
    with pytest.raises(ZinfError, match=r"no space left on device.*optimizer state of '0.weight'.*nothing was loaded"):
        load_checkpoint(ckpt, fresh, fresh_opt)
    assert_snapshot(fresh, fresh_opt, before)
    fs.unfill()
    load_checkpoint(ckpt, fresh, fresh_opt)
    assert_snapshot(fresh, fresh_opt, saved)


# -- kills ---------------------------------------------------------------------------------------
KILL_POINTS = {  # where the worker is killed -> the checkpoint that must load: after step 1 or 2
    "nvme-step:chunk-written": 1, "step:commit": 1,
    "save:shards-written": 1, "save:before-switch": 1, "save:after-switch": 2,
}


def test_a_kill_at_any_point_leaves_a_checkpoint_that_loads(tmp_path):
    """SIGKILL at chosen points of a step and of a save (the worker pauses there): the checkpoint
    at its path is the old or the new one, whole; the next save removes what the dead save left
    and the next zinf process the dead one's swap folder."""
    procs = {}
    for point in KILL_POINTS:
        d = tmp_path / point.replace(":", "-")
        d.mkdir()
        procs[point] = (d, subprocess.Popen([sys.executable, WORKER, str(d / "swap"), str(d / "ckpt"), point],
                                            stdout=subprocess.PIPE, text=True,
                                            env=dict(os.environ, PYTHONPATH=ROOT)))
    for point, (d, p) in procs.items():
        try:
            assert p.stdout.readline().strip() == f"paused {point}", point
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    expected = {}
    for step in (1, 2):
        step_ref(ref, ref_opt, grads(step, ref))
        expected[step] = (copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict()))
    for point, (d, _) in procs.items():
        ckpt = str(d / "ckpt")
        model = build()
        opt = optimizer(model, torch.optim.AdamW, **HP)
        load_checkpoint(ckpt, model, opt)
        params, optim = expected[KILL_POINTS[point]]
        for k, v in params.items():
            assert torch.equal(model.state_dict()[k], v), (point, k)
        assert_same_optim_state(opt.state_dict(), optim)
        left = sorted(os.listdir(ckpt))
        assert len(left) == (3 if point.startswith("save") else 2), (point, left)  # CURRENT, versions
        assert len(os.listdir(d / "swap")) == 1  # the dead worker's swap folder
        model2, opt2 = nvme_model(str(d / "swap"))[1:3]  # a zinf process on the same offload dir
        assert len(os.listdir(d / "swap")) == 1 and str(os.getpid()) in os.listdir(d / "swap")[0]
        save_checkpoint(ckpt, model2, opt2)
        assert len(os.listdir(ckpt)) == 2, (point, os.listdir(ckpt))  # CURRENT and the new version
    zinf_compile.reset()


# -- damaged checkpoints ------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    """A checkpoint after step 1, and a model two steps on (other values) to load it into."""
    ref, model, opt, _ = nvme_model(str(tmp_path / "swap"))
    give(model, grads(1, model))
    opt.step()
    opt.zero_grad()
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, model, opt)
    good = snapshot(model, opt)
    give(model, grads(2, model))
    opt.step()
    yield ckpt, model, opt, good
    zinf_compile.reset()


def _version(ckpt: str) -> str:
    return os.path.join(ckpt, open(os.path.join(ckpt, CURRENT)).read().split()[0])


def _flip(f: str) -> None:
    b = bytearray(open(f, "rb").read())
    b[len(b) // 2] ^= 0x40
    open(f, "wb").write(bytes(b))


def _zero(f: str) -> None:
    open(f, "wb").write(bytes(os.path.getsize(f)))


def _truncate(f: str) -> None:
    os.truncate(f, os.path.getsize(f) // 2)


DAMAGE = {
    "flipped shard": ("rank00000/t00000.pt", _flip, "is damaged"),
    "zeroed shard": ("rank00000/t00002.pt", _zero, "is damaged"),
    "truncated shard": ("rank00000/t00002.pt", _truncate, "truncated"),
    "flipped bias": ("rank00000/t00001.pt", _flip, "is damaged"),
    "flipped optimizer": ("optim.pt", _flip, "is damaged"),
    "truncated manifest": ("manifest.json", _truncate, "is damaged"),
    "missing shard": ("rank00000/t00003.pt", os.remove, "is missing"),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_before_anything_changes(saved, what):
    ckpt, model, opt, good = saved
    rel, damage, says = DAMAGE[what]
    f = os.path.join(_version(ckpt), rel)
    keep = open(f, "rb").read()
    damage(f)
    now = snapshot(model, opt)
    with pytest.raises(ZinfError, match=says) as err:
        load_checkpoint(ckpt, model, opt)
    assert f in str(err.value)  # the error names the damaged file
    assert_snapshot(model, opt, now)  # model and optimizer as they were
    open(f, "wb").write(keep)
    load_checkpoint(ckpt, model, opt)
    assert_snapshot(model, opt, good)


class _FailingReads:
    """A file whose reads fail as a dying disk's do (EIO)."""

    def __init__(self, f) -> None:
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def _eio(self, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    read = readinto = readline = read1 = readinto1 = _eio

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("nth", [1, 3, 6, 8])
def test_a_read_error_midway_through_a_load_changes_nothing(saved, monkeypatch, nth):
    """Every file passed its checks, then the n-th file the load opens after them fails to read
    (EIO): a parameter's, a later one's, an optimizer state's. The load raises a ZinfError naming
    that file; model and optimizer are as they were; the swap files it staged are handed back;
    loading again (the disk well) gives the checkpoint's state."""
    import builtins

    from zinf_compile import checkpoint as ckpt_mod

    ckpt, model, opt, good = saved
    before = snapshot(model, opt)
    version = _version(ckpt)
    e = STORE.entry(model[0].weight)
    in_use = e.engine.swap.files_in_use()
    checked, opened, failed = [], [], []
    real_verify, real_open = ckpt_mod._verify, builtins.open

    def verify(*args):
        real_verify(*args)
        checked.append(args[2])

    def failing_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if len(checked) == 2 and isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(version):
            opened.append(os.fspath(file))
            if len(opened) == nth:
                failed.append(os.fspath(file))
                return _FailingReads(f)
        return f

    monkeypatch.setattr(ckpt_mod, "_verify", verify)
    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(ZinfError) as info:
        load_checkpoint(ckpt, model, opt)
    monkeypatch.undo()
    assert failed, f"the load opened {len(opened)} files after its checks"
    msg = str(info.value)
    assert repr(failed[0]) in msg and "Input/output error" in msg, msg
    assert_snapshot(model, opt, before)
    assert e.engine.swap.files_in_use() == in_use
    load_checkpoint(ckpt, model, opt)
    assert_snapshot(model, opt, good)


def test_swapped_same_shaped_files_are_refused(saved):
    """0.weight (256x128) and 2.weight (128x256) have shards of the same shape: swapped, each file
    still has a valid zip and the right tensors, but not the right name (nor checksum)."""
    ckpt, model, opt, good = saved
    a, b = (os.path.join(_version(ckpt), "rank00000", f) for f in ("t00000.pt", "t00002.pt"))
    tmp = a + ".x"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    now = snapshot(model, opt)
    with pytest.raises(ZinfError, match="t0000[02].pt"):
        load_checkpoint(ckpt, model, opt)
    assert_snapshot(model, opt, now)


def test_a_checkpoint_without_a_pointer_is_not_one(saved):
    ckpt, model, opt, good = saved
    os.remove(os.path.join(ckpt, CURRENT))
    with pytest.raises(ZinfError, match="not a zinf checkpoint"):
        load_checkpoint(ckpt, model, opt)
    open(os.path.join(ckpt, CURRENT), "w").write("garbage")
    with pytest.raises(ZinfError, match="CURRENT' is damaged"):
        load_checkpoint(ckpt, model, opt)


def test_a_dead_saves_folder_is_removed_by_the_next_save_and_a_live_ones_kept(saved):
    ckpt, model, opt, good = saved
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = os.path.basename(_version(ckpt)).split("-")[1]
    stale = os.path.join(ckpt, f"v-{host}-{dead.pid}-{uuid.uuid4().hex[:8]}")
    live = os.path.join(ckpt, f"v-{host}-1-{uuid.uuid4().hex[:8]}")  # pid 1: alive, not ours
    for d in (stale, live):
        os.makedirs(os.path.join(d, "rank00000"))
        open(os.path.join(d, "rank00000", "t00000.pt"), "wb").write(b"half")
    save_checkpoint(ckpt, model, opt)
    left = sorted(os.listdir(ckpt))
    assert os.path.basename(stale) not in left and os.path.basename(live) in left and len(left) == 3


# -- the real workload: a compiled Hugging Face Llama ---------------------------------------------
def test_a_compiled_llama_on_a_full_disk_keeps_its_state_and_resumes_exactly(small_fs):
    """Training a compiled HF Llama with its parameters in the NVMe tier on a small disk: when the
    disk fills, the step and the save fail saying so, nothing changed; after space is freed the
    retried step is torch's AdamW step from the state before, bit for bit."""
    from hf_models import hf_batch, hf_model

    fs = small_fs(32 << 20)
    model = hf_model("llama", layers=1)
    compiled = torch.compile(model, backend="zinf",
                             options={"params": "offload", "offload": "nvme", "offload_dir": fs.path})
    opt = optimizer(compiled, torch.optim.AdamW, **HP)
    batch = hf_batch("llama", batch=2, seq=32)
    compiled(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
    compiled(**batch).loss.backward()
    managed = {n for n, p in model.named_parameters() if STORE.entry(p) is not None}
    assert len(managed) >= 8 and all(STORE.entry(p).tier == "nvme" for n, p in model.named_parameters() if n in managed)
    grads = {n: (STORE.entry(p).read_grad()[:p.numel()].view(p.shape).clone() if n in managed else p.grad.clone())
             for n, p in model.named_parameters()}
    params, state = copy.deepcopy(full_state_dict(compiled)), copy.deepcopy(opt.state_dict())
    fs.fill(leave=64 << 10)  # step 2 makes the states' second slots
    with pytest.raises(ZinfError, match=r"(?i)no space left on device.*nothing was applied"):
        opt.step()
    ckpt = os.path.join(fs.path, "ckpt")
    with pytest.raises(ZinfError, match="no space left on device"):
        save_checkpoint(ckpt, compiled, opt)
    assert not os.path.exists(ckpt)
    after = full_state_dict(compiled)
    assert all(torch.equal(after[k], v) for k, v in params.items())
    assert_same_optim_state(opt.state_dict(), state)
    fs.unfill()
    opt.step()
    ref = hf_model("llama", layers=1)
    ref.load_state_dict(params)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    ref_opt.load_state_dict(state)
    for n, q in ref.named_parameters():
        q.grad = grads[n]
    ref_opt.step()
    after = full_state_dict(compiled)
    for k, v in ref.state_dict().items():
        assert torch.equal(after[k], v), k
    assert_same_optim_state(opt.state_dict(), ref_opt.state_dict())


# -- several ranks -------------------------------------------------------------------------------
def test_two_ranks_save_and_load_a_checkpoint_and_refuse_a_damaged_shard(tmp_path):
    """Each rank writes its shards; rank 0's manifest holds every rank's checksums; a rank whose
    own shard file is damaged refuses to load (the other loads: it reads only its own files)."""
    import json

    out = str(tmp_path / "out.json")
    worker = os.path.join(os.path.dirname(WORKER), "dist_checkpoint.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", worker,
           str(tmp_path / "swap"), str(tmp_path / "ckpt"), out]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.load(open(out))
    assert res["world"] == 2 and res["loaded_equal"] and res["sharded"] == [128 * 256 // 2] * 2
    assert "rank00001/t00002.pt" in res["files"] and "rank00000/t00002.pt" in res["files"]
    assert res["errors"][0] is None
    assert res["errors"][1] is not None and "rank00001/t00002.pt" in res["errors"][1] and "damaged" in res["errors"][1]
    assert res["unchanged"]
    assert not os.path.exists(tmp_path / "swap") or os.listdir(tmp_path / "swap") == []


# -- a finalizer while the store is busy ----------------------------------------------------------
def test_a_parameter_dying_in_another_thread_while_the_store_is_busy_does_not_wait():
    """A parameter's finalizer runs in whatever thread's garbage collection frees it, e.g. a new I/O
    thread that `manage` (holding the store's lock) waits to start: it must not wait for the lock
    (that hung the suite: tests/test_faults.py's kill test, 14:3x on 2026-12-03)."""
    import threading

    holder = [torch.nn.Parameter(torch.randn(16))]
    pid = STORE.identify(holder[0], "dying")
    with STORE._lock:  # as manage holds it
        t = threading.Thread(target=holder.clear)  # the parameter dies in that thread
        t.start()
        t.join(10)
        assert not t.is_alive(), "the finalizer waited for the store's lock"
        assert pid in STORE._forgotten
    fresh = torch.nn.Parameter(torch.randn(16))
    STORE.identify(fresh, "fresh")  # takes the lock: the dead one is forgotten now
    assert pid not in STORE._forgotten and pid not in STORE._keys


# -- damaged swap records -------------------------------------------------------------------------
RECORD_DAMAGE = ("zeroed", "flipped", "garbage")


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _damage_record(fd: int, nbytes: int, how: str) -> bytes:
    """Damage the record in the first `nbytes` bytes of fd's file behind zinf's back (another
    open of the file: what a failing disk or a stray process does); returns the bytes to restore."""
    with open(_fd_path(fd), "r+b") as f:
        saved = f.read(nbytes)
        assert len(saved) == nbytes
        if how == "zeroed":
            new = bytes(nbytes)
        elif how == "flipped":
            new = bytearray(saved)
            new[nbytes // 2] ^= 0x40
        else:
            new = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
            new = new.numpy().tobytes()
        assert new != saved
        f.seek(0)
        f.write(new)
    return saved


def _restore_record(fd: int, saved: bytes) -> None:
    with open(_fd_path(fd), "r+b") as f:
        f.write(saved)


def test_a_damaged_shard_fails_the_forward_naming_the_parameter_and_file(tmp_path):
    """A shard file zeroed, with a flipped byte or garbage under a compiled model: the gather (a
    checked mapping of the file) raises SwapCorruptionError naming the parameter and the file;
    restored, the forward gives the same output as before."""
    from zinf_compile.errors import SwapCorruptionError

    model = build()
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                         "offload_dir": str(tmp_path)})
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = cm(x)
        e = STORE.entry(model[2].weight)
        assert e.tier == "nvme" and e.maps and e.engine.checksums
        for how in RECORD_DAMAGE:
            saved = _damage_record(e.fd, e.shard_nbytes, how)
            with pytest.raises(SwapCorruptionError) as info:
                cm(x)
            msg = str(info.value)
            assert "shard of parameter '2.weight'" in msg and _fd_path(e.fd) in msg and "corrupt" in msg, msg
            with pytest.raises(SwapCorruptionError, match="2.weight"):
                STORE.full(e)  # a plain read of it (state_dict, a released parameter)
            _restore_record(e.fd, saved)
            assert torch.equal(cm(x), out)
    zinf_compile.reset()


def test_a_damaged_gradient_state_or_shard_fails_the_step_and_applies_nothing(tmp_path):
    """The gradient file, each optimizer-state file and the shard file of a parameter in the NVMe
    tier, each zeroed, with a flipped byte, or garbage before step 2: the step raises a ZinfError
    caused by a SwapCorruptionError, naming the parameter, the record and the file; nothing is
    applied. Restored, step 2 gives torch's AdamW result bit for bit."""
    from zinf_compile.errors import SwapCorruptionError

    ref, model, opt, ref_opt = stepped_once(str(tmp_path / "swap"))
    before = snapshot(model, opt)
    e = STORE.entry(model[0].weight)
    records = {"gradient": e.grad_fd, "optimizer state 'exp_avg'": e.state_fds["exp_avg"],
               "optimizer state 'exp_avg_sq'": e.state_fds["exp_avg_sq"], "shard": e.fd}
    for what, fd in records.items():
        for how in RECORD_DAMAGE:
            saved = _damage_record(fd, e.shard_nbytes, how)
            with pytest.raises(ZinfError, match="nothing was applied") as info:
                opt.step()
            msg = str(info.value)
            assert isinstance(info.value.__cause__, SwapCorruptionError), repr(info.value.__cause__)
            assert f"{what} of parameter '0.weight'" in msg and _fd_path(fd) in msg and "corrupt" in msg, msg
            _restore_record(fd, saved)
            assert_snapshot(model, opt, before)
    opt.step()
    step_ref(ref, ref_opt, grads(2, ref))
    assert_like_ref(model, opt, ref, ref_opt)
    zinf_compile.reset()


def test_offloaded_activations_are_checked_and_a_clean_run_matches_inductor(tmp_path, monkeypatch):
    """Training with activations offloaded to NVMe files (checksummed) gives Inductor's losses and
    parameters bit for bit; then an activation file damaged between the forward that wrote it and
    the backward that reads it fails the backward with SwapCorruptionError naming the file."""
    from mlp import build as build_mlp

    from zinf_compile.errors import SwapCorruptionError
    from zinf_compile.runtime.state import RUNTIME

    def train(m, inputs, steps):
        sgd = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for _ in range(steps):
            loss = m(*inputs).pow(2).mean()
            loss.backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        return losses

    ref, inputs = build_mlp()
    model, _ = build_mlp()
    ref_losses = train(torch.compile(ref), inputs, 2)
    zinf_compile.reset()
    cm = torch.compile(model, backend="zinf", options={"budget": "85%", "offload": "nvme",
                                                         "offload_dir": str(tmp_path)})
    assert train(cm, inputs, 2) == ref_losses
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    eng = next(e for e in RUNTIME.engines.values() if e.offload_dir == str(tmp_path))
    assert eng.checksums and eng.stats["offloads"] > 0 and any(eng.swap.sums.values())
    for how in RECORD_DAMAGE:
        real = type(eng).prefetch

        def damaging(h, device, how=how):
            s = eng._stored_of(h)
            _damage_record(s.fd, s.nbytes, how)
            return real(eng, h, device)

        monkeypatch.setattr(eng, "prefetch", damaging)
        loss = cm(*inputs).pow(2).mean()
        with pytest.raises(SwapCorruptionError) as info:
            loss.backward()
        msg = str(info.value)
        assert "an offloaded activation, float32[512, 256]" in msg and str(tmp_path) in msg and "corrupt" in msg, msg
        monkeypatch.undo()
    model.zero_grad(set_to_none=True)
    zinf_compile.reset()


def test_the_checksums_option_turns_the_checks_off(tmp_path):
    """options={"checksums": False}: nothing is summed or checked; a damaged shard then reads
    through into the output (what the checks are there to stop). Anything else than a bool is
    refused."""
    from zinf_compile.config import ZinfConfig
    from zinf_compile.errors import ZinfConfigError

    assert ZinfConfig.from_options({}).checksums and not ZinfConfig.from_options({"checksums": False}).checksums
    with pytest.raises(ZinfConfigError, match="checksums: expected True or False"):
        ZinfConfig.from_options({"checksums": "off"})
    model = build()
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme", "checksums": False,
                                                         "offload_dir": str(tmp_path)})
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = cm(x)
        e = STORE.entry(model[2].weight)
        assert not e.engine.checksums and not any(e.engine.swap.sums.values())
        saved = _damage_record(e.fd, e.shard_nbytes, "flipped")
        assert not torch.equal(cm(x), out)
        _restore_record(e.fd, saved)
        assert torch.equal(cm(x), out)
    zinf_compile.reset()


# -- a backward that does not complete --------------------------------------------------------------
class _Reduce(torch.autograd.Function):
    """Identity forward; its backward adds a fixed gradient to parameter `w`'s shard through the
    store, as a compiled backward's reduce does (inside autograd's backward, one graph task)."""

    @staticmethod
    def forward(ctx, x, w, g):
        ctx.w, ctx.g = w, g
        return x.clone()

    @staticmethod
    def backward(ctx, up):
        STORE.reduce_grad(ctx.w, ctx.g)
        return up, None, None


class _Boom(torch.autograd.Function):
    """Identity; its backward raises while `armed` (an error anywhere in a backward: a kernel's,
    a full disk's in another reduce, Ctrl-C)."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, up):
        if _Boom.armed:
            raise RuntimeError("boom in the backward")
        return up


class _Nested(_Reduce):
    """_Reduce whose backward runs a backward of its own (another graph task, inside this one), as
    reentrant checkpointing does, whose reduce gives `w` its gradient `g`."""

    @staticmethod
    def backward(ctx, up):
        with torch.enable_grad():
            z = torch.zeros(4, requires_grad=True)
            _Reduce.apply(z, ctx.w, ctx.g).sum().backward()
        return up, None, None


def _backward(model, gs, fail: bool) -> None:
    """A backward whose reduces give model[2].weight then model[0].weight their gradients in `gs`,
    with an error between the two when `fail`."""
    w0, w2 = model[0].weight, model[2].weight
    x = torch.zeros(4, requires_grad=True)
    y = _Reduce.apply(_Boom.apply(_Reduce.apply(x, w0, gs[0])), w2, gs[2])
    _Boom.armed = fail
    try:
        y.sum().backward()
    finally:
        _Boom.armed = False


def _zeroed_with_bias_grads(model, opt, gs):
    """opt.zero_grad(), then the resident biases' gradients of `gs` (as a backward would leave them)."""
    opt.zero_grad()
    for i in (1, 3):
        list(model.parameters())[i].grad = gs[i].clone()
    return gs


def test_a_backward_that_fails_half_way_is_rolled_back(tmp_path):
    """An error in the middle of a backward, after it added some gradients: a step refuses (nothing
    stepped, the error says why) and the gradients it started are gone; the backward run again, or
    the same after the refused step, gives the parameters and states a clean run gives, bit for
    bit. A gradient it added to an earlier sum cannot be restored: it is marked partial, a step or
    a reduce into it names it, zero_grad clears it."""
    ref, model, opt, ref_opt = nvme_model(str(tmp_path / "a"))
    gs = [g.clone() for g in grads(1, model)]
    for i in (1, 3):  # the biases: resident, as a backward would leave them
        list(model.parameters())[i].grad = gs[i].clone()
    e0, e2 = STORE.entry(model[0].weight), STORE.entry(model[2].weight)
    snap = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="boom"):
        _backward(model, gs, fail=True)
    assert e2.has_grad and not e0.has_grad  # half way: one of the two reduces ran
    with pytest.raises(ZinfError, match="did not complete.*removed"):
        opt.step()
    assert_snapshot(model, opt, snap)
    assert not e2.has_grad and not e0.has_grad
    _backward(model, gs, fail=False)  # run again
    opt.step()
    step_ref(ref, ref_opt, gs)
    assert_like_ref(model, opt, ref, ref_opt)

    # the retry straight after the failure (no step between): the gradient both added to is partial
    gs = _zeroed_with_bias_grads(model, opt, grads(2, model))
    snap = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="boom"):
        _backward(model, gs, fail=True)
    _backward(model, gs, fail=False)
    with pytest.raises(ZinfError, match=r"1 parameter\(s\) \('2.weight'\).*zero_grad"):
        opt.step()
    assert_snapshot(model, opt, snap)
    _zeroed_with_bias_grads(model, opt, gs)
    _backward(model, gs, fail=False)
    opt.step()
    step_ref(ref, ref_opt, gs)
    assert_like_ref(model, opt, ref, ref_opt)

    # a backward run inside another (reentrant checkpointing does it): both complete, nothing settled
    gs = _zeroed_with_bias_grads(model, opt, grads(3, model))
    x = torch.zeros(4, requires_grad=True)
    y = _Reduce.apply(_Nested.apply(x, model[0].weight, gs[0]), model[2].weight, gs[2])
    y.sum().backward()
    opt.step()
    step_ref(ref, ref_opt, gs)
    assert_like_ref(model, opt, ref, ref_opt)

    # a gradient summed over two backwards, the second failing after adding to it: partial
    opt.zero_grad()
    _backward(model, gs, fail=False)
    with pytest.raises(RuntimeError, match="boom"):
        _backward(model, gs, fail=True)
    with pytest.raises(ZinfError, match=r"1 parameter\(s\) \('2.weight'\).*zero_grad"):
        opt.step()
    with pytest.raises(ZinfError, match="'2.weight' holds part of a backward"):
        _backward(model, gs, fail=False)
    opt.zero_grad()
    assert not e2.grad_partial and not e2.has_grad
    _backward(model, gs, fail=False)
    for i in (1, 3):
        list(model.parameters())[i].grad = gs[i].clone()
    opt.step()
    step_ref(ref, ref_opt, gs)
    assert_like_ref(model, opt, ref, ref_opt)
