"""The errors zinf raises. Each says what was wrong and what would be right.

Dynamo wraps what a backend raises in BackendCompilerFailed, except `ShortenTraceback`s, which it
re-raises unchanged (appending the user's frames to the message). The errors a user may want to
catch from `torch.compile(...)(x)` -- a bad option, an impossible budget -- are therefore also
ShortenTracebacks (hence RuntimeErrors): `except zinf_compile.BudgetError` catches them. The cost:
importing this module imports torch._dynamo (~1 s, once; any torch.compile does).
"""
from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback


class ZinfError(Exception):
    """Base class for every error zinf raises on purpose."""


class SwapCorruptionError(ZinfError):
    """A swap record (a parameter's shard, its gradient, an optimizer state, an offloaded
    activation) read back other than zinf wrote it: its checksum does not match. The message names
    the file and what it holds; the data are lost (a damaged disk, or something else wrote the file)."""


class _Unwrapped(ShortenTraceback):
    """Reaches the caller of a compiled function as it is, not as BackendCompilerFailed."""

    first_useful_frame = None

    def __init__(self, *args) -> None:
        super().__init__(*args, first_useful_frame=None)  # None: Dynamo keeps the whole traceback


class ZinfConfigError(ZinfError, _Unwrapped, ValueError):
    """A bad option: unknown name, unparsable value, unusable offload directory."""


class BudgetError(ZinfError, _Unwrapped):
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


def eager_fallback_refusal(err: Exception, example_inputs):
    """With torch._dynamo.config.suppress_errors, Dynamo answers a failed compile by running the
    frame eagerly. A parameter an earlier compile took over has no storage (its data is a shard in
    zinf's store): eager code would read freed memory. Then this returns the "compiled" function
    to hand Dynamo instead, which raises a ZinfError saying so at each call; None when eager is
    safe (no parameter of the frame is managed: Dynamo runs it eagerly and logs the error)."""
    import torch

    from zinf_compile.runtime.state import STORE

    names = [e.name for e in (STORE.entry(x) for x in example_inputs if isinstance(x, torch.nn.Parameter)) if e]
    if not names:
        return None
    message = (f"zinf: compiling this frame failed ({type(err).__name__}: {err}), and with "
               f"torch._dynamo.config.suppress_errors=True Dynamo would run it eagerly on {len(names)} "
               f"parameter(s) zinf manages (e.g. {names[0]!r}), whose storage is freed. Fix the error above "
               "or turn suppress_errors off.")

    def refuse(*args, **kwargs):
        raise ZinfError(message) from err

    return refuse
