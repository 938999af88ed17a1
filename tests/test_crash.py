"""Kills leave nothing behind: SIGTERM exits like a normal exit (the swap folder goes), and the
folder of a process killed outright (SIGKILL: nothing of it runs) is removed by the next zinf
process that uses the same offload folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

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
