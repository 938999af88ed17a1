"""Offline capture: forward and backward graphs of a model built under FakeTensorMode, so that
`zinf plan` can plan a 7B-parameter model on a laptop without allocating a byte of it."""
from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

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


@dataclass
class Captured:
    """What `trace` captured: the graphs as a real compile partitions them with every parameter
    resident and, to plan again with managed parameters, (training, when asked) the joint graph."""

    graphs: dict[str, fx.GraphModule]
    num_fwd_outputs: int
    params: tuple[CapturedParam, ...] = ()  # empty when the graph's inputs do not line up with them
    joint: fx.GraphModule | None = None  # untouched by any partition; `partition` copies it
    joint_inputs: Any = None
    partition_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def can_manage(self) -> bool:
        """Whether `partition` can manage parameters (inference, or training with the joint kept)."""
        return bool(self.params) and ("inference" in self.graphs or self.joint is not None)

    def partition(self, managed: dict[int, dict]) -> tuple[dict[str, fx.GraphModule], list]:
        """The graphs with the parameters in `managed` (input index -> param_meta) managed, as the
        backend does: gathered before use (training: again in backward, and gradients reduced into
        their shards). Fresh graphs each call. Returns (graphs, the parameter passes' reports)."""
        from zinf_compile.passes.params import InsertGathers, partition_with_params
        from zinf_compile.runtime import ops  # noqa: F401  (registers the zinf:: ops)

        if not managed:
            return self.graphs, []
        if not self.can_manage:
            raise ZinfConfigError("this capture kept no joint graph to manage parameters in: "
                                  "trace(..., keep_joint=True)")
        if "inference" in self.graphs:
            gm = _copy(self.graphs["inference"])
            inputs = list(gm.graph.find_nodes(op="placeholder"))
            report = InsertGathers()(gm.graph, {inputs[i]: m for i, m in managed.items()}, recompute=False)
            gm.recompile()
            return {"inference": gm}, [report]
        fw, bw, reports = partition_with_params(_partition_fn, _copy(self.joint), self.joint_inputs,
                                                dict(self.partition_kwargs), managed)
        return {"forward": fw, "backward": bw}, reports


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    with warnings.catch_warnings():  # torch's pytree warns about its own specs while they are copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm)


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
    """Build the model under FakeTensorMode and trace it. Returns (graphs by role, num_fwd_outputs).

    Training: the joint graph of the loss goes through the default partitioner, as in a real
    compile, and the forward/backward pair comes back. Inference: the forward graph alone.
    """
    c = trace(factory, kwargs, inference=inference)
    return c.graphs, c.num_fwd_outputs


def trace(factory: Callable[..., Any], kwargs: dict[str, Any], inference: bool = False,
          keep_joint: bool = False) -> Captured:
    """`capture`, keeping what planning with managed parameters needs: the parameters' names and
    sizes and, with `keep_joint` (training), a copy of the joint graph to partition again."""
    from torch._functorch.aot_autograd import aot_function

    graphs: dict[str, fx.GraphModule] = {}
    nfo: list[int] = []
    kept: dict[str, Any] = {}

    def partition(joint, joint_inputs, **kw):
        if keep_joint:
            kept.update(joint=_copy(joint), joint_inputs=joint_inputs, partition_kwargs=dict(kw))
        fw, bw = _partition_fn(joint, joint_inputs, **kw)
        graphs["forward"], graphs["backward"] = fw, bw
        nfo.append(kw["num_fwd_outputs"])
        return fw, bw

    def keep_inference(gm, _inputs):
        graphs["inference"] = gm
        return gm

    with FakeTensorMode(allow_non_fake_inputs=False):
        built = factory(**kwargs)
        if not (isinstance(built, tuple) and len(built) == 2):
            raise ZinfConfigError("FACTORY must return (model, example_inputs)")
        model, inputs = built
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        named = [*model.named_parameters(), *model.named_buffers()]
        names = [n for n, _ in named]
        k = len(named)
        if inference:
            model.requires_grad_(False)
        params = tuple(CapturedParam(i, n, p.numel() * p.element_size(), p.requires_grad)
                       for i, (n, p) in enumerate(model.named_parameters()))

        def run(*args):
            out = torch.func.functional_call(model, dict(zip(names, args[:k])), args[k:])
            return out if inference else _loss_of(out)

        if inference:
            compiled = aot_function(run, fw_compiler=keep_inference, inference_compiler=keep_inference,
                                    num_params_buffers=k)
            with torch.no_grad():
                compiled(*[t for _, t in named], *inputs)
        else:
            compiled = aot_function(run, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                                    partition_fn=partition, num_params_buffers=k)
            compiled(*[t for _, t in named], *inputs)
    if kept or inference:
        params = _checked(params, kept["joint"] if kept else graphs["inference"])
    return Captured(graphs, nfo[0] if nfo else -1, params, **kept)


def _checked(params: tuple[CapturedParam, ...], gm: fx.GraphModule) -> tuple[CapturedParam, ...]:
    """The parameters, if the graph's inputs are the model's parameters first and in order (by
    size); none otherwise (AOT deduplicated some), and then no parameter can be managed."""
    primals = [n for n in gm.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
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
    facts: Any
    plan: Any
    graphs: dict[str, fx.GraphModule]
    managed: tuple[CapturedParam, ...]  # the parameters the plan manages
    tried: tuple[str, ...]  # each choice tried, the last the plan's: "all resident: needs ..", "4 of 10 managed"


def plan_captured(c: Captured, budget: int, profile, tier: str, params: str = "auto",
                  device: str = "cpu", tiling: str = "auto", max_tile_bytes: int | None = None) -> OfflinePlan:
    """Plan a capture as the backend's partitioner would: `params` "resident" keeps every parameter
    on the device; "offload" manages every parameter of PERSIST_BYTES or more; "auto" tries
    resident, then the fewest (largest first) that close the shortfall, then all of them."""
    from zinf_compile.backend import PERSIST_BYTES
    from zinf_compile.planner import try_param_choices
    from zinf_compile.units import format_bytes

    if params not in PARAM_MODES:
        raise ZinfConfigError(f"params: expected one of {', '.join(PARAM_MODES)}, got {params!r}")
    big = [p for p in c.params if p.nbytes >= PERSIST_BYTES] if c.can_manage else []
    tried: list[str] = []

    def failed(chosen, e):
        tried.append(f"{_what(chosen, len(c.params))}: needs {format_bytes(max(e.lower_bound, e.best_peak))} "
                     f"> budget {format_bytes(e.budget)}")

    return try_param_choices(params, big, [], lambda p: p.nbytes,
                             lambda chosen, _last: _plan_with(c, chosen, budget, profile, tier, device, tried,
                                                              tiling, max_tile_bytes),
                             on_fail=failed)


def _what(chosen: list[CapturedParam], n_params: int) -> str:
    return "all resident" if not chosen else f"{len(chosen)} of {n_params} managed"


def _plan_with(c: Captured, chosen: list[CapturedParam], budget, profile, tier, device, tried,
               tiling: str = "auto", max_tile_bytes: int | None = None) -> OfflinePlan:
    """Plan one choice of managed parameters as the backend does: weights too large to gather
    whole in tiles, NVMe shards fetched ahead of their gathers or, when that breaks the budget,
    gathered just in time."""
    import dataclasses

    from zinf_compile.config import tier_frees_device
    from zinf_compile.passes.params import param_meta
    from zinf_compile.pipeline import fit_tiled, plan_graphs, tile_choices
    from zinf_compile.planner import managed_params, tiled_ops_of, with_param_actions

    frees = tier_frees_device(tier, profile.device)  # planned for the target, as plan_graphs does
    managed = {p.index: param_meta(p.name, p.index, 0 if frees else p.nbytes, tier, p.requires_grad)
               for p in chosen}
    graphs, _ = c.partition(managed)
    what = _what(chosen, len(c.params))

    def finish(graphs, _reports):
        facts, plan = plan_graphs(graphs, c.num_fwd_outputs, budget, profile, tier, device=device)
        mp = managed_params(graphs.values(), 1)
        if mp:
            plan = with_param_actions(plan, facts, mp, profile)
        tiles = tiled_ops_of(graphs)
        if tiles:
            plan = dataclasses.replace(plan, tiles=tiles)
        n_tiled = len({t.param for t in tiles})
        return OfflinePlan(facts, plan, graphs, tuple(chosen),
                           (*tried, what + (f", {n_tiled} weight(s) tiled" if n_tiled else "")))

    choices = tile_choices(graphs, c.num_fwd_outputs, tiling, max_tile_bytes, budget, None, profile, tier,
                           device) if managed else [{}]

    def failed(tiles, ahead, _e):
        how = [f"{len(tiles)} weight(s) tiled"] * bool(tiles) + ["fetched ahead"] * ahead
        if how:  # a choice's last failure is the caller's to report
            tried.append(f"{what}, {', '.join(how)}: over budget")

    return fit_tiled(graphs, choices, finish,
                     (lambda gs, aware: _prefetch_gathers(gs, tier, profile))
                     if managed and tier == "nvme" else None, on_fail=failed)[1]


def _prefetch_gathers(graphs: dict[str, fx.GraphModule], tier: str, profile) -> list:
    """As the backend (one rank offline; buffered I/O, the default: on a CPU target the gathers map
    the files, and on a GPU a fetched shard lands in host memory, so no fetch holds device memory
    and fit_tiled makes no room-aware try)."""
    from zinf_compile.planner import prefetch_param_gathers

    reports = prefetch_param_gathers([gm.graph for gm in graphs.values()], profile, tier, profile.device,
                                     mapped=profile.device == "cpu")
    for gm in graphs.values():
        gm.recompile()
    return reports
