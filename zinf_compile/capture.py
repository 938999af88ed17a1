"""Offline capture: forward and backward graphs of a model built under FakeTensorMode, so that
`zinf plan` can plan a 7B-parameter model on a laptop without allocating a byte of it."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from zinf_compile.errors import ZinfConfigError


def load_factory(spec: str) -> Callable[..., Any]:
    """`path/to/file.py:fn` or `package.module:fn` -> the callable."""
    if ":" not in spec:
        raise ZinfConfigError(f"FACTORY must look like 'file.py:build' or 'module:build', got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.path.sep in where:
        if not os.path.exists(where):
            raise ZinfConfigError(f"no such file {where!r} (from FACTORY {spec!r})")
        mod_name = "_zinf_factory_" + os.path.splitext(os.path.basename(where))[0]
        s = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(s)
        sys.modules[mod_name] = module
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ZinfConfigError(f"{where!r} has no callable {name!r}")
    return fn


def parse_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values become int, float, bool or stay strings."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise ZinfConfigError(f"--arg expects key=value, got {p!r}")
        k, v = p.split("=", 1)
        if not k.strip().isidentifier():
            raise ZinfConfigError(f"--arg expects key=value with a keyword name as key, got {p!r}")
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _loss_of(out) -> torch.Tensor:
    """The output's `.loss` if it has one, the output if it is a scalar, else its sum."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.sum()
    if isinstance(out, (tuple, list)):
        return sum(_loss_of(o) for o in out if isinstance(o, torch.Tensor) or hasattr(o, "loss"))
    raise ZinfConfigError(f"cannot derive a loss from a model output of type {type(out).__name__}")


@dataclass(frozen=True)
class CapturedParam:
    """A model parameter among the joint graph's primals, as plain values."""

    index: int  # position among the primals (the model's parameters come first, in order)
    name: str  # the model's name for it, e.g. "blocks.0.fc.weight"
    nbytes: int
    requires_grad: bool
    dtype: str = "float32"  # torch's name for it, without "torch."


@dataclass
class Captured:
    """What `trace` captured: the graphs as a real compile partitions them with every parameter
    resident, and the model's parameters (empty when the graph's inputs do not line up with them)."""

    graphs: dict[str, fx.GraphModule]
    num_fwd_outputs: int
    params: tuple[CapturedParam, ...] = ()


def _partition_fn(joint, joint_inputs, **kw):
    """min-cut as a real compile; torch's default split when the solver fails."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    try:
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw)
    except Exception as e:  # the min-cut solver can fail on unusual graphs: plan the default split
        warnings.warn(f"zinf plan: the min-cut partitioner failed ({e}); planning torch's default "
                      f"partition instead, which saves more for backward than a real compile would")
        return default_partition(joint, joint_inputs, **kw)


def capture(factory: Callable[..., Any], kwargs: dict[str, Any], inference: bool = False):
    """Build the model under FakeTensorMode and trace it. Returns (graphs by role, num_fwd_outputs)."""
    c = trace(factory, kwargs, inference=inference)
    return c.graphs, c.num_fwd_outputs


def trace(factory: Callable[..., Any], kwargs: dict[str, Any], inference: bool = False,
          on_joint: Callable | None = None, on_inference: Callable | None = None) -> Captured:
    """Build the model under FakeTensorMode and trace it as a real compile does: training, the
    joint graph of the loss through the partitioner (or `on_joint(joint, joint_inputs, kwargs,
    params)` -> (forward, backward), which plans it); inference, the forward graph (or
    `on_inference(gm, params)` -> gm). `params`: the model's parameters, if the graph's inputs
    line up with them."""
    from torch._functorch.aot_autograd import aot_function

    graphs: dict[str, fx.GraphModule] = {}
    nfo: list[int] = []
    box: dict[str, Any] = {}

    def partition(joint, joint_inputs, **kw):
        params = box["params"] = _checked(box["params"], joint)
        with ranges.suspended():
            fw, bw = on_joint(joint, joint_inputs, kw, params) if on_joint else _partition_fn(joint, joint_inputs, **kw)
        graphs["forward"], graphs["backward"] = fw, bw
        nfo.append(kw["num_fwd_outputs"])
        raise _Traced  # the graphs are what we came for: AOT need not wrap them nor run them on fakes

    def keep_inference(gm, _inputs):
        params = box["params"] = _checked(box["params"], gm)
        with ranges.suspended():
            graphs["inference"] = on_inference(gm, params) if on_inference else gm
        raise _Traced

    ranges = _RandomRanges()
    with FakeTensorMode(allow_non_fake_inputs=False), _compiling(), ranges:
        try:
            built = factory(**kwargs)
        except TypeError as e:  # a wrong or wrongly typed --arg, as the factory saw it
            raise ZinfConfigError(f"the factory rejected its arguments {kwargs}: {e}") from e
        if not (isinstance(built, tuple) and len(built) == 2):
            raise ZinfConfigError("FACTORY must return (model, example_inputs)")
        model, inputs = built
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        named = [*model.named_parameters(), *model.named_buffers()]
        names = [n for n, _ in named]
        k = len(named)
        if inference:
            model.requires_grad_(False)
        box["params"] = tuple(CapturedParam(i, n, p.numel() * p.element_size(), p.requires_grad,
                                            str(p.dtype).removeprefix("torch."))
                              for i, (n, p) in enumerate(model.named_parameters()))

        def run(*args):
            out = torch.func.functional_call(model, dict(zip(names, args[:k])), args[k:])
            return out if inference else _loss_of(out)

        # enable_log off: AOT would print every graph to a string for its logs (~1 s per 10k nodes)
        try:
            if inference:
                compiled = aot_function(run, fw_compiler=keep_inference, inference_compiler=keep_inference,
                                        num_params_buffers=k, enable_log=False)
                with torch.no_grad():
                    compiled(*[t for _, t in named], *inputs)
            else:
                compiled = aot_function(run, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                                        partition_fn=partition, num_params_buffers=k, enable_log=False)
                compiled(*[t for _, t in named], *inputs)
        except _Traced:
            pass
        except DataDependentOutputException as e:
            raise ZinfConfigError(
                f"the model reads a tensor's value in Python ({e.func}: an `if` on a tensor, `.item()`, "
                f"`.tolist()`); zinf plan traces without values, so it cannot follow that branch. Plan with "
                f"values that decide it (a LayerDrop of 0), with --inference, or compile the model for real"
            ) from e
    if ranges.sites:
        where = ", ".join(sorted(os.path.basename(x) for x in ranges.sites)[:3])
        warnings.warn(f"zinf plan: the model branches in Python on a random draw at {len(ranges.sites)} "
                      f"place(s) ({where}), decided by the draw's range ({ranges.example}); torch.compile "
                      f"breaks the graph at each of them, so the plan traces one graph where a real compile has several")
    return Captured(graphs, nfo[0] if nfo else -1, box["params"])


class _Traced(Exception):
    """Raised from AOT's partition or inference compiler once the graphs are captured (and planned):
    the rest of aot_function (its runtime wrappers, one run of the compiled graphs on fake
    tensors) only costs time here."""


def _compiling():
    """Tell model code it is being compiled (torch.compiler.is_compiling() is True), as a real
    torch.compile does: Hugging Face models then skip the data-dependent checks (an all-ones
    attention mask, `torch.all(mask == 1)`) that FakeTensorMode cannot answer. torch's own
    context for a compile session where this torch has it; else nothing changes."""
    import contextlib

    ctx = getattr(torch.compiler, "_compile_session_context", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


class _RandomRanges(torch.overrides.TorchFunctionMode):
    """Answers a comparison of a random draw with a constant outside its range. Hugging Face's
    LayerDrop (BART, Whisper, ...) runs `torch.rand([]) < self.layerdrop` in Python in train mode;
    FakeTensorMode has no value to compare, but with layerdrop 0 (every config's default) the
    answer is known: a draw of torch.rand lies in [0, 1). A comparison the range cannot decide
    stays data-dependent: `trace` turns the failure into a ZinfConfigError saying what to do."""

    _CMP = {"lt": lambda lo, hi, c: True if hi <= c else False if lo >= c else None,
            "le": lambda lo, hi, c: True if hi <= c else False if lo > c else None,
            "gt": lambda lo, hi, c: True if lo > c else False if hi <= c else None,
            "ge": lambda lo, hi, c: True if lo >= c else False if hi <= c else None}

    def __init__(self) -> None:
        super().__init__()
        self._draws: dict[int, Any] = {}  # id -> weakref of each scalar draw (tensors hash by id, compare by value)
        self.sites: set[str] = set()  # file:line of each branch decided (AOT runs the model twice)
        self.example = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").strip("_")  # `draw < c` arrives as Tensor.lt(draw, c)
        if name in self._CMP and len(args) == 2 and self._is_draw(args[0]) \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
            answer = self._CMP[name](0.0, 1.0, float(args[1]))  # a draw of torch.rand lies in [0, 1)
            if answer is not None:
                self.sites.add(_caller())
                self.example = self.example or f"torch.rand(...) {name} {args[1]} is always {answer}"
                return torch.tensor(answer)
        out = func(*args, **kwargs)
        if func is torch.rand and isinstance(out, torch.Tensor) and out.numel() == 1:
            import weakref

            self._draws[id(out)] = weakref.ref(out)
        return out

    @contextlib.contextmanager
    def suspended(self):
        """Off while the partitioner and zinf's passes run on the traced graphs (the model's code has
        run): an active TorchFunctionMode sends every torch call through Python, which made the
        pipeline of a 32-layer GPT ~1.5x slower."""
        from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

        if self not in _get_current_function_mode_stack():
            yield
            return
        above = []
        while (m := _pop_mode()) is not self:
            above.append(m)
        for m in reversed(above):
            _push_mode(m)
        try:
            yield
        finally:
            for _ in above:
                _pop_mode()
            _push_mode(self)
            for m in reversed(above):
                _push_mode(m)

    def _is_draw(self, t) -> bool:
        ref = self._draws.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t


def _caller() -> str:
    """file:line of the innermost frame outside torch (the model's code that compared)."""
    import sys

    torch_dir = os.path.dirname(torch.__file__)
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(torch_dir) or f.f_code.co_filename == __file__):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def _checked(params: tuple[CapturedParam, ...], gm: fx.GraphModule) -> tuple[CapturedParam, ...]:
    """The parameters, if the graph's inputs are the model's parameters first and in order (by
    size); none otherwise (AOT deduplicated some), and then no parameter can be managed."""
    primals = list(gm.graph.find_nodes(op="placeholder"))
    for p in params:
        val = primals[p.index].meta.get("val") if p.index < len(primals) else None
        if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() != p.nbytes:
            warnings.warn("zinf plan: the traced graph's inputs do not line up with the model's parameters; "
                          "planning with every parameter resident")
            return ()
    return params


# -- parameters (ZeRO-3) in the offline plan ---------------------------------------------------------


PARAM_MODES = ("auto", "offload", "resident")  # as the backend's `params` option


@dataclass(frozen=True)
class OfflinePlan:
    plan: Any
    graphs: dict[str, fx.GraphModule]  # planned; their Python code not regenerated (gm.recompile() to run one)
    managed: tuple[CapturedParam, ...]  # the parameters the plan manages
    params: tuple[CapturedParam, ...]  # every parameter of the model (empty: they could not be matched)
    seconds: dict[str, float]  # per pass and planning phase
    num_fwd_outputs: int = -1


def plan_offline(factory: Callable[..., Any], kwargs: dict[str, Any], budget: int, profile, tier: str,
                 params: str = "auto", inference: bool = False, device: str = "cpu", tiling: str = "auto",
                 max_tile_bytes: int | None = None, gather_dtype: str | None = None) -> OfflinePlan:
    """Trace the model under FakeTensorMode and plan it through the same pipeline as the backend
    (one rank; buffered files). `params` as the backend's option: "auto" manages the fewest
    parameters (of PERSIST_BYTES or more) that fit, "offload" all of them, "resident" none.
    `gather_dtype` as the backend's option: the gathers read copies in that dtype."""
    from zinf_compile.config import tier_frees_device
    from zinf_compile.passes.params import gather_dtype_of, param_meta
    from zinf_compile.analysis.facts import paused_gc
    from zinf_compile.pipeline import Request, compile_inference, compile_joint
    from zinf_compile.planner import PERSIST_BYTES, DeviceModel

    if params not in PARAM_MODES:
        raise ZinfConfigError(f"params: expected one of {', '.join(PARAM_MODES)}, got {params!r}")
    frees = tier_frees_device(tier, profile.device)  # planned for the target, as the backend plans its device
    model = DeviceModel(profile.device, tier, 1, maps_files=profile.device == "cpu")
    done: dict[str, Any] = {}

    def request(cparams):
        cands = tuple((p.index, param_meta(p.name, p.index, 0 if frees else p.nbytes, tier, p.requires_grad,
                                           gather=gather_dtype_of(gather_dtype, p.dtype)), False)
                      for p in cparams if p.nbytes >= PERSIST_BYTES) if params != "resident" else ()
        return Request(profile=profile, model=model, budget=budget, params_mode=params, candidates=cands,
                       tiling=tiling, max_tile_bytes=max_tile_bytes, trace_device=device, codegen=False)

    def on_joint(joint, joint_inputs, kw, cparams):
        done["c"] = compile_joint(joint, joint_inputs, kw, _partition_fn, request(cparams))
        return done["c"].graphs["forward"], done["c"].graphs["backward"]

    def on_inference(gm, cparams):
        done["c"] = compile_inference(gm, request(cparams))
        return gm

    # the cyclic GC paused for the whole trace: tracing a 64-layer GPT makes millions of objects, and
    # each full collection walks them all (CPU time 16.3 -> 12.7 s, peak RSS 499 -> 538 MB)
    c = paused_gc(trace)(factory, kwargs, inference=inference, on_joint=on_joint, on_inference=on_inference)
    compiled = done["c"]
    managed = tuple(p for p in c.params if p.index in compiled.managed)
    return OfflinePlan(compiled.plan, compiled.graphs, managed, c.params, dict(compiled.seconds), c.num_fwd_outputs)
