"""The per-process folder of NVMe swap files: made on first use, removed at exit and on error."""
from __future__ import annotations

import _thread
import contextlib
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import weakref

from zinf_compile.errors import ZinfConfigError, ZinfError


_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def reap_dead(offload_dir: str) -> list[str]:
    """Remove the swap folders of this host's zinf processes that are gone (killed: no exit ran).
    A folder is recognised by its name alone, `zinf-<host>-<pid>-<token>`; another host's folders
    (a shared file system) and live processes' are left alone. Returns what it removed."""
    removed = []
    try:
        names = os.listdir(offload_dir)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "zinf" or parts[1] != _HOST or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid == os.getpid() or _alive(pid):
            continue
        path = os.path.join(offload_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _exit_on_sigterm() -> None:
    """SIGTERM (a job scheduler stopping the run) exits like Ctrl-C's normal exit: the interpreter
    unwinds, exit handlers run and the swap folder goes. Only where SIGTERM still has its default
    action and this is the main thread: a handler the program set stays its own."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            if not isinstance(sys.unraisablehook, _Redeliver):
                sys.unraisablehook = _Redeliver(sys.unraisablehook)
            _watch_exit()
    except (ValueError, OSError):
        pass


class Terminated(SystemExit):
    """The exit zinf's SIGTERM handler raises (status 128 + SIGTERM)."""


# Set once the interpreter has begun to exit (threading's exit hook, the first to run; atexit as a
# fallback): from then on no SIGTERM is handed on again (_ended), so none raises into the exit
# handlers (they remove the swap folder) by zinf's doing.
_exiting = False
_watching = False
# The exits the handler raised, while they live: weakrefs whose callback (_ended) sees each go.
_raised: set = set()


def _mark_exiting() -> None:
    global _exiting
    _exiting = True


def _watch_exit() -> None:
    global _watching
    if _watching:
        return
    _watching = True
    import atexit

    atexit.register(_mark_exiting)
    register = getattr(threading, "_register_atexit", None)  # before threads are joined (3.9+)
    if register is not None:
        try:
            register(_mark_exiting)
        except RuntimeError:  # already shutting down
            _mark_exiting()


def _on_sigterm(signum, frame):
    exit = Terminated(128 + signum)
    _raised.add(weakref.ref(exit, _ended))
    try:
        raise exit
    finally:  # no cycle (its traceback holds this frame): it ends as soon as nothing holds it
        del exit


def _ended(ref) -> None:
    """A Terminated the handler raised is gone. Its normal end is the top of the main thread, as
    the interpreter takes its status and exits: no Python frame is left there. Gone anywhere else,
    something swallowed it and the program goes on: C code that calls Python and clears whatever
    it raised (Dynamo's guards, evaluated at every call of a compiled function: a lambda guard that
    raises is a failed guard; PyObject_HasAttr...), Python ignoring an exception in a finalizer, or
    code catching SystemExit and dropping it. Then the SIGTERM is handed to the handler again."""
    _raised.discard(ref)
    if _exiting or sys._getframe().f_back is None:
        return
    _deliver_again()


def _deliver_again() -> None:
    """Run the SIGTERM handler again, from another thread a moment later (`_thread.interrupt_main`,
    no new OS signal: a no-op if SIGTERM has its default action again), so it runs once the main
    thread has left the code that swallowed the exit; if it lands in such code again, the new exit
    is handed on in turn. A bare thread (`_thread`): nothing here takes threading's locks, which the
    code that swallowed it may hold."""
    def later() -> None:
        time.sleep(0.002)
        if not _exiting:
            _thread.interrupt_main(signal.SIGTERM)

    try:
        _thread.start_new_thread(later, ())
    except RuntimeError:  # no new thread at interpreter shutdown: the process is exiting anyway
        pass


class _Redeliver:
    """sys.unraisablehook while zinf's SIGTERM handler is set. Python runs a signal handler at
    the next bytecode of the main thread, which may be inside a finalizer (`weakref.finalize`,
    `__del__`, a weakref callback), where an exception is ignored ("Exception ignored in ...") and
    the program goes on. A Terminated the handler raised arriving here is not printed: it is
    dropped once this returns, and its end hands the SIGTERM to the handler again (`_ended`).
    Everything else goes to the hook that was set before."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, Terminated) and any(ref() is exc for ref in list(_raised)):
            return
        self.previous(unraisable)


class SwapDir:
    """`<offload_dir>/zinf-<host>-<pid>-<token>/`, holding reusable swap files `swap-<n>.bin`.

    Files are reused: a file freed by one tensor is rewritten by the next, so a training loop opens
    a fixed set of files. Everything this object created (including missing parents of the offload
    directory) is removed by `close()`, which also runs at interpreter exit.
    """

    def __init__(self, offload_dir: str, o_direct: bool = False) -> None:
        self.offload_dir = offload_dir
        self._created: list[str] = []
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._fds: dict[int, int] = {}
        self._labels: dict[int, str] = {}  # fd -> what its file holds now, for error messages
        # fd -> its blocks' checksums (engine.py: block number -> (bytes, xxh3-64 digest)), reset when the
        # file is handed to a new record; and a lock per file for the writes that merge into a block
        self.sums: dict[int, dict[int, tuple[int, int]]] = {}
        self.sum_locks: dict[int, threading.Lock] = {}
        self.o_direct = o_direct
        try:
            missing = []
            p = offload_dir
            while not os.path.isdir(p):
                if os.path.exists(p):
                    raise NotADirectoryError(f"{p!r} exists and is not a directory")
                missing.append(p)
                p = os.path.dirname(p)
            for d in reversed(missing):
                try:
                    os.mkdir(d)
                except FileExistsError:  # another rank (or process) made it meanwhile: theirs
                    if not os.path.isdir(d):
                        raise NotADirectoryError(f"{d!r} exists and is not a directory") from None
                    continue
                self._created.append(d)
            reap_dead(offload_dir)
            self.path = os.path.join(offload_dir, f"zinf-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
            os.mkdir(self.path)
            self._created.append(self.path)
            probe = os.path.join(self.path, "probe")
            with open(probe, "wb") as f:
                f.write(b"zinf")
            os.remove(probe)
        except OSError as e:
            self._remove_created()
            raise ZinfConfigError(
                f"offload_dir {offload_dir!r} cannot be used for NVMe swap files: {e.strerror or e}"
                f" ({getattr(e, 'filename', None) or offload_dir}); pass a writable directory as "
                f"options={{'offload_dir': ...}}"
            ) from None
        if o_direct and not self._supports_o_direct():
            self.o_direct = False
        # runs on close(), when this object dies, or at interpreter exit, whichever comes first
        self._finalizer = weakref.finalize(self, SwapDir._cleanup, os.getpid(), self._fds, list(self._created))
        _exit_on_sigterm()

    def _supports_o_direct(self) -> bool:
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return False
        probe = os.path.join(self.path, "odirect-probe")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | flag, 0o600)
            os.close(fd)
            return True
        except OSError:
            return False  # e.g. tmpfs: fall back to buffered I/O
        finally:
            if os.path.exists(probe):
                os.remove(probe)

    def acquire(self, label: str = "an offloaded activation") -> tuple[int, int]:
        """A (file number, fd) to write one tensor into; `label` says what it holds (errors name it)."""
        with self._lock:
            if not self._finalizer.alive:
                raise ZinfError(f"the NVMe swap folder {self.path!r} was already closed")
            if self._free:
                n = self._free.pop()
                self._labels[self._fds[n]] = label
                self.sums[self._fds[n]] = {}
                return n, self._fds[n]
            n = len(self._fds)
            flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if self.o_direct else 0)
            try:
                fd = os.open(os.path.join(self.path, f"swap-{n}.bin"), flags, 0o600)
            except OSError as e:
                raise ZinfError(f"cannot create a swap file in {self.path!r}: {e.strerror}") from None
            self._fds[n] = fd
            self._labels[fd] = label
            self.sums[fd] = {}
            self.sum_locks[fd] = threading.Lock()
            return n, fd

    def release(self, n: int) -> None:
        with self._lock:
            if n in self._fds:
                self._free.append(n)

    def discard(self, fd: int) -> None:
        """Empty the file behind fd (its blocks go back to the file system) and forget its
        checksums; it stays open and owned, to be written from offset 0 again."""
        lock = self.sum_locks.get(fd)
        with lock if lock is not None else contextlib.nullcontext():
            try:
                os.ftruncate(fd, 0)
            except OSError as e:
                raise ZinfError(f"cannot empty {self.describe(fd)}: {e.strerror}") from None
            self.sums[fd] = {}

    def describe(self, fd: int) -> str:
        """'<path> (<what it holds>)' for the file behind fd, for error messages."""
        n = next((k for k, v in self._fds.items() if v == fd), None)
        path = os.path.join(self.path, f"swap-{n}.bin") if n is not None else f"fd {fd}"
        return f"{path} ({self._labels.get(fd, 'unknown contents')})"

    def file_count(self) -> int:
        return len(self._fds)

    def files_in_use(self) -> int:
        """Files holding something (released ones stay open in the pool for reuse)."""
        with self._lock:
            return len(self._fds) - len(self._free)

    def close(self) -> None:
        self._finalizer()

    def disown(self) -> None:
        """In a forked child: this folder is the parent's; never close, reuse or remove it here."""
        self._finalizer.detach()
        self._free = []

    def _remove_created(self) -> None:
        for d in reversed(self._created):
            shutil.rmtree(d, ignore_errors=True)
        self._created.clear()

    @staticmethod
    def _cleanup(owner_pid: int, fds: dict[int, int], created: list[str]) -> None:
        if os.getpid() != owner_pid:
            return  # a forked child exiting: the folder is the parent's
        if created:  # forked children that ended without exit handlers (multiprocessing): theirs too
            reap_dead(os.path.dirname(created[-1]))
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        fds.clear()
        # the session folder first, then the parents this process made, if they are empty
        for d in reversed(created):
            if d == created[-1]:
                shutil.rmtree(d, ignore_errors=True)
            else:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
