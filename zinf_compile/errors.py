"""The errors zinf raises. Each says what was wrong and what would be right."""
from __future__ import annotations


class ZinfError(Exception):
    """Base class for every error zinf raises on purpose."""


class ZinfConfigError(ZinfError, ValueError):
    """A bad option: unknown name, unparsable value, unusable offload directory."""


class BudgetError(ZinfError):
    """No plan can keep the graph within the budget."""

    def __init__(self, budget: int, lower_bound: int, best_peak: int, detail: str = "") -> None:
        from zinf_compile.units import format_bytes

        self.budget = budget
        self.lower_bound = lower_bound
        self.best_peak = best_peak
        msg = (
            f"budget {format_bytes(budget)} is impossible for this graph: the lower bound on peak "
            f"device memory is {format_bytes(lower_bound)} (largest single-step working set plus "
            f"what cannot move); the best plan reaches {format_bytes(best_peak)}. "
            f"Raise the budget to at least {format_bytes(max(lower_bound, best_peak))}."
        )
        if detail:
            msg += " " + detail
        super().__init__(msg)
