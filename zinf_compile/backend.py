"""The `zinf` torch.compile backend: glue from options to Inductor hooks.

    Dynamo graph -> compile_fx(config_patches={custom_partitioner_fn, post_grad_custom_post_pass})
      training:  joint graph -> ZinfPartitioner: default partition, analyse fw+bw, plan, insert
      inference: post-grad graph -> ZinfPostGrad: analyse, plan, insert
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
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
from zinf_compile.pipeline import plan_and_rewrite
from zinf_compile.runtime.engine import get_engine, register_engine

PLANNED = "zinf_planned"  # output-node meta: this graph was planned by the partitioner


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

    @staticmethod
    def start(cfg: ZinfConfig, device: str) -> "Session":
        tier = cfg.tier_for(device)
        budget = cfg.budget if cfg.budget is not None else _free_device_memory(device)
        # with a share of the peak (budget="80%"), the pipeline sets the budget per graph
        key = int(cfg.key(), 16) & ((1 << 62) - 1)
        register_engine(key, tier, cfg.offload_dir, cfg.io_threads, cfg.o_direct)
        if device == "cpu" and tier == "nvme" and cfg.malloc_mmap_threshold:
            _pin_mmap_threshold(cfg.malloc_mmap_threshold)
        return Session(cfg, device, tier, budget, key)

    @property
    def engine(self):
        return get_engine(self.engine_key)

    def uuid(self) -> str:
        """Covers every plan input: zinf's code, the options, the budget, the profile's numbers."""
        from zinf_compile.cost import load_profile

        profile = json.dumps(load_profile(self.cfg.profile, self.device).to_json(), sort_keys=True)
        digest = hashlib.sha256(profile.encode()).hexdigest()[:16]
        return f"zinf-{_source_hash()}-{self.cfg.key()}-{self.budget}-{self.device}-{digest}"


class ZinfPartitioner(CustomPartitionerFn):
    def __init__(self, session: Session) -> None:
        self.session = session

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        plan_and_rewrite(self.session, {"forward": fw, "backward": bw}, num_fwd_outputs)
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
            plan_and_rewrite(self.session, {"inference": graph.owning_module}, -1)
            out.meta[PLANNED] = True
        records.attach(graph, PinOrder()(graph))

    def uuid(self) -> str:
        return self.session.uuid()


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
    session = Session.start(cfg, _graph_device(example_inputs))
    patches = {
        "custom_partitioner_fn": ZinfPartitioner(session),
        "post_grad_custom_post_pass": ZinfPostGrad(session),
    }
    if cfg.cache:
        return compile_fx(gm, example_inputs, config_patches=patches)
    patches["fx_graph_cache"] = False
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches=patches)
