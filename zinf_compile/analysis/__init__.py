"""Analysis: pure functions over FX graphs returning immutable facts."""
from zinf_compile.analysis.facts import Buffer, Gap, GraphFacts, StepFact, analyze

__all__ = ["Buffer", "Gap", "GraphFacts", "StepFact", "analyze"]
