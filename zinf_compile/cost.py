"""The cost model: what a device can do (DeviceProfile) and what each graph step costs on it."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from zinf_compile.analysis.sizes import hint_of, tensor_nbytes

GB = 10**9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    device: str  # "cpu" | "cuda"
    capacity: int  # bytes of device memory
    flops: float  # dense fp32 matmul FLOP/s (tf32/bf16 rates are higher; we plan conservatively)
    mem_bw: float  # device memory bytes/s
    d2h_bw: float  # device -> host bytes/s (pinned)
    h2d_bw: float
    nvme_read_bw: float  # host <- NVMe bytes/s
    nvme_write_bw: float
    collective_bw: float  # bytes/s per rank for all-gather / reduce-scatter
    nvme_direct_read_bw: float = 0.0  # host <- NVMe with O_DIRECT, past the page cache (0: nvme_read_bw)

    def transfer_time(self, nbytes: int, tier: str, direction: str) -> float:
        """Seconds to move nbytes between the device and `tier` ("out" to it, "in" from it)."""
        if tier == "cpu":
            return 0.0 if self.device == "cpu" else nbytes / (self.d2h_bw if direction == "out" else self.h2d_bw)
        disk = self.nvme_write_bw if direction == "out" else self.nvme_read_bw
        t = nbytes / disk
        if self.device != "cpu":
            t += nbytes / (self.d2h_bw if direction == "out" else self.h2d_bw)
        return t

    def seen_by(self, direct_io: bool) -> "DeviceProfile":
        """This profile as a run whose swap files are O_DIRECT (or not) sees it: one read
        bandwidth for every NVMe read the plan times."""
        if not direct_io or not self.nvme_direct_read_bw:
            return self
        return dataclasses.replace(self, nvme_read_bw=self.nvme_direct_read_bw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


BUILTIN = {
    # a 2-core cloud VM like the CI machine; `zinf calibrate` replaces it with measured numbers
    "cpu": DeviceProfile("cpu", "cpu", 24 * 2**30, 50e9, 8 * GB, 8 * GB, 8 * GB, 1.5 * GB, 1.0 * GB, 5 * GB, 0.9 * GB),
    # datasheet figures (fp32 non-tensor-core rate; PCIe 5 x16 ~ 50 GB/s achieved; one Gen4 NVMe)
    "h100-80gb": DeviceProfile("h100-80gb", "cuda", 80 * GB, 67e12, 3.35e12, 50 * GB, 50 * GB,
                               6.5 * GB, 5 * GB, 200 * GB, 6.5 * GB),
    "h200": DeviceProfile("h200", "cuda", 141 * GB, 67e12, 4.8e12, 50 * GB, 50 * GB, 6.5 * GB, 5 * GB, 200 * GB,
                          6.5 * GB),
}

CALIBRATED_PATH = os.path.join(os.path.expanduser("~"), ".cache", "zinf", "profile-local.json")


def load_profile(name: str, device: str = "cpu") -> DeviceProfile:
    """A profile by name ("cpu", "h100-80gb", "h200"), by JSON path, or "auto": the calibrated
    profile of this machine when `zinf calibrate` wrote one for this device, else the built-in."""
    if name == "auto":
        if os.path.exists(CALIBRATED_PATH):
            prof = load_profile(CALIBRATED_PATH)
            if prof.device == device:
                return prof
        return BUILTIN["cpu"] if device == "cpu" else BUILTIN["h100-80gb"]
    if name in BUILTIN:
        return BUILTIN[name]
    if os.path.exists(name):
        with open(name) as f:
            return DeviceProfile(**json.load(f))
    from zinf_compile.errors import ZinfConfigError

    raise ZinfConfigError(f"unknown profile {name!r}: use one of {', '.join(BUILTIN)}, 'auto', or a JSON path")


def _flop_registry():
    from torch.utils.flop_counter import flop_registry

    return flop_registry


def _matmul_flops(node: fx.Node) -> int | None:
    """2*M*K*N (times the batch) for mm/addmm/bmm, straight from the shapes: the flop counter's
    generic path (pytree over the arguments) was a quarter of the analysis time of a large graph."""
    aten = torch.ops.aten
    t = node.target
    if t not in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return None
    a, b = (node.args[1], node.args[2]) if t is aten.addmm.default else node.args[:2]
    try:
        sa, sb = a.meta["val"].shape, b.meta["val"].shape
        return hint_of(2 * math.prod(sa) * sb[-1])
    except Exception:
        return None


def node_flops(node: fx.Node) -> int:
    """FLOPs of one aten node from its fake values (0 for ops the flop counter does not know)."""
    fast = _matmul_flops(node)
    if fast is not None:
        return fast
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    registry = _flop_registry()
    if packet not in registry:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, val)
    kwargs = fx.node.map_aggregate(node.kwargs, val)
    try:
        return hint_of(registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:
        return 0


def _bytes_touched(node: fx.Node, known: dict | None = None) -> int:
    """Bytes of the node's tensor inputs and outputs; `known` memoizes each node's bytes (a value
    is read by several steps)."""
    total = 0
    for a in [*node.all_input_nodes, node]:
        n = known.get(a) if known is not None else None
        if n is None:
            n = 0
            v = a.meta.get("val")
            for t in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(t, torch.Tensor):
                    n += tensor_nbytes(t)
            if known is not None:
                known[a] = n
        total += n
    return total


_FREE = {"getitem", "view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze",
         "squeeze", "slice", "select", "as_strided", "alias", "detach", "sym_size", "sym_stride"}


def step_cost(profile: DeviceProfile):
    """`node -> (flops, seconds)`: a roofline estimate, max(compute, memory traffic)."""

    free: dict = {}  # target -> whether it costs nothing (asked once per target, not per node)
    nbytes: dict = {}  # node -> bytes of its value, once (the closure lives for one analysis)

    def cost(node: fx.Node) -> tuple[int, float]:
        t = node.target
        if t not in free:
            name = getattr(getattr(t, "overloadpacket", None), "__name__", getattr(t, "__name__", ""))
            free[t] = name in _FREE or str(t).startswith("zinf.")
        if free[t]:
            return 0, 0.0
        flops = node_flops(node)
        return flops, max(flops / profile.flops, _bytes_touched(node, nbytes) / profile.mem_bw)

    return cost
