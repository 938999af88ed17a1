"""The parameter store: ZeRO-3 shards of the parameters zinf manages, in their home tier.

A managed parameter keeps its Python object, shape, stride, dtype, device and requires_grad (Dynamo's
guards see nothing change) but its storage is freed (`untyped_storage().resize_(0)`). A storage that
cannot be resized (a memory-mapped file, as `from_pretrained` loads safetensors; a numpy array's
memory) is first swapped for a resizable one of the parameter's own (`_own_storage`): the original
is never written, and its memory goes when its last other user lets it go. Its data lives
here as this rank's shard: the flattened parameter, padded to a multiple of the world size, split in
equal parts. The compiled graph reads a managed parameter only through `zinf::gather`, and hands its
gradient to `zinf::reduce_grad`, which reduce-scatters it into the shard's gradient.

Home tiers: "cpu" (host memory, pinned on CUDA) or "nvme" (files in the engine's swap folder).
A shard's gradient lives in the same tier (ZeRO-Infinity keeps gradients in host memory; on a CPU
device host memory *is* the device, so the NVMe tier keeps gradients in files too).

Entries are found from any alias of the parameter through its storage: autograd and AOT may hand
the graph a different tensor object over the same storage, never a different storage. (A storage
swapped at take-over is re-keyed: aliases made of the old one before, if any, are not found.)
"""
from __future__ import annotations

import functools
import itertools
import math
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from zinf_compile.errors import SwapCorruptionError, ZinfError


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _exclusive(t: torch.Tensor) -> bool:
    """Whether `t` alone covers its storage (freeing the storage frees nothing else)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill exactly numel * itemsize bytes from its first (no gaps, no
    overlap): what a storage of its own, of that size, holds under the same strides."""
    return t.numel() == 0 or bool(torch._prims_common.is_non_overlapping_and_dense_or_false(t))


def take_over_refusal(t: torch.Tensor) -> str | None:
    """Why the store cannot take `t` over (None: it can). A resizable storage shared with other
    tensors is refused: freeing it would free them too, and giving `t` a storage of its own would
    silently end an aliasing the user made (tied views). A storage that cannot be resized (a
    mapped file, numpy memory) is not the user's aliasing but a loader's: `t` gets its own."""
    if t.untyped_storage().resizable():
        if not _exclusive(t):
            return "shares its storage with other tensors; freeing it would free them too, so it stays resident"
        return None
    if not _dense(t):
        return ("is a strided view with gaps in a storage zinf cannot resize; give it a dense copy of its own "
                "(p.data = p.data.contiguous().clone()) before compiling")
    return None


@dataclass
class Entry:
    """One managed parameter on this rank."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # where the graph computes with the gathered parameter
    requires_grad: bool
    rank: int
    world: int
    tier: str  # "cpu" | "nvme"
    engine_key: int
    param: weakref.ref = field(repr=False)
    shard: torch.Tensor | None = field(default=None, repr=False)  # cpu tier
    fd: int | None = None  # nvme tier: the shard's file
    grad: torch.Tensor | None = field(default=None, repr=False)  # cpu tier
    grad_fd: int | None = None  # nvme tier
    grad_spare_fd: int | None = None  # nvme tier: where an accumulated gradient is written, then switched to
    has_grad: bool = False
    # nvme tier: the flat [lo, hi) ranges of this step's gradient written so far, tile by tile
    # (empty: the whole file is this step's gradient when has_grad)
    grad_parts: set = field(default_factory=set)
    # nvme tier: clip coefficients (0-dim tensors) not yet multiplied into the gradient file; every
    # reader applies them in order (read_grad_into); see zinf_compile/grads.py
    grad_scales: list = field(default_factory=list, repr=False)
    # nvme tier: the flat [lo, hi) ranges (sorted, disjoint) of the gradient whose values are in the
    # spare file (`grad_spare_fd`, at the same offsets), not in `grad_fd`: a sum that replaces part of
    # the gradient is written beside it and switched to when whole (`_write_grad_beside`); empty
    # in the common path (then `grad_fd` holds the whole gradient)
    grad_moved: list = field(default_factory=list)
    state_fds: dict = field(default_factory=dict)  # optimizer states in files (nvme tier)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the shard's (and its gradient's and optimizer states') dtype: fp32 master shards under a
    # bf16/fp16 model (mixed precision as ZeRO does it); the gathered copy has `dtype`
    master_dtype: torch.dtype | None = None
    file_nos: list = field(default_factory=list)  # swap-folder file numbers this entry holds
    # the budget of the compile that took it over: its optimizer's default chunk size follows it
    budget: int | None = None
    # gradient contributions (reduces) added since the gradient was last cleared: an optimizer that
    # steps in backward learns from one step how many make the gradient whole (zinf_compile/optim.py)
    reduces: int = 0
    # every change of the gradient (a contribution, a write, a clip's scale) counts one: an optimizer
    # committing per parameter tells a retry of a failed step from a gradient that changed since
    grad_writes: int = 0
    # the gradient holds part of a backward that did not complete, added to an earlier sum: reading
    # or adding to it raises until it is cleared (ParamStore.settle_backward)
    grad_partial: bool = False
    # a weak reference to whatever consumes this entry's gradient as it arrives (a ZinfOptimizer made
    # with step_in_backward=True), or None: `add_grad` offers it each contribution first
    # (`take_grad(entry, part, rows) -> bool`: True when it took it), and clearing the gradient
    # tells it (`grad_cleared(entry)`)
    grad_sink: weakref.ref | None = field(default=None, repr=False)
    # nvme tier, in place: the shard is bytes of a file zinf does not own (a safetensors checkpoint,
    # zinf_compile.loading), `fd` opened read-only, the shard from byte `base`. The first write or
    # gradient moves it to a swap file of its own (`_own_file`); until then nothing writes `fd`.
    source: str | None = None
    base: int = 0
    # a low-precision copy of the shard that the graph's gathers read (option gather_dtype): a
    # float32 shard gathered from a bfloat16 copy reads half the bytes. The shard stays the master
    # that the optimizer steps, checkpoints save and reads outside the graph see; every write of it
    # writes the copy too. `copy_ok` False: the copy does not hold the shard's values (never made,
    # as for an in-place shard, or a write of it failed): the next gather makes it from the shard
    gather_dtype: torch.dtype | None = None
    copy: torch.Tensor | None = field(default=None, repr=False)  # cpu tier
    copy_fd: int | None = None  # nvme tier
    copy_ok: bool = False

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.master_dtype or self.dtype

    @property
    def read_dtype(self) -> torch.dtype:
        """The dtype the graph's gathers read from the tier: the copy's, where there is one."""
        return self.gather_dtype or self.shard_dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world)

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.shard_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def engine(self):
        from zinf_compile.runtime.state import get_engine

        return get_engine(self.engine_key)

    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the flat parameter (end may pass numel: padding)."""
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a flat whole-parameter tensor (a parameter, a gradient, a state),
        zero-padded to shard_numel, always a fresh tensor (the CPU tier may keep it)."""
        lo, hi = self.shard_range()
        out = torch.zeros(self.shard_numel, dtype=flat.dtype, device=flat.device)
        n = max(0, min(hi, self.numel) - lo)
        out[:n] = flat[lo:lo + n]
        return out

    def on_device(self, shard: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                  mapped: bool = False, graph: bool | None = None) -> torch.Tensor:
        """The shard, or its `rows` (read from its tier unless given), in the parameter's dtype on
        its device. `mapped`: for the graph alone, a mapping of the file will do (see `maps`).
        `graph` (default: `mapped`): for the graph's gathers, which read the gather copy if any."""
        if shard is None:
            shard = (self.read_shard(mapped, graph) if rows is None
                     else self.read_rows(rows, mapped=mapped, graph=graph))
        if shard.dtype == self.dtype:
            return shard.to(self.device, non_blocking=True)
        if self.device.type != "cpu":  # the narrower dtype crosses the bus: a bf16 copy moves half the bytes
            if shard.dtype.itemsize < self.dtype.itemsize:
                return shard.to(self.device, non_blocking=True).to(self.dtype)
            return shard.to(self.dtype).to(self.device, non_blocking=True)
        # a recycled, already touched buffer: a fresh one costs a zero-filled page fault per 4 KiB
        # (HostBuffers), slower than the read that saved the bytes
        out = self.engine.buffers.empty(shard.numel(), self.dtype) if self.tier == "nvme" else None
        return shard.to(self.dtype) if out is None else out.copy_(shard)

    # -- tiles: rows of the parameter (its first dimension), a contiguous range of the shard -----
    def row_range(self, rows: tuple[int, int]) -> tuple[int, int]:
        """Flat [lo, hi) of rows [start, end) in the shard (one rank: the shard is the parameter)."""
        if self.world > 1:
            raise ZinfError(f"zinf: {self.name!r}: tiles of a parameter sharded over {self.world} ranks are not "
                            "supported yet (options={'tiling': 'off'} gathers it whole)")
        row = self.numel // self.shape[0]
        return rows[0] * row, rows[1] * row

    def read_rows(self, rows: tuple[int, int], futures: list | None = None, mapped: bool = False,
                  graph: bool | None = None) -> torch.Tensor:
        """Rows [start, end) as a fresh flat host tensor; with `futures`, the read is only started
        (its futures appended) and the tensor is filled when they complete. `mapped`: see
        read_shard."""
        lo, hi = self.row_range(rows)
        fd, base, dtype, held = self._source(graph=(mapped or futures is not None) if graph is None else graph)
        if self.tier == "cpu":
            return held[lo:hi].clone()
        if mapped and self.maps:
            return self.engine.map_file(fd, base + lo * dtype.itemsize, hi - lo, dtype)
        out = torch.empty(hi - lo, dtype=dtype, pin_memory=self.device.type == "cuda")
        off = base + lo * dtype.itemsize
        if futures is None:
            self.engine.read_file(fd, out, off)
        else:
            futures += self.engine.submit_read(fd, out, off)
        return out

    # -- the shard's bytes, wherever they live --------------------------------------------------
    def _host_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.engine.host_empty(self.shard_numel, dtype or self.shard_dtype,
                                      pin_memory=self.device.type == "cuda")

    def _source(self, graph: bool) -> tuple[int | None, int, torch.dtype, torch.Tensor | None]:
        """(file, its first byte, dtype, CPU-tier tensor) of what a read takes: the graph's gathers
        (`graph`) read the low-precision copy where there is one (made first if it is not the
        shard's); everything else reads the shard."""
        if not graph or self.gather_dtype is None:
            return self.fd, self.base, self.shard_dtype, self.shard
        self._ensure_copy()
        return self.copy_fd, 0, self.gather_dtype, self.copy

    def _ensure_copy(self, chunk: int = 1 << 22) -> None:
        """Make the copy from the shard unless it holds the shard's values (`copy_ok`)."""
        if self.copy_ok:
            return
        with self.lock:
            if self.copy_ok:
                return
            if self.tier == "cpu":
                self.copy = self.shard.to(self.gather_dtype)
            else:
                self._transcribe(self._copy_file(), self.gather_dtype, chunk)
            self.copy_ok = True

    def _copy_file(self) -> int:
        if self.copy_fd is None:
            self.copy_fd = self._acquire("low-precision copy")
        return self.copy_fd

    def _transcribe(self, dst: int, dtype: torch.dtype, chunk: int) -> None:
        """The shard's values into file `dst` from its first byte, in `dtype`, chunk by chunk."""
        buf = torch.empty(min(chunk, self.shard_numel), dtype=self.shard_dtype)
        size = self.shard_dtype.itemsize
        for start in range(0, self.shard_numel, chunk):
            part = buf[:min(chunk, self.shard_numel - start)]
            self.engine.read_file(self.fd, part, self.base + start * size)
            self.engine.write_file(dst, part.to(dtype), start * dtype.itemsize)

    def _write_copy(self, flat: torch.Tensor) -> None:
        """The copy of a shard just written whole (`flat`, in shard_dtype). A failure leaves the copy
        marked stale (the next gather makes it from the shard) and raises."""
        if self.gather_dtype is None:
            return
        self.copy_ok = False
        if self.tier == "cpu":
            self.copy = flat.to(self.gather_dtype)
        else:
            self.engine.write_file(self._copy_file(), flat.to(self.gather_dtype).contiguous())
        self.copy_ok = True

    def refresh_copy(self) -> None:
        """The CPU tier's shard was changed in place (an optimizer step): its copy follows."""
        if self.gather_dtype is not None and self.tier == "cpu":
            self._write_copy(self.shard)

    @property
    def maps(self) -> bool:
        """Whether gathers map the shard's file instead of reading it into a fresh buffer: on a
        CPU device (the mapped pages are the tensor the graph computes with), buffered I/O. A fresh
        buffer costs a zero-filled page fault per 4 KiB, which made reading from the page cache
        4.5x slower than into a reused buffer (46 MiB: 43 vs 9.6 ms); a mapping costs neither."""
        return self.tier == "nvme" and self.device.type == "cpu" and self.engine.can_map()

    def read_shard(self, mapped: bool = False, graph: bool | None = None) -> torch.Tensor:
        """The shard as a fresh flat host tensor. `mapped` (the graph's gathers, whose tensors die
        within the graph): a private mapping of its file where `maps` allows; never for what may
        outlive a later write of the file (a state dict, a released parameter)."""
        fd, base, dtype, held = self._source(graph=mapped if graph is None else graph)
        if self.tier == "cpu":
            return held.clone()
        if mapped and self.maps:
            return self.engine.map_file(fd, base, self.shard_numel, dtype)
        out = self._host_buffer(dtype)
        self.engine.read_file(fd, out, base)
        return out

    def map_ahead(self, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, list]:
        """The shard (or its `rows`) mapped as read_shard(mapped=True) maps it, with the futures of
        its checksum checks, which run on the I/O threads: a fetch's disk reads overlap the graph's
        compute instead of running on the graph thread at the fetch (`maps` must hold)."""
        lo, hi = (0, self.shard_numel) if rows is None else self.row_range(rows)
        fd, base, dtype, _ = self._source(graph=True)
        return self.engine.submit_map(fd, base + lo * dtype.itemsize, hi - lo, dtype)

    def submit_read(self) -> tuple[torch.Tensor, list]:
        """The graph's read of the whole shard (or its copy) started: its buffer and futures."""
        fd, base, dtype, _ = self._source(graph=True)
        buf = self._host_buffer(dtype)
        return buf, self.engine.submit_read(fd, buf, base)

    def write_shard(self, flat: torch.Tensor) -> None:
        flat = flat.detach().reshape(-1).to("cpu", self.shard_dtype)
        if self.tier == "cpu":
            if self.shard is None:
                self.shard = self._host_buffer()
            self.shard.copy_(flat)
        else:
            if self.fd is None or self.source is not None:
                self.fd, self.base, self.source = self._acquire("shard"), 0, None  # a whole write: nothing to copy
            self.copy_ok = False  # until the copy below is written: never a copy of other values
            self.engine.write_file(self.fd, flat.contiguous())
        self._write_copy(flat)

    def write_whole(self, value: torch.Tensor) -> None:
        """Write the shard from the whole parameter's value (any shape). On one rank the shard is
        the value itself: its bytes go to the file straight from its storage (the engine borrows
        them, the storage stays resizable: a parameter's own is freed after), no padded copy, so
        materializing a parameter peaks at about its size, not twice it. A value in another dtype
        than the shard's (fp32 masters of a bf16 model) is converted first, as write_shard does."""
        flat = value.detach().reshape(-1)
        self.write_shard(flat if self.world == 1 else self.slice_of(flat))

    def read_whole_into(self, t: torch.Tensor) -> bool:
        """The whole parameter's value read straight into `t` (contiguous, on the CPU, the shard's
        dtype; its storage stays resizable), where this rank's shard is the whole parameter (one
        rank): no second full-size buffer. False elsewhere (the caller copies from STORE.full)."""
        if self.world != 1 or t.device.type != "cpu" or t.dtype != self.shard_dtype or not t.is_contiguous():
            return False
        if self.tier == "cpu":
            t.view(-1).copy_(self.shard)
        else:
            self.engine.read_file(self.fd, t.view(-1), self.base)
        return True

    def _own_file(self, chunk: int = 1 << 22) -> None:
        """An in-place shard (`source`) moves to a swap file of its own, chunk by chunk, before
        anything is written for it (the optimizer reads and writes `fd` from offset 0)."""
        if self.source is None:
            return
        fd = self._acquire("shard")
        try:
            self._transcribe(fd, self.shard_dtype, chunk)
        except BaseException:  # the shard stays where it lies; the half-written file goes back
            n = self.file_nos.pop()
            self.engine.swap.release(n)
            raise
        self.fd, self.base, self.source = fd, 0, None

    def read_grad(self) -> torch.Tensor | None:
        if not self.has_grad:
            return None
        self.complete_grad()
        if self.tier == "cpu":
            return self.grad
        out = self._host_buffer()
        self.read_grad_into(out)
        return out

    def read_grad_into(self, out: torch.Tensor, start: int = 0) -> None:
        """Elements [start, start + len(out)) of the gradient file into `out`, scaled by the clip
        coefficients pending on it (nvme tier; the file must be whole: complete_grad)."""
        self._read_grad_raw(out, start)
        for coef in self.grad_scales:
            out.mul_(coef)

    def _read_grad_raw(self, out: torch.Tensor, start: int) -> None:
        """Elements [start, start + len(out)) of the gradient as written, each piece from the file
        holding it (`grad_moved`), no pending scale applied."""
        size = self.shard_dtype.itemsize
        if not self.grad_moved:
            self.engine.read_file(self.grad_fd, out, start * size)
            return
        for a, b, moved in _pieces(self.grad_moved, start, start + out.numel()):
            self.engine.read_file(self.grad_spare_fd if moved else self.grad_fd, out[a - start:b - start], a * size)

    def _write_grad_beside(self, values: torch.Tensor, start: int) -> None:
        """Elements [start, start + len(values)) of a new gradient, each piece to the gradient file
        that does NOT hold its values now: a failure half way overwrites nothing of the gradient
        (the whole-file-write rule of the optimizer's records, two slots, per range). Nothing
        reads them until `_switch_grad` makes them the gradient."""
        if self.grad_spare_fd is None:
            self.grad_spare_fd = self._acquire("gradient")
        size = self.shard_dtype.itemsize
        values = values.contiguous()
        for a, b, moved in _pieces(self.grad_moved, start, start + values.numel()):
            self.engine.write_file(self.grad_fd if moved else self.grad_spare_fd, values[a - start:b - start], a * size)

    def _switch_grad(self, lo: int, hi: int) -> None:
        """Elements [lo, hi), written by `_write_grad_beside`, become the gradient: bookkeeping
        only (signals held back meanwhile: it is never left half done)."""
        with _deferred_signals():
            if (lo, hi) == (0, self.shard_numel):  # every element changed file: swap the two
                self.grad_fd, self.grad_spare_fd = self.grad_spare_fd, self.grad_fd
                return
            moved = _toggle(self.grad_moved, lo, hi)
            if moved == [(0, self.shard_numel)]:
                self.grad_fd, self.grad_spare_fd, moved = self.grad_spare_fd, self.grad_fd, []
            self.grad_moved = moved

    def scale_grad(self, coef: torch.Tensor) -> None:
        """Multiply the gradient by `coef` (a 0-dim CPU tensor) as torch's clip_grad_norm_ does
        (`g.mul_(coef)`): the CPU tier in place, the NVMe tier when its file is next read."""
        if not self.has_grad:
            return
        self.grad_writes += 1
        if self.tier == "cpu":
            self.grad.mul_(coef)
        else:
            self.grad_scales.append(coef)

    def _settle_grad_scales(self, chunk: int = 1 << 21) -> None:
        """Multiply the pending clip coefficients into the gradient file (before adding to it).
        The scaled gradient goes beside the old one (`_write_grad_beside`): a failure half way
        leaves the gradient and its pending coefficients as they were."""
        self.complete_grad()
        buf = torch.empty(min(chunk, self.shard_numel), dtype=self.shard_dtype)
        for start in range(0, self.shard_numel, chunk):
            part = buf[:min(chunk, self.shard_numel - start)]
            self.read_grad_into(part, start)
            self._write_grad_beside(part, start)
        with _deferred_signals():
            self._switch_grad(0, self.shard_numel)
            self.grad_scales.clear()

    def add_grad(self, part: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Accumulate `part` (this rank's flat gradient, or of `rows` of it, on the CPU in
        shard_dtype; the CPU tier keeps it: there no one may alias it) into the shard gradient,
        unless the entry's gradient sink takes it (an optimizer stepping in backward)."""
        self.reduces += 1
        self.grad_writes += 1
        sink = self.grad_sink() if self.grad_sink is not None else None
        if sink is not None and sink.take_grad(self, part, rows):
            return
        self.accumulate_grad(part, rows)

    def drop_grad(self) -> None:
        """Forget the gradient (taken by a step in backward), keeping the count of its reduces."""
        with self.lock:
            self.grad = None
            self.has_grad = False
            self.grad_parts.clear()
            self.grad_moved = []
            self.grad_scales.clear()

    def accumulate_grad(self, part: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """add_grad without the sink: `part` into the gradient, in its tier. All or nothing on
        NVMe: a failure (a full disk, an I/O error) leaves the gradient as it was, so the same
        call retried gives what it would have given."""
        try:
            self._accumulate(part, rows)
        except SwapCorruptionError:
            raise  # the gradient's file is damaged: nothing to retry
        except Exception as err:
            what = f"rows {rows[0]}:{rows[1]} of " if rows is not None else ""
            raise ZinfError(f"zinf: adding to {what}the gradient of parameter {self.name!r} failed ({err}); "
                            "nothing was added: the gradient is as it was before. Free space (or fix the "
                            "cause) and run it again: the result is as if this attempt had not happened") from err

    def _accumulate(self, part: torch.Tensor, rows: tuple[int, int] | None) -> None:
        with self.lock:
            self._own_file()  # a gradient: the optimizer will write the shard
            if self.grad_scales and self.has_grad:
                self._settle_grad_scales()  # a gradient added to after a clip (rare): scale first
            self.grad_scales.clear()
            if rows is None:
                prev = self.read_grad()
                self.write_grad(part if prev is None else prev.add_(part))
                return
            lo, hi = self.row_range(rows)
            if self.tier == "cpu":
                if not self.has_grad or self.grad is None:
                    self.grad = torch.zeros(self.shard_numel, dtype=self.shard_dtype)
                self.grad[lo:hi].add_(part)
                self.has_grad = True
                return
            if self.grad_fd is None:
                self.grad_fd = self._acquire("gradient")
            if self.has_grad and (lo, hi) not in self.grad_parts and any(a < hi and lo < b for a, b in self.grad_parts):
                self.complete_grad()  # a range overlapping others: make the whole file valid
            if self.has_grad and (not self.grad_parts or (lo, hi) in self.grad_parts):
                # the range holds this step's gradient: the sum goes beside it, switched to when whole
                prev = torch.empty(hi - lo, dtype=self.shard_dtype)
                self._read_grad_raw(prev, lo)
                self._write_grad_beside(prev.add_(part), lo)
                self._switch_grad(lo, hi)
                return
            # the range holds nothing of this step's yet (its bytes are no one's): written in place,
            # and part of the gradient once written whole
            self.engine.write_file(self.grad_fd, part.contiguous(), lo * self.shard_dtype.itemsize)
            with _deferred_signals():
                if not self.has_grad or self.grad_parts:
                    self.grad_parts.add((lo, hi))
                self.has_grad = True

    def complete_grad(self) -> None:
        """Make the gradient file whole: zeros where no tile wrote this step (nvme tier). Only
        bytes that are no one's are written: a failure half way changes nothing of the gradient."""
        if not (self.has_grad and self.grad_parts):
            return
        at = 0
        for lo, hi in sorted(self.grad_parts) + [(self.shard_numel, self.shard_numel)]:
            if lo > at:
                self.engine.write_file(self.grad_fd, torch.zeros(lo - at, dtype=self.shard_dtype),
                                       at * self.shard_dtype.itemsize)
            at = max(at, hi)
        self.grad_parts.clear()

    def write_grad(self, flat: torch.Tensor) -> None:
        self.grad_writes += 1
        self._own_file()
        if self.tier == "cpu":
            self.grad = flat
        elif self.has_grad:  # the gradient held survives a failed write: the new one goes beside it
            if self.grad_fd is None:
                self.grad_fd = self._acquire("gradient")
            self._write_grad_beside(flat, 0)
            self._switch_grad(0, self.shard_numel)
        else:
            if self.grad_fd is None:
                self.grad_fd = self._acquire("gradient")
            self.grad_moved = []
            self.engine.write_file(self.grad_fd, flat.contiguous())
        with _deferred_signals():
            self.grad_parts.clear()
            self.grad_scales.clear()
            self.has_grad = True

    def state_fd(self, name: str) -> int:
        if name not in self.state_fds:
            self.state_fds[name] = self._acquire(f"optimizer state {name!r}")
        return self.state_fds[name]

    def _acquire(self, what: str) -> int:
        n, fd = self.engine.swap.acquire(f"{what} of parameter {self.name!r}")
        self.file_nos.append(n)
        return fd

    def close_files(self) -> None:
        """Hand this entry's files (shard, gradient, optimizer states) back to the swap folder."""
        try:
            swap = self.engine._swap
        except ZinfError:
            return
        if swap is not None:
            for n in self.file_nos:
                swap.release(n)
        self.file_nos.clear()
        self.fd = self.grad_fd = self.grad_spare_fd = self.copy_fd = None
        self.copy, self.copy_ok = None, False
        self.grad_moved = []
        self.source, self.base = None, 0  # the source file's descriptor is shared (ParamStore.source_fd)
        self.state_fds.clear()


def _dead() -> None:
    return None


class ParamStore:
    """Every parameter a compile has seen (by storage, with a stable id) and those it manages."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}  # storage key -> pid
        self._params: dict[int, weakref.ref] = {}  # pid -> parameter (a live one: `_drain` forgets the dead)
        self._names: dict[int, str] = {}
        self._pids = itertools.count()  # a new id never reuses an old one
        self._unnamed = itertools.count()  # names of parameters a graph met unmanaged (adopt)
        self._keys: dict[int, int] = {}  # pid -> storage key (changes when manage swaps a storage)
        self._entries: dict[int, Entry] = {}  # pid -> entry, for managed parameters
        self._lock = threading.RLock()
        self._forgotten: list[int] = []  # parameters that died while the lock was busy (_forget_id)
        self._fetches: dict[int, tuple] = {}  # ticket -> (entry, host buffer or None, futures)
        self._tickets = itertools.count(1)
        self._sources: dict[str, int] = {}  # a file read in place -> its read-only descriptor (process-long)
        self.stats = {"gathers": 0, "reduces": 0, "bytes_gathered": 0, "fetches": 0, "fetch_waits_s": 0.0}
        # backwards that added gradients and have not completed (autograd's graph task id, a
        # process-wide counter): task -> {id(entry): [entry, whether it held a gradient before, its
        # counters then, whether a later backward added to it too]}. Several are open at once in a
        # reentrant backward (checkpointing runs one inside another) or after one that failed. Those
        # still open when no backward runs (step, zero_grad) never completed: `settle_backward`
        # rolls them back; see "A failed backward" in docs/decisions.md
        self._bw_open: dict[int, dict[int, list]] = {}

    def _note_backward(self, e: Entry) -> None:
        """A reduce of `e` in a backward: a backward seen for the first time queues its completion
        with autograd; `e`'s state before any open backward touched it is noted once."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return  # not in a backward (a take-over's gradient)
        with self._lock:
            mine = self._bw_open.get(task)
            if mine is None:
                mine = self._bw_open[task] = {}
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(self._backward_completed, task))
            if id(e) in mine:
                return
            for t, rec in self._bw_open.items():
                if t != task and id(e) in rec:
                    rec[id(e)][4] = True  # an older open backward noted it: its state before is there
                    return
            mine[id(e)] = [e, e.has_grad, e.reduces, e.grad_writes, False]

    def _backward_completed(self, task: int) -> None:
        with self._lock:
            self._bw_open.pop(task, None)

    def settle_backward(self) -> list[str] | None:
        """Outside any backward: roll back the backwards that added gradients and never completed.
        The gradients they started (none before them) are dropped, so they are as before and
        running the backward again gives what it would have given; those they added to (a sum of
        earlier backwards), or that a later backward added to as well, cannot be restored and are
        marked partial: a step or a reduce into them raises until zero_grad. Returns None when
        there was nothing to roll back, else the names marked partial. Called by the optimizer's
        step and zero_grad (and the store's); one comparison when every backward completed."""
        if not self._bw_open or torch._C._current_graph_task_id() >= 0:
            return None
        with self._lock:
            records, self._bw_open = self._bw_open, {}
        partial = []
        for rec in records.values():
            for e, had, reduces, writes, later in rec.values():
                if had or later:
                    if e.has_grad:
                        e.grad_partial = True
                        partial.append(e.name)
                    continue
                if e.has_grad or e.grad_parts:
                    e.drop_grad()
                e.reduces, e.grad_writes = reduces, writes + 1
        return partial

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, param: torch.Tensor, name: str) -> int:
        """A stable id for `param` (its storage), given on first sight."""
        with self._lock:
            self._drain()
            k = _key(param)
            pid = self._ids.get(k)
            if pid is None:
                pid = next(self._pids)
                self._ids[k] = pid
                self._keys[pid] = k
                self._params[pid] = weakref.ref(param)
                self._names[pid] = name
                weakref.finalize(param, self._forget_id, pid)
            return pid

    def _forget_id(self, pid: int) -> None:
        # A finalizer runs inside some thread's garbage collection, maybe a thread the lock's holder
        # waits for (an I/O thread being started while `manage` writes a shard): it never waits for
        # the lock (that deadlocked); a busy lock's holder forgets the parameter (`_drain`).
        self._forgotten.append(pid)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Forget the parameters that died (with the lock held)."""
        while self._forgotten:
            pid = self._forgotten.pop()
            k = self._keys.pop(pid, None)
            if k is not None and self._ids.get(k) == pid:
                del self._ids[k]
            self._params.pop(pid, None)  # else a dead weakref and a name per parameter of every model
            self._names.pop(pid, None)   # compiled and dropped stayed for the life of the process
            e = self._entries.pop(pid, None)
            if e is not None:
                e.close_files()

    def pid(self, t: torch.Tensor) -> int | None:
        pid = self._ids.get(_key(t))
        return None if self._forgotten and pid in self._forgotten else pid  # a dead one's storage reused

    def entry(self, t: torch.Tensor) -> Entry | None:
        pid = self.pid(t)
        return None if pid is None else self._entries.get(pid)

    def entry_by_id(self, pid: int) -> Entry | None:
        return self._entries.get(pid)

    def is_managed(self, t: torch.Tensor) -> bool:
        return self.entry(t) is not None

    def entries(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.index)

    def manage(self, pid: int, tier: str, engine_key: int, master_dtype: torch.dtype | None = None,
               budget: int | None = None, value: torch.Tensor | None = None,
               gather_dtype: torch.dtype | None = None) -> Entry:
        """Take parameter `pid` over: copy this rank's shard to its tier (as `master_dtype` if
        given), free its storage. `value`: the parameter's whole value, written instead of its own
        data (zinf_compile.loading: a parameter born without storage, its value read from a file;
        on one rank it is written as it is, no padded copy). `gather_dtype`: the graph gathers a
        copy in this dtype where it is narrower than the shard's (Entry.gather_dtype)."""
        with self._lock:
            self._drain()
            e = self._entries.get(pid)
            if e is not None:
                return e
            param = self._params.get(pid, _dead)()
            name = self._names.get(pid, f"#{pid}")
            if param is None:
                raise ZinfError(f"zinf: parameter {name!r} no longer exists")
            if value is None and param.untyped_storage().nbytes() < param.numel() * param.element_size():
                raise ZinfError(f"zinf: parameter {name!r} has no data to take over (freed elsewhere?)")
            if value is not None and (tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype):
                raise ZinfError(f"zinf: parameter {name!r}: a value of {tuple(value.shape)} {value.dtype} cannot "
                                f"be its shard ({tuple(param.shape)} {param.dtype})")
            # a parameter born without storage (value given) shares nothing and has nothing to free
            refusal = take_over_refusal(param) if value is None or param.untyped_storage().nbytes() else None
            if refusal is not None:
                raise ZinfError(f"zinf: parameter {name!r} {refusal}")
            rank, size = world()
            e = Entry(pid, name, tuple(param.shape), param.dtype, param.device,
                      param.requires_grad, rank, size, tier, engine_key, weakref.ref(param),
                      master_dtype=master_dtype if master_dtype != param.dtype else None, budget=budget,
                      gather_dtype=narrower(gather_dtype, master_dtype or param.dtype))
            try:
                e.write_whole(param if value is None else value)
            except BaseException:
                e.close_files()
                raise
            from zinf_compile.grads import install
            install()  # torch's clip_grad_norm_ and optimizers now meet managed parameters
            self._entries[pid] = e  # before the storage goes: a parameter is never freed unmanaged
            swapped = False
            try:
                if not param.untyped_storage().resizable():
                    self._own_storage(pid, param)
                    swapped = True
                param.untyped_storage().resize_(0)
            except BaseException as err:  # nor managed while whole
                try:
                    if swapped:  # its new storage holds no values yet: they come from the shard
                        param.untyped_storage().resize_(e.nbytes)
                        with torch.no_grad():
                            param.copy_(self.full(e))
                finally:
                    del self._entries[pid]
                    e.close_files()
                if isinstance(err, RuntimeError):
                    raise ZinfError(f"zinf: parameter {name!r}: its storage cannot be freed ({err}); give it a "
                                    "storage of its own before compiling (p.data = p.data.clone()) or keep it "
                                    "resident (options={'params': 'resident'})") from err
                raise
            from zinf_compile.runtime.access import mark

            mark(param)  # reads and writes outside the graph reach the shards (runtime/access.py)
            if param.grad is not None:
                # a gradient accumulated while the parameter was resident joins the shard's
                grad, param.grad = param.grad, None
                self.reduce_grad(param, grad, average=False)
            return e

    def manage_in_place(self, pid: int, engine_key: int, source: str, offset: int, dtype: torch.dtype,
                        gather_dtype: torch.dtype | None = None) -> Entry:
        """Take parameter `pid` (its storage empty) over with its shard read where it lies: `source`
        from byte `offset`, holding the parameter's bytes in `dtype` (nvme tier, one rank; the file
        is never written: see Entry.source). A `gather_dtype` copy is made at the first gather."""
        import os

        with self._lock:
            param = self._params.get(pid, _dead)()
            name = self._names.get(pid, f"#{pid}")
            if param is None:
                raise ZinfError(f"zinf: parameter {name!r} no longer exists")
            rank, size = world()
            if size > 1 or dtype != param.dtype or offset % param.element_size():
                raise ZinfError(f"zinf: parameter {name!r} cannot be read in place from {source} (one rank, its "
                                f"own dtype {param.dtype}, aligned bytes needed; got {dtype} at byte {offset})")
            if param.untyped_storage().nbytes():
                raise ZinfError(f"zinf: parameter {name!r} holds data; only a storageless one is read in place")
            fd = self._sources.get(source)
            if fd is None or not os.path.samestat(os.fstat(fd), os.stat(source)):  # new, or replaced since
                fd = self._sources[source] = os.open(source, os.O_RDONLY)  # (the old one stays its users')
            e = Entry(pid, name, tuple(param.shape), param.dtype, param.device, param.requires_grad, rank, size,
                      "nvme", engine_key, weakref.ref(param), fd=fd, source=source, base=offset,
                      gather_dtype=narrower(gather_dtype, param.dtype))
            from zinf_compile.grads import install
            install()
            self._entries[pid] = e
            from zinf_compile.runtime.access import mark

            mark(param)
            return e

    def _own_storage(self, pid: int, param: torch.Tensor) -> None:
        """Give `param` a fresh resizable storage of its own, same shape, stride and offset 0, in
        place of one that cannot be resized (the shard is already written: the new storage's bytes
        are never read before it is freed). The Python object, its size, stride, dtype, device
        and requires_grad stay, so Dynamo's guards still pass (it does not guard data_ptr); the old
        storage is let go untouched. The store's key for `param` follows its storage."""
        old = _key(param)
        fresh = torch.UntypedStorage(param.numel() * param.element_size(), device=param.device)
        with torch.no_grad():  # in place on the parameter itself: the same object, everywhere
            param.set_(fresh, 0, param.shape, param.stride())
        with self._lock:
            if self._ids.get(old) == pid:
                del self._ids[old]
            k = _key(param)
            self._ids[k] = pid
            self._keys[pid] = k

    def forget_all(self) -> None:
        """After every entry was released (`Runtime.reset`): no fetch outstanding, counters at zero.
        Parameter ids stay (finalizers hold them; a new id never reuses an old one)."""
        with self._lock:
            self._fetches.clear()
            self.stats = dict.fromkeys(self.stats, 0) | {"fetch_waits_s": 0.0}

    def release_id(self, pid: int) -> None:
        param = self._params.get(pid, _dead)()
        if param is not None:
            self.release(param)

    def release(self, param: torch.Tensor) -> None:
        """Give `param` its full data back and stop managing it (the inverse of `manage`)."""
        e = self.entry(param)
        if e is None:
            return
        from zinf_compile.runtime.access import unmark

        full = self.full(e)
        with self._lock:
            del self._entries[e.index]
        unmark(param)
        param.untyped_storage().resize_(e.nbytes)
        with torch.no_grad():
            param.copy_(full)
        # the entry's files stay: an optimizer moves its states back from them at its next step;
        # they go with the parameter (_forget_id) or the process

    # -- what the graph calls -----------------------------------------------------------------
    def adopt(self, t: torch.Tensor, engine_key: int, tier: str) -> Entry:
        """The entry of `t`, taking it over first if no compile did: Dynamo reuses a compiled graph
        for another instance of the same model (its parameters are graph inputs), whose parameters
        reach the graph's gathers still whole."""
        e = self.entry(t)
        if e is None:
            refusal = take_over_refusal(t)
            if refusal is not None:
                raise ZinfError(f"zinf: a compiled graph gathers a parameter that {refusal} (another instance "
                                "of the model?); zinf cannot take it over")
            tier, master, gather = (tier.split(",") + ["", ""])[:3]
            with torch.no_grad():
                e = self.manage(self.identify(t, f"param#{next(self._unnamed)}"), tier, engine_key,
                                getattr(torch, master) if master else None,
                                gather_dtype=getattr(torch, gather) if gather else None)
        return e

    def _entry_for(self, t: torch.Tensor, engine_key: int, tier: str) -> Entry:
        """The graph ops' entry lookup: with a tier, a parameter met unmanaged is taken over."""
        return self.adopt(t, engine_key, tier) if tier else self._require(t)

    def _take_fetch(self, e: Entry, handle: torch.Tensor) -> torch.Tensor | None:
        """The shard a fetch read for `e` (waiting for the read), or None (no such fetch)."""
        with self._lock:
            fetched = self._fetches.pop(int(handle.reshape(-1)[0]), None)
        if fetched is None or fetched[0] is not e:
            return None
        t0 = time.perf_counter()
        for f in fetched[2]:
            f.result()
        self.stats["fetch_waits_s"] += time.perf_counter() - t0
        return fetched[1]

    def _count_gather(self, e: Entry, rows: tuple[int, int] | None = None) -> None:
        self.stats["gathers"] += 1
        self.stats["bytes_gathered"] += e.nbytes if rows is None else e.nbytes // e.shape[0] * (rows[1] - rows[0])

    def gather(self, t: torch.Tensor, engine_key: int = 0, tier: str = "",
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole parameter, or its `rows` (a tile), fresh on its device."""
        e = self._entry_for(t, engine_key, tier)
        self._count_gather(e, rows)
        return self.full(e, rows=rows, mapped=True)

    def fetch(self, t: torch.Tensor, engine_key: int = 0, tier: str = "",
              rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Start reading the shard of parameter `t` (or its `rows`) from its tier; the handle goes
        to gather_from. The handle is a one-element int64 tensor whose storage (numpy-owned) ends
        the fetch if the handle dies unused."""
        e = self._entry_for(t, engine_key, tier)
        ticket = next(self._tickets)
        buf, futures = None, []
        if e.maps:  # mapped now; its checksum checks (which fault the pages in) run on the I/O threads
            buf, futures = e.map_ahead(rows)
        elif e.tier == "nvme" and rows is not None:
            buf = e.read_rows(rows, futures)
        elif e.tier == "nvme":
            buf, futures = e.submit_read()
        with self._lock:
            self._fetches[ticket] = (e, buf, futures)
        cell = np.array([ticket], dtype=np.int64)
        weakref.finalize(cell, self._fetches.pop, ticket, None)
        self.stats["fetches"] += 1
        return torch.from_numpy(cell)

    def gather_from(self, t: torch.Tensor, handle: torch.Tensor, engine_key: int = 0, tier: str = "",
                    rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole parameter (or its `rows`), from the shard a fetch started reading (read now
        if none did)."""
        e = self._entry_for(t, engine_key, tier)
        self._count_gather(e, rows)
        return self.full(e, shard=self._take_fetch(e, handle), rows=rows, mapped=True)

    def local_shard(self, t: torch.Tensor, engine_key: int, tier: str, handle: torch.Tensor | None = None):
        """This rank's padded flat shard on the device in the parameter's dtype (the graph
        all-gathers it), from a fetch's read when `handle` names one."""
        e = self.adopt(t, engine_key, tier)
        self._count_gather(e)
        return e.on_device(None if handle is None else self._take_fetch(e, handle), graph=True)

    def store_grad(self, t: torch.Tensor, part: torch.Tensor) -> None:
        """Add this rank's part of the gradient (the sum over ranks, reduce-scattered by the
        graph) into the shard's gradient, as the mean over ranks."""
        e = self._require(t)
        e.add_grad((part.detach() / e.world).to("cpu", e.shard_dtype))
        self.stats["reduces"] += 1

    def full(self, e: Entry, shard: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
             mapped: bool = False) -> torch.Tensor:
        """The whole parameter, fresh, on its device (an all-gather over ranks when sharded); with
        `rows`, those rows of it (`shard`: what a fetch of them read). `mapped`: for the graph,
        a mapping of the shard's file will do (Entry.read_shard)."""
        if rows is not None:
            e.row_range(rows)  # one rank only
            return e.on_device(shard, rows, mapped).view(rows[1] - rows[0], *e.shape[1:])
        shard = e.on_device(shard, mapped=mapped)
        if e.world > 1:
            flat = torch.empty(e.shard_numel * e.world, dtype=e.dtype, device=e.device)
            dist.all_gather_into_tensor(flat, shard)
        else:
            flat = shard
        return flat[: e.numel].view(e.shape)

    def reduce_grad(self, t: torch.Tensor, g: torch.Tensor, average: bool = True,
                    rows: tuple[int, int] | None = None) -> None:
        """Add this step's gradient of parameter `t` (whole, from this rank's batch) into the
        shard's gradient; over ranks, the mean (as DDP and DeepSpeed do). `average=False`: g is
        already the mean over ranks (a resident parameter's .grad): just take this rank's part.
        `rows`: g is the gradient of those rows only (a tile; one rank)."""
        e = self._require(t)
        self._note_backward(e)
        if e.grad_partial:
            raise ZinfError(f"zinf: the gradient of parameter {e.name!r} holds part of a backward that did not "
                            "complete (added to an earlier sum, it cannot be restored); call zero_grad() and run "
                            "the backward(s) again")
        flat = g.detach().reshape(-1)
        if rows is not None:
            e.row_range(rows)
            e.add_grad(flat.to("cpu", e.shard_dtype, copy=e.tier == "cpu" or flat.device.type != "cpu"), rows)
            self.stats["reduces"] += 1
            return
        if e.world > 1 and not average:
            part = e.slice_of(flat)
        elif e.world > 1:
            padded = torch.zeros(e.shard_numel * e.world, dtype=g.dtype, device=g.device)
            padded[: e.numel] = flat
            part = torch.empty(e.shard_numel, dtype=g.dtype, device=g.device)
            _reduce_scatter(part, padded)
            part.div_(e.world)
        else:
            part = flat
        # the CPU tier keeps `part`: a copy when it may alias g (Inductor reuses g's buffer after
        # this op returns); the NVMe tier writes it to the file before returning: no copy needed
        e.add_grad(part.to("cpu", e.shard_dtype, copy=part.device.type != "cpu" or (part is flat and e.tier == "cpu")))
        self.stats["reduces"] += 1

    def zero_grad(self, entries=None) -> None:
        self.settle_backward()  # a failed backward's record goes (its gradients are cleared here anyway)
        for e in entries if entries is not None else self.entries():
            e.grad = None
            e.has_grad = False
            e.grad_partial = False
            e.grad_parts.clear()
            e.grad_moved = []
            e.reduces = 0
            sink = e.grad_sink() if e.grad_sink is not None else None
            if sink is not None:
                sink.grad_cleared(e)  # a step taken in backward with this gradient is dropped with it

    def _require(self, t: torch.Tensor) -> Entry:
        e = self.entry(t)
        if e is None:
            raise ZinfError("zinf: a graph gathers a parameter the store does not manage (was the store "
                            "reset while compiled code still runs?)")
        return e


def narrower(gather: torch.dtype | None, stored: torch.dtype) -> torch.dtype | None:
    """The dtype of a gather copy of a shard stored in `stored`: `gather` where it saves bytes (a
    floating shard, a narrower floating dtype), else None (the gathers read the shard itself)."""
    if gather is None or not stored.is_floating_point or gather.itemsize >= stored.itemsize:
        return None
    return gather


def _pieces(ranges: list, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """[lo, hi) cut where `ranges` (sorted, disjoint [a, b)) start or end: (a, b, inside) pieces."""
    out, at = [], lo
    for a, b in ranges:
        if b <= at:
            continue
        if a >= hi:
            break
        if a > at:
            out.append((at, a, False))
        at = min(b, hi)
        out.append((max(a, lo), at, True))
        if at >= hi:
            break
    if at < hi:
        out.append((at, hi, False))
    return out


def _toggle(ranges: list, lo: int, hi: int) -> list[tuple[int, int]]:
    """`ranges` with [lo, hi) toggled (the symmetric difference), sorted, disjoint, merged."""
    keep = [(a, min(b, lo)) for a, b in ranges if a < lo] + [(max(a, hi), b) for a, b in ranges if b > hi]
    keep += [(a, b) for a, b, inside in _pieces(ranges, lo, hi) if not inside]
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in keep if r[0] < r[1]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _deferred_signals():
    from zinf_compile.optim import _deferred_signals as held

    return held()


_REDUCE_SCATTER_OK: bool | None = None


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    """reduce_scatter_tensor where the backend has it; gloo builds without it all-reduce instead."""
    global _REDUCE_SCATTER_OK
    if _REDUCE_SCATTER_OK is not False:
        try:
            dist.reduce_scatter_tensor(out, inp)
            _REDUCE_SCATTER_OK = True
            return
        except (RuntimeError, NotImplementedError, ValueError):
            if _REDUCE_SCATTER_OK:
                raise
            _REDUCE_SCATTER_OK = False
    dist.all_reduce(inp)
    rank = dist.get_rank()
    out.copy_(inp[rank * out.numel():(rank + 1) * out.numel()])

