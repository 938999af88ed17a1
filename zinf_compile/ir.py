"""zinf's node metadata: one typed value under `node.meta["zinf"]`, the only schema passes, analysis,
planner and verifier share. Nothing compares kind strings: a node is a gather when its meta is a
`GatherMeta`, and so on.

    ParamMeta    a managed parameter's placeholder (what its shard keeps on the device)
    GatherMeta   a node along a parameter's gather: its shard read, the collective parts, the whole
                 gathered tensor (or a tile's rows of it)
    FetchMeta    a shard's read started ahead of its gather (a handle; `resident_bytes` it holds)
    ReduceMeta   a node along a gradient's reduction into its shard
    MoveMeta     an activation's offload / prefetch / wait, or the backward's handle placeholder
    TileMeta     one tile of a tiled matmul
    RecomputeMeta  a node of a chain re-run in the backward to rebuild a saved activation
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

KEY = "zinf"


@dataclass(frozen=True)
class ParamMeta:
    pid: int  # the parameter store's id (offline: the parameter's index)
    name: str
    resident_bytes: int  # device bytes the shard keeps (0 where the tier frees the device)
    tier: str
    requires_grad: bool = True
    engine: int = 0
    master: str | None = None  # the shard's dtype when it is not the parameter's (mixed precision)
    gather: str | None = None  # the dtype of the copy gathers read, when narrower than the shard's

    @property
    def where(self) -> str:
        """The ops' tier argument: the tier, and the master and gather dtypes of a shard taken
        over at run time ("nvme", "nvme,float32", "nvme,,bfloat16")."""
        if self.gather:
            return f"{self.tier},{self.master or ''},{self.gather}"
        return self.tier + (f",{self.master}" if self.master else "")


@dataclass(frozen=True)
class GatherMeta:
    pid: int
    name: str
    part: Literal["shard", "collective", "whole"] = "whole"  # "whole": the gathered parameter
    rows: tuple[int, int] | None = None  # a tile: rows [start, end) of the weight


@dataclass(frozen=True)
class FetchMeta:
    pid: int
    name: str
    resident_bytes: int  # device bytes the fetched shard holds until its gather
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class ReduceMeta:
    pid: int
    name: str
    slot: int  # the joint graph's output position of this gradient
    part: bool = False  # a step of the collective chain, not the final store
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class MoveMeta:
    kind: Literal["offload", "prefetch", "wait", "handle"]
    group: int
    buffer: int
    tier: str


@dataclass(frozen=True)
class TileMeta:
    op: str  # the matmul's name before tiling
    target: str  # mm | addmm | bmm
    axis: str
    index: int
    count: int
    range: tuple[int, int]
    pid: int | None = None  # the weight whose rows the tiles read (or whose gradient they make)
    grad: bool = False


@dataclass(frozen=True)
class RecomputeMeta:
    group: int  # the plan's recompute action
    buffer: int
    of: str  # the forward node it re-runs
    fused: bool = False  # inside the kernel that makes the rebuilt tensor: no storage of its own


Meta = ParamMeta | GatherMeta | FetchMeta | ReduceMeta | MoveMeta | TileMeta | RecomputeMeta


def meta(node: fx.Node) -> Meta | None:
    return node.meta.get(KEY)


def mark(node: fx.Node, m: Meta) -> fx.Node:
    node.meta[KEY] = m
    return node


def param(node: fx.Node) -> ParamMeta | None:
    m = node.meta.get(KEY)
    return m if isinstance(m, ParamMeta) else None


def is_whole_gather(node: fx.Node) -> bool:
    m = node.meta.get(KEY)
    return isinstance(m, GatherMeta) and m.part == "whole"


def is_shard_read(node: fx.Node) -> bool:
    """A zinf op that reads a managed parameter's shard from its tier (a whole gather, a tile's
    rows, or this rank's shard before an all-gather): where a fetch can start the read earlier."""
    m = node.meta.get(KEY)
    return (isinstance(m, GatherMeta) and m.part != "collective"
            and getattr(node.target, "namespace", None) == "zinf")


def is_handle(node: fx.Node) -> bool:
    """A handle-valued node (8 bytes of bookkeeping, not device memory worth planning)."""
    m = node.meta.get(KEY)
    return isinstance(m, MoveMeta) and m.kind != "wait"


def resident_bytes(node: fx.Node) -> int | None:
    """Device bytes a managed parameter's placeholder or a fetched shard holds (None: its value's)."""
    m = node.meta.get(KEY)
    return m.resident_bytes if isinstance(m, (ParamMeta, FetchMeta)) else None


def output_node(graph: fx.Graph) -> fx.Node:
    return next(iter(graph.find_nodes(op="output")))


def fake_mode_of(*vals):
    """The fake mode of the values (a context manager; a null one where they are real)."""
    import contextlib

    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    return mode if mode is not None else contextlib.nullcontext()


def emit(graph: fx.Graph, target, args, kwargs=None) -> fx.Node:
    """A call_function node at the graph's insertion point, with its fake value computed from its
    inputs' (the one way every pass makes a node)."""
    kwargs = kwargs or {}
    n = graph.call_function(target, tuple(args), kwargs)
    fargs, fkwargs = fx.node.map_arg((tuple(args), kwargs), lambda a: a.meta["val"])
    vals = [a for a in fx.node.map_aggregate(fargs, lambda a: a) if isinstance(a, torch.Tensor)]
    with fake_mode_of(*vals):
        n.meta["val"] = target(*fargs, **fkwargs)
    return n
