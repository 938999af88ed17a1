"""The optimizer for a model zinf compiles: each parameter is stepped where it lives.

    model = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme"})
    opt = zinf_compile.optim.optimizer(model, torch.optim.AdamW, lr=1e-3)
    for batch in data:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()

The optimizer is made before the first forward, when zinf manages nothing yet: which parameters it
manages (their data and gradient shards in the parameter store, their storage freed) is known only
after the first compile. So the layout is decided lazily, at each `step()` (and `zero_grad()`,
`state_dict()`, ...): the parameters are looked up in the store and, when the managed set differs
from the last one, the inner optimizers are rebuilt and the state carried over (through the same
per-parameter form `state_dict` uses; from the NVMe tier that reads the states into memory, so keep
rebuilds rare -- in a normal run there is one, at the first step).

  nothing managed       one inner `cls(params, **kwargs)`; every call is delegated to it, so results,
                        `state`, `param_groups` and `state_dict()` are exactly torch's.
  resident parameters   an inner `cls(resident, **kwargs)`.
  managed, "cpu" tier   an inner `cls(shards, **kwargs)` over the flat shard tensors of the store
                        (`entry.shard`); each step hands them their gradient shards. Elementwise
                        optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) compute on the flat
                        shard exactly what they compute on the whole parameter.
  managed, "nvme" tier  streamed (ZeRO-Infinity's pipelined optimizer swapper). Any elementwise
                        optimizer: per chunk of `chunk_elems` elements, the parameter, gradient and
                        per-element states (momentum_buffer, sum, ...) are read from their files and
                        stepped by an instance of the optimizer's own class over that chunk (its
                        other states, e.g. step, kept in memory), then written back; one chunk at a
                        time, not overlapped. Adam and AdamW take a faster path:
                        per parameter the flat shard is processed in chunks of `chunk_elems`; for
                        each chunk the parameter, gradient and states are read from their files, the
                        chunk is stepped by torch's own functional Adam (`torch.optim.adam.adam`, the
                        path `torch.optim.AdamW.step` takes), and written back. The read of chunk i+1
                        and the write of chunk i-1 run in threads while chunk i computes: three chunk
                        buffers in memory, whatever the model's size.

A step is all or nothing. The NVMe tier writes each record's new values (parameter, states) into
the record's second file (its spare slot), never over the values it reads; only when every chunk of
every parameter is written do the in-memory steps (resident parameters, CPU tier) run and the NVMe
records switch slots (integer swaps), with SIGINT/SIGTERM held back until the switch is done. So
an I/O error (a full disk) or Ctrl-C during a step leaves every parameter and state as the previous
step left them; the error says so, and calling step() again continues bit-identically (the
gradients are only read). The cost: the spare slots, one more shard-sized file per NVMe record
(parameter and each state: 3 x the shard for Adam); no extra I/O.

Committing per parameter (`commit="param"`), for a disk that cannot hold those spares: each
NVMe-tier parameter is stepped into its spare slots and committed at once (signals held), and its
old slots are emptied (truncated: their blocks go back to the file system) before the next
parameter is written. The disk then holds parameters + gradients + states + one parameter's
spare records (the largest), instead of twice the parameters and states. A step that fails
part-way (a full disk, Ctrl-C) leaves the parameters it committed stepped and the others (and the
resident and CPU-tier ones, stepped last) as they were; the error says how many. Calling step()
again steps only what is left, so training still continues bit-identically; `zero_grad()` instead
gives the rest of that step up (the model then holds a half-applied step). A parameter committed
by the failed attempt that gets more gradient before the retry is refused (ZinfError). Not with
`step_in_backward` (its new values wait for step() beside the old ones).

Stepping in backward (`step_in_backward=True`; ZeRO-Offload/Infinity overlap the optimizer with
the backward). Without it, a step with parameters in the NVMe tier writes each gradient to its file
in the backward and reads it back in step(). With it, each NVMe-tier parameter is stepped inside
the backward, in the reduce that makes its gradient whole: its parameter and states are read, the
gradient is taken from memory, and the new parameter and states are written to the records' spare
slots, exactly as step() would write them -- the gradient never reaches its file (2 x the gradient's
bytes less I/O per parameter per step; bench/training.py measures it). Resident and CPU-tier
parameters (whose gradients are in memory anyway) are stepped in step() as before.

  When the update becomes visible: at `opt.step()`, which commits it (the slot switch above, with
  the in-memory steps) and steps whatever was not stepped in backward. Until then every read of
  a parameter (a later gather in the same backward, a tied weight's second use, `state_dict()`,
  `opt.state`) sees the previous step's values. A backward that fails midway (an exception, an I/O
  error, Ctrl-C) commits nothing: step() then refuses (ZinfError) and drops what that backward
  wrote, so the parameters and states stay as the previous step left them; `zero_grad()` drops it
  too, as it drops gradients.
  When a gradient is whole: a parameter's gradient may come in several reduces per step (a weight
  used by two compiled graphs, a tiled weight's tiles, eager reads, gradient accumulation over
  several backward calls). The optimizer counts them in each step and steps a parameter in the
  next steps at the reduce that reaches that count (earlier ones go to the gradient file as
  without the option, and the last reads it back). So the first step after the parameters are
  taken over runs as without the option; a parameter getting fewer reduces than counted is simply
  stepped in step() from its file (and counted anew); one getting more -- after it was stepped --
  raises ZinfError in the backward and abandons the step: parameters and states as the previous
  step left them, this step's gradients lost (zero_grad() and run it again; the count is learned
  anew).
  Overlap (`overlap=True`, the default): the reduce hands the step to the optimizer's own worker
  thread (one, so steps run in the order their gradients were completed) and returns; the backward
  computes on while the worker reads the parameter and states, steps and writes (its torch ops use
  the caller's torch.get_num_threads(); its file I/O the optimizer's I/O threads). The step gets a
  gradient of its own: a copy of the reduce's (which may alias a buffer the graph reuses once the
  reduce returns), or, when earlier parts went to the file, the sum read back from it. The end of
  the backward (autograd's final callback) waits for every queued step, so a failure on the worker
  (a full disk) is raised from the backward (or already at the next reduce that would step), with
  the same guarantees as above; step(), zero_grad() and state changes wait for them too.
  `overlap=False` steps inside the reduce instead, the backward waiting (bench/training.py
  compares the two).
  Memory: a step in backward streams the parameter in chunks through a ring of buffers of at most
  1/16 of the budget (IN_BACKWARD_SHARE; `chunk_elems` overrides), allocated at the backward's
  first step, reused by the next ones (grown to the widest) and freed at the backward's end; it
  adds to the backward's memory, which the plan does not count. With overlap, the gradients held
  by queued steps are bounded by the ring's size too (a reduce waits in the backward until earlier
  steps free room; a gradient larger than that waits until the queue is empty and goes alone), so
  a backward holds at most twice the ring's size, or one ring and one gradient larger than it.
  Numerics: bit-identical to the same optimizer without the option, hence to torch.optim on the
  whole parameters (the same arithmetic on the same values, chunk by chunk).
  Refused (ZinfError): clipping by global norm (`clip_grad_norm_`, `total_norm` of these
  parameters: the norm needs every gradient before any parameter steps), optimizers whose update is
  not elementwise (at construction), `differentiable`/`capturable`, and hyperparameters changed
  between the backward and step() (set the learning rate before the forward, or step a scheduler
  after step(), as usual). After a step, a parameter stepped in backward has no gradient to read.

Hyperparameters are read from `param_groups` at each step, so the user or an LR scheduler may change
them between steps (`ZinfOptimizer` is a `torch.optim.Optimizer` for the schedulers' sake).

Gradients: a managed parameter's gradient is its shard's in the store; `p.grad` stays None. Frozen
parameters (or any without a gradient this step) are skipped, as torch does.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from zinf_compile.errors import ZinfError
from zinf_compile.runtime.params import Entry, world
from zinf_compile.runtime.state import RUNTIME, STORE

__all__ = ["ZinfOptimizer", "optimizer", "DEFAULT_CHUNK_ELEMS"]

# Elements per chunk of the NVMe-tier optimizer: 2M fp32 elements are 8 MiB per tensor per chunk,
# ~100 MiB for the three chunk buffers of Adam (param, grad, exp_avg, exp_avg_sq). A multiple of
# 4096 elements keeps every chunk's byte offset aligned for O_DIRECT whatever the dtype.
DEFAULT_CHUNK_ELEMS = 2 << 20
_ALIGN_ELEMS = 4096
_RING = 3  # chunk buffers: one reading, one computing, one writing
# step_in_backward: the ring of chunk buffers of a step taken inside the backward takes at most this
# fraction (1/N) of the budget (by default; chunk_elems overrides): the graph's memory is live there
IN_BACKWARD_SHARE = 16
_NVME_STATES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_FORWARD_KEYS = ("params", "param_names")  # group keys that are not hyperparameters


def optimizer(model, cls: type, *, chunk_elems: int | None = None, step_in_backward: bool = False,
              overlap: bool = True, commit: str = "step", **kwargs) -> "ZinfOptimizer":
    """An optimizer of class `cls` over `model`'s parameters (a module, possibly compiled, or an
    iterable of parameters / param-group dicts), stepping managed parameters where they live.

    `chunk_elems`: elements per chunk of the NVMe tier's streamed step (a multiple of 4096). By
    default the ring of chunk buffers takes at most half the budget its parameters were planned
    under (the step runs between training steps, when the graphs' memory is free), and at most
    DEFAULT_CHUNK_ELEMS. `step_in_backward`: step each NVMe-tier parameter in the backward, as soon
    as its gradient is whole, instead of writing the gradient to its file and reading it back at
    step() (see "Stepping in backward" in the module's docstring); `overlap` (with it): those steps
    run on the optimizer's own thread while the backward continues (False: inside the reduce, the
    backward waiting); `commit`: "step" (all or nothing per step) or "param" (each NVMe-tier
    parameter committed as soon as it is written: the disk holds one parameter's spare records
    instead of every parameter's; see "Committing per parameter" in the module's docstring); the
    other keyword arguments go to `cls`."""
    return ZinfOptimizer(model, cls, chunk_elems=chunk_elems, step_in_backward=step_in_backward, overlap=overlap,
                         commit=commit, **kwargs)


def _supported_nvme() -> tuple[type, ...]:
    return (torch.optim.Adam, torch.optim.AdamW)


def _whole_param_classes() -> tuple[type, ...]:
    """Optimizers whose update is not elementwise: they cannot step a flat shard."""
    names = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def _scalar_dtype(fused) -> torch.dtype:
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype(is_fused=fused)
    except ImportError:  # pragma: no cover
        return torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64


def _per_element(key, value) -> bool:
    """A state value with one element per parameter element (exp_avg, momentum_buffer, ...), as
    opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() >= 1


def _full_to_shard(value: torch.Tensor, e: Entry) -> torch.Tensor:
    """This rank's flat shard of a whole (parameter-shaped) tensor, zero-padded."""
    flat = value.detach().reshape(-1)
    if flat.numel() != e.numel:
        raise ZinfError(f"zinf: a state of {e.name!r} has {flat.numel()} elements; the parameter has {e.numel}")
    return e.slice_of(flat)


def _cast_like(param: torch.Tensor, key, value, group: dict):
    """torch's policy when loading optimizer state (`_process_value_according_to_param_policy`):
    floating states take the parameter's dtype and device; `step` stays as it is unless fused or
    capturable. Always a fresh tensor here (never aliasing what was loaded)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            out = value.to(dtype=torch.float32, device=param.device)
        else:
            out = value
    elif param.is_floating_point():
        out = value.to(dtype=param.dtype, device=param.device)
    else:
        out = value.to(device=param.device)
    return out.clone() if out is value else out


@dataclass
class _Layout:
    key: tuple
    plain: bool = True
    res_opt: torch.optim.Optimizer | None = None
    res_groups: list = field(default_factory=list)  # facade group index of each inner group
    cpu_opt: torch.optim.Optimizer | None = None
    cpu_groups: list = field(default_factory=list)
    cpu: list = field(default_factory=list)  # (group index, param, entry)
    nvme: list = field(default_factory=list)  # (group index, param, entry)
    where: dict = field(default_factory=dict)  # id(param) -> (kind, entry, group index)


@dataclass
class _NvmeState:
    step: int = 0  # steps taken (torch's state["step"]); 0: the states are zeros, never read
    names: tuple = ()  # state files written (per-element states)
    scalars: dict = field(default_factory=dict)  # other optimizers' other states (step, mu_product, ...)


class ZinfOptimizer(torch.optim.Optimizer):
    """See the module's docstring. Made by `optimizer(model, cls, **kwargs)`."""

    def __init__(self, model, cls: type, *, chunk_elems: int | None = None, step_in_backward: bool = False,
                 overlap: bool = True, commit: str = "step", **kwargs) -> None:
        # torch.optim.Optimizer.__init__ is not called: every torch optimizer behaviour is an inner
        # optimizer's. The hook tables are there for the methods inherited from the base class.
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"zinf: optimizer class must be a torch.optim.Optimizer subclass, got {cls!r}")
        if isinstance(model, nn.Module):
            params = list(model.parameters())
        else:
            params = list(model)
        if params and not isinstance(params[0], dict):
            params = list(dict.fromkeys(params))  # tied parameters: one object, stepped once
        self._cls = cls
        self._kwargs = dict(kwargs)
        self._plain = cls(params, **kwargs)  # holds the param groups the user sees, and steps when nothing is managed
        self._layout = _Layout(key=self._unmanaged_key())  # what the plain optimizer covers
        self._nvme_state: dict[int, _NvmeState] = {}  # id(entry) -> its streamed state (entries are held by the layout)
        self._pending: list[Callable[[], None]] = []  # state loads waiting for the layout (checkpoint.py)
        self._pool: ThreadPoolExecutor | None = None
        # id(entry) -> {"param" or a state name: fd}: each NVMe record's second slot, written by a
        # step and switched to when the step is complete (the entry owns the files: file_nos)
        self._spare: dict[int, dict[str, int]] = {}
        if chunk_elems is not None and (int(chunk_elems) <= 0 or int(chunk_elems) % _ALIGN_ELEMS):
            raise ZinfError(f"zinf: chunk_elems must be a positive multiple of {_ALIGN_ELEMS}, got {chunk_elems}")
        self.chunk_elems = chunk_elems  # None: from the budget its parameters were planned under
        self.step_in_backward = bool(step_in_backward)
        if self.step_in_backward:
            _check_in_backward_class(cls, kwargs)
        if commit not in ("step", "param"):
            raise ZinfError(f"zinf: commit must be 'step' (all or nothing) or 'param' (per parameter), got {commit!r}")
        if commit == "param" and self.step_in_backward:
            raise ZinfError("zinf: commit='param' commits each parameter in step() as soon as it is written; with "
                            "step_in_backward=True the new values are written during the backward and must wait "
                            "for step() beside the old ones, so it would save no disk: use one or the other")
        self.commit = commit
        # commit="param": id(entry) -> its grad_writes when this step (not yet finished) committed it
        self._stepped: dict[int, int] = {}
        self._bw = _BackwardSteps()
        self.overlap = bool(overlap)  # steps in backward on the queue's worker thread (else in the reduce)
        self._queue = _StepQueue()
        # what the last step() committed: NVMe-tier parameters stepped in backward / in step()
        self.last_step_counts = {"in_backward": 0, "in_step": 0}
        RUNTIME.optimizers.add(self)  # zinf_compile.reset() brings its states home before the files go
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    # -- what torch.optim.Optimizer users touch -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The groups (dicts) whose hyperparameters apply to every parameter, wherever it lives."""
        return self._plain.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self._plain.defaults

    @property
    def state(self):
        """torch's `state` when nothing is managed; otherwise a read-only mapping param -> state,
        where a managed parameter's states are this rank's flat shard (shaped like the parameter
        with one process), read from the files for the NVMe tier."""
        self._sync()
        if self._layout.plain:
            return self._plain.state
        return _StateView(self)

    @property
    def inner_class(self) -> type:
        return self._cls

    def __repr__(self) -> str:
        return f"ZinfOptimizer({self._cls.__name__}) over " + repr(self._plain)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._plain.add_param_group(param_group)  # the layout is rebuilt at the next step

    def step(self, closure=None):
        for hook in list(self._optimizer_step_pre_hooks.values()):
            res = hook(self, (), {})
            if res is not None:
                raise ZinfError("zinf: step pre-hooks that change arguments are not supported")
        self._sync()
        lay = self._layout
        if lay.plain:
            loss = self._plain.step(closure)
        else:
            self._check_managed_class()
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            settled = STORE.settle_backward()  # a backward that did not complete: its gradients rolled back
            self._settle()  # the steps queued in backward: done (normally already, at the backward's end)
            self._check_backward_steps()
            self._check_backward_completed(settled)
            self._push_hyper()
            # All or nothing: the NVMe tier (the only part doing I/O) writes its new values beside
            # the old ones first (some already did, in backward: self._bw); only when all are
            # written do the in-memory steps run and the NVMe records switch slots, with Ctrl-C and
            # SIGTERM held back until that is done.
            work = self._nvme_prepare() if lay.nvme else []
            if self.step_in_backward:  # how many reduces made each gradient: the next steps step there
                for w in work:
                    if w.entry.reduces:
                        self._bw.expect[id(w.entry)] = w.entry.reduces
            n_work = len(work)
            if work and self.commit == "param":
                self._nvme_step_each(work)
                work = []  # each committed already
            elif work:
                self._nvme_step(work)
            with _deferred_signals():
                _point("step:commit")
                try:
                    if lay.res_opt is not None:
                        lay.res_opt.step()
                    if lay.cpu_opt is not None:
                        self._cpu_step()
                except BaseException:
                    self._keep_spares(work)  # not an I/O error: torch's own, raised as it is
                    raise
                self._nvme_commit(work)
                done = list(self._bw.work.values())
                self._nvme_commit(done)
                for w in done:
                    w.entry.reduces = 0  # its gradient was taken: the next step counts afresh
                self._bw.clear()
                self._stepped.clear()
            self.last_step_counts = {"in_backward": len(done), "in_step": n_work}
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resident parameters as torch does. Managed parameters' gradient shards are cleared;
        with set_to_none=False the CPU tier's are zeroed in place as torch would (the NVMe tier's
        are cleared all the same: a step then skips a parameter that got no new gradient, where
        torch would step it with a zero gradient)."""
        self._sync(run_pending=False)
        lay = self._layout
        if lay.plain:
            self._plain.zero_grad(set_to_none)
            return
        if lay.res_opt is not None:
            lay.res_opt.zero_grad(set_to_none)
        STORE.settle_backward()  # before the in-place zeroing below, which it would mark partial
        entries = []
        for _, _, e in lay.cpu:
            if not set_to_none and e.has_grad and e.grad is not None:
                e.grad.zero_()
                e.grad_partial = False
            else:
                entries.append(e)
        entries += [e for _, _, e in lay.nvme]
        self._stepped.clear()  # a step that failed half-way (commit="param") is given up
        self._queue.drain()  # no step queued in backward still running while its gradient goes
        STORE.zero_grad(entries)

    def state_dict(self) -> dict[str, Any]:
        """torch's format. With nothing managed, the inner optimizer's own. Otherwise states are
        keyed by parameter index (as torch numbers them); a managed parameter's states are read
        into CPU tensors (from the files for the NVMe tier), shaped like the parameter with one
        process. With several processes each rank's are its flat shards, and the dict says so
        under "zinf". For big models, `zinf_compile.checkpoint.save_checkpoint` streams instead."""
        self._sync()
        if self._layout.plain:
            return self._plain.state_dict()
        packed = self._plain.state_dict()  # the plain optimizer holds no state once rebuilt
        state, sharded = {}, []
        for idx, p in enumerate(self._all_params()):
            got = self._export_param_state(p)
            if got is None:
                continue
            form, st = got
            state[idx] = self._present(p, form, st)
            if form == "shard" and world()[1] > 1:
                sharded.append(idx)
        out = {"state": state, "param_groups": packed["param_groups"]}
        if sharded:
            rank, size = world()
            out["zinf"] = {"world": size, "rank": rank, "sharded": sharded}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of `state_dict()`; also loads a plain torch optimizer's state dict (whole
        tensors: each managed parameter takes its shard of them)."""
        self._sync()
        if self._layout.plain:
            self._plain.load_state_dict(state_dict)
            return
        meta = state_dict.get("zinf") or {}
        sharded = set(meta.get("sharded", ()))
        if sharded and (meta.get("world"), meta.get("rank")) != (world()[1], world()[0]):
            raise ZinfError(
                f"zinf: this optimizer state dict holds rank {meta.get('rank')}'s shards of a "
                f"{meta.get('world')}-process run; this is rank {world()[0]} of {world()[1]}")
        # hyperparameters and the group checks: torch's own code, on the plain optimizer (stateless)
        self._plain.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._plain.state.clear()
        self._clear_state()
        params = self._all_params()
        for idx, st in state_dict["state"].items():
            if not isinstance(idx, int) or not 0 <= idx < len(params):
                raise ZinfError(f"zinf: optimizer state dict has state for parameter #{idx!r}, which this "
                                f"optimizer does not have ({len(params)} parameters)")
            self._import_param_state(params[idx], "shard" if idx in sharded else "full", st)

    # -- layout ----------------------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        out, seen = [], set()
        for g in self._plain.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _layout_key(self) -> tuple:
        key = []
        for gi, g in enumerate(self._plain.param_groups):
            for p in g["params"]:
                e = STORE.entry(p)
                key.append((gi, id(p), None if e is None else (id(e), e.tier)))
        return tuple(key)

    def _unmanaged_key(self) -> tuple:
        return tuple((gi, id(p), None) for gi, g in enumerate(self._plain.param_groups) for p in g["params"])

    @staticmethod
    def _layout_key_managed(key: tuple) -> bool:
        return any(k[2] is not None for k in key)

    def _any_managed(self) -> bool:
        return self._layout_key_managed(self._layout_key())

    def _sync(self, run_pending: bool = True) -> None:
        """Rebuild the inner optimizers if the managed set changed; then run pending state loads
        (not from zero_grad: a loop may call it before the first forward manages anything)."""
        key = self._layout_key()
        if key != self._layout.key:
            if self._layout.plain and not self._layout_key_managed(key):
                self._layout.key = key  # still nothing managed (a group was added): still torch's own
            else:
                self._rebuild(key)
        while run_pending and self._pending:
            self._pending.pop(0)()

    def _defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` after the next layout sync (a checkpoint loaded before the first compile: its
        states go straight to where the parameters will live)."""
        self._pending.append(fn)

    def _rebuild(self, key: tuple) -> None:
        old = self._layout
        lay = self._new_layout(key)
        carried, lost = [], []
        for p in self._all_params():
            was, now = old.where.get(id(p)), lay.where.get(id(p))
            if was and now and was[0] == now[0] == "nvme" and was[1] is now[1]:
                continue  # same entry, same files: its state stays where it is
            try:
                got = self._export_param_state(p)  # through the old layout
            except Exception as err:  # e.g. the engine holding its files was closed
                lost.append((p, err))
                continue
            if got is not None:
                carried.append((p, got))
        self._layout = lay
        self._plain.state.clear()
        for opt in (old.res_opt, old.cpu_opt):
            if opt is not None:
                opt.state.clear()
        keep = {id(e) for _, _, e in lay.nvme} & {id(e) for _, _, e in old.nvme}
        self._nvme_state = {i: r for i, r in self._nvme_state.items() if i in keep}
        self._spare = {i: r for i, r in self._spare.items() if i in keep}
        self._queue.drain()  # a failure stays recorded: step() raises it
        for i in [i for i in self._bw.work if i not in keep]:  # a parameter released since its step in backward
            del self._bw.work[i]
        # counts of reduces: only for entries still held (a new entry may reuse a dead one's id)
        self._bw.expect = {i: n for i, n in self._bw.expect.items() if i in keep}
        for p, (form, st) in carried:
            try:
                self._import_param_state(p, form, st)
            except Exception as err:
                lost.append((p, err))
        self._attach_sinks(old, lay)
        if lost:
            warnings.warn(f"zinf: the optimizer's layout changed (parameters taken over or released) and the "
                          f"state of {len(lost)} parameter(s) could not be carried over; they start afresh "
                          f"(first error: {lost[0][1]})", RuntimeWarning, stacklevel=3)

    def _new_layout(self, key: tuple) -> _Layout:
        groups = self._plain.param_groups
        lay = _Layout(key=key, plain=not self._layout_key_managed(key))
        if lay.plain:
            return lay
        res: dict[int, list] = {}
        cpu: dict[int, list] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in lay.where:
                    continue
                e = STORE.entry(p)
                if e is None:
                    res.setdefault(gi, []).append(p)
                    lay.where[id(p)] = ("res", None, gi)
                elif e.tier == "cpu":
                    cpu.setdefault(gi, []).append(e.shard)
                    lay.cpu.append((gi, p, e))
                    lay.where[id(p)] = ("cpu", e, gi)
                else:
                    lay.nvme.append((gi, p, e))
                    lay.where[id(p)] = ("nvme", e, gi)
        if res:
            lay.res_groups = sorted(res)
            lay.res_opt = self._cls([dict(self._hyper(gi), params=res[gi]) for gi in lay.res_groups],
                                    **self._kwargs)
        if cpu:
            lay.cpu_groups = sorted(cpu)
            lay.cpu_opt = self._cls([dict(self._hyper(gi), params=cpu[gi]) for gi in lay.cpu_groups],
                                    **self._kwargs)
        return lay

    def _where(self, p: torch.Tensor) -> tuple[str, Entry | None, int]:
        if self._layout.plain:
            return "plain", None, -1
        got = self._layout.where.get(id(p))
        if got is None:
            raise ZinfError("zinf: this parameter is not one of the optimizer's")
        return got

    def _hyper(self, gi: int) -> dict[str, Any]:
        return {k: v for k, v in self._plain.param_groups[gi].items() if k not in _FORWARD_KEYS}

    def _push_hyper(self) -> None:
        """The facade's hyperparameters (changed by the user or a scheduler) into the inner ones."""
        lay = self._layout
        for opt, gis in ((lay.res_opt, lay.res_groups), (lay.cpu_opt, lay.cpu_groups)):
            if opt is None:
                continue
            for g, gi in zip(opt.param_groups, gis):
                g.update(self._hyper(gi))

    def _check_managed_class(self) -> None:
        lay = self._layout
        if (lay.cpu or lay.nvme) and issubclass(self._cls, _whole_param_classes()):
            raise ZinfError(
                f"zinf: {self._cls.__name__} needs whole parameters (its update is not elementwise), but "
                f"zinf manages parameters as flat shards; use an elementwise optimizer or params='resident'")

    def _clear_state(self) -> None:
        self._abandon_backward()  # steps taken in backward from the states being replaced
        lay = self._layout
        self._plain.state.clear()
        for opt in (lay.res_opt, lay.cpu_opt):
            if opt is not None:
                opt.state.clear()
        self._nvme_state.clear()

    # -- per-parameter state (state_dict, rebuilds and checkpoint.py go through these) ---------------
    def _export_param_state(self, p: torch.Tensor) -> tuple[str, dict] | None:
        """(form, state) of one parameter, or None without state. form "full": tensors shaped like
        the parameter (as torch keeps them); "shard": per-element states are this rank's flat
        shard (managed parameters). Live tensors, except NVMe states (read fresh)."""
        kind, e, _ = self._where(p)
        if kind == "plain":
            st = self._plain.state.get(p)
            return ("full", st) if st else None
        if kind == "res":
            st = self._layout.res_opt.state.get(p)
            return ("full", st) if st else None
        if kind == "cpu":
            st = self._layout.cpu_opt.state.get(e.shard)
            return ("shard", st) if st else None
        rec = self._nvme_state.get(id(e))
        if rec is None or rec.step == 0:
            return None
        g = self._plain.param_groups[self._layout.where[id(p)][2]]
        if self._fast():
            st = {"step": torch.tensor(float(rec.step), dtype=_scalar_dtype(g.get("fused")))}
        else:
            st = {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in rec.scalars.items()}
        for name in rec.names:
            buf = torch.empty(e.shard_numel, dtype=e.shard_dtype)
            e.engine.read_file(e.state_fd(name), buf)
            st[name] = buf
        return "shard", st

    def _present(self, p: torch.Tensor, form: str, st: dict) -> dict:
        """A state as the user sees it: with one process, shards are the whole parameter: reshape."""
        if form == "shard" and world()[1] == 1:
            return {k: (v.view(p.shape) if _per_element(k, v) and v.numel() == p.numel() else v)
                    for k, v in st.items()}
        return dict(st)

    def _import_param_state(self, p: torch.Tensor, form: str, st: dict) -> None:
        """Set one parameter's state from (form, state) as `_export_param_state` gives it (or a
        whole-tensor state from a plain torch optimizer)."""
        kind, e, gi = self._where(p)
        lay = self._layout
        if kind in ("plain", "res"):
            opt = self._plain if kind == "plain" else lay.res_opt
            group = self._plain.param_groups[gi] if gi >= 0 else self._group_of(p)
            out = {}
            for k, v in st.items():
                if form == "shard" and _per_element(k, v) and v.numel() != p.numel():
                    if world()[1] > 1:
                        raise ZinfError(f"zinf: cannot load a shard of a state into whole parameter {k!r} "
                                        f"across {world()[1]} processes (gather it first)")
                    v = v.reshape(-1)[: p.numel()]
                if _per_element(k, v):
                    v = v.reshape(p.shape)
                out[k] = _cast_like(p, k, v, group)
            opt.state[p] = out
            return
        group = self._plain.param_groups[gi]
        if kind == "cpu":
            out = {}
            for k, v in st.items():
                if _per_element(k, v):
                    v = _full_to_shard(v, e) if form == "full" else self._check_shard(v, e, k)
                out[k] = _cast_like(e.shard, k, v, group)
            lay.cpu_opt.state[e.shard] = out
            return
        if not self._fast():  # nvme, any other optimizer: per-element states to files, the rest to memory
            names, scalars = [], {}
            for k, v in st.items():
                if _per_element(k, v):
                    v = _full_to_shard(v, e) if form == "full" else self._check_shard(v, e, k)
                    e.engine.write_file(e.state_fd(k), v.detach().to(device="cpu", dtype=e.shard_dtype).contiguous())
                    names.append(k)
                else:
                    scalars[k] = _cast_like(e.shard if e.shard is not None else torch.empty(0, dtype=e.shard_dtype),
                                            k, v, group)
            self._nvme_state[id(e)] = _NvmeState(1 if st else 0, tuple(names), scalars)
            return
        # nvme: the states to their files, the step count to memory
        unknown = sorted(set(st) - {"step", *_NVME_STATES})
        if unknown:
            raise ZinfError(f"zinf: state {unknown} of {e.name!r} is not Adam's: the NVMe tier keeps "
                            f"{('step',) + _NVME_STATES}")
        step = st.get("step", 0)
        step = int(round(float(step.item() if isinstance(step, torch.Tensor) else step)))
        names = tuple(n for n in _NVME_STATES if n in st)
        if step and not {"exp_avg", "exp_avg_sq"} <= set(names):
            raise ZinfError(f"zinf: Adam state of {e.name!r} at step {step} lacks exp_avg / exp_avg_sq")
        for name in names:
            v = st[name]
            v = _full_to_shard(v, e) if form == "full" else self._check_shard(v, e, name)
            v = v.detach().to(device="cpu", dtype=e.shard_dtype).contiguous()
            e.engine.write_file(e.state_fd(name), v)
        self._nvme_state[id(e)] = _NvmeState(step, names)

    def _group_of(self, p: torch.Tensor) -> dict:
        for g in self._plain.param_groups:
            if any(q is p for q in g["params"]):
                return g
        return self._plain.param_groups[0]

    @staticmethod
    def _check_shard(v: torch.Tensor, e: Entry, key) -> torch.Tensor:
        if v.numel() != e.shard_numel:
            raise ZinfError(f"zinf: state {key!r} of {e.name!r} has {v.numel()} elements; this rank's shard "
                            f"has {e.shard_numel}")
        return v.reshape(-1)

    # -- stepping managed parameters ------------------------------------------------------------
    def _cpu_step(self) -> None:
        lay = self._layout
        given = []
        for _, _, e in lay.cpu:
            g = e.read_grad()
            if g is not None:
                e.shard.grad = g
                given.append(e.shard)
        try:
            if given:
                lay.cpu_opt.step()
        finally:
            for s in given:
                s.grad = None
        for _, _, e in lay.cpu:
            e.refresh_copy()  # a gather copy follows its stepped shard

    def _chunk(self, in_backward: bool = False) -> int:
        """Elements per chunk of the NVMe step: the user's `chunk_elems`, else the ring of chunk
        buffers (3 slots x param, grad and up to 3 states, fp32 at most) in half of the smallest
        budget this optimizer's NVMe parameters were planned under; in a backward (step_in_backward)
        in 1/IN_BACKWARD_SHARE of it: there it adds to the graph's memory, which the plan did not count."""
        if self.chunk_elems is not None:
            chunk = int(self.chunk_elems)
            if chunk <= 0 or chunk % _ALIGN_ELEMS:
                raise ZinfError(f"zinf: chunk_elems must be a positive multiple of {_ALIGN_ELEMS}, got {chunk}")
            return chunk
        budgets = [e.budget for _, _, e in self._layout.nvme if e.budget]
        if not budgets:
            return DEFAULT_CHUNK_ELEMS
        share = IN_BACKWARD_SHARE if in_backward else 2
        fit = min(budgets) // (share * _RING * 5 * 4) // _ALIGN_ELEMS * _ALIGN_ELEMS
        return max(_ALIGN_ELEMS, min(DEFAULT_CHUNK_ELEMS, fit))

    def after_fork_in_child(self) -> None:
        """In a forked child (RUNTIME's at-fork hook): the parent's worker threads do not exist
        here, and a job submitted to their executors would never run; the child gets its own when
        it steps (the NVMe tier's step is refused there: it writes the parent's files)."""
        self._pool = None
        self._queue = _StepQueue()

    @property
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="zinf-optim")
        return self._pool

    def _nvme_prepare(self) -> list["_Work"]:
        """The NVMe tier's work of this step: each parameter with a gradient, its states, and the
        files its new values go to (the spare slot of each record: never the files read)."""
        work = []
        for gi, _, e in self._layout.nvme:
            if not e.has_grad:
                continue
            if id(e) in self._bw.work:
                raise ZinfError(f"zinf: {e.name!r} was stepped in backward and got a gradient since (written "
                                "outside a backward?); call opt.zero_grad() and run the step again")
            if id(e) in self._stepped:  # committed by this step's earlier attempt (commit="param")
                if self._stepped[id(e)] != e.grad_writes:
                    raise ZinfError(f"zinf: {e.name!r} was stepped by a step() that failed part-way "
                                    "(commit='param') and got more gradient since; call opt.zero_grad() "
                                    "and run the step again")
                continue
            work.append(self._nvme_work(gi, e))
        return work

    def _nvme_work(self, gi: int, e: Entry) -> "_Work":
        """One NVMe parameter's step: its group, step count, states and the files they are read from."""
        g = self._plain.param_groups[gi]
        if g.get("differentiable") or g.get("capturable"):
            raise ZinfError("zinf: the NVMe tier's optimizer computes on the CPU: differentiable=True "
                            "and capturable=True are not supported there")
        rec = self._nvme_state.get(id(e)) or _NvmeState()
        if not self._fast():
            fds = {n: e.state_fds[n] for n in rec.names} if rec.step else {}
            return _Work(e, g, rec.step, rec.names if rec.step else (), fds, e.engine, {},
                         scalars=rec.scalars if rec.step else None)
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())
        if rec.step and not set(names) <= set(rec.names):
            raise ZinfError(f"zinf: {e.name!r} has no {set(names) - set(rec.names)} state (amsgrad "
                            "turned on after the first step?)")
        fds = {n: e.state_fds[n] for n in names if rec.step}  # made here, not in the I/O threads
        return _Work(e, g, rec.step, names, fds, e.engine, {})

    def _nvme_step(self, work: list["_Work"], chunk: int | None = None, chunk_ring: list | None = None) -> None:
        """Adam/AdamW over the NVMe tier's parameters, chunk by chunk, reads and writes overlapped
        with the arithmetic (the read of chunk i+1, the write of chunk i-1). Every new value goes
        to the record's spare file, never over the one read: until `_nvme_commit` switches the
        slots, the previous step's parameters and states are whole in their files. A failure
        here leaves them (and everything else) as they were: nothing was applied. `chunk_ring`:
        chunk buffers kept by the caller across calls (the steps of one backward), grown as needed."""
        chunk = chunk or self._chunk()
        try:
            for w in work:
                w.entry.complete_grad()  # a tiled parameter's gradient comes tile by tile: zeros where none came
                for name in ("param",) + w.names + _copy_of(w):
                    self._out_file(w, name)
            if not self._fast():
                self._generic_step(work, chunk)
                return
        except BaseException as err:
            self._keep_spares(work)
            raise self._nothing_applied(err) if isinstance(err, Exception) else err
        chunks = [(w, start, min(chunk, w.entry.shard_numel - start))
                  for w in work for start in range(0, w.entry.shard_numel, chunk)]
        width = max(w.entry.shard_dtype.itemsize for w in work) * min(chunk, max(w.entry.shard_numel for w in work))
        used = ("param", "grad") + tuple(n for n in _NVME_STATES if any(n in w.names for w in work))
        if chunk_ring is None:
            ring = [{n: torch.empty(width, dtype=torch.uint8) for n in used} for _ in range(min(_RING, len(chunks)))]
        else:  # the backward's ring, grown to the widest step so far (its steps run one at a time)
            while len(chunk_ring) < _RING:
                chunk_ring.append({})
            for slot in chunk_ring:
                for n in used:
                    if n not in slot or slot[n].numel() < width:
                        slot[n] = torch.empty(width, dtype=torch.uint8)
            ring = chunk_ring
        pool = self._executor
        reads: dict[int, tuple] = {}
        writes: dict[int, list] = {}

        def views(i):
            w, start, n = chunks[i]
            nbytes = n * w.entry.shard_dtype.itemsize
            slot = ring[i % len(ring)]
            return {k: slot[k][:nbytes].view(w.entry.shard_dtype) for k in ("param", "grad") + w.names}

        def submit_read(i):
            prev = writes.pop(i - len(ring), None)  # that chunk's buffers are this one's
            if prev:
                _wait_all(prev)
            w, start, n = chunks[i]
            v = views(i)
            off = start * w.entry.shard_dtype.itemsize
            futs = [pool.submit(w.engine.read_file, w.entry.fd, v["param"], off)]
            if w.grad is not None:  # stepping in backward: the gradient is in memory
                v["grad"].copy_(w.grad[start:start + n])
            else:
                futs.append(pool.submit(w.entry.read_grad_into, v["grad"], start))  # with a pending clip's scale
            for name in w.names:
                if w.step == 0:
                    v[name].zero_()  # torch starts its states at zeros; the files hold nothing yet
                else:
                    futs.append(pool.submit(w.engine.read_file, w.fds[name], v[name], off))
            reads[i] = (v, futs)

        def submit_write(i, v):
            w, start, n = chunks[i]
            off = start * w.entry.shard_dtype.itemsize
            writes[i] = [pool.submit(w.engine.write_file, w.out[name], v[name], off)
                         for name in ("param",) + w.names]
            if _copy_of(w):  # the gather copy of the new values, beside the old copy like every record
                writes[i].append(pool.submit(w.engine.write_file, w.out["copy"], v["param"].to(w.entry.gather_dtype),
                                             start * w.entry.gather_dtype.itemsize))

        try:
            submit_read(0)
            for i in range(len(chunks)):
                v, futs = reads.pop(i)
                _wait_all(futs)
                if i + 1 < len(chunks):
                    submit_read(i + 1)
                w = chunks[i][0]
                _adam_chunk(w, v)
                submit_write(i, v)
                _point("nvme-step:chunk-written")
            for i in sorted(writes):
                _wait_all(writes.pop(i))
        except BaseException as err:
            for _, futs in reads.values():
                _wait_all(futs, raise_=False)
            for futs in writes.values():
                _wait_all(futs, raise_=False)
            self._keep_spares(work)
            if not isinstance(err, Exception):  # Ctrl-C, SystemExit: themselves (nothing applied either)
                raise
            raise self._nothing_applied(err) from err

    def _nvme_step_each(self, work: list["_Work"]) -> None:
        """commit="param": each parameter stepped, its new records committed (signals held) and
        its old ones emptied (their disk blocks freed) before the next one is written, so the disk
        holds one parameter's spare records at a time. A failure leaves the parameters committed
        before it stepped (`_stepped`: a retry skips them) and every other one as it was."""
        for i, w in enumerate(work):
            try:
                self._nvme_step([w])
            except ZinfError as err:
                raise self._partly_applied(err, w, i, len(work)) from err
            with _deferred_signals():
                self._nvme_commit([w])
                self._stepped[id(w.entry)] = w.entry.grad_writes
                spare = self._spare.get(id(w.entry), {})
                for fd in spare.values():
                    w.engine.swap.discard(fd)
            _point("step:param-committed")

    def _partly_applied(self, err: ZinfError, w: "_Work", i: int, n: int) -> ZinfError:
        why = getattr(err, "what", str(err))
        done = len(self._stepped)
        return ZinfError(f"zinf: the optimizer step failed in the NVMe tier at parameter {w.entry.name!r} ({why}); "
                         f"with commit='param' the {done} NVMe-tier parameter(s) before it in this step are stepped "
                         f"and committed, it and the {n - i - 1} after it are as they were, and so are the resident "
                         "and CPU-tier parameters; the gradients are kept. Free space (or fix the cause) and call "
                         "step() again: it steps only what this step has not, so training continues exactly as if "
                         "the failure had not happened (zero_grad() instead gives the rest of this step up)")

    # -- stepping in backward (step_in_backward=True; the module's docstring) ----------------------
    def take_grad(self, e: Entry, part: torch.Tensor, rows: tuple[int, int] | None) -> bool:
        """Entry.add_grad's sink: step `e` now if this contribution (its `e.reduces`-th this step)
        makes its gradient whole, as counted in an earlier step; False to let the gradient go to
        its tier as usual. Runs inside the backward (the graph's reduce, or an eager read's)."""
        bw = self._bw
        if self._queue.error is not None:
            self._settle()  # a step queued earlier in this backward failed: abandon it here
        if id(e) in bw.work:
            self._abandon_backward()
            bw.expect.clear()
            raise ZinfError(
                f"zinf: parameter {e.name!r} got another gradient after step_in_backward stepped it in this "
                f"step (an earlier step made its gradient whole in fewer reductions: gradient accumulation over "
                f"more backward calls than before, or the parameter used more often). The step is abandoned: "
                f"every parameter and optimizer state is as the previous step left them, and this step's "
                f"gradients are lost. Call opt.zero_grad() and run the step again (the counts are learned "
                f"anew), or make the optimizer with step_in_backward=False")
        task = torch._C._current_graph_task_id()
        if task < 0 or bw.expect.get(id(e)) != e.reduces:
            return False  # not in a backward (a take-over's gradient), or not whole yet, or never counted
        p = e.param()
        got = self._layout.where.get(id(p)) if p is not None else None
        if got is None or got[0] != "nvme" or got[1] is not e:
            return False  # not in this optimizer's layout (yet): step() steps it
        gi = got[2]
        hyper = self._hyper(gi)
        try:
            if gi in bw.hyper and not _same_hyper(bw.hyper[gi], hyper):
                raise ZinfError("zinf: the hyperparameters changed within one backward; step_in_backward "
                                "steps every parameter of a group with the same ones")
            w = self._nvme_work(gi, e)
        except BaseException:
            self._abandon_backward()
            raise
        chunk = self._chunk(in_backward=True)
        if self.overlap:
            self._queue_step(w, part, rows, chunk)
        else:
            if rows is not None or e.has_grad:
                e.accumulate_grad(part, rows)  # earlier parts are in the file: the step reads the sum there
            else:
                w.grad = part  # the whole gradient, in memory: it never reaches the file
            try:
                self._nvme_step([w], chunk, self._bw.ring)
            except BaseException as err:
                self._in_backward_failed(e, err)
            w.grad = None  # may be the graph's buffer: not kept past this call
            e.drop_grad()
            bw.work[id(e)] = w
        bw.hyper.setdefault(gi, hyper)
        if task not in bw.open:  # the backward's end (only when it completes) closes it
            bw.open.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_backward_done, weakref.ref(self), task))
        _point("step-in-backward:stepped")
        return True

    def _check_backward_completed(self, settled: list[str] | None) -> None:
        """Refuse to step on the gradients of a backward that did not complete (an error or Ctrl-C
        in it, caught by the caller): the store rolls it back first (the gradients it started are
        dropped: as before it), then this raises, saying so, and names any gradient left partial
        (one it added to an earlier sum) or still partial from an earlier such backward."""
        lay = self._layout
        partial = [e.name for _, _, e in lay.cpu + lay.nvme if e.grad_partial]
        if settled is None and not partial:
            return
        what = ("the last backward did not complete; the gradients it started were removed, so every gradient "
                "is as it was before it" if settled is not None else "")
        if partial:
            what += ("; " if what else "") + (f"the gradients of {len(partial)} parameter(s) ({', '.join(map(repr, partial[:4]))}"
                                               f"{' ...' if len(partial) > 4 else ''}) hold part of a backward that did "
                                               "not complete, added to an earlier sum: call zero_grad() first")
        raise ZinfError(f"zinf: nothing was stepped: {what}. Run the backward again, then step")

    def _queue_step(self, w: "_Work", part: torch.Tensor, rows: tuple[int, int] | None, chunk: int) -> None:
        """overlap=True: hand `w`'s step to the queue's worker, with a gradient of its own (`part`
        may be the graph's buffer, which Inductor reuses once the reduce returns). Waits first for
        room in the queue (its gradients within the chunk ring's size), so the copy is made within it."""
        e, q = w.entry, self._queue
        nbytes = e.shard_numel * e.shard_dtype.itemsize
        q.admit(nbytes, _RING * 5 * 4 * chunk)
        try:
            if rows is not None or e.has_grad:
                e.accumulate_grad(part, rows)  # earlier parts are in the file: the sum is read back here
                e.complete_grad()
                w.grad = torch.empty(e.shard_numel, dtype=e.shard_dtype)
                e.read_grad_into(w.grad)
            else:
                w.grad = part.clone()
            for name in ("param",) + w.names:  # the files are taken here: the worker touches no shared table
                self._out_file(w, name)
        except BaseException as err:
            q.release(nbytes)
            self._keep_spares([w])
            self._in_backward_failed(e, err)
        w.group = dict(w.group)  # the hyperparameters as they are now (step() checks they still are)
        e.drop_grad()  # the step holds the gradient now (w.grad)
        self._bw.work[id(e)] = w
        q.submit(functools.partial(self._run_queued, w, chunk), nbytes)

    def _in_backward_failed(self, e: Entry, err: BaseException) -> None:
        """A step in backward failed: every step of this backward is dropped, and this raises."""
        self._abandon_backward()
        if not isinstance(err, Exception):
            raise err  # Ctrl-C, SystemExit: themselves (nothing applied either)
        raise ZinfError(
            f"zinf: stepping {e.name!r} in backward failed ({err.__cause__ or err}); this step is abandoned: "
            f"every parameter and optimizer state is as the previous step left them, and this step's "
            f"gradients are lost. Fix the cause (free space), call opt.zero_grad() and run the step again") from err

    def _run_queued(self, w: "_Work", chunk: int) -> None:
        """A step in backward, on the queue's worker thread: reads, steps and writes to the spare
        slots. A failure is kept for the backward's end (or the next take, or step()) to raise."""
        try:
            if self._queue.error is None:  # after a failure the backward's steps are all dropped
                self._nvme_step([w], chunk, self._bw.ring)
        except BaseException as err:
            if self._queue.error is None:
                self._queue.error = (w.entry, err)
        finally:
            w.grad = None

    def _settle(self) -> None:
        """Wait for the steps queued in backward; if one failed, abandon them all and raise."""
        q = self._queue
        q.drain()
        if q.error is not None:
            self._in_backward_failed(*q.error)

    def grad_cleared(self, e: Entry) -> None:
        """The store cleared `e`'s gradient (zero_grad): a step taken with it in backward goes too."""
        self._queue.drain()  # a step queued with it is done (or failed: step() says so)
        w = self._bw.work.pop(id(e), None)
        if w is not None:
            self._keep_spares([w])
        if not self._bw.work:
            self._bw.clear()

    def _abandon_backward(self) -> None:
        """Drop every step taken in backward and not committed (their files are spares again)."""
        self._queue.drain()
        self._queue.error = None
        self._keep_spares(list(self._bw.work.values()))
        self._bw.clear()

    def _check_backward_steps(self) -> None:
        """Before a commit: the steps taken in backward may be committed (their backward completed
        and the hyperparameters are those they were taken with); otherwise dropped, and refused."""
        bw = self._bw
        if not bw.work:
            return
        why = None
        if bw.open:
            why = ("the backward that stepped them did not complete (it raised, or step() runs inside it)")
        else:
            for gi, hyper in bw.hyper.items():
                if not _same_hyper(hyper, self._hyper(gi)):
                    changed = sorted(k for k in hyper if not _same_hyper({k: hyper[k]}, {k: self._hyper(gi).get(k)}))
                    why = (f"hyperparameters {changed} of group {gi} changed between the backward and step(): "
                           f"set them before the forward (or step a scheduler after step())")
                    break
        if why is None:
            return
        n = len(bw.work)
        self._abandon_backward()
        raise ZinfError(f"zinf: {n} parameter(s) were stepped in backward (step_in_backward=True) but {why}. "
                        f"Nothing was applied: every parameter and optimizer state is as the previous step left "
                        f"them. Call opt.zero_grad() and run the step again")

    def _attach_sinks(self, old: _Layout, lay: _Layout) -> None:
        """With step_in_backward, the NVMe tier's entries hand their gradients to this optimizer."""
        mine = {id(e) for _, _, e in lay.nvme} if self.step_in_backward else set()
        for _, _, e in old.nvme:
            if id(e) not in mine and e.grad_sink is not None and e.grad_sink() is self:
                e.grad_sink = None
        if not self.step_in_backward:
            return
        for _, _, e in lay.nvme:
            other = e.grad_sink() if e.grad_sink is not None else None
            if other is not None and other is not self:
                raise ZinfError(f"zinf: parameter {e.name!r} is already stepped in backward by another optimizer "
                                "(step_in_backward=True): one optimizer per parameter")
            e.grad_sink = weakref.ref(self)

    def _fast(self) -> bool:
        """Adam and AdamW: the pipelined NVMe step (torch's functional adam on each chunk)."""
        return self._cls in _supported_nvme()

    def _out_file(self, w: "_Work", name: str) -> int:
        """The file record `name` of w's parameter is written to this step: its spare slot."""
        if name not in w.out:
            spare = self._spare.setdefault(id(w.entry), {})
            what = {"param": "shard", "copy": "low-precision copy"}.get(name, f"optimizer state {name!r}")
            w.out[name] = spare.pop(name) if name in spare else w.entry._acquire(what)
        return w.out[name]

    def _generic_step(self, work: list["_Work"], chunk: int) -> None:
        """Any other elementwise torch.optim optimizer over the NVMe tier: per chunk of each flat
        shard, the parameter, gradient and per-element states are read, stepped by an instance of
        the optimizer's own class over that chunk (its state set from the files and the record's
        other states), and written to the spare slots. Not overlapped (Adam/AdamW are)."""
        for w in work:
            e, dt = w.entry, w.entry.shard_dtype
            names, scalars = None, None
            for start in range(0, e.shard_numel, chunk):
                n = min(chunk, e.shard_numel - start)
                off = start * dt.itemsize
                p = torch.empty(n, dtype=dt)
                w.engine.read_file(e.fd, p, off)
                grad = torch.empty(n, dtype=dt)
                if w.grad is not None:  # stepping in backward: the gradient is in memory
                    grad.copy_(w.grad[start:start + n])
                else:
                    e.read_grad_into(grad, start)
                st = {}
                for name in w.names:
                    st[name] = torch.empty(n, dtype=dt)
                    w.engine.read_file(w.fds[name], st[name], off)
                new = _generic_chunk(self._cls, self._kwargs, w.group, p, grad, st, w.scalars)
                per = {k: v for k, v in new.items() if _per_element(k, v) and v.numel() == n}
                if names is None:
                    names, scalars = tuple(per), {k: v for k, v in new.items() if k not in per}
                for k, v in ({"param": p} | per).items():
                    w.engine.write_file(self._out_file(w, k), v.detach().contiguous(), off)
                if _copy_of(w):
                    w.engine.write_file(self._out_file(w, "copy"), p.detach().to(e.gather_dtype),
                                        start * e.gather_dtype.itemsize)
                _point("nvme-step:chunk-written")
            w.names, w.scalars = names or (), scalars or {}

    def _keep_spares(self, work: list["_Work"]) -> None:
        """After a failed step: the files written are spares again (the next attempt reuses them)."""
        for w in work:
            spare = self._spare.setdefault(id(w.entry), {})
            spare.update(w.out)
            w.out = {}

    @staticmethod
    def _nothing_applied(err: BaseException) -> ZinfError:
        what = str(err) if isinstance(err, ZinfError) else f"{type(err).__name__}: {err}"
        out = ZinfError(f"zinf: the optimizer step failed in the NVMe tier ({what}); nothing was applied: "
                        "every parameter and optimizer state (resident ones too) is as it was before this "
                        "step, and the gradients are kept. Free space (or fix the cause) and call step() "
                        "again: training continues exactly as if this attempt had not happened")
        out.what = what  # the cause alone (commit="param" words its own message around it)
        return out

    def _nvme_commit(self, work: list["_Work"]) -> None:
        """Switch each record to the slot the step wrote (and keep the old one as the spare).
        Integer swaps only: it cannot fail half-way."""
        for w in work:
            e, spare = w.entry, self._spare.setdefault(id(w.entry), {})
            spare["param"], e.fd = e.fd, w.out["param"]
            if "copy" in w.out:  # written whole with the shard: it is the new shard's copy
                if e.copy_fd is not None:
                    spare["copy"] = e.copy_fd
                e.copy_fd, e.copy_ok = w.out["copy"], True
            for name in w.names:
                old = e.state_fds.get(name)
                e.state_fds[name] = w.out[name]
                if old is not None:
                    spare[name] = old
            w.out = {}
            self._nvme_state[id(e)] = _NvmeState(w.step + 1, w.names, w.scalars or {})


@dataclass
class _BackwardSteps:
    """The NVMe tier's steps taken in backward, waiting for step() to commit them."""

    work: dict = field(default_factory=dict)  # id(entry) -> its _Work, new values in the spare slots
    hyper: dict = field(default_factory=dict)  # group index -> the hyperparameters they were taken with
    open: set = field(default_factory=set)  # graph tasks (backward calls) that stepped and have not completed
    expect: dict = field(default_factory=dict)  # id(entry) -> reduces that make its gradient whole (counted)
    # the chunk buffers of the steps in backward, reused from one to the next (one runs at a time):
    # allocated at the first, freed with the backward's end (or step(), or an abandon)
    ring: list = field(default_factory=list)

    def clear(self) -> None:
        self.work.clear()
        self.hyper.clear()
        self.open.clear()
        self.ring.clear()


class _StepQueue:
    """The steps taken in backward with overlap=True, run in order on one worker thread while the
    backward computes. The gradients they hold (copies) are bounded: a step whose gradient would
    take them past `cap` bytes waits in the backward until earlier ones are done (one is always
    admitted), so with the chunk ring their memory stays within the in-backward share."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._cond = threading.Condition()
        self._futures: list = []
        self.held = 0  # bytes of gradients held by steps submitted and not done
        self.peak = 0  # the most `held` was (tests, bench)
        self.waits = 0  # submissions that waited for room
        self.error: tuple | None = None  # (entry, exception) of the first step that failed

    def admit(self, nbytes: int, cap: int) -> None:
        """Room for a gradient of `nbytes`: waits while earlier steps hold too much."""
        with self._cond:
            if self.held and self.held + nbytes > cap:
                self.waits += 1
                self._cond.wait_for(lambda: not self.held or self.held + nbytes <= cap)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()

    def submit(self, fn: Callable[[], None], nbytes: int) -> None:
        """Run `fn` on the worker; `nbytes` (admitted) are released when it is done."""
        if self._pool is None:  # its torch ops use as many threads as the caller's (1 in a 1-thread run)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zinf-step-in-backward",
                                            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))

        def run() -> None:
            try:
                fn()
            finally:
                self.release(nbytes)

        self._futures.append(self._pool.submit(run))

    def drain(self) -> None:
        """Wait for every step submitted (they do not raise: a failure is kept in `error`)."""
        futs, self._futures = self._futures, []
        for f in futs:
            f.result()


def _backward_done(ref: "weakref.ref[ZinfOptimizer]", task: int) -> None:
    """Autograd's final callback of a backward that stepped parameters: it completed."""
    opt = ref()
    if opt is not None:
        opt._bw.open.discard(task)
        opt._settle()  # the steps it queued: done here, a failure raised from the backward
        opt._bw.ring.clear()  # their chunk buffers go with the backward


def _same_hyper(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.shape == w.shape
                    and torch.equal(v, w)):
                return False
        elif v != w:
            return False
    return True


def _check_in_backward_class(cls: type, kwargs: dict) -> None:
    if issubclass(cls, _whole_param_classes()):
        raise ZinfError(f"zinf: step_in_backward=True steps each parameter's shard as its gradient arrives; "
                        f"{cls.__name__}'s update is not elementwise (it needs whole parameters or every "
                        f"gradient at once): use step_in_backward=False")
    if kwargs.get("differentiable") or kwargs.get("capturable"):
        raise ZinfError("zinf: step_in_backward=True steps the NVMe tier on the CPU inside the backward: "
                        "differentiable=True and capturable=True are not supported; use step_in_backward=False")


# A test hook (tests/workers/): called with the name of a point of a step, e.g. to pause there
# while the test kills the process. None in normal runs.
FAULT_HOOK: Callable[[str], None] | None = None


def _point(name: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(name)


@contextlib.contextmanager
def _deferred_signals():
    """Hold SIGINT and SIGTERM back for the block (the commit of a step: short, in memory) and
    deliver them after it, to the handlers that were set. Only in the main thread (the only one
    Python runs signal handlers in)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got, old = [], {}

    def note(signum, frame):
        got.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, note)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in got:
            handler = old.get(sig)
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), sig)


@dataclass
class _Work:
    entry: Entry
    group: dict
    step: int
    names: tuple
    fds: dict  # name -> the file the state is read from (the committed slot)
    engine: Any
    out: dict  # "param" and state names -> the file the new values go to (the spare slot)
    scalars: dict | None = None  # other optimizers: the states that are not per element (step, ...)
    grad: torch.Tensor | None = None  # stepping in backward: the whole flat gradient (else read from its file)


def _generic_chunk(cls: type, kwargs: dict, group: dict, p: torch.Tensor, grad: torch.Tensor, states: dict,
                   scalars: dict | None) -> dict:
    """One chunk stepped by `cls` itself: a fresh instance over the chunk as its one parameter,
    with the group's hyperparameters and the chunk's states; returns its state after the step."""
    hyper = {k: v for k, v in group.items() if k not in _FORWARD_KEYS}
    p.grad = grad
    opt = cls([dict(hyper, params=[p])], **kwargs)
    if scalars is not None:  # a state from earlier steps (else: whatever the class starts with)
        opt.state[p] = {**{k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                           for k, v in scalars.items()}, **states}
    with torch.no_grad():
        opt.step()
    p.grad = None
    return dict(opt.state[p])


def _copy_of(w: _Work) -> tuple[str, ...]:
    """("copy",) where w's parameter keeps a gather copy its step rewrites (Entry.gather_dtype)."""
    return ("copy",) if w.entry.gather_dtype is not None else ()


def _wait_all(futs, raise_: bool = True) -> None:
    first = None
    for f in futs:
        try:
            f.result()
        except BaseException as err:
            first = first or err
    if first is not None and raise_:
        raise first


def _adam_chunk(w: _Work, v: dict) -> None:
    """One chunk through torch's functional Adam, exactly as `torch.optim.Adam(W).step` calls it
    for one parameter (each chunk its own copy of the step count: torch increments it in place)."""
    from torch.optim.adam import adam

    g = w.group
    beta1, beta2 = g["betas"]
    fused = g.get("fused")
    step_t = torch.tensor(float(w.step), dtype=_scalar_dtype(fused))
    p = v["param"]
    with torch.no_grad():
        adam([p], [v["grad"]], [v["exp_avg"]], [v["exp_avg_sq"]],
             [v["max_exp_avg_sq"]] if g["amsgrad"] else [], [step_t],
             foreach=g.get("foreach"), capturable=False, differentiable=False, fused=fused,
             grad_scale=None, found_inf=None, has_complex=torch.is_complex(p),
             decoupled_weight_decay=g.get("decoupled_weight_decay", False),
             amsgrad=g["amsgrad"], beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"],
             eps=g["eps"], maximize=g["maximize"])


class _StateView(Mapping):
    """`ZinfOptimizer.state` once parameters are managed: param -> its state, read on access."""

    def __init__(self, opt: ZinfOptimizer) -> None:
        self._opt = opt

    def _params_with_state(self):
        return [p for p in self._opt._all_params() if self._opt._export_param_state(p) is not None]

    def __getitem__(self, p):
        try:
            got = self._opt._export_param_state(p)
        except ZinfError:
            raise KeyError(p) from None
        if got is None:
            raise KeyError(p)
        return self._opt._present(p, *got)

    def get(self, p, default=None):
        try:
            return self[p]
        except (KeyError, ZinfError):
            return default

    def __iter__(self):
        return iter(self._params_with_state())

    def __len__(self) -> int:
        return len(self._params_with_state())
