"""Kills leave nothing behind: SIGTERM exits like a normal exit (the swap folder goes), and the
folder of a process killed outright (SIGKILL: nothing of it runs) is removed by the next zinf
process that uses the same offload folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from zinf_compile.runtime.swapdir import _HOST, SwapDir, reap_dead

CHILD = textwrap.dedent("""
    import sys, time, torch
    from zinf_compile.runtime.state import register_engine
    eng = register_engine(77, "nvme", sys.argv[1], 1, False)
    h = eng.offload(torch.randn(1 << 16), [0])   # a swap file on disk
    print("ready", flush=True)
    time.sleep(60)
""")


def _folders(root):
    return [d for d in os.listdir(root) if d.startswith("zinf-")]


def _start(root):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert len(_folders(root)) == 1 and os.listdir(os.path.join(root, _folders(root)[0]))
    return p


def test_sigterm_removes_the_swap_folder(tmp_path):
    p = _start(tmp_path)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    assert _folders(tmp_path) == []


IN_FINALIZER = textwrap.dedent("""
    import os, signal, sys, time, weakref, torch
    from zinf_compile.runtime.state import register_engine
    eng = register_engine(77, "nvme", sys.argv[1], 1, False)
    h = eng.offload(torch.randn(1 << 16), [0])

    def terminate():
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler right here, in the finalizer
        sum(range(1000))

    class Dying:
        def __del__(self):
            terminate()

    if sys.argv[2] == "__del__":
        Dying()
    else:
        weakref.finalize(Dying.__new__(Dying), terminate)  # dies at once: its finalizer runs
    time.sleep(5)
    print("still running", flush=True)
""")


@pytest.mark.parametrize("finalizer", ["__del__", "weakref.finalize"])
def test_sigterm_inside_a_finalizer_still_exits_and_removes_the_swap_folder(tmp_path, finalizer):
    """A SIGTERM handled while a finalizer runs: Python ignores the exception a finalizer raises,
    so the handler's exit would be lost and the program would go on. It is handled again once the
    finalizer has returned: the process exits with 128 + SIGTERM, its swap folder gone."""
    p = subprocess.run([sys.executable, "-c", IN_FINALIZER, str(tmp_path), finalizer], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "still running" not in p.stdout and "Exception ignored" not in p.stderr, p.stderr[-2000:]
    assert _folders(tmp_path) == []


SWALLOWED = textwrap.dedent("""
    import os, signal, sys, time, torch
    import torch._functorch._aot_autograd.utils as aot_utils
    from zinf_compile.runtime.state import register_engine
    eng = register_engine(77, "nvme", sys.argv[1], 1, False)
    h = eng.offload(torch.randn(1 << 16), [0])

    def terminate():
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler right here
        sum(range(1000))

    if sys.argv[2] == "dynamo-guard":
        # a guard Dynamo evaluates (C++) at every call of a compiled function calls this: the exit
        # the handler raises in it is cleared there, as a failed guard
        top = aot_utils.top_saved_tensors_hooks
        armed = []

        def hooks():
            if armed:
                armed.clear()
                terminate()
            return top()

        aot_utils.top_saved_tensors_hooks = hooks
        f = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")
        x = torch.randn(4, requires_grad=True)
        f(x)
        armed.append(1)
        f(x)
    else:
        try:
            terminate()
        except SystemExit:
            pass
    time.sleep(5)
    print("still running", flush=True)
""")


@pytest.mark.parametrize("where", ["dynamo-guard", "caught-and-dropped"])
def test_a_swallowed_sigterm_is_delivered_again_and_exits(tmp_path, where):
    """The handler's exit swallowed where it was raised (C code clearing what Python code it calls
    raised: Dynamo's guards, evaluated at every call of a compiled function; or code dropping a
    SystemExit): the program went on training, the SIGTERM lost (the compiled-training test below
    hung in CI so, SIGTERM'd at delay 0). Its end hands it to the handler again: exit 143."""
    p = subprocess.run([sys.executable, "-c", SWALLOWED, str(tmp_path), where], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "still running" not in p.stdout and "Exception ignored" not in p.stderr, p.stderr[-2000:]
    assert _folders(tmp_path) == []


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_WORKER = os.path.join(ROOT, "tests", "workers", "fault_worker.py")

TRAINER = textwrap.dedent("""
    import faulthandler, signal, sys, time, torch
    stacks = open(sys.argv[3], "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # where it hangs, if it does
    sys.path.insert(0, sys.argv[2])
    import zinf_compile
    from mlp import build
    model, inputs = build()
    cm = torch.compile(model, backend="zinf", options={"budget": "85%", "offload": "nvme", "params": "offload",
                                                       "offload_dir": sys.argv[1]})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    step = 0
    while True:
        cm(*inputs).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 1:
            print("training", flush=True)
""")


def test_sigterm_in_the_middle_of_an_nvme_optimizer_step_exits_and_removes_the_swap_folder(tmp_path):
    """SIGTERM while the optimizer step is half-way through its chunks (the worker pauses after
    one is written): the process exits with 128 + SIGTERM and its swap folder is gone, as after a
    normal exit; the checkpoint saved before the step is untouched."""
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, FAULT_WORKER, str(swap), str(ckpt), "nvme-step:chunk-written"],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert p.stdout.readline().strip() == "paused nvme-step:chunk-written"
        assert len(_folders(swap)) == 1 and os.listdir(swap / _folders(swap)[0])
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    assert not swap.exists()  # zinf made it (and the swap folder in it): zinf removed both
    assert (ckpt / "CURRENT").exists()


def test_sigterm_at_any_instant_of_compiled_training_exits_and_removes_the_swap_folder(tmp_path):
    """A compiled model training with parameters, gradients, optimizer states and activations in
    NVMe files, SIGTERM'd at several instants of its steps (forward, backward, optimizer): each
    process exits with 128 + SIGTERM within a minute and leaves no swap folder behind."""
    import time

    delays = (0.0, 0.3, 0.9, 1.7)
    procs = []
    for i, _ in enumerate(delays):
        d = tmp_path / f"run{i}"
        err = open(tmp_path / f"run{i}.stderr", "w")  # a file: a pipe nobody drains could block the child
        procs.append((d, subprocess.Popen([sys.executable, "-c", TRAINER, str(d), os.path.join(ROOT, "examples"),
                                           str(tmp_path / f"run{i}.stacks")], stdout=subprocess.PIPE,
                                          stderr=err, text=True, env=dict(os.environ, PYTHONPATH=ROOT))))
        err.close()
    try:
        for (d, p), delay in zip(procs, delays):
            assert p.stdout.readline().strip() == "training", (tmp_path / f"{d.name}.stderr").read_text()[-4000:]
            time.sleep(delay)
            assert len(_folders(d)) == 1
            p.send_signal(signal.SIGTERM)
        for d, p in procs:
            try:
                code = p.wait(60)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to run<i>.stacks
                time.sleep(2)
                stacks = tmp_path / f"{d.name}.stacks"
                pytest.fail(f"{d.name} did not exit within 60 s of SIGTERM; its threads:\n{stacks.read_text()}\n"
                            f"its stderr:\n{(tmp_path / f'{d.name}.stderr').read_text()[-4000:]}")
            assert code == 128 + signal.SIGTERM, (d, (tmp_path / f"{d.name}.stderr").read_text()[-4000:])
            assert not d.exists(), (d, list(os.walk(d)))  # zinf made the folder: zinf removed it
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_a_killed_process_folder_is_reaped_by_the_next(tmp_path):
    p = _start(tmp_path)
    p.kill()
    p.wait(30)
    dead = _folders(tmp_path)
    assert len(dead) == 1  # SIGKILL: nothing ran
    live = _start(tmp_path)  # a live process's folder is never touched
    try:
        other = tmp_path / "zinf-otherhost-1-abcd"  # another host's (a shared file system)
        other.mkdir()
        s = SwapDir(str(tmp_path))
        left = set(_folders(tmp_path))
        assert dead[0] not in left and other.name in left and os.path.basename(s.path) in left
        assert len(left) == 3  # ours, the live child's, the other host's
        s.close()
    finally:
        live.kill()
        live.wait(30)
    assert reap_dead(str(tmp_path)) and _folders(tmp_path) == [other.name]


def test_a_forked_child_reads_the_model_and_cannot_write_the_parents_files(tmp_path):
    """A forked child (a DataLoader worker running the model) gets its own I/O threads and swap
    folder: inference works (no hang on the parent's thread pools), training is refused with a
    clear error (it would write the parent's shard files), and the parent's files are untouched.
    The child recompiles (its torch.set_num_threads(1) fails Dynamo's guard on the thread count):
    run cold (a fresh Inductor cache, two compile threads), the parent's C++ builds make Inductor's
    compile thread pool and the child's builds go to it, where they waited forever until zinf's
    at-fork hook reset it (docs/decisions.md, "Fork safety"); a child that hangs again prints
    where (its threads' stacks)."""
    import contextlib
    import hashlib
    import pickle
    import select

    import torch
    import torch._inductor.config as inductor_config
    import torch.nn as nn
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    import zinf_compile

    def digests(folder):
        return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in os.listdir(folder)}

    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_cache_dir(str(tmp_path / "inductor-cache")))  # cold: C++ builds
        stack.enter_context(inductor_config.patch(compile_threads=2))  # through the compile thread pool
        stack.callback(torch.set_num_threads, threads)
        torch.set_num_threads(2)  # so the child's 1 is a change, on a 1-core machine too
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        ref = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        ref.load_state_dict(model.state_dict())
        cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                             "offload_dir": str(tmp_path)})
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
        x = torch.randn(8, 128)
        cm(x).sum().backward()  # compiled, parameters managed
        opt.zero_grad()
        ours = _folders(tmp_path)
        before = digests(tmp_path / ours[0])
        dump = tmp_path / "child-stacks.txt"  # where a hung child says where it hangs (all threads)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            import faulthandler

            stacks = open(dump, "w")
            faulthandler.dump_traceback_later(60, file=stacks)  # before the parent gives up (120 s)
            out = {}
            torch.set_num_threads(1)  # as DataLoader workers do (the parent's OpenMP pool is not here)
            try:
                out["equal"] = bool(torch.allclose(cm(x), ref(x), atol=1e-6))  # recompiled in the child
                try:  # a backward adds to the managed parameters' gradients: the parent's files
                    cm(x).sum().backward()
                    out["backward"] = "no error"
                except zinf_compile.ZinfError as err:
                    out["backward"] = str(err)
                from zinf_compile.runtime.state import STORE

                e = STORE.entry(model[0].weight)
                try:  # what an optimizer step would do: write the parent's shard file
                    e.write_shard(torch.zeros(e.shard_numel))
                    out["train"] = "no error"
                except zinf_compile.ZinfError as err:
                    out["train"] = str(err)
            except BaseException as e:  # noqa: BLE001  (reported to the parent)
                out["error"] = repr(e)
            os.write(w, pickle.dumps(out))
            os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 120)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert ready, "the forked child hung; its threads' stacks after 60 s:\n" + (
            dump.read_text() if dump.exists() else "(no dump)")
        out = pickle.loads(os.read(r, 1 << 16))
        os.waitpid(pid, 0)
        assert "error" not in out, out
        assert out["equal"]
        assert "forked" in out["backward"] and "spawn" in out["backward"], out["backward"]
        assert "forked" in out["train"] and "spawn" in out["train"], out["train"]
        assert digests(tmp_path / ours[0]) == before
        assert torch.allclose(cm(x), ref(x), atol=1e-6)  # the parent goes on
        zinf_compile.reset()
        assert _folders(tmp_path) == []  # the child's folder too (it ended without exit handlers)
