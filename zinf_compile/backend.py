"""The `zinf` torch.compile backend: glue from options to Inductor hooks.

    Dynamo graph -> compile_fx(config_patches={custom_partitioner_fn, post_grad_custom_post_pass})
      training:  joint graph -> ZinfPartitioner -> pipeline.compile_joint (every pass, one plan)
      inference: post-grad graph -> ZinfPostGrad -> pipeline.compile_inference
      every graph: ZinfPostGrad pins the planned order of zinf ops (PinOrder)
The backend chooses the candidates (which parameters zinf may manage) and takes over the ones the
plan manages; the pipeline decides and rewrites.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
import weakref
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
from zinf_compile.errors import BudgetError, ZinfError, eager_fallback_refusal
from zinf_compile.ir import output_node
from zinf_compile.planner import PERSIST_BYTES, DeviceModel, direct_io
from zinf_compile.runtime.state import RUNTIME, get_engine, register_engine

PLANNED = "zinf_planned"  # output-node meta: this graph was planned by the partitioner


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
    group: str | None = None  # its name, for the collectives the passes insert
    token: int = 0  # the _CompiledToken of the function this backend call returns

    @staticmethod
    def start(cfg: ZinfConfig, device: str, params: tuple[ParamInfo, ...] = (), token: int = 0,
              file_bytes: int | None = None) -> "Session":
        """`file_bytes`: what the run will keep in swap files, where the caller knows it better than
        `params` say (materialize and load_pretrained: every parameter they shard)."""
        tier = cfg.tier_for(device)
        from zinf_compile.runtime.params import world

        n_world = world()[1]
        budget = cfg.budget if cfg.budget is not None else _free_device_memory(device)
        if cfg.budget is None and n_world > 1:
            budget = _shared_default_budget(device, n_world)  # every rank must make the same plan
        # with a share of the peak (budget="80%"), the pipeline sets the budget per graph
        key = int(cfg.key(), 16) & ((1 << 62) - 1)
        engine = register_engine(key, tier, cfg.offload_dir, cfg.io_threads, cfg.o_direct)
        engine.checksums = cfg.checksums  # the key covers it: this engine's files all have sums or none
        if tier == "nvme":
            nbytes = file_bytes if file_bytes is not None else _params_file_bytes(params)
            engine.choose_direct(direct_io(cfg.o_direct, nbytes, _cache_room(device, cfg.budget)))
        if device == "cpu" and tier == "nvme" and cfg.malloc_mmap_threshold:
            _pin_mmap_threshold(cfg.malloc_mmap_threshold)
        group = None
        if n_world > 1:
            import torch.distributed as dist

            group = dist.group.WORLD.group_name
        return Session(cfg, device, tier, budget, key, params, n_world, group, token)

    def request(self, primals: list[fx.Node]):
        """The pipeline's Request for a graph whose inputs `primals` include these parameters."""
        from zinf_compile.cost import load_profile
        from zinf_compile.passes.params import gather_dtype_of, param_meta
        from zinf_compile.pipeline import Request

        cands, resident = _candidates(self, primals)
        model = DeviceModel(self.device, self.tier, self.world, maps_files=_maps_files(self))
        metas = tuple((primals.index(n), param_meta(info.name, info.pid, _resident_bytes(self, info), self.tier,
                                                    info.requires_grad, self.engine_key, self.cfg.master_dtype,
                                                    gather_dtype_of(self.cfg.gather_dtype,
                                                                    info.dtype.removeprefix("torch."),
                                                                    self.cfg.master_dtype)),
                       info.managed) for n, info in cands)
        allreduce = tuple(primals.index(n) for n, info in resident if info.requires_grad) if self.world > 1 else ()
        direct = self.tier == "nvme" and self.engine.direct  # the reads the plan times: as the run does them
        return Request(
            profile=load_profile(self.cfg.profile, self.device).seen_by(direct), model=model,
            budget=None if self.cfg.budget_fraction is not None else self.budget,
            budget_fraction=self.cfg.budget_fraction, params_mode=self.cfg.params, candidates=metas,
            allreduce=allreduce, group=self.group, tiling=self.cfg.tiling, max_tile_bytes=self.cfg.max_tile_bytes,
            engine_key=self.engine_key, verify=self.cfg.verify, dump_dir=self.cfg.dump_dir,
            disabled=frozenset(self.cfg.disabled_passes))

    @property
    def engine(self):
        return get_engine(self.engine_key)

    def uuid(self) -> str:
        """Covers every plan input: zinf's code, the options, the budget, the profile's numbers."""
        from zinf_compile.cost import load_profile

        profile = json.dumps(load_profile(self.cfg.profile, self.device).to_json(), sort_keys=True)
        digest = hashlib.sha256(profile.encode()).hexdigest()[:16]
        params = hashlib.sha256(repr(self.params).encode()).hexdigest()[:16]
        direct = int(self.tier == "nvme" and self.engine.direct)
        return f"zinf-{_source_hash()}-{self.cfg.key()}-{self.budget}-{self.device}-{digest}-{params}-{direct}"


class ZinfPartitioner(CustomPartitionerFn):
    def __init__(self, session: Session) -> None:
        self.session = session

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from zinf_compile.analysis import primal_nodes
        from zinf_compile.pipeline import compile_joint

        primals = primal_nodes(gm.graph, joint_inputs)
        req = self.session.request(primals)
        done = _compiled(self.session, req, lambda: compile_joint(gm, joint_inputs, kwargs,
                                                                  min_cut_rematerialization_partition, req))
        fw, bw = done.graphs["forward"], done.graphs["backward"]
        for m in (fw, bw):
            output_node(m.graph).meta[PLANNED] = True
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
        from zinf_compile.pipeline import compile_inference

        out = output_node(graph)
        if is_inference is None:  # an older torch: training graphs carry the partitioner's marker
            is_inference = not out.meta.get(PLANNED)
        if is_inference and not out.meta.get(PLANNED):
            req = self.session.request(list(graph.find_nodes(op="placeholder")))
            _compiled(self.session, req, lambda: compile_inference(graph.owning_module, req))
            output_node(graph).meta[PLANNED] = True
        if "pin-order" not in self.session.cfg.disabled_passes:
            records.attach(graph, PinOrder().pin(graph))

    def uuid(self) -> str:
        return self.session.uuid()


def _compiled(s: Session, req, run):
    """Run the pipeline; take over the parameters its plan manages. A BudgetError where parameters
    a graph compiled earlier reads directly were left out says so."""
    try:
        done = run()
    except BudgetError as e:
        _close_if_idle(s)
        pinned = [info for info in s.params if not info.manageable and not info.managed and info.nbytes >= PERSIST_BYTES]
        if not pinned:
            raise
        raise BudgetError(e.budget, e.lower_bound, e.best_peak, detail=(
            f"{len(pinned)} large parameter(s) stay resident because a graph compiled earlier (when "
            "they fitted) reads them directly; call torch._dynamo.reset() before this compile or "
            "compile with options={'params': 'offload'} from the start.")) from None
    except BaseException:
        _close_if_idle(s)
        raise
    by_pid = {info.pid: info for info in s.params}
    cand_pids = {m.pid for _, m, _ in req.candidates}
    # managed already (an earlier compile, or zinf_compile.load_pretrained / materialize): they stay
    _take_over(s, [by_pid[pid] for pid in sorted(done.managed) if not by_pid[pid].managed], done.plan.budget)
    _pin_resident((by_pid[pid] for pid in cand_pids - done.managed), s.token)
    owner = RUNTIME.pins.owner(s.token)  # the compiled function's token: these live as long as it
    if owner is not None:
        RUNTIME.engines.hold(s.engine_key, owner)
        if getattr(done, "record", None) is not None:
            records.hold(done.record, owner)
    return done


def _close_if_idle(s: Session) -> None:
    """Leave no empty swap folder behind a failed compile; a folder holding any file (parameter
    shards, optimizer states) stays: its descriptors are in use."""
    eng = s.engine
    if eng.live_tickets() == 0 and (eng._swap is None or eng._swap.file_count() == 0):
        eng.close()


def _candidates(s: Session, primals: list[fx.Node]):
    """(candidates, resident): the (primal, parameter) pairs zinf may manage (those managed
    already, and those of PERSIST_BYTES or more it can free), and the others."""
    pairs = _match_params(primals, s.params)
    if not pairs and any(info.managed for info in s.params):
        raise ZinfError("zinf: this graph's inputs do not line up with its parameters (AOT deduplicated "
                        "some?), but some are managed and must be gathered; call torch._dynamo.reset()")
    if s.cfg.params == "resident":
        cands = [c for c in pairs if c[1].managed]
    else:
        cands = [c for c in pairs if c[1].managed or (c[1].nbytes >= PERSIST_BYTES and c[1].manageable
                                                       and not _mutated(c[0]))]
    return cands, [c for c in pairs if c not in cands]


def _mutated(n: fx.Node) -> bool:
    """The graph writes into this input (an in-place update of a parameter): it stays resident."""
    return any(u.op == "call_function" and u.target is torch.ops.aten.copy_.default and u.args[0] is n
               for u in n.users)


class _CompiledToken:
    """Lives as long as the function a zinf_backend call returned (Dynamo drops that function on
    torch._dynamo.reset()): the parameters its graphs read directly are pinned while it lives."""


def _holding(fn, token: _CompiledToken):
    """fn, with the token in its closure: the pins of this compile live as long as Dynamo keeps the
    compiled function (Dynamo re-wraps what a backend returns, keeping its code and closure, not
    the function object or its attributes: measured on torch 2.13)."""

    @functools.wraps(fn)
    def run(*args):
        assert token is not None
        return fn(*args)

    return run


def _pin_resident(infos, token: int) -> None:
    """Parameters a compiled graph reads directly: later compiles must not take them over while
    that graph lives (Dynamo would keep running it on their freed storage)."""
    RUNTIME.pins.pin((info.pid for info in infos), token)


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
    """Gathers map the shard files: a CPU device whose engine reads buffered files (the engine
    knows: it falls back from O_DIRECT where the file system refuses it)."""
    return s.device == "cpu" and s.engine.can_map()


def _take_over(s: Session, infos: list[ParamInfo], budget: int) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from zinf_compile.runtime.state import STORE

    if infos:
        if s.cfg.params == "auto" and "auto-managed" not in RUNTIME.warned:
            RUNTIME.warned.add("auto-managed")
            warnings.warn(
                f"zinf: {len(infos)} parameter(s) do not fit the budget and are sharded to the {s.tier} tier "
                "(params='auto'); their gradients go to the shards, not to p.grad: step them with "
                "zinf_compile.optimizer(model, cls, **kwargs) (a plain torch.optim optimizer or "
                "clip_grad_norm_ would not see them).", stacklevel=2)
    with unset_fake_temporarily(), torch.no_grad():  # the partitioner runs under the compile's fake mode
        for info in infos:
            STORE.manage(info.pid, s.tier, s.engine_key,
                         getattr(torch, s.cfg.master_dtype) if s.cfg.master_dtype else None, budget=budget,
                         gather_dtype=getattr(torch, s.cfg.gather_dtype) if s.cfg.gather_dtype else None)


def _param_infos(gm: fx.GraphModule, example_inputs) -> tuple[ParamInfo, ...]:
    from zinf_compile.runtime.params import take_over_refusal
    from zinf_compile.runtime.state import STORE

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
            out.append(ParamInfo(i, pid, name, x.numel() * x.element_size(), tuple(x.shape), str(x.dtype),
                                 x.requires_grad, STORE.entry_by_id(pid) is not None,
                                 take_over_refusal(x) is None and not RUNTIME.pins.pinned(pid)))
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


def file_bytes(param_bytes: int, trained: bool) -> int:
    """Bytes a run may keep in swap files, for planner.direct_io: the parameters, and when they
    are trained (grad mode on, some require grad) their gradients and two optimizer states."""
    return param_bytes * (4 if trained and torch.is_grad_enabled() else 1)


def _params_file_bytes(params: tuple[ParamInfo, ...]) -> int:
    return file_bytes(sum(p.nbytes for p in params), any(p.requires_grad for p in params))


def _cache_room(device: str, budget: int | None) -> int:
    """The page cache free for swap files, for planner.direct_io: the memory available now, less a
    budget given where the graphs compute in it (a CPU device; the default budget, all that is
    free, is a ceiling the graphs do not fill)."""
    import psutil

    room = int(psutil.virtual_memory().available) - ((budget or 0) if device == "cpu" else 0)
    return max(room, 0)


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
    token = _CompiledToken()
    infos = _param_infos(gm, example_inputs)
    session = Session.start(cfg, _graph_device(example_inputs), infos, RUNTIME.pins.token(token))
    patches = {
        "custom_partitioner_fn": ZinfPartitioner(session),
        "post_grad_custom_post_pass": ZinfPostGrad(session),
    }
    if cfg.params != "resident" and any(len(i.shape) == 4 and (i.managed or i.manageable) for i in infos):
        # Inductor's layout optimisation (channels-last around convolutions) would copy a 4-d
        # parameter the forward returns (saved for the backward's gather) into a channels-last
        # buffer: a kernel reading a managed parameter's freed storage (SIGSEGV)
        patches["layout_optimization"] = False
    from zinf_compile.runtime.state import STORE

    before = {e.index for e in STORE.entries()}
    try:
        if cfg.cache:
            fn = compile_fx(gm, example_inputs, config_patches=patches)
        else:
            patches["fx_graph_cache"] = False
            with torch._functorch.config.patch(enable_autograd_cache=False):
                fn = compile_fx(gm, example_inputs, config_patches=patches)
        from zinf_compile.runtime.access import mark_all

        mark_all()  # before Dynamo builds its guards: they expect the managed class (runtime/access.py)
        return _holding(fn, token)
    except BaseException as err:
        # the partitioner took parameters over, then something later failed: no graph will gather
        # them, so give them their data back (Dynamo may run the model eagerly next)
        for pid in {e.index for e in STORE.entries()} - before:
            try:
                STORE.release_id(pid)
            except Exception as cleanup:  # the compile's own error is the one to see
                warnings.warn(f"zinf: could not give parameter #{pid} its data back: {cleanup}", stacklevel=2)
        refusal = eager_fallback_refusal(err, example_inputs) if torch._dynamo.config.suppress_errors else None
        if refusal is not None and isinstance(err, Exception):
            return refusal  # not eager on freed parameters
        raise
