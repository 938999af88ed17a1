"""What the pictures, the graph and the HTML share: phases of the timeline and offload groups."""
from __future__ import annotations

from dataclasses import dataclass

from zinf_compile.plan import Action, Plan

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
