"""Pictures and the HTML report of a memory plan."""
from __future__ import annotations

from zinf_compile.report.graph import render_svg, write_dot
from zinf_compile.report.html import write_report
from zinf_compile.report.lanes import draw_lanes
from zinf_compile.report.summary import summary_rows
from zinf_compile.report.timeline import draw_timeline
from zinf_compile.report.units import format_bytes, format_seconds

__all__ = [
    "draw_timeline",
    "draw_lanes",
    "write_dot",
    "render_svg",
    "write_report",
    "summary_rows",
    "format_bytes",
    "format_seconds",
]
