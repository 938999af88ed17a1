"""Matplotlib without global state: an Agg figure, the phase bands, saving."""
from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from zinf_compile.plan import Plan
from zinf_compile.report.common import PHASE_BAND_COLOR, segments

DPI = 110


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str) -> str:
    fig.savefig(path, format="png", dpi=DPI)
    fig.clear()
    return path


def phase_bands(ax: Axes, plan: Plan, label: bool = False) -> None:
    """Shade where one graph ends and the next begins; name each graph above the axes if `label`."""
    segs = segments(plan)
    width = max(0.3, 0.004 * len(plan.steps))
    for seg in segs[1:]:
        x = seg.start - 0.5
        ax.axvspan(x - width / 2, x + width / 2, color=PHASE_BAND_COLOR, alpha=0.6, lw=0, zorder=0)
    if label and len(segs) > 1:
        for seg in segs:
            ax.text(
                (seg.start + seg.stop - 1) / 2, 1.01, seg.graph, transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=9, color="#555555", style="italic",
            )


def step_axis(ax: Axes) -> None:
    """Whole step numbers on the x axis."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))


def outside_legend(ax: Axes, **kw: object) -> None:
    """A legend to the right of the axes, where it hides no data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, **kw)


def empty_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#777777")
