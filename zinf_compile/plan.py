"""The memory plan: a frozen, versioned, JSON-serialisable value.

A plan decides; it never rewrites. Steps are the compute nodes of the captured graphs laid on one
timeline (forward, then backward; or the inference graph alone). Every action is anchored on a step:
an offload runs right *after* its step, a prefetch and a wait run right *before* theirs.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

PLAN_VERSION = 1

# offload/prefetch/wait move activations (group >= 0: one gap each); recompute rebuilds a saved
# activation in the backward right before its step instead of keeping it (group >= 0: one each, its
# tier "device"); gather/release/reduce are a managed parameter's (group = -1 - its id): its
# shard's read started early (fetch), gathered whole before use, released after the last use, its
# gradient reduce-scattered into the shard.
ActionKind = Literal["offload", "prefetch", "wait", "recompute", "fetch", "gather", "release", "reduce"]
Tier = Literal["cpu", "nvme"]
ActionTier = Literal["cpu", "nvme", "device"]
TensorRole = Literal["input", "activation", "saved", "output", "gradient", "tangent"]


@dataclass(frozen=True)
class Step:
    """One compute node on the timeline."""

    index: int
    graph: str  # "forward" | "backward" | "inference"
    name: str  # the FX node's name, for people reading the plan
    op: str  # the node's target, e.g. "aten.mm.default"
    est_time_s: float  # the cost model's estimate
    flops: int


@dataclass(frozen=True)
class TensorLife:
    """One storage on the compute device: its size and when it is defined and used."""

    id: int
    name: str  # the node that defines it (a placeholder for inputs)
    graph: str
    role: TensorRole
    nbytes: int  # at the size hints
    size_expr: str  # symbolic byte count, e.g. "3072*s0"
    shape: str  # e.g. "[s0, 768]"
    dtype: str
    def_step: int  # -1 for graph inputs (live before the first step)
    use_steps: tuple[int, ...]
    movable: bool  # False for graph inputs/outputs, views we cannot re-create, etc.


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    tensor: int  # TensorLife.id
    step: int  # anchor step (after it for offload; before it for prefetch/wait/recompute)
    tier: ActionTier
    nbytes: int
    group: int  # offload/prefetch/wait of one gap share a group id


@dataclass(frozen=True)
class ManagedParam:
    """A parameter the plan shards and keeps in a tier (ZeRO-3), gathered only around its uses."""

    pid: int  # the parameter store's id; its actions have group -1 - pid
    name: str
    nbytes: int  # the whole parameter
    shard_nbytes: int  # what one rank keeps
    tier: Tier
    world: int


@dataclass(frozen=True)
class TiledOp:
    """A matmul the plan splits into tiles (memory-centric tiling), each reading its own rows of
    a managed weight (or, for a weight's gradient, making its own rows of it)."""

    graph: str
    op: str  # the FX node's name before tiling
    target: str  # "mm" | "addmm" | "bmm"
    axis: str  # "M" | "N" | "K" of the matmul
    count: int
    param: str  # the weight's name
    grad: bool  # the matmul computes the weight's gradient
    tile_shape: tuple[int, ...]  # the largest weight tile
    tile_nbytes: int


@dataclass(frozen=True)
class Plan:
    version: int
    graphs: tuple[str, ...]
    device: str  # the compute device type, e.g. "cpu" or "cuda"
    profile: str  # DeviceProfile name
    budget: int
    tier: Tier
    steps: tuple[Step, ...]
    tensors: tuple[TensorLife, ...]
    actions: tuple[Action, ...]
    timeline_before: tuple[int, ...]  # device bytes live during each step, without the plan
    timeline_after: tuple[int, ...]  # ... and with it
    peak_before: int
    peak_after: int
    lower_bound: int  # largest single-step working set plus what cannot move
    bytes_moved: dict[str, int]  # tier -> bytes written+read per step of training/inference
    predicted_compute_s: float
    predicted_stall_s: float
    notes: tuple[str, ...] = field(default=())
    params: tuple[ManagedParam, ...] = field(default=())
    tiles: tuple[TiledOp, ...] = field(default=())

    # -- summaries -------------------------------------------------------------------------------
    def action_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for a in self.actions:
            counts[a.kind] = counts.get(a.kind, 0) + 1
        return counts

    def moves(self) -> tuple[Action, ...]:
        """The activation moves (offload/prefetch/wait), without the parameters' ones."""
        return tuple(a for a in self.actions if a.group >= 0 and a.kind != "recompute")

    def recomputes(self) -> tuple[Action, ...]:
        """The saved activations rebuilt in the backward instead of kept."""
        return tuple(a for a in self.actions if a.kind == "recompute")

    def fetches(self) -> tuple[Action, ...]:
        """The parameters' shard reads started ahead of their gathers."""
        return tuple(a for a in self.actions if a.kind == "fetch")

    def is_empty(self) -> bool:
        return not self.actions

    # -- serialisation ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Plan":
        if data.get("version") != PLAN_VERSION:
            raise ValueError(
                f"plan version {data.get('version')!r} is not supported "
                f"(this zinf reads version {PLAN_VERSION})"
            )
        fields = {f.name for f in dataclasses.fields(Plan)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"not a zinf plan: unknown field(s) {', '.join(unknown)}")
        d = dict(data)
        d["graphs"] = tuple(d["graphs"])
        d["steps"] = tuple(Step(**s) for s in d["steps"])
        d["tensors"] = tuple(
            TensorLife(**{**t, "use_steps": tuple(t["use_steps"])}) for t in d["tensors"]
        )
        d["actions"] = tuple(Action(**a) for a in d["actions"])
        d["timeline_before"] = tuple(d["timeline_before"])
        d["timeline_after"] = tuple(d["timeline_after"])
        d["notes"] = tuple(d.get("notes", ()))
        d["params"] = tuple(ManagedParam(**p) for p in d.get("params", ()))
        d["tiles"] = tuple(TiledOp(**{**t, "tile_shape": tuple(t["tile_shape"])}) for t in d.get("tiles", ()))
        plan = Plan(**d)
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ValueError when the plan's parts do not refer to each other consistently."""
        n = len(self.steps)
        if any(s.index != i for i, s in enumerate(self.steps)):
            raise ValueError("plan steps are not numbered 0..n-1 in order")
        if len(self.timeline_before) != n or len(self.timeline_after) != n:
            raise ValueError(f"plan timelines do not have one entry per step ({n} steps)")
        ids = {t.id for t in self.tensors}
        for a in self.actions:
            if not 0 <= a.step < n or a.tensor not in ids:
                raise ValueError(f"plan action {a} refers to a step or tensor the plan does not have")

    @staticmethod
    def load(path: str) -> "Plan":
        """The plan in the JSON file `path`; a ZinfError naming the file for anything else."""
        from zinf_compile.errors import ZinfError

        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ZinfError(f"cannot read plan {path!r}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ZinfError(f"{path!r} is not a zinf plan (not JSON: {e})") from None
        if not isinstance(data, dict):
            raise ZinfError(f"{path!r} is not a zinf plan (a JSON {type(data).__name__}, not an object)")
        try:
            return Plan.from_json(data)
        except (ValueError, TypeError, KeyError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ZinfError(f"{path!r} is not a plan this zinf reads: {what}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())
