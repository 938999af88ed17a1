"""Analysis: pure functions over FX graphs returning immutable facts."""
from zinf_compile.analysis.facts import Buffer, Gap, GraphFacts, GraphSpec, StepFact, analyze
from zinf_compile.analysis.graphs import graph_specs, primal_nodes

__all__ = ["Buffer", "Gap", "GraphFacts", "GraphSpec", "StepFact", "analyze", "graph_specs", "primal_nodes"]
