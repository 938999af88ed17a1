"""The `zinf` torch.compile backend: glue from options to Inductor hooks.

    Dynamo graph -> compile_fx(config_patches={custom_partitioner_fn, post_grad_custom_post_pass})
      training:  joint graph -> ZinfPartitioner: default partition, analyse fw+bw, plan, insert
      inference: post-grad graph -> ZinfPostGrad: analyse, plan, insert
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

try:  # torch >= 2.12 tells a post-grad pass whether the graph is an inference graph
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PostGradPass
except ImportError:  # older torch (GPU machines carry 2.11): the partitioner's marker tells instead
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PostGradPass

from zinf_compile import records
from zinf_compile.config import ZinfConfig
from zinf_compile.errors import BudgetError, ZinfError
from zinf_compile.pipeline import fit_tiled, plan_and_rewrite, tile_choices
from zinf_compile.planner import prefetch_param_gathers, try_param_choices
from zinf_compile.runtime.engine import get_engine, register_engine

PLANNED = "zinf_planned"  # output-node meta: this graph was planned by the partitioner
# Parameters smaller than this stay resident when zinf manages parameters (the bookkeeping and the
# latency of a gather outweigh the bytes; DeepSpeed's stage3_param_persistence_threshold is the same idea)
PERSIST_BYTES = 64 << 10


@dataclass(frozen=True)
class ParamInfo:
    """A parameter among a graph's inputs, as plain values."""

    index: int  # position among the graph's inputs (AOT's primals in the same order)
    pid: int  # the parameter store's id
    name: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    managed: bool  # already managed (an earlier compile took it over)
    # False when zinf must leave it resident: it shares its storage with other tensors (freeing
    # it would free them), or an earlier compiled graph reads it directly (see _pin_resident)
    manageable: bool = True


@functools.lru_cache(None)
def _source_hash() -> str:
    """Digest of zinf's own sources: part of every hook's uuid, so a code change misses the cache."""
    from zinf_compile import passes as _p

    h = hashlib.sha256()

    for root in (os.path.dirname(__file__), os.path.dirname(_p.__file__)):
        for dirpath, _, files in sorted(os.walk(root)):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Session:
    """One backend call, as plain values: Inductor deep-copies its config, hooks included, so the
    engine (threads, files) is reached through its key, never held."""

    cfg: ZinfConfig
    device: str
    tier: str
    budget: int
    engine_key: int
    params: tuple[ParamInfo, ...] = ()
    world: int = 1  # ranks in the default process group at compile time

    @staticmethod
    def start(cfg: ZinfConfig, device: str, params: tuple[ParamInfo, ...] = ()) -> "Session":
        tier = cfg.tier_for(device)
        from zinf_compile.runtime.params import world

        n_world = world()[1]
        budget = cfg.budget if cfg.budget is not None else _free_device_memory(device)
        if cfg.budget is None and n_world > 1:
            budget = _shared_default_budget(device, n_world)  # every rank must make the same plan
        # with a share of the peak (budget="80%"), the pipeline sets the budget per graph
        key = int(cfg.key(), 16) & ((1 << 62) - 1)
        register_engine(key, tier, cfg.offload_dir, cfg.io_threads, cfg.o_direct)
        if device == "cpu" and tier == "nvme" and cfg.malloc_mmap_threshold:
            _pin_mmap_threshold(cfg.malloc_mmap_threshold)
        return Session(cfg, device, tier, budget, key, params, n_world)

    @property
    def engine(self):
        return get_engine(self.engine_key)

    def uuid(self) -> str:
        """Covers every plan input: zinf's code, the options, the budget, the profile's numbers."""
        from zinf_compile.cost import load_profile

        profile = json.dumps(load_profile(self.cfg.profile, self.device).to_json(), sort_keys=True)
        digest = hashlib.sha256(profile.encode()).hexdigest()[:16]
        params = hashlib.sha256(repr(self.params).encode()).hexdigest()[:16]
        return f"zinf-{_source_hash()}-{self.cfg.key()}-{self.budget}-{self.device}-{digest}-{params}"


class ZinfPartitioner(CustomPartitionerFn):
    def __init__(self, session: Session) -> None:
        self.session = session

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        primals = [n for n in gm.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]

        def attempt(chosen, last):
            return self._partition(gm if last else copy.deepcopy(gm), chosen, joint_inputs, kwargs), chosen

        return _try_param_choices(self.session, primals, attempt)

    def _partition(self, gm: fx.GraphModule, chosen, joint_inputs, kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from zinf_compile.passes.params import param_meta, partition_with_params

        s = self.session
        managed = {info.index: param_meta(info.name, info.pid, _resident_bytes(s, info), s.tier, info.requires_grad,
                                          s.engine_key, s.cfg.master_dtype) for _, info in chosen}
        # over several ranks, the gradients of resident parameters are averaged as DDP does
        chosen_ids = {info.index for _, info in chosen}
        allreduce = [info.index for info in s.params if info.requires_grad and info.index not in chosen_ids] \
            if s.world > 1 else []
        fw, bw, reports = partition_with_params(min_cut_rematerialization_partition, gm, joint_inputs, kwargs, managed,
                                                allreduce=allreduce, world=s.world)
        graphs = {"forward": fw, "backward": bw}
        nfo = kwargs["num_fwd_outputs"]
        # weights too large to gather whole: tiles (memory-centric tiling); NVMe shards fetched
        # ahead of their gathers, or when that breaks the budget, gathered just in time
        choices = _tile_choices(s, graphs, nfo) if managed else [{}]
        prefetch = (lambda gs, aware: _prefetch_gathers(s, gs, nfo, aware)) if managed and s.tier == "nvme" else None
        graphs, _ = fit_tiled(graphs, choices, lambda gs, rep: plan_and_rewrite(s, gs, nfo, pre_reports=rep),
                              prefetch, reports, room_aware=_fetches_hold_memory(s))
        fw, bw = graphs["forward"], graphs["backward"]
        _take_over(s, [info for _, info in chosen])
        for m in (fw, bw):
            next(iter(m.graph.find_nodes(op="output"))).meta[PLANNED] = True
        return fw, bw

    def uuid(self) -> str:
        return self.session.uuid()


class ZinfPostGrad(_PostGradPass):
    """The last post-grad pass before lowering. Inference graphs reach Inductor without a
    partitioner: plan them here. Every graph's zinf ops are then pinned in the planned order."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        from zinf_compile.passes import PinOrder

        out = next(iter(graph.find_nodes(op="output")))
        if is_inference is None:  # an older torch: training graphs carry the partitioner's marker
            is_inference = not out.meta.get(PLANNED)
        if is_inference and not out.meta.get(PLANNED):
            placeholders = list(graph.find_nodes(op="placeholder"))
            _try_param_choices(self.session, placeholders, lambda chosen, last: (self._plan(graph, chosen), chosen))
            out.meta[PLANNED] = True
        records.attach(graph, PinOrder()(graph))

    def _plan(self, graph: fx.Graph, chosen) -> None:
        """Plan an inference graph. With managed parameters the rewrites (gathers, tiles, fetches)
        are tried on copies, and the one that fits replaces the graph's nodes; a BudgetError leaves
        the graph as it came, so a retry with other parameters starts clean."""
        from zinf_compile.passes.params import InsertGathers, param_meta
        from zinf_compile.pipeline import copy_graphs

        s = self.session
        if not chosen:
            plan_and_rewrite(s, {"inference": graph.owning_module}, -1, pre_reports=[])
            return
        work = copy_graphs({"inference": graph.owning_module})
        wg = work["inference"].graph
        index = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
        copies = list(wg.find_nodes(op="placeholder"))
        managed = {copies[index[n]]: param_meta(info.name, info.pid, _resident_bytes(s, info), s.tier, False,
                                                s.engine_key, s.cfg.master_dtype) for n, info in chosen}
        reports = [InsertGathers()(wg, managed, recompute=False, world=s.world)]
        work["inference"].recompile()
        prefetch = (lambda gs, aware: _prefetch_gathers(s, gs, -1, aware)) if s.tier == "nvme" else None
        done, _ = fit_tiled(work, _tile_choices(s, work, -1), lambda gs, rep: plan_and_rewrite(s, gs, -1, rep),
                            prefetch, reports, room_aware=_fetches_hold_memory(s))
        _transplant(graph, done["inference"].graph)
        _take_over(s, [info for _, info in chosen])

    def uuid(self) -> str:
        return self.session.uuid()


def _transplant(dst: fx.Graph, src: fx.Graph) -> None:
    """Make `dst` (a graph Inductor owns) what `src` (a rewritten copy of it) is: its placeholders
    stay (with src's meta), every other node is replaced by a copy of src's."""
    for n in reversed(list(dst.nodes)):
        if n.op != "placeholder":
            dst.erase_node(n)
    kept = list(dst.find_nodes(op="placeholder"))
    theirs = list(src.find_nodes(op="placeholder"))
    env = dict(zip(theirs, kept))
    for a, b in env.items():
        b.meta.update(a.meta)
    for n in src.nodes:
        if n.op != "placeholder":
            env[n] = dst.node_copy(n, env.__getitem__)
    dst.lint()
    if dst.owning_module is not None:
        dst.owning_module.recompile()


def _try_param_choices(s: Session, primals: list[fx.Node], attempt):
    """Run attempt(chosen, last) on the cheapest choice of managed parameters that fits the budget:
    the parameters as they are, then the fewest (largest first) that free the shortfall, then every
    parameter of PERSIST_BYTES or more. attempt(chosen, last) -> (result, chosen) raises BudgetError
    when a choice does not fit (the choosing itself: planner.try_param_choices)."""
    cands = _match_params(primals, s.params)
    if not cands and any(info.managed for info in s.params):
        raise ZinfError("zinf: this graph's inputs do not line up with its parameters (AOT deduplicated "
                        "some?), but some are managed and must be gathered; call torch._dynamo.reset()")
    forced = [c for c in cands if c[1].managed]
    big = [c for c in cands if c[1].managed or (c[1].nbytes >= PERSIST_BYTES and c[1].manageable
                                                 and not _mutated(c[0]))]
    pinned = [c for c in cands if not c[1].manageable and c[1].nbytes >= PERSIST_BYTES]
    try:
        out = try_param_choices(s.cfg.params, big, forced, lambda c: c[1].nbytes, attempt)
    except BudgetError as e:
        if not pinned:
            raise
        raise BudgetError(e.budget, e.lower_bound, e.best_peak, detail=(
            f"{len(pinned)} large parameter(s) stay resident because a graph compiled earlier (when "
            "they fitted) reads them directly; call torch._dynamo.reset() before this compile or "
            "compile with options={'params': 'offload'} from the start.")) from None
    chosen = out[1]
    _pin_resident(c[1] for c in cands if c not in chosen and c[1].nbytes >= PERSIST_BYTES)
    return out[0]


def _mutated(n: fx.Node) -> bool:
    """The graph writes into this input (an in-place update of a parameter): it stays resident."""
    return any(u.op == "call_function" and u.target is torch.ops.aten.copy_.default and u.args[0] is n
               for u in n.users)


def _pin_resident(infos) -> None:
    """Parameters a compiled graph reads directly: later compiles must not take them over (Dynamo
    would keep running that graph on their freed storage)."""
    from zinf_compile.runtime.params import STORE

    for info in infos:
        STORE.pinned.add(info.pid)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@functools.lru_cache(None)
def _pin_mmap_threshold(nbytes: int) -> bool:
    """Make glibc serve allocations of nbytes and more from their own mappings, returned to the
    system when freed. Setting it also stops glibc from raising the threshold on its own, which
    otherwise keeps freed activations resident and hides the budget from RSS (see bench/)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):  # not glibc
        return False


def _match_params(primals: list[fx.Node], params: tuple[ParamInfo, ...]) -> list[tuple[fx.Node, ParamInfo]]:
    """(primal placeholder, parameter) pairs, checked by shape and dtype: AOT's primals follow the
    graph's inputs one to one unless it deduplicated some, and then zinf manages none."""
    out = []
    for info in params:
        if info.index >= len(primals):
            return []
        n = primals[info.index]
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != info.shape or str(val.dtype) != info.dtype:
            return []
        out.append((n, info))
    return out


def _resident_bytes(s: Session, info: ParamInfo) -> int:
    """What a managed parameter keeps on the device: its shard, unless the tier frees it."""
    from zinf_compile.config import tier_frees_device

    if tier_frees_device(s.tier, s.device):
        return 0
    from zinf_compile.runtime.params import world

    from zinf_compile.passes.params import stored_nbytes

    itemsize = getattr(torch, info.dtype.removeprefix("torch.")).itemsize
    return -(-stored_nbytes(info.nbytes // itemsize, itemsize, s.cfg.master_dtype) // world()[1])


def _shared_default_budget(device: str, n_world: int) -> int:
    """A default budget every rank computes alike without talking (ranks may compile different
    numbers of graphs, so a collective here could hang): 90% of the device's capacity, the host's
    RAM split over the ranks of this host on a CPU device."""
    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory * 0.9)
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", n_world))
    return int(psutil.virtual_memory().total * 0.9) // max(1, local)


def _maps_files(s: Session) -> bool:
    """Gathers map the shard files: a CPU device with buffered (not O_DIRECT) files."""
    return s.device == "cpu" and not s.cfg.o_direct


def _fetches_hold_memory(s: Session) -> bool:
    from zinf_compile.planner import fetch_holds_device_memory

    return fetch_holds_device_memory(s.device, _maps_files(s))


def _prefetch_gathers(s: Session, graphs: dict[str, fx.GraphModule], nfo: int, aware: bool = False) -> list | None:
    """Fetch the graphs' NVMe shards ahead of their gathers; `aware`: only over steps with room
    for what a fetched shard holds (None when nothing would differ from fetching without it)."""
    from zinf_compile.cost import load_profile
    from zinf_compile.pipeline import room_by_node

    profile = load_profile(s.cfg.profile, s.device)
    room = room_by_node(graphs, nfo, s.budget, s.cfg.budget_fraction, s.device, profile).get if aware else None
    reports = prefetch_param_gathers([m.graph for m in graphs.values()], profile, s.tier, s.device, s.world,
                                     mapped=_maps_files(s), room=room)
    if aware and not any(r.counts.get("held back for room") for r in reports):
        return None
    for m in graphs.values():
        m.recompile()
    return reports


def _tile_choices(s: Session, graphs: dict, nfo: int) -> list[dict]:
    from zinf_compile.cost import load_profile

    return tile_choices(graphs, nfo, s.cfg.tiling, s.cfg.max_tile_bytes, s.budget, s.cfg.budget_fraction,
                        load_profile(s.cfg.profile, s.device), s.tier, s.device)


_WARNED: list = []


def _take_over(s: Session, infos: list[ParamInfo]) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from zinf_compile.runtime.params import STORE

    if infos:
        STORE.budget = min(STORE.budget or s.budget, s.budget)  # sizes the optimizer's NVMe chunks
        if s.cfg.params == "auto" and not _WARNED:
            _WARNED.append(True)
            warnings.warn(
                f"zinf: {len(infos)} parameter(s) do not fit the budget and are sharded to the {s.tier} tier "
                "(params='auto'); their gradients go to the shards, not to p.grad: step them with "
                "zinf_compile.optimizer(model, cls, **kwargs) (a plain torch.optim optimizer or "
                "clip_grad_norm_ would not see them).", stacklevel=2)
    with unset_fake_temporarily(), torch.no_grad():  # the partitioner runs under the compile's fake mode
        for info in infos:
            STORE.manage(info.pid, s.tier, s.engine_key,
                         getattr(torch, s.cfg.master_dtype) if s.cfg.master_dtype else None)


def _param_infos(gm: fx.GraphModule, example_inputs) -> tuple[ParamInfo, ...]:
    from zinf_compile.runtime.params import STORE

    names = []
    for n in gm.graph.find_nodes(op="placeholder"):
        arg = n.meta.get("grapharg")
        src = getattr(arg, "source", None)
        name = getattr(src, "name", None) if src is not None else None
        name = name() if callable(name) else name
        names.append(_readable(name) if isinstance(name, str) else n.name)
    out = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.nn.Parameter) and not x.is_meta:
            name = names[i] if i < len(names) else f"param{i}"
            pid = STORE.identify(x, name)
            exclusive = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
            out.append(ParamInfo(i, pid, name, x.numel() * x.element_size(), tuple(x.shape), str(x.dtype),
                                 x.requires_grad, STORE.entry_by_id(pid) is not None,
                                 exclusive and pid not in STORE.pinned))
    return tuple(out)


def _readable(source: str) -> str:
    """L['self']._modules['fc1']._parameters['weight'] -> fc1.weight (the module's own name for it)"""
    import re

    keys = [a or b for a, b in re.findall(r"\['([^']+)'\]|\[(\d+)\]", source)]
    if source.startswith("L[") and len(keys) > 1:
        keys = keys[1:]  # the local variable holding the module
    return ".".join(keys) or source


def _free_device_memory(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        # the graph's plan counts the parameters already resident: add back what torch holds
        return int(free + torch.cuda.memory_allocated())
    import psutil

    return int(psutil.virtual_memory().available)


def _graph_device(example_inputs) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return x.device.type
    return "cpu"


def zinf_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **_: Any):
    """The backend torch.compile(backend="zinf", options={...}) calls."""
    from torch._inductor.compile_fx import compile_fx

    from zinf_compile.runtime import ops  # noqa: F401  (registers zinf:: ops)

    cfg = ZinfConfig.from_options(options)
    session = Session.start(cfg, _graph_device(example_inputs), _param_infos(gm, example_inputs))
    patches = {
        "custom_partitioner_fn": ZinfPartitioner(session),
        "post_grad_custom_post_pass": ZinfPostGrad(session),
    }
    from zinf_compile.runtime.params import STORE

    before = {e.index for e in STORE.entries()}
    try:
        if cfg.cache:
            return compile_fx(gm, example_inputs, config_patches=patches)
        patches["fx_graph_cache"] = False
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)
    except BaseException:
        # the partitioner took parameters over, then something later failed: no graph will gather
        # them, so give them their data back (Dynamo may run the model eagerly next)
        for pid in {e.index for e in STORE.entries()} - before:
            try:
                STORE.release_id(pid)
            except Exception as cleanup:  # the compile's own error is the one to see
                warnings.warn(f"zinf: could not give parameter #{pid} its data back: {cleanup}", stacklevel=2)
        raise
