"""A managed parameter read or written outside zinf's graphs behaves as the parameter it stands for.

Taking a parameter over frees its storage; a kernel reading it would read freed memory (the process
dies). So the store gives each parameter it manages a class of its own at take-over: the same
class with a `__torch_function__` (`Managed<cls>`, made once per class). Every torch function that
meets the parameter comes here first:

  metadata           size, stride, dtype, requires_grad, the storage object, hooks, ...: torch's own
  zinf's ops         the compiled graph's gathers, fetches and reduces: torch's own (the only other
                     calls a compiled step makes on a managed parameter are two metadata reads)
  a read             (`p.norm()`, `print(p)`, `p.detach()` as `state_dict()` takes it, `copy.deepcopy`,
                     `torch.save`, an eager forward: the uncompiled model, a Dynamo fallback frame)
                     runs on the whole value, gathered from its shards for this call. Where autograd
                     records it, the gradient goes to the shards (`ParamStore.reduce_grad`), as the
                     compiled graph's would: `zinf_compile.optimizer` steps it, `p.grad` stays None.
  a write in place   (`p.copy_(x)` as `load_state_dict` does it, `nn.init.normal_(p)`, `p.mul_(2)`,
                     `p[0] = 1`, `p.data = x`) runs on the whole value and writes it back to the
                     shards; `copy_` and `p.data = x` of the whole parameter skip the gather.
  a conversion       that changes nothing (`p.to(its device)`, `p.float()` of a float parameter)
                     returns the parameter itself, as torch does.

Dynamo must never trace that `__torch_function__` (it would inline it: gathers and graph breaks in
the graph). So while Dynamo compiles, managed parameters have their plain class back (a start-of-
compile callback), and get the managed class again inside zinf's backend call, before Dynamo builds
its guards (or at the end of any other compile): the guards expect the managed class, and nothing
recompiles (measured: torch 2.13's guards check a tensor's exact type).

Not covered: a view taken outside the graph (`p[0]`, `p.t()`) is a view of that call's gathered copy,
so writing through it does not reach the parameter; write to the parameter itself. Under a process
group a read gathers from every rank (a collective): every rank reads, as with DeepSpeed's
GatheredParameters.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._pytree import tree_map

from zinf_compile.errors import ZinfError

# torch functions that only look at a tensor's metadata (never its elements): torch's own, always
_METADATA = frozenset({
    "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size", "storage_offset",
    "untyped_storage", "_typed_storage", "storage", "is_contiguous", "is_neg", "is_conj", "_is_view",
    "is_floating_point", "is_complex", "is_signed", "is_inference", "get_device", "is_pinned", "is_shared",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "_fix_weakref",
    "__len__", "__hash__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__getstate__", "_is_zerotensor",
    "has_names", "is_set_to", "_use_count", "_base", "type", "__dir__", "is_nested", "data_ptr",
    "__torch_function__", "__class__", "__weakref__", "_version", "dim_order", "__sizeof__",
    "_has_compatible_shallow_copy_type", "is_same_size", "_is_functional_tensor", "is_tensor",
})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "contiguous"})

_PASS, _READ, _WRITE, _CONVERT, _DATA_GET, _DATA_SET = range(6)

# While zinf_compile.loading replays a module's initialisation: called with each managed parameter
# a torch function meets, which it makes whole and plain for the rest of that call (loading.py)
_CHECKOUT = None


@contextlib.contextmanager
def checking_out(fn):
    """Within: every managed parameter a torch function meets is first handed to `fn`, which gives
    it its storage and value back and its plain class; the function then runs as torch's own."""
    global _CHECKOUT
    prev, _CHECKOUT = _CHECKOUT, fn
    try:
        yield
    finally:
        _CHECKOUT = prev


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


@functools.lru_cache(maxsize=4096)
def _kind(func) -> int:
    if getattr(func, "namespace", None) == "zinf" or getattr(getattr(func, "_schema", None), "name", "").startswith(
            "zinf::"):
        return _PASS
    name = _name(func)
    owner = getattr(func, "__self__", None)  # a property's __get__ / __set__: the descriptor
    if name in ("__get__", "__set__", "__delete__"):
        prop = getattr(owner, "__name__", "")
        if prop == "data":
            return _DATA_GET if name == "__get__" else _DATA_SET
        return _PASS  # shape, dtype, device, grad, requires_grad, is_leaf, grad_fn, names, ...
    if name in _METADATA:
        return _PASS
    if name in _CONVERSIONS:
        return _CONVERT
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        return _WRITE
    return _READ


class _Gathered(torch.autograd.Function):
    """The whole value of a managed parameter for an eager computation; its gradient goes to the
    shards (the mean over ranks, as the compiled graph's reduce), never to p.grad."""

    @staticmethod
    def forward(ctx, p):
        from zinf_compile.runtime.state import STORE

        ctx.p = p
        return STORE.full(_entry(p))

    @staticmethod
    def backward(ctx, g):
        from zinf_compile.runtime.state import STORE

        with torch._C.DisableTorchFunctionSubclass():
            STORE.reduce_grad(ctx.p, g)
        return None


def _entry(p):
    from zinf_compile.runtime.state import STORE

    with torch._C.DisableTorchFunctionSubclass():
        return STORE.entry(p)


def _whole(p, e, for_grad: bool):
    """The value of managed parameter `p` (entry `e`) for one call: recorded by autograd when the
    call builds a graph through a parameter that takes gradients."""
    from zinf_compile.runtime.state import STORE

    with torch._C.DisableTorchFunctionSubclass():
        if for_grad and p.requires_grad and torch.is_grad_enabled():
            return _Gathered.apply(p)
        return STORE.full(e)


def _write_back(e, value: torch.Tensor) -> None:
    if tuple(value.shape) != tuple(e.shape):
        raise ZinfError(f"zinf: cannot write a tensor of shape {tuple(value.shape)} into managed parameter "
                        f"{e.name!r} of shape {tuple(e.shape)}")
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        e.write_whole(value)


def _same_after(p, func, args, kwargs) -> bool:
    """Whether conversion `func(p, ...)` changes nothing (torch then returns p itself)."""
    name = _name(func)
    if name == "contiguous":
        return True  # a managed parameter is dense
    if name == "cpu":
        return p.device.type == "cpu"
    if name == "cuda":
        return p.device.type == "cuda"
    if name in ("float", "double", "half", "bfloat16"):
        return p.dtype == {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                           "bfloat16": torch.bfloat16}[name]
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    except Exception:
        return False
    if kwargs.get("copy"):
        return False
    return ((device is None or torch.device(device) == p.device) and (dtype is None or dtype == p.dtype)
            and memory_format in (None, torch.preserve_format))


def _managed(t):
    if isinstance(t, ManagedMixin):
        return _entry(t)
    return None


def _on_access(func, args, kwargs):
    kind = _kind(func)
    if kind == _DATA_GET:
        p = args[0]
        e = _managed(p)
        return _whole(p, e, for_grad=False) if e is not None else _torch(func, args, kwargs)
    if kind == _DATA_SET:
        p, value = args[0], args[1]
        e = _managed(p)
        if e is None:
            return _torch(func, args, kwargs)
        if value is p:
            return None  # Module._apply after a conversion that returned the parameter itself
        if value.dtype != p.dtype or value.device != p.device:
            raise ZinfError(f"zinf: {e.name!r} is managed by zinf: p.data = x must keep its dtype and device "
                            f"({p.dtype} on {p.device}, got {value.dtype} on {value.device}); convert the model "
                            "before compiling it")
        _write_back(e, value)
        return None
    if kind == _CONVERT and _managed(args[0]) is not None and _same_after(args[0], func, args, kwargs):
        return args[0]
    if kind == _WRITE:
        target = args[0] if args else None
        e = _managed(target)
        if e is not None:
            if torch.is_grad_enabled() and target.requires_grad:
                raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
            if _name(func) == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor) and \
                    tuple(args[1].shape) == tuple(e.shape):
                _write_back(e, _plain(args[1]).to(target.dtype))  # the whole value replaced: no gather
                return target
            whole = _whole(target, e, for_grad=False)
            rest = tree_map(lambda t: _whole(t, _managed(t), False) if _managed(t) is not None else t,
                            (args[1:], kwargs))
            _torch(func, (whole, *rest[0]), rest[1])
            _write_back(e, whole)
            return None if _name(func) == "__setitem__" else target
    swapped = tree_map(lambda t: _whole(t, _managed(t), True) if _managed(t) is not None else t, (args, kwargs))
    return _torch(func, swapped[0], swapped[1])


def _plain(t):
    e = _managed(t)
    return _whole(t, e, False) if e is not None else t


def _torch(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class ManagedMixin:
    """Mixed into a managed parameter's class (see the module's docstring)."""

    _zinf_base: type = torch.nn.Parameter

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _kind(func) == _PASS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _CHECKOUT is not None:
            tree_map(lambda t: _CHECKOUT(t) if isinstance(t, ManagedMixin) else t, (args, kwargs))
            return _torch(func, args, kwargs)
        return _on_access(func, args, kwargs)

    def __repr__(self, *, tensor_contents=None):
        e = _managed(self)
        if e is None:
            return self._zinf_base.__repr__(self)
        return "Parameter containing (managed by zinf):\n" + repr(_whole(self, e, False))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        e = _managed(self)
        value = _whole(self, e, False).clone() if e is not None else _torch(torch.Tensor.clone, (self,), {})
        result = self._zinf_base(value, self.requires_grad)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto):
        e = _managed(self)
        if e is None:
            return self._zinf_base.__reduce_ex__(self, proto)
        import collections

        return (torch._utils._rebuild_parameter, (_whole(self, e, False), self.requires_grad, collections.OrderedDict()))


@functools.lru_cache(maxsize=None)
def managed_class(cls: type) -> type:
    """The class a managed parameter of class `cls` takes (`cls` itself when it cannot: a class
    with its own __torch_function__, which zinf must not shadow)."""
    base = getattr(cls, "_zinf_base", cls)
    if issubclass(cls, ManagedMixin):
        return cls
    tf = getattr(cls, "__torch_function__", None)
    if getattr(tf, "__func__", tf) is not getattr(torch._C._disabled_torch_function_impl, "__func__",
                                                    torch._C._disabled_torch_function_impl):
        return cls
    return type(f"Managed{base.__name__}", (ManagedMixin, base), {"_zinf_base": base, "__module__": __name__})


def mark(p: torch.Tensor) -> None:
    """Give managed parameter `p` its managed class (at take-over)."""
    if isinstance(p, torch.nn.Parameter) and not isinstance(p, ManagedMixin):
        _install()
        new = managed_class(type(p))
        if new is not type(p):
            p.__class__ = new


def unmark(p: torch.Tensor) -> None:
    """Its class back (when the store lets it go)."""
    if isinstance(p, ManagedMixin):
        p.__class__ = type(p)._zinf_base


def _params():
    from zinf_compile.runtime.state import STORE

    for e in STORE.entries():
        p = e.param()
        if p is not None:
            yield p


def mark_all(*_) -> None:
    """Every managed parameter with its managed class (the backend, before Dynamo's guards; the end
    of any compile)."""
    for p in _params():
        mark(p)


def unmark_all(*_) -> None:
    """Every managed parameter with its plain class, for Dynamo to trace (the start of a compile)."""
    for p in _params():
        unmark(p)


def _install() -> None:
    """Register the compile callbacks once. `torch._dynamo.reset()` clears every callback (the
    advice zinf gives for a pinned parameter, and what test suites do between tests), while the
    parameters stay managed: the handler's clear() registers ours again."""
    from torch._dynamo.callback import callback_handler as h

    if getattr(h, "_zinf_installed", False):
        return

    def register() -> None:
        h.register_start_callback(unmark_all)
        h.register_end_callback(mark_all)

    cleared = h.clear

    def clear() -> None:
        cleared()
        register()

    h.clear = clear
    h._zinf_installed = True
    register()
