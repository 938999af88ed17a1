"""Runtime: the zinf:: ops and the tiers they move tensors between."""
from zinf_compile.runtime import ops  # noqa: F401  (registers the zinf:: ops)
from zinf_compile.runtime.engine import OffloadEngine
from zinf_compile.runtime.state import close_all, get_engine, register_engine

__all__ = ["OffloadEngine", "close_all", "get_engine", "register_engine", "ops"]
