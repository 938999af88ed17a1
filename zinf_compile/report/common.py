"""What the pictures, the graph and the HTML share: phases of the timeline, offload groups and the
managed parameters' gathers."""
from __future__ import annotations

from dataclasses import dataclass

from zinf_compile.plan import Action, ManagedParam, Plan

GRAPH_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "inference": "#55a868"}
OTHER_COLOR = "#8c8c8c"
TIER_COLORS = {"cpu": "#e377c2", "nvme": "#9467bd"}
BEFORE_COLOR = "#7f7f7f"
AFTER_COLOR = "#1f77b4"
BUDGET_COLOR = "#d62728"
LOWER_BOUND_COLOR = "#2ca02c"
PHASE_BAND_COLOR = "#bdbdbd"


@dataclass(frozen=True)
class Segment:
    """A run of consecutive steps of one graph, positions [start, stop)."""

    graph: str
    start: int
    stop: int


@dataclass(frozen=True)
class Group:
    """One offload -> prefetch -> wait group; steps are None where the plan has no such action."""

    group: int
    tensor: int
    tier: str
    nbytes: int
    offload: int | None
    prefetch: int | None
    wait: int | None

    @property
    def start(self) -> int | None:
        return self.offload

    @property
    def end(self) -> int | None:
        """The step the tensor is back on the device for (wait, else prefetch)."""
        return self.wait if self.wait is not None else self.prefetch


def graph_color(graph: str) -> str:
    return GRAPH_COLORS.get(graph, OTHER_COLOR)


def segments(plan: Plan) -> list[Segment]:
    """The runs of steps of one graph, in timeline order."""
    out: list[Segment] = []
    for i, step in enumerate(plan.steps):
        if out and out[-1].graph == step.graph:
            out[-1] = Segment(step.graph, out[-1].start, i + 1)
        else:
            out.append(Segment(step.graph, i, i + 1))
    return out


def groups(plan: Plan) -> list[Group]:
    """Offload groups in order of their group id; the first action of each kind counts."""
    by_group: dict[int, dict[str, Action]] = {}
    for a in plan.moves():
        by_group.setdefault(a.group, {}).setdefault(a.kind, a)
    out = []
    for gid in sorted(by_group):
        kinds = by_group[gid]
        first = kinds.get("offload") or next(iter(kinds.values()))
        out.append(
            Group(
                group=gid,
                tensor=first.tensor,
                tier=first.tier,
                nbytes=first.nbytes,
                offload=kinds["offload"].step if "offload" in kinds else None,
                prefetch=kinds["prefetch"].step if "prefetch" in kinds else None,
                wait=kinds["wait"].step if "wait" in kinds else None,
            )
        )
    return out


def counts_text(plan: Plan, kinds: list[str]) -> str:
    """ "offload 12, prefetch 12, wait 12": the listed kinds first, then any others; "none"."""
    counts = plan.action_counts()
    order = [k for k in kinds if k in counts] + sorted(k for k in counts if k not in kinds)
    return ", ".join(f"{k} {counts[k]}" for k in order) or "none"


# -- managed parameters (ZeRO-3): actions with group = -1 - pid -----------------------------------

PARAM_KINDS = ("fetch", "gather", "release", "reduce")


@dataclass(frozen=True)
class ParamSpan:
    """One gather of a managed parameter: whole on the device from `gather` to `release`; its
    shard's read started at `fetch` when the plan fetches it ahead (None: read at the gather)."""

    pid: int
    name: str
    tier: str
    nbytes: int
    tensor: int  # the gathered tensor's TensorLife.id
    graph: str  # the graph of the gather step
    gather: int
    release: int
    fetch: int | None = None


@dataclass(frozen=True)
class ParamUse:
    """A managed parameter and where the plan gathers, releases and reduces it."""

    param: ManagedParam
    fetches: tuple[int, ...]
    gathers: tuple[int, ...]
    releases: tuple[int, ...]
    reduces: tuple[int, ...]


def pid_of(a: Action) -> int:
    return -1 - a.group


def param_actions(plan: Plan) -> tuple[Action, ...]:
    """The managed parameters' actions (gather/release/reduce: group < 0)."""
    return tuple(a for a in plan.actions if a.group < 0)


def _param_by_pid(plan: Plan) -> dict[int, ManagedParam]:
    """The plan's managed parameters by id; a parameter with actions but no entry gets a stand-in."""
    out = {p.pid: p for p in plan.params}
    for a in param_actions(plan):
        pid = pid_of(a)
        if pid not in out:
            out[pid] = ManagedParam(pid, f"param {pid}", a.nbytes, a.nbytes, a.tier, 1)
    return out


def param_spans(plan: Plan) -> list[ParamSpan]:
    """Each gather with its release (the same gathered tensor) and the fetch that started its read
    (the parameter's latest fetch before it, not after its previous gather), in gather order.
    A gather without a release lasts to the end of its graph."""
    params = _param_by_pid(plan)
    releases: dict[tuple[int, int], list[int]] = {}
    fetches: dict[int, list[int]] = {}
    for a in param_actions(plan):
        if a.kind == "release":
            releases.setdefault((a.group, a.tensor), []).append(a.step)
        elif a.kind == "fetch":
            fetches.setdefault(a.group, []).append(a.step)
    graph_end = {i: seg.stop - 1 for seg in segments(plan) for i in range(seg.start, seg.stop)}
    out = []
    last_gather: dict[int, int] = {}
    for a in sorted((a for a in param_actions(plan) if a.kind == "gather"), key=lambda a: (a.step, a.group)):
        rel = [r for r in releases.get((a.group, a.tensor), ()) if r >= a.step]
        end = min(rel) if rel else graph_end.get(a.step, a.step)
        ahead = [f for f in fetches.get(a.group, ()) if last_gather.get(a.group, -1) < f <= a.step]
        last_gather[a.group] = a.step
        p = params[pid_of(a)]
        graph = plan.steps[a.step].graph if 0 <= a.step < len(plan.steps) else "?"
        out.append(ParamSpan(p.pid, p.name, a.tier, a.nbytes, a.tensor, graph, a.step, end,
                             max(ahead) if ahead else None))
    out.sort(key=lambda s: (s.gather, s.pid))
    return out


def param_uses(plan: Plan) -> list[ParamUse]:
    """The managed parameters (the plan's own list, plus any that only actions name), by id."""
    steps: dict[int, dict[str, list[int]]] = {}
    for a in param_actions(plan):
        steps.setdefault(pid_of(a), {}).setdefault(a.kind, []).append(a.step)
    out = []
    for pid, p in sorted(_param_by_pid(plan).items()):
        k = steps.get(pid, {})
        out.append(ParamUse(p, *(tuple(sorted(k.get(kind, ()))) for kind in PARAM_KINDS)))
    return out
