"""Graph passes that apply a zinf Plan. Installed as `zinf_compile.passes`.

Each pass is a small frozen dataclass with a `name`; `run_passes` runs them in order and owns
verification, timing and dumps, so passes contain none of that.
"""
from .base import PassContext, PassReport
from .insert_offload import InsertOffloads
from .pin_order import PinOrder
from .verifier import VerificationError, verify

PIPELINE = (InsertOffloads(),)

__all__ = ["PIPELINE", "InsertOffloads", "PinOrder", "PassContext", "PassReport", "VerificationError", "verify"]
