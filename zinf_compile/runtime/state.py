"""Everything zinf holds between compiles in one process, with one owner: `RUNTIME`.

  engines   offload engines by key (I/O threads, swap folders): one per option set, shared by the
            compiles made with those options; closed (files removed) when nothing uses them any
            more (`Runtime.collect`: no live compiled function, parameter, optimizer state or
            activation in flight), by `reset()` and at exit
  store     the parameter store: which parameters are managed, their shards, gradients and files
  pins      the parameters a live compiled function reads directly (never taken over meanwhile)
  warned    one-time warnings already given
  optimizers  the zinf optimizers alive (weakly): reset moves their states home first

Everything else a compile needs travels as plain values (the backend's `Session`, the `Plan`); the
records of what each compile planned are `zinf_compile.records` (inspection only, cleared too).
`zinf_compile.reset()` is `RUNTIME.reset()`: compiled code dropped first (nothing can run on state
being torn down), then every managed parameter gets its data back, then the engines go.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref

from zinf_compile.errors import ZinfError
from zinf_compile.runtime.engine import OffloadEngine
from zinf_compile.runtime.params import ParamStore


class Engines:
    """Offload engines by key."""

    def __init__(self) -> None:
        self._by_key: dict[int, OffloadEngine] = {}
        self._lock = threading.Lock()
        # key -> the compiled functions' tokens using it (weakly); an engine no compile has held
        # yet (its compile still running) is never collected
        self._users: dict[int, weakref.WeakSet] = {}

    def hold(self, key: int, owner: object) -> None:
        """`owner` (a compiled function's token) uses engine `key` while it lives."""
        with self._lock:
            self._users.setdefault(key, weakref.WeakSet()).add(owner)

    def idle(self, busy_keys: set[int]) -> list[OffloadEngine]:
        """Take out the engines a compile held once, that no live compiled function holds now,
        with nothing in flight and no file in their swap folder, and not in `busy_keys`."""
        with self._lock:
            out = [eng for k, eng in self._by_key.items()
                   if k in self._users and not self._users[k] and k not in busy_keys
                   and eng.live_tickets() == 0 and (eng._swap is None or eng._swap.files_in_use() == 0)]
            for eng in out:
                del self._by_key[eng.key]
                del self._users[eng.key]
            return out

    def register(self, key: int, tier: str, offload_dir: str, io_threads: int, o_direct: bool) -> OffloadEngine:
        with self._lock:
            eng = self._by_key.get(key)
            if eng is None:
                eng = OffloadEngine(key, tier, offload_dir, io_threads, o_direct)
                self._by_key[key] = eng
            return eng

    def get(self, key: int) -> OffloadEngine:
        try:
            return self._by_key[key]
        except KeyError:
            raise ZinfError(f"zinf: no offload engine #{key} in this process (compiled code from another, "
                            "or run after zinf_compile.reset()?)") from None

    def values(self) -> list[OffloadEngine]:
        return list(self._by_key.values())

    def close(self) -> None:
        """Close every engine: stop its I/O threads, remove its swap files."""
        with self._lock:
            engines, self._by_key = list(self._by_key.values()), {}
            self._users.clear()
        for eng in engines:
            eng.close()


class Pins:
    """Parameters that compiled functions read directly, pinned while such a function lives.

    A compile's token lives in the closure of the function the backend returns (Dynamo keeps code
    and closure, not the function object): `torch._dynamo.reset()` drops it, and the pins with it."""

    def __init__(self) -> None:
        self._tokens: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._by_pid: dict[int, set[int]] = {}  # pid -> tokens of the live functions reading it

    def token(self, token: object) -> int:
        self._tokens[id(token)] = token
        return id(token)

    def owner(self, token: int) -> object | None:
        """The token object itself while its compiled function lives (things tied to its life
        hang on it: the compile's records)."""
        return self._tokens.get(token)

    def pin(self, pids, token: int) -> None:
        for pid in pids:
            self._by_pid.setdefault(pid, set()).add(token)

    def pinned(self, pid: int) -> bool:
        live = {t for t in self._by_pid.get(pid, ()) if t in self._tokens}
        if live:
            self._by_pid[pid] = live
        else:
            self._by_pid.pop(pid, None)
        return bool(live)

    def clear(self) -> None:
        self._by_pid.clear()


class Runtime:
    def __init__(self) -> None:
        self.engines = Engines()
        self.store = ParamStore()
        self.pins = Pins()
        self.warned: set[str] = set()
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()  # zinf optimizers alive

    def collect(self, keep: int | None = None) -> int:
        """Close the engines nothing uses any more (their I/O threads stop, their swap folders go):
        run when a compile starts (`keep`: its engine; not from a finalizer when a compiled function
        dies: the garbage collector may run inside a lock this takes). An engine
        whose key a managed parameter carries stays (a CPU-tier shard has no file but gathers
        through it). Returns how many closed."""
        busy = {e.engine_key for e in self.store.entries()}
        if keep is not None:
            busy.add(keep)
        idle = self.engines.idle(busy)
        for eng in idle:
            eng.close()
        return len(idle)

    def reset(self) -> None:
        """Back to a fresh process: compiled functions dropped (torch._dynamo.reset()), every
        managed parameter given its data back (gathered from its shards: a collective under a
        process group, so every rank calls it), engines closed and their files removed, pins,
        warnings and compile records forgotten. An optimizer made before it steps whatever is
        managed after it (its layout is looked up at every step)."""
        import torch

        from zinf_compile import records

        torch._dynamo.reset()
        self.pins.clear()
        failed = []
        for e in self.store.entries():
            try:
                self.store.release_id(e.index)
            except Exception as err:  # the others still get theirs back
                failed.append(f"{e.name}: {err}")
        self.store.forget_all()
        for opt in list(self.optimizers):  # their states leave the tiers' files while those are open
            try:
                opt._sync(run_pending=False)
            except Exception as err:
                failed.append(f"an optimizer's state: {err}")
        self.engines.close()
        self.warned.clear()
        records.reset()
        if failed:
            warnings.warn("zinf: reset could not give these parameters their data back: " + "; ".join(failed),
                          stacklevel=2)


    def after_fork_in_child(self) -> None:
        """A forked child (DataLoader workers, multiprocessing): fresh locks and I/O threads, its
        own swap folders; the parent's files are read-only here (runtime/engine.py)."""
        self.engines._lock = threading.Lock()
        for eng in self.engines.values():
            eng.after_fork_in_child()
        self.store._lock = threading.RLock()
        self.store._fetches.clear()  # the parent's reads in flight: void here
        for e in self.store.entries():
            e.lock = threading.Lock()
        for opt in list(self.optimizers):
            opt.after_fork_in_child()
        recs = sys.modules.get("zinf_compile.records")  # imports nothing in the at-fork hook
        if recs is not None:
            recs._lock = threading.Lock()
        _inductor_after_fork_in_child()


def _inductor_after_fork_in_child() -> None:
    """Inductor's thread pool for C++ compiles (`AsyncCompile.pool`, memoized) survives a fork
    with none of its threads: torch's own at-fork hook resets only its process pool. A compile in
    the child (a DataLoader worker recompiles: its torch.set_num_threads(1) fails Dynamo's guard on
    the thread count) submitted to it and waited forever: the executor's idle count, left by the
    parent's finished workers, let it start no thread (docs/decisions.md, "Fork safety").
    Not imported here if the parent never compiled: then nothing to reset."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


RUNTIME = Runtime()
os.register_at_fork(after_in_child=RUNTIME.after_fork_in_child)
STORE = RUNTIME.store


def register_engine(key: int, *args, **kwargs) -> OffloadEngine:
    """The engine of an option set (Engines.register), for a compile starting now; the engines
    nothing uses any more close first."""
    RUNTIME.collect(keep=key)
    _forget_shape_envs()
    return RUNTIME.engines.register(key, *args, **kwargs)


def _forget_shape_envs() -> None:
    """Clear the caches torch keeps on ShapeEnv's methods (functools.lru_cache on the class, keyed
    by the instance): they hold every earlier compile's ShapeEnv, and through it its fake tensors
    and Dynamo's sources, after the compiled code is gone (measured: ~0.7 MiB per compile of a
    2-layer GPT, as zinf's planning calls evaluate_expr thousands of times). A new compile has a
    new ShapeEnv, so nothing cached for an old one can serve it: clearing costs no hit."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for attr in vars(ShapeEnv).values():
        clear = getattr(attr, "cache_clear", None) or getattr(getattr(attr, "__wrapped__", None), "cache_clear", None)
        if callable(clear):
            clear()


get_engine = RUNTIME.engines.get


def close_all() -> None:
    """Close every engine (stop I/O threads, remove swap files). Runs at exit too."""
    RUNTIME.engines.close()


atexit.register(close_all)
