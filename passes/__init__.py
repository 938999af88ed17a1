"""Graph passes that apply a zinf Plan. Installed as `zinf_compile.passes`.

Each pass is a small frozen dataclass with a class-level `name` and its options as fields;
`apply(graphs, ctx)` returns a PassReport. The driver (`zinf_compile.pipeline`) runs them in order
and owns linting, verification, timing and dumps, so passes contain none of that.
"""
from .base import Graphs, Pass, PassContext, PassReport
from .insert_offload import InsertOffloads
from .params import (AllReduceGrads, DropReducedOutputs, FetchAhead, InsertGathers, KeepResident, Partition,
                     ReduceGrads, SinkGathers, partition_pass)
from .pin_order import PinOrder
from .recompute import Recompute
from .tiling import TileMatmuls
from .verifier import VerificationError, check_budget, check_invariants, verify

__all__ = ["AllReduceGrads", "DropReducedOutputs", "FetchAhead", "Graphs", "InsertGathers", "InsertOffloads",
           "KeepResident", "Partition", "Pass", "PassContext", "PassReport", "PinOrder", "Recompute", "ReduceGrads",
           "SinkGathers", "TileMatmuls", "VerificationError", "check_budget", "check_invariants",
           "partition_pass", "verify"]
