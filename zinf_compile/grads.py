"""Gradients of managed parameters for torch's tools that read `p.grad`: clipping, and a guard on
plain optimizers.

A managed parameter's gradient is its shard's in the store (`Entry.grad` in memory, `Entry.grad_fd`
on NVMe); `p.grad` stays None. torch's `clip_grad_norm_` would see only the resident gradients (a
norm too small, and only those scaled), and a plain `torch.optim.AdamW(model.parameters())` would
never update a managed parameter. Both silently.

  clip_grad_norm_     torch's arithmetic over every gradient: per parameter the norm of its
                      gradient (a managed one's over this rank's shard, padding excluded, read from
                      its file in chunks on NVMe), then the norm of those norms, grouped by device
                      and dtype as torch groups them. One process: bit-identical to torch on the same
                      gradients (an NVMe gradient larger than one chunk: its norm is the norm of its
                      chunks' norms, within a few ulp). Several ranks: shards partition a parameter,
                      so their per-parameter |g|^p are summed over ranks (one all_reduce of one
                      value per managed parameter; max / min for the inf norms); resident
                      gradients are all-reduced by the graph, hence replicated: counted once.
                      Then every gradient is scaled by min(max_norm / (total + 1e-6), 1) as torch
                      does: resident ones by torch itself, CPU-tier shards in place, NVMe-tier
                      shards by a pending coefficient their readers apply (docs/decisions.md).
  install()           when zinf first manages a parameter (ParamStore.manage): torch's
                      `clip_grad_norm_` and `clip_grads_with_norm_` (they take parameters) run this
                      module's versions when a managed parameter is among those passed, torch's own
                      untouched otherwise; and a global optimizer step pre-hook refuses a plain
                      torch optimizer that holds a managed parameter. `get_total_norm` takes
                      gradient tensors, not parameters: a managed parameter's never reaches it, so
                      it is left alone (use clip_grad_norm_ or total_norm here).
                      And `nn.Module.zero_grad` clears the gradient shards of the module's managed
                      parameters after torch's own (a loop that zeroes through the model, as
                      Hugging Face's Trainer does, would otherwise sum every step's gradient into
                      the shards: measured, Trainer's second grad_norm 1.90 where Inductor's is 1.64).
                      One dict lookup per parameter per call, none while nothing is managed.
  step_in_backward    norms and clips of the parameters of an optimizer made with
                      step_in_backward=True are refused (ZinfError): their NVMe-tier gradients are
                      consumed by the optimizer inside the backward, before a norm could see them.

Names bound before install (`from torch.nn.utils import clip_grad_norm_` at the top of a script
that runs before the first compile) keep torch's function: call `zinf_compile.clip_grad_norm_`.
"""
from __future__ import annotations

import functools
import math
import types

import torch
import torch.distributed as dist

from zinf_compile.errors import ZinfError
from zinf_compile.runtime.params import Entry, world
from zinf_compile.runtime.state import STORE

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "install", "total_norm"]

# Elements of an NVMe gradient read at a time for its norm (8 MiB in fp32, as the optimizer's chunk)
NORM_CHUNK_ELEMS = 2 << 20

_TORCH: dict[str, object] = {}  # torch's own functions, kept by install()


def _as_list(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _gradients(params: list[torch.Tensor]) -> list[torch.Tensor | Entry]:
    """Each parameter's gradient in order, as torch lists them (`p.grad` when not None), a managed
    parameter's as its entry (when it has one this step)."""
    out: list[torch.Tensor | Entry] = []
    for p in params:
        e = STORE.entry(p)
        if e is not None:
            if e.has_grad:
                out.append(e)
        elif p.grad is not None:
            out.append(p.grad)
    return out


def _combine(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of a vector from the norms of its parts (the parts partition it)."""
    return norms.sum() if norm_type == 0 else torch.linalg.vector_norm(norms, norm_type)


def _valid(e: Entry) -> int:
    """Elements of this rank's shard that are the parameter's (the rest is padding)."""
    lo, hi = e.shard_range()
    return max(0, min(hi, e.numel) - lo)


def shard_grad_norm(e: Entry, norm_type: float, chunk: int = NORM_CHUNK_ELEMS) -> torch.Tensor:
    """The norm of this rank's part of `e`'s gradient (padding excluded), with its pending scales.
    The NVMe tier reads the file `chunk` elements at a time into one buffer."""
    n = _valid(e)
    if e.tier == "cpu":
        return torch.linalg.vector_norm(e.grad[:n], norm_type)
    e.complete_grad()
    buf = torch.empty(max(1, min(chunk, n)), dtype=e.shard_dtype)
    parts = []
    for start in range(0, n, chunk):
        part = buf[:min(chunk, n - start)]
        e.read_grad_into(part, start)
        parts.append(torch.linalg.vector_norm(part, norm_type))
    if len(parts) == 1:
        return parts[0]  # one read: the norm of the whole gradient, as torch computes it
    if not parts:
        return torch.linalg.vector_norm(buf[:0], norm_type)
    return _combine(torch.stack(parts), norm_type)


def _over_ranks(local: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per managed parameter, the norm of its whole gradient from every rank's shard norm: one
    all_reduce of |g|^p (sum), of the max or min (inf norms), of the count (p = 0)."""
    vec = torch.stack(local).to(torch.float64)
    if math.isinf(norm_type):
        op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    else:
        op = dist.ReduceOp.SUM
        if norm_type != 0:
            vec = vec.pow(norm_type)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    vec = vec.to(dev)
    dist.all_reduce(vec, op=op)
    if not math.isinf(norm_type) and norm_type != 0:
        vec = vec.pow(1.0 / norm_type)
    return [v.to(device="cpu", dtype=n.dtype) for v, n in zip(vec, local)]


@torch.no_grad()
def total_norm(parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    """The norm of all the parameters' gradients, resident and managed, as one vector: torch's
    `get_total_norm` of what `p.grad` would be (see the module's docstring). Several ranks: a
    collective; every rank must call it with the same parameters."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

    params = _as_list(parameters)
    _refuse_stepped_in_backward(params)
    grads = _gradients(params)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)

    def where(g):  # a shard's gradient lives on the host
        return (torch.device("cpu"), g.shard_dtype) if isinstance(g, Entry) else (g.device, g.dtype)

    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault(where(g), []).append(i)
    norm_of: dict[int, torch.Tensor] = {}
    for (device, _), idx in groups.items():
        tensors = [grads[i] for i in idx if not isinstance(grads[i], Entry)]
        if not tensors:
            pass
        elif (foreach is None and _has_foreach_support(tensors, device)) or (
                foreach and _device_has_foreach_support(device)):
            got = torch._foreach_norm(tensors, norm_type)
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            got = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        resident = iter(got if tensors else ())
        for i in idx:
            norm_of[i] = shard_grad_norm(grads[i], norm_type) if isinstance(grads[i], Entry) else next(resident)
    managed = [i for i, g in enumerate(grads) if isinstance(g, Entry)]
    if managed and max(grads[i].world for i in managed) > 1:
        for i, n in zip(managed, _over_ranks([norm_of[i] for i in managed], norm_type)):
            norm_of[i] = n
    first = where(grads[0])[0]
    norms = [norm_of[i] for idx in groups.values() for i in idx]
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`")
    return total


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                          foreach: bool | None = None) -> None:
    """torch's `clip_grads_with_norm_` over resident and managed gradients alike: each multiplied
    by min(max_norm / (total_norm + 1e-6), 1), the same 0-dim tensor torch multiplies by."""
    params = _as_list(parameters)
    _refuse_stepped_in_backward(params)
    _TORCH.get("clip_grads_with_norm_", torch.nn.utils.clip_grad._clip_grads_with_norm_)(
        params, max_norm, total_norm, foreach)  # the resident ones (a managed p.grad is None)
    entries = [g for g in _gradients(params) if isinstance(g, Entry)]
    if not entries:
        return
    coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0).to("cpu")
    for e in entries:
        e.scale_grad(coef)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ where some parameters are managed: the total norm over every
    gradient (resident `p.grad`s and managed shards, over all ranks), then each scaled by
    min(max_norm / (total + 1e-6), 1). Returns the total norm. Several ranks: a collective."""
    if isinstance(parameters, types.GeneratorType):
        parameters = list(parameters)
    params = _as_list(parameters)
    total = total_norm(params, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _refuse_stepped_in_backward(params: list[torch.Tensor]) -> None:
    """A norm over gradients, or a clip, needs every gradient before any parameter steps: refused
    for the parameters of an optimizer made with step_in_backward=True (zinf_compile/optim.py)."""
    from zinf_compile.runtime.state import RUNTIME

    opts = [o for o in list(RUNTIME.optimizers) if getattr(o, "step_in_backward", False)]
    if not opts:
        return
    ids = {id(p) for p in params}
    for opt in opts:
        if any(id(p) in ids for p in opt._all_params()):
            raise ZinfError(
                "zinf: clipping by global norm (or a total norm of the gradients) needs every gradient before "
                "any parameter steps, but these parameters belong to an optimizer made with "
                "step_in_backward=True, which steps the NVMe tier's parameters during the backward (their "
                "gradients are gone by now). Make it with step_in_backward=False to clip; nothing was clipped")


# -- torch's own entry points ---------------------------------------------------------------------
def _any_managed(params: list[torch.Tensor]) -> bool:
    return any(STORE.entry(p) is not None for p in params)


def _dispatching(torch_fn, zinf_fn):
    """torch_fn, or zinf_fn when a managed parameter is among those passed."""

    @functools.wraps(torch_fn)
    def dispatch(parameters, *args, **kwargs):
        if len(STORE):
            if isinstance(parameters, torch.Tensor):
                if STORE.entry(parameters) is not None:
                    return zinf_fn(parameters, *args, **kwargs)
            else:
                was_generator = isinstance(parameters, types.GeneratorType)
                parameters = list(parameters)
                if _any_managed(parameters):
                    return zinf_fn(parameters, *args, **kwargs)
                if was_generator and not parameters:
                    parameters = (p for p in ())  # torch warns about an empty generator
        return torch_fn(parameters, *args, **kwargs)

    dispatch.__zinf_wraps__ = torch_fn
    return dispatch


def _module_zero_grad(torch_fn):
    """nn.Module.zero_grad, then the module's managed parameters' gradient shards cleared as
    ZinfOptimizer.zero_grad clears them (set_to_none=False zeroes the CPU tier's in place)."""

    @functools.wraps(torch_fn)
    def zero_grad(self, set_to_none: bool = True) -> None:
        torch_fn(self, set_to_none)
        if not len(STORE):
            return
        entries = []
        for p in self.parameters():
            e = STORE.entry(p)
            if e is None:
                continue
            if not set_to_none and e.has_grad and e.grad is not None:
                e.grad.zero_()
            else:
                entries.append(e)
        STORE.zero_grad(entries)

    zero_grad.__zinf_wraps__ = torch_fn
    return zero_grad


def _refuse_plain_optimizer(opt, args, kwargs) -> None:
    """Global step pre-hook: a torch optimizer holding a managed parameter would never update it
    (its p.grad stays None). ZinfOptimizer's inner optimizers hold flat shard tensors, not
    managed parameters. One dict lookup per parameter, none while nothing is managed."""
    if not len(STORE):
        return None
    from zinf_compile.optim import ZinfOptimizer

    if isinstance(opt, ZinfOptimizer):
        return None
    for group in opt.param_groups:
        for p in group["params"]:
            e = STORE.entry(p)
            if e is not None:
                cls = type(opt).__name__
                raise ZinfError(
                    f"zinf: {cls} holds parameter {e.name!r}, which zinf manages: its data, gradient and "
                    f"optimizer state live as a shard in zinf's parameter store and its p.grad stays None, "
                    f"so {cls} would never update it. Make the optimizer with "
                    f"zinf_compile.optimizer(model, torch.optim.{cls}, **kwargs) instead: it steps every "
                    f"parameter where it lives.")
    return None


def install() -> None:
    """Make torch's clip_grad_norm_ / clip_grads_with_norm_ count managed gradients, Module.zero_grad
    clear them, and refuse plain optimizers over managed parameters. Once per process; called by
    ParamStore.manage."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if "hook" in _TORCH:
        return
    if not hasattr(clip_grad.clip_grad_norm_, "__zinf_wraps__"):
        _TORCH["clip_grad_norm_"] = clip_grad.clip_grad_norm_
        utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = _dispatching(clip_grad.clip_grad_norm_, clip_grad_norm_)
    if hasattr(utils, "clip_grads_with_norm_") and not hasattr(utils.clip_grads_with_norm_, "__zinf_wraps__"):
        _TORCH["clip_grads_with_norm_"] = utils.clip_grads_with_norm_
        utils.clip_grads_with_norm_ = _dispatching(utils.clip_grads_with_norm_, clip_grads_with_norm_)
    if not hasattr(torch.nn.Module.zero_grad, "__zinf_wraps__"):
        _TORCH["zero_grad"] = torch.nn.Module.zero_grad
        torch.nn.Module.zero_grad = _module_zero_grad(torch.nn.Module.zero_grad)
    _TORCH["hook"] = register_optimizer_step_pre_hook(_refuse_plain_optimizer)
