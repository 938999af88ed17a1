"""The offload engine: where tensors go when the plan sends them away, and how they come back.

A tensor sent away is represented in the graph by a *handle*: an int64 tensor with one element,
expanded (stride 0) to the tensor's shape. The element is a ticket number; the shape keeps every
symbolic size visible to the graph that receives the handle, so dynamic shapes stay bound.

Writes are synchronous with respect to the graph: Inductor may reuse a buffer for a later result as
soon as its last use (our offload op) returns, so the data must have left before. With buffered
I/O the kernel's page cache makes such writes cheap; the transfer that costs, the read, is the one
that overlaps compute: `prefetch` submits it to a thread pool, `wait` joins it.

Every record written to a swap file (an activation, a parameter's shard, gradient, optimizer
state) carries a 64-bit digest (xxh3) per BLOCK_BYTES of its file, checked wherever it is read or mapped: a
zeroed, flipped or overwritten record is a SwapCorruptionError naming the file and what it holds,
never data computed with (option "checksums" turns both off). A file zinf reads in place and does
not own (a safetensors checkpoint, `SourceFile`) has no digests of its own: zinf records each
block's digest at its first read or mapping and checks every later one against it, and the file's
size and mtime against those it had at load.
"""
from __future__ import annotations

import ctypes
import fcntl
import itertools
import math
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from zinf_compile.errors import SwapCorruptionError, ZinfError
from zinf_compile.runtime.swapdir import SwapDir

CHUNK_BYTES = 16 << 20  # one positional read/write; chunks of a tensor run in parallel
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
# Swap files are checksummed per block of this many bytes: it divides CHUNK_BYTES (the chunks a
# read or write is cut into never share a block) and is a multiple of ALIGN and of the mmap
# granularity, and a read or write that starts or ends inside a block reads at most two blocks more.
# The digest is xxh3-64: 20.5 GiB/s on one core of this 2-core machine against zlib.crc32's 3.7;
# crc32 took 16% of the CPU of a cold streamed forward, which is CPU-bound here (decisions.md,
# "Swap-file digests: xxh3").
BLOCK_BYTES = 256 << 10
_digest = xxhash.xxh3_64_intdigest  # of a buffer (anything with the buffer protocol, contiguous)
# A mapping's checks run in pieces of this many bytes (whole blocks) over the I/O threads.
VERIFY_BYTES = 8 << 20


@dataclass
class Stored:
    """A tensor away from the device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    host: torch.Tensor | None = None  # cpu tier
    file: int | None = None  # nvme tier: swap file number
    fd: int | None = None
    refs: int = 0


@dataclass
class PendingRead:
    """A prefetch in flight: the destination and what completes it."""

    dest: torch.Tensor
    futures: list[Future] = field(default_factory=list)
    event: object | None = None  # CUDA event recorded after the host-to-device copy
    refs: int = 0


@dataclass(eq=False)
class SourceFile:
    """A file zinf reads in place and does not own (a safetensors checkpoint, `load_pretrained(...,
    in_place=True)`), through the read-only descriptor `fd`. It has no digests of its own, so they
    are taken on trust at first use: the first read or mapping of each BLOCK_BYTES block records
    the xxh3-64 of the whole block (clipped to the file's size; a block two tensors share is one
    block of the file), every later read or mapping of it checks it. `size` and `mtime_ns` are the
    file's at load (`OffloadEngine.watch_source`): every read checks them first, and a block's
    first digest is recorded only while they still hold (a change after load reaches no table)."""

    path: str
    fd: int
    size: int
    mtime_ns: int
    sums: dict = field(default_factory=dict)  # block k -> digest of bytes [k*B, min(k*B + B, size))
    ranges: list = field(default_factory=list)  # (start, end, parameter name) registered at load
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # records a first digest

    @classmethod
    def of(cls, fd: int, path: str) -> "SourceFile":
        st = os.fstat(fd)
        return cls(path, fd, st.st_size, st.st_mtime_ns)

    def block(self, k: int) -> tuple[int, int]:
        """Block k's first byte and length (the file's last block is shorter)."""
        return k * BLOCK_BYTES, min(BLOCK_BYTES, self.size - k * BLOCK_BYTES)

    def changed(self, st: os.stat_result) -> str | None:
        """How the file differs from the one loaded, from its fstat (None: it does not)."""
        if st.st_size != self.size:
            how = "truncated" if st.st_size < self.size else "grown"
            return f"it holds {st.st_size} bytes, {self.size} when zinf loaded it ({how})"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was modified after zinf loaded it (its mtime changed)"
        return None

    def holders(self, lo: int, hi: int) -> str:
        """The parameters whose bytes fall in [lo, hi), for error messages."""
        names = list(dict.fromkeys(n for a, b, n in self.ranges if a < hi and lo < b))
        if not names:
            return f"bytes [{lo}, {hi})"
        return ("parameter " if len(names) == 1 else "parameters ") + ", ".join(map(repr, names[:4])) + (
            f" and {len(names) - 4} more" if len(names) > 4 else "")


def inverse_order(dim_order) -> list[int]:
    """The permutation that undoes `dim_order` (wait returns the stored layout permuted back)."""
    inverse = [0] * len(dim_order)
    for i, d in enumerate(dim_order):
        inverse[d] = i
    return inverse


def _byte_view(t: torch.Tensor):
    """A writable uint8 numpy view over a contiguous CPU tensor's bytes, which keeps the tensor
    alive (reads run on after the call that starts them). torch makes the storage of a tensor
    exported to numpy non-resizable, for good."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _borrowed_bytes(t: torch.Tensor):
    """A writable uint8 numpy array over a contiguous CPU tensor's bytes, through their address:
    the storage stays resizable (a parameter's storage is freed by resizing it, and writing its
    shard straight from it must not prevent that; `_byte_view` would). It holds no reference:
    for a transfer that ends before the caller, who holds `t`, returns."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ZinfError(f"zinf: internal: file I/O needs a contiguous CPU tensor, got a {t.device} tensor of "
                        f"strides {tuple(t.stride())}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(t.data_ptr()), dtype=np.uint8)


class OffloadEngine:
    """One per (tier, offload_dir, io options); ops find it through `engine(key)`."""

    # Every swap record carries block digests, checked on each read (see _sums_of). The option
    # "checksums" (config.py) sets it per engine, before it writes anything: records written
    # unsummed have no sums to check later.
    checksums: bool = True

    def __init__(self, key: int, tier: str, offload_dir: str, io_threads: int, o_direct: bool) -> None:
        self.key = key
        self.tier = tier
        self.offload_dir = offload_dir
        self.io_threads = io_threads
        self.o_direct_requested = o_direct
        self._swap: SwapDir | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()  # _drop may run from a GC finalizer inside a locked section
        self._ids = itertools.count(1)
        self._stored: dict[int, Stored] = {}
        self._reads: dict[int, PendingRead] = {}
        self._side_streams: dict[torch.device, object] = {}
        self.stats = {"offloads": 0, "prefetches": 0, "waits": 0, "bytes_written": 0, "bytes_read": 0}
        self._parent_fds: frozenset[int] = frozenset()  # in a forked child: the parent's files, read-only
        self._parent_sums: dict[int, dict] = {}  # and their checksums
        self._sources: dict[int, SourceFile] = {}  # fd -> a file read in place (watch_source)
        self.buffers = HostBuffers()
        if tier == "nvme":
            self.swap  # fail now, naming the path, rather than in the middle of a step

    def after_fork_in_child(self) -> None:
        """In a forked child: the parent's I/O threads do not exist here and its locks may have been
        held at the fork; the child gets its own threads, lock and swap folder for what it writes
        (activations), and may only read the parent's files (its in-flight handles are void)."""
        self._lock = threading.RLock()
        self._pool = None
        self.buffers = HostBuffers()  # its lock may have been held at the fork
        for src in self._sources.values():  # so may theirs; their descriptors and digests stay good
            src.lock = threading.Lock()
        if self._swap is not None:
            self._parent_fds = frozenset(self._swap._fds.values()) | self._parent_fds
            self._parent_sums.update(self._swap.sums)
            self._swap.disown()
            self._swap = None
        self._stored.clear()
        self._reads.clear()

    # -- resources, made on first use ---------------------------------------------------------
    @property
    def swap(self) -> SwapDir:
        if self._swap is None:
            self._swap = SwapDir(self.offload_dir, self.o_direct_requested is True)
        return self._swap

    def choose_direct(self, direct: bool) -> bool:
        """Apply a compile's choice of O_DIRECT (planner.direct_io) where the option left it to
        zinf ("auto") and no swap file exists yet (a file keeps the flags it was opened with: the
        first compile that writes decides). Returns whether the engine's files are O_DIRECT."""
        if self.o_direct_requested == "auto" and self.tier == "nvme" and self.swap.file_count() == 0:
            self.swap.o_direct = bool(direct) and self.swap._supports_o_direct()
        return self.direct

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="zinf-io")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._stored.clear()
        self._reads.clear()
        self.buffers.clear()
        self._sources.clear()
        if self._swap is not None:
            self._swap.close()
            self._swap = None

    def live_tickets(self) -> int:
        return len(self._stored) + len(self._reads)

    # -- handles ------------------------------------------------------------------------------
    def _handle(self, ticket: int, shape) -> torch.Tensor:
        # The handle's one element lives in a numpy array that its storage owns: when the last
        # view of the handle dies (wherever autograd or Inductor re-wrapped it), the array dies
        # and the ticket is released. A finalizer on the tensor object itself would fire too early.
        cell = np.array([ticket], dtype=np.int64)
        weakref.finalize(cell, self._drop, ticket)
        base = torch.from_numpy(cell)
        return base.expand(*shape) if len(shape) else base.view(())

    @staticmethod
    def ticket_of(h: torch.Tensor) -> int:
        return int(h.as_strided((1,), (1,), h.storage_offset())[0])

    def _drop(self, ticket: int) -> None:
        with self._lock:
            if ticket in self._stored:
                self._unref_stored(ticket)
                return
            r = self._reads.get(ticket)
            if r is not None:
                r.refs -= 1
                if r.refs <= 0:
                    del self._reads[ticket]

    def _unref_stored(self, ticket: int) -> None:
        """One holder less (a handle, or a read in flight); the last one frees the swap file."""
        with self._lock:
            s = self._stored.get(ticket)
            if s is None:
                return
            s.refs -= 1
            if s.refs <= 0:
                del self._stored[ticket]
                if s.file is not None and self._swap is not None:
                    self._swap.release(s.file)

    # -- the three operations -----------------------------------------------------------------
    def offload(self, x: torch.Tensor, dim_order: list[int]) -> torch.Tensor:
        """Send `x` to the tier; returns its handle. `x` is laid out in `dim_order` first."""
        if self.direct and x.device.type == "cpu":  # one copy, onto whole pages: no bounce in the write
            data = self.buffers.empty(x.numel(), x.dtype).view([x.shape[d] for d in dim_order])
            data.copy_(x.permute(dim_order))
        else:
            data = x.permute(dim_order).contiguous()
        stored = Stored(tuple(data.shape), data.dtype, data.numel() * data.element_size())
        if self.tier == "cpu":
            # a copy even on a CPU device: Inductor may reuse x's buffer once this op returns
            stored.host = data.clone() if data.device.type == "cpu" else self._to_host(data)
        else:
            dtype = str(data.dtype).removeprefix("torch.")
            stored.file, stored.fd = self.swap.acquire(f"an offloaded activation, {dtype}{list(x.shape)}")
            host = self._to_host(data) if data.device.type != "cpu" else data  # written before we return
            try:
                self._run_chunks(self._write_chunk, stored.fd, host, stored.nbytes)
            except BaseException:
                self.swap.release(stored.file)
                raise
            self.stats["bytes_written"] += stored.nbytes
        ticket = next(self._ids)
        stored.refs = 1
        with self._lock:
            self._stored[ticket] = stored
        self.stats["offloads"] += 1
        return self._handle(ticket, x.shape)

    def prefetch(self, h: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Start bringing the tensor behind `h` back to `device`; returns a new handle."""
        source = self.ticket_of(h)
        stored = self._stored_of(h)
        if stored.fd is not None:
            self.check_size(stored.fd, 0, stored.nbytes)
        if device.type == "cpu" and self.tier == "nvme":
            dest = self.host_empty(math.prod(stored.shape), stored.dtype).view(stored.shape)
        else:
            dest = torch.empty(stored.shape, dtype=stored.dtype, device=device)
        pending = PendingRead(dest=dest)
        # The read holds the stored tensor (and its swap file) until it is done: Inductor frees
        # the handle right after this op, and a later offload must not reuse the file mid-read.
        with self._lock:
            stored.refs += 1
        ready = None
        if device.type == "cuda":  # what the caller's stream queued before us (dest's last users)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self.tier == "cpu":
            self._copy_in(stored.host, pending, ready)
            self._unref_stored(source)
        elif device.type == "cpu":
            pending.futures = self._submit_chunks(self._read_chunk, stored.fd, pending.dest, stored.nbytes)
        else:
            staging = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True)
            futures = self._submit_chunks(self._read_chunk, stored.fd, staging, stored.nbytes)
            pending.futures = [self.pool.submit(self._after_read_copy_in, futures, staging, pending, ready)]
        if pending.futures:
            _when_all_done(pending.futures, lambda: self._unref_stored(source))
        self.stats["bytes_read"] += stored.nbytes if self.tier == "nvme" else 0
        ticket = next(self._ids)
        pending.refs = 1
        with self._lock:
            self._reads[ticket] = pending
        self.stats["prefetches"] += 1
        return self._handle(ticket, h.shape)

    def wait(self, h: torch.Tensor, device: torch.device, dim_order: list[int]) -> torch.Tensor:
        """The tensor behind a prefetch handle (or an offload handle: then read it now)."""
        ticket = self.ticket_of(h)
        with self._lock:
            pending = self._reads.get(ticket)
        if pending is None:
            tmp = self.prefetch(h, device)  # keep the handle alive while we use its read
            tmp_ticket = self.ticket_of(tmp)
            with self._lock:
                pending = self._reads[tmp_ticket]
        for f in pending.futures:
            f.result()  # re-raises an I/O error here, in the step that needs the data
        if pending.event is not None:
            torch.cuda.current_stream(device).wait_event(pending.event)
        self.stats["waits"] += 1
        return pending.dest.permute(inverse_order(dim_order))

    # -- helpers --------------------------------------------------------------------------------
    def _stored_of(self, h: torch.Tensor) -> Stored:
        ticket = self.ticket_of(h)
        with self._lock:
            stored = self._stored.get(ticket)
        if stored is None:
            raise ZinfError(f"zinf: offloaded tensor #{ticket} is gone (was its graph already freed?)")
        return stored

    def _side_stream(self, device: torch.device):
        with self._lock:
            if device not in self._side_streams:
                self._side_streams[device] = torch.cuda.Stream(device)
            return self._side_streams[device]

    def _to_host(self, data: torch.Tensor) -> torch.Tensor:
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        stream = self._side_stream(data.device)
        stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(stream):
            host.copy_(data, non_blocking=True)
        # the source may be reused by the next kernel as soon as we return: wait for the copy
        stream.synchronize()
        return host

    def _copy_in(self, host: torch.Tensor, pending: PendingRead, ready=None) -> None:
        """host -> pending.dest; on CUDA on the side stream, after `ready` (an event the caller's
        stream recorded: this may run in an I/O thread, whose current stream is another one)."""
        dest = pending.dest
        if dest.device.type == "cpu":
            dest.copy_(host)
            return
        stream = self._side_stream(dest.device)
        with torch.cuda.device(dest.device):
            if ready is not None:
                stream.wait_event(ready)
            with torch.cuda.stream(stream):
                dest.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        dest.record_stream(stream)
        pending.event = event

    def _after_read_copy_in(self, futures: list[Future], staging: torch.Tensor, pending: PendingRead,
                            ready) -> None:
        for f in futures:
            f.result()
        self._copy_in(staging, pending, ready)

    def _chunks(self, nbytes: int, base: int = 0):
        """(offset, length) pieces of [0, nbytes), cut where base + offset is a multiple of
        CHUNK_BYTES: two pieces never share a page of the file (an unaligned O_DIRECT write
        rewrites its boundary pages, which must be its own)."""
        cuts = [0, *range(CHUNK_BYTES - base % CHUNK_BYTES, nbytes, CHUNK_BYTES), nbytes]
        return [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a] or [(0, 0)]

    def _submit_chunks(self, fn, fd: int, t: torch.Tensor, nbytes: int, base: int = 0, view=None) -> list[Future]:
        if view is None:
            view = _byte_view(t) if nbytes else None
        return [self.pool.submit(fn, fd, view, off, n, base) for off, n in self._chunks(nbytes, base)]

    def _run_chunks(self, fn, fd: int, t: torch.Tensor, nbytes: int, base: int = 0) -> None:
        """fn over every chunk of t's bytes, waited for (all of them, even after an error): t's
        bytes are borrowed for the call (`_borrowed_bytes`), so its storage stays resizable."""
        _join(self._submit_chunks(fn, fd, t, nbytes, base, view=_borrowed_bytes(t)))

    def _write_chunk(self, fd: int, view, off: int, n: int, base: int = 0) -> None:
        """Bytes [off, off+n) of `view` to the file at base+off (and their blocks' checksums)."""
        if n == 0:
            return
        sums = self._sums_of(fd)
        try:
            if sums is None:
                self._write_raw(fd, view, off, n, base)
            else:
                self._write_summed(fd, sums, view, off, n, base)
        except OSError as e:
            raise ZinfError(
                f"zinf: writing {n} bytes to the swap file {self.describe(fd)} failed: {e.strerror or e}"
            ) from None

    def _write_raw(self, fd: int, view, off: int, n: int, base: int) -> None:
        if n == 0:
            return
        if _opened_direct(fd):
            body = _direct_body(view, off, n, base)
            if body:  # straight from the tensor's pages
                _pwrite_all(fd, memoryview(view[off:off + body]), base + off)
            if body < n:
                self._write_bounced(fd, view, off + body, n - body, base)
            return
        _pwrite_all(fd, memoryview(view[off:off + n]), base + off)

    # -- checksums: every swap record's bytes, per BLOCK_BYTES block of its file ----------------
    # A file's table maps block k (bytes [k*B, k*B + B)) to (length, digest of bytes [k*B, k*B +
    # length)). A write sums the whole blocks it covers from its own bytes, without a lock. A block
    # it covers in part (a record's last block; a piece starting or ending inside one, as the
    # optimizer's chunks and a tile's rows do, several at once in the I/O pool) is written and
    # summed under the file's lock: when bytes of the block outside the write carry over, it reads
    # the block, checks what was recorded, and sums it with the new bytes in. A read checks every
    # block it touches: those it covers whole in its own buffer, the (at most two) it covers in
    # part by reading the block again.
    def _sums_of(self, fd: int) -> dict | None:
        """The checksum table of a swap file (None: not ours, e.g. a checkpoint read in place)."""
        if not self.checksums:
            return None
        swap = self._swap
        sums = swap.sums.get(fd) if swap is not None and fd not in self._parent_fds else None
        return sums if sums is not None else self._parent_sums.get(fd)

    def _sum_lock(self, fd: int):
        swap = self._swap
        lock = swap.sum_locks.get(fd) if swap is not None else None
        return lock if lock is not None else self._lock

    def _write_summed(self, fd: int, sums: dict, view, off: int, n: int, base: int) -> None:
        pos, end = base + off, base + off + n
        first, last = pos // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        whole = range(-(-pos // BLOCK_BYTES), end // BLOCK_BYTES)  # the blocks covered whole
        if len(whole):
            lo, hi = whole.start * BLOCK_BYTES, whole.stop * BLOCK_BYTES
            plain = {k: (BLOCK_BYTES, _digest(view[k * BLOCK_BYTES - base:(k + 1) * BLOCK_BYTES - base]))
                     for k in whole}
            for k in whole:
                sums.pop(k, None)  # a failed write leaves these blocks unknown, not wrongly summed
            self._write_raw(fd, view, lo - base, hi - lo, base)
            sums.update(plain)
        for k in {first, last} - set(whole):
            self._write_part(fd, sums, k, view, max(pos, k * BLOCK_BYTES), min(end, (k + 1) * BLOCK_BYTES), base)

    def _write_part(self, fd: int, sums: dict, k: int, view, lo: int, hi: int, base: int) -> None:
        """Write bytes [lo, hi) of block k (file positions) and sum the block, with the bytes it
        held before where they carry over (checked against their sum first)."""
        start = k * BLOCK_BYTES
        new = view[lo - base:hi - base]
        with self._sum_lock(fd):
            old = sums.pop(k, None)
            old_len = old[0] if old else 0
            if lo == start and old_len <= hi - start:  # nothing carries over
                self._write_raw(fd, view, lo - base, hi - lo, base)
                sums[k] = (hi - start, _digest(new))
                return
            length = max(old_len, hi - start)
            try:
                block = self._read_block(fd, start, length)
            except OSError:
                if old is not None:
                    sums[k] = old  # nothing was written: the block is as recorded
                raise
            if old is not None and _digest(block[:old_len]) != old[1]:
                raise SwapCorruptionError(self._corrupt(fd, start, start + old_len))
            block[lo - start:hi - start] = new
            try:
                self._write_raw(fd, view, lo - base, hi - lo, base)
            except OSError:
                if old is not None:
                    self._resum_after_failure(fd, sums, k, block, old_len, lo - start, hi - start)
                raise
            sums[k] = (length, _digest(block[:length]))

    def _resum_after_failure(self, fd: int, sums: dict, k: int, block, length: int, lo: int, hi: int) -> None:
        """A write of bytes [lo, hi) of block k failed: the block's other bytes are another record's
        (a neighbouring tile of a gradient) and must stay readable. Sum the first `length` bytes
        as they are now if those outside [lo, hi) are still the ones checked before the write
        (`block`); the failed range holds no one's data (the caller did not record it), else the
        block stays unsummed, which reads as "never completely written"."""
        try:
            now = self._read_block(fd, k * BLOCK_BYTES, length)
        except OSError:
            return
        if (bytes(now[:min(lo, length)]) == bytes(block[:min(lo, length)])
                and bytes(now[hi:length]) == bytes(block[hi:length])):
            sums[k] = (length, _digest(now[:length]))

    def _read_block(self, fd: int, start: int, length: int):
        """Bytes [start, start + length) of the file (zeros past its end) in a fresh buffer."""
        buf = aligned_empty(_round_up(length, ALIGN), torch.uint8).numpy()
        _pread_all(fd, memoryview(buf), start, upto_eof=True)
        return buf

    def _verify_read(self, fd: int, sums: dict, view, off: int, n: int, base: int) -> None:
        """Check bytes [off, off+n) just read into `view` against the file's checksums."""
        pos, end = base + off, base + off + n
        self._verify_covered(fd, sums, pos // BLOCK_BYTES, (end - 1) // BLOCK_BYTES, pos, end)
        for k in range(pos // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1):
            start = k * BLOCK_BYTES
            length, digest = sums[k]
            if pos <= start and start + length <= end:
                ok = _digest(view[start - base:start + length - base]) == digest
            else:  # a block read in part: the whole block, checked, and the part from it
                with self._sum_lock(fd):
                    block = self._read_block(fd, start, length)
                ok = _digest(block[:length]) == digest
                lo, hi = max(pos, start), min(end, start + length)
                view[lo - base:hi - base] = block[lo - start:hi - start]
            if not ok:
                raise SwapCorruptionError(self._corrupt(fd, start, start + length))

    def _verify_covered(self, fd: int, sums: dict, first: int, last: int, pos: int, end: int) -> None:
        """Raise unless blocks first..last have checksums for all of bytes [pos, end)."""
        for k in range(first, last + 1):
            start = k * BLOCK_BYTES
            rec = sums.get(k)
            if rec is None or start + rec[0] < min(end, start + BLOCK_BYTES):
                raise SwapCorruptionError(
                    f"zinf: the swap file {self.describe(fd)} does not hold what zinf wrote: bytes "
                    f"[{max(pos, start)}, {min(end, start + BLOCK_BYTES)}) were never completely written (a "
                    "write failed, or the record is not the one expected)")

    def _corrupt(self, fd: int, lo: int, hi: int) -> str:
        return (f"zinf: the swap file {self.describe(fd)} is corrupt: bytes [{lo}, {hi}) do not match the "
                "checksum zinf recorded when it wrote them (a failing disk, or another process wrote the "
                "file); the data are lost, rather than computed with. Restore from a checkpoint")

    def _verify_mapped(self, fd: int, sums: dict, arr, start: int, lo: int, hi: int) -> None:
        """Check the blocks of file bytes [lo, hi) (block boundaries) in `arr`, a mapping of the
        file from byte `start`."""
        for k in range(lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES + 1):
            length, digest = sums[k]
            at = k * BLOCK_BYTES - start
            if _digest(arr[at:at + length]) != digest:
                raise SwapCorruptionError(self._corrupt(fd, k * BLOCK_BYTES, k * BLOCK_BYTES + length))

    # -- files read in place (SourceFile): digests taken on trust at the first read -------------
    # Reads and mappings of such a file are checked like a swap file's, per whole block (the last
    # clipped to the file's size): a block's digest is taken from the first read or mapping that
    # covers it and recorded under the file's lock, after an fstat shows the file still has the
    # size and mtime it had at load (bytes read from a file changed since are never trusted); a
    # later read or mapping that digests it otherwise, including a second first read racing the
    # first on another I/O thread, raises SwapCorruptionError naming the file and the parameter.
    def watch_source(self, fd: int, path: str, name: str, start: int, nbytes: int,
                     renew: bool = False) -> SourceFile:
        """Check parameter `name`, bytes [start, start + nbytes) of the file `path` read in place
        through `fd`, from now on (load_pretrained). The first call for `fd`, or one with `renew`
        (the file changed since an earlier load, whose parameters are all gone), takes the file's
        size and mtime now as the ones it must keep and starts an empty digest table."""
        with self._lock:
            src = self._sources.get(fd)
            if src is None or renew:
                src = self._sources[fd] = SourceFile.of(fd, path)
            src.ranges.append((start, start + nbytes, name))
            return src

    def source(self, fd: int) -> SourceFile | None:
        """The file read in place behind `fd`, if watch_source registered it."""
        return self._sources.get(fd)

    def _source_of(self, fd: int) -> SourceFile | None:
        """The file read in place behind `fd`, when its blocks are digested (option "checksums")."""
        return self._sources.get(fd) if self.checksums else None

    def _source_error(self, src: SourceFile, lo: int, hi: int, what: str) -> str:
        return (f"zinf: the checkpoint file {src.path}, read in place for {src.holders(lo, hi)}, is not the file "
                f"zinf loaded: {what}. Another process rewrote or truncated it, or the disk returns other bytes "
                "than before; nothing was computed with them. Restore or re-download the checkpoint, then load "
                "the model again (zinf_compile.reset(), then load_pretrained into a new model)")

    def _changed_block(self, src: SourceFile, k: int, lo: int, hi: int) -> SwapCorruptionError:
        start, length = src.block(k)
        return SwapCorruptionError(self._source_error(
            src, lo, hi, f"bytes [{start}, {start + length}) (of {src.holders(start, start + length)}) differ from "
                         "what zinf read there first (their xxh3-64 digest)"))

    def _record_source(self, src: SourceFile, fresh: dict, lo: int, hi: int) -> None:
        """Record first digests (block -> digest), taken from bytes read for [lo, hi): only while
        the file still has its size and mtime from load; a block another thread recorded meanwhile
        must agree."""
        with src.lock:
            why = src.changed(os.fstat(src.fd))
            if why is not None:
                raise SwapCorruptionError(self._source_error(src, lo, hi, why))
            for k, d in fresh.items():
                if src.sums.setdefault(k, d) != d:
                    raise self._changed_block(src, k, lo, hi)

    def _verify_source_read(self, src: SourceFile, view, off: int, n: int, base: int) -> None:
        """Check bytes [off, off+n) just read into `view` (file position base+off) against the
        blocks' digests, recording those read for the first time. A block read in part is read
        whole, checked, and the part copied from it (as _verify_read does)."""
        pos, end = base + off, base + off + n
        fresh = {}
        for k in range(pos // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1):
            start, length = src.block(k)
            if pos <= start and start + length <= end:
                d = _digest(view[start - base:start + length - base])
            else:
                block = self._read_block(src.fd, start, length)
                d = _digest(block[:length])
                lo, hi = max(pos, start), min(end, start + length)
                view[lo - base:hi - base] = block[lo - start:hi - start]
            self._learn_or_check(src, k, d, fresh, pos, end)
        if fresh:
            self._record_source(src, fresh, pos, end)

    def _learn_or_check(self, src: SourceFile, k: int, d: int, fresh: dict, pos: int, end: int) -> None:
        """Block k's digest `d`: noted in `fresh` (recorded after) on its first read, else checked."""
        rec = src.sums.get(k)
        if rec is None:
            fresh[k] = d
        elif rec != d:
            raise self._changed_block(src, k, pos, end)

    def _verify_source_mapped(self, src: SourceFile, arr, start: int, pos: int, end: int, lo: int, hi: int) -> None:
        """Check the blocks of file bytes [lo, hi) (block boundaries) in `arr`, a mapping of the
        file from byte `start` made for the tensor at [pos, end), recording first digests."""
        fresh = {}
        for k in range(lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES + 1):
            at, length = src.block(k)
            self._learn_or_check(src, k, _digest(arr[at - start:at - start + length]), fresh, pos, end)
        if fresh:
            self._record_source(src, fresh, pos, end)

    def digest_source(self, fd: int, ranges, piece: int = 4 << 20) -> int:
        """Read the blocks of `ranges` ((start, end) byte ranges) of the file read in place behind
        `fd` once, now, in pieces over the I/O threads, recording each block's digest (checking
        those recorded already): load_pretrained(..., verify="load"). The bytes go through one
        reused buffer per thread (no mapping, nothing kept). Returns the bytes read."""
        src = self._sources[fd]
        if not self.checksums:
            return 0
        blocks = sorted({k for a, b in ranges if b > a for k in range(a // BLOCK_BYTES, (b - 1) // BLOCK_BYTES + 1)})
        per = max(1, piece // BLOCK_BYTES)
        runs, run = [], []
        for k in blocks:
            if run and (k != run[-1] + 1 or len(run) == per):
                runs.append(run)
                run = []
            run.append(k)
        if run:
            runs.append(run)
        self.check_size(fd, 0, src.size)
        _join([self.pool.submit(self._digest_run, src, r[0], r[-1]) for r in runs])
        return sum(src.block(k)[1] for k in blocks)

    def _digest_run(self, src: SourceFile, first: int, last: int) -> None:
        lo, hi = first * BLOCK_BYTES, sum(src.block(last))
        buf = _aligned(hi - lo)
        try:
            _pread_all(src.fd, memoryview(buf), lo)
        except _EndOfFile:
            raise SwapCorruptionError(self._source_error(
                src, lo, hi, f"it ended before byte {hi} (truncated)")) from None
        except OSError as e:
            raise ZinfError(f"zinf: reading {self._the_file(src.fd, lo, hi)} failed: {e.strerror or e}") from None
        self._verify_source_mapped(src, buf, lo, lo, hi, lo, hi)

    def _write_bounced(self, fd: int, view, off: int, n: int, base: int) -> None:
        """An O_DIRECT write of bytes that do not start or end on a page: through an aligned buffer,
        the boundary pages read back first (a tile of a parameter starts anywhere)."""
        pos = base + off
        lead = pos % ALIGN
        padded = _round_up(lead + n, ALIGN)
        buf = _aligned(padded)
        if lead or (lead + n) % ALIGN:
            _pread_all(fd, memoryview(buf[:ALIGN]), pos - lead, upto_eof=True)
            _pread_all(fd, memoryview(buf[padded - ALIGN:]), pos - lead + padded - ALIGN, upto_eof=True)
        buf[lead:lead + n] = view[off:off + n]
        _pwrite_all(fd, memoryview(buf), pos - lead)

    def _read_chunk(self, fd: int, view, off: int, n: int, base: int = 0) -> None:
        if n == 0:
            return
        try:
            self._read_raw(fd, view, off, n, base)
            sums = self._sums_of(fd)
            if sums is not None:
                self._verify_read(fd, sums, view, off, n, base)
            elif (src := self._source_of(fd)) is not None:
                self._verify_source_read(src, view, off, n, base)
        except _EndOfFile:
            src = self._sources.get(fd)
            if src is not None:
                raise SwapCorruptionError(self._source_error(
                    src, base + off, base + off + n, f"it ended before byte {base + off + n} (truncated)")) from None
            raise ZinfError(f"zinf: the swap file {self.describe(fd)} ended before byte {base + off + n}: it was "
                            "truncated while in use; its data are lost") from None
        except OSError as e:
            raise ZinfError(f"zinf: reading {self._the_file(fd, base + off, base + off + n)} failed: "
                            f"{e.strerror or e}") from None

    def _read_raw(self, fd: int, view, off: int, n: int, base: int) -> None:
        if _opened_direct(fd):
            body = _direct_body(view, off, n, base)
            if body:  # straight into the tensor's pages: no copy
                _pread_all(fd, memoryview(view[off:off + body]), base + off)
            if body < n:  # through an aligned buffer (the size was checked: zeros past the end are padding)
                pos = base + off + body
                lead = pos % ALIGN
                buf = _aligned(_round_up(lead + n - body, ALIGN))
                _pread_all(fd, memoryview(buf), pos - lead, upto_eof=True)
                view[off + body:off + n] = buf[lead:lead + n - body]
            return
        _pread_all(fd, memoryview(view[off:off + n]), base + off)

    def describe(self, fd: int) -> str:
        """The file behind fd and what it holds, for error messages."""
        src = self._sources.get(fd)
        if src is not None:
            return f"{src.path} (a checkpoint file read in place)"
        return self._swap.describe(fd) if self._swap is not None else f"fd {fd}"

    def _the_file(self, fd: int, lo: int, hi: int) -> str:
        """'the swap file <path> (<what it holds>)', or for a file read in place 'the checkpoint
        file <path> (read in place for parameter <name>)' (whose bytes [lo, hi) are)."""
        src = self._sources.get(fd)
        if src is not None:
            return f"the checkpoint file {src.path} (read in place for {src.holders(lo, hi)})"
        return f"the swap file {self.describe(fd)}"

    def check_size(self, fd: int, offset: int, nbytes: int) -> None:
        """Raise a ZinfError naming the file (and the parameter it holds) unless it has bytes
        [offset, offset + nbytes): a truncated file must never reach a mapping (SIGBUS) or be read
        as zeros. A file read in place must also have the size and mtime it had at load."""
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise ZinfError(f"zinf: {self._the_file(fd, offset, offset + nbytes)} cannot be read: "
                            f"{e.strerror or e}") from None
        size = st.st_size
        src = self._sources.get(fd)
        if src is not None and (why := src.changed(st)) is not None:
            raise SwapCorruptionError(self._source_error(src, offset, offset + nbytes, why))
        if src is not None and size < offset + nbytes:  # a registered range lies within the file at load
            raise SwapCorruptionError(self._source_error(
                src, offset, offset + nbytes, f"it holds {size} bytes, {offset + nbytes} expected"))
        if size < offset + nbytes:
            raise ZinfError(f"zinf: the swap file {self.describe(fd)} holds {size} bytes, {offset + nbytes} expected: "
                            "it was truncated (by another process or a full disk?); its data are lost")

    # -- whole files, for the parameter store and the optimizer ----------------------------------
    def write_file(self, fd: int, t: torch.Tensor, offset: int = 0) -> None:
        """t's bytes (contiguous, on the CPU) into the file at `offset`, in parallel chunks, straight
        from t's memory (O_DIRECT: through a bounded aligned buffer where t's pages are not the
        file's), checksummed; t's storage stays resizable (a parameter's may be freed after)."""
        if fd in self._parent_fds:
            raise ZinfError("zinf: this process was forked from the one whose swap files hold the model's shards "
                            "and states; a forked child may read them (inference) but not write them (training, "
                            "an optimizer step): start workers with the 'spawn' method, or train in the parent")
        if not t.is_contiguous():  # its bytes in order, as a numpy view of it wrote them
            t = t.contiguous()
        self._run_chunks(self._write_chunk, fd, t, t.numel() * t.element_size(), offset)
        self.stats["bytes_written"] += t.numel() * t.element_size()

    def submit_read(self, fd: int, t: torch.Tensor, offset: int = 0) -> list[Future]:
        """Start reading the file from `offset` into t; the futures complete the read."""
        self.check_size(fd, offset, t.numel() * t.element_size())
        self.stats["bytes_read"] += t.numel() * t.element_size()
        return self._submit_chunks(self._read_chunk, fd, t, t.numel() * t.element_size(), offset)

    @property
    def direct(self) -> bool:
        """Whether the swap files are read and written with O_DIRECT."""
        return self._swap is not None and self._swap.o_direct

    def host_empty(self, numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
        """A flat host buffer for this engine's reads: on whole pages where they are O_DIRECT,
        recycled (HostBuffers) unless pinned."""
        if self.direct and not pin_memory:
            return self.buffers.empty(numel, dtype)
        if self.direct:
            return aligned_empty(numel, dtype, pin_memory)
        return torch.empty(numel, dtype=dtype, pin_memory=pin_memory)

    def can_map(self) -> bool:
        """Whether map_file serves reads: buffered files (O_DIRECT bypasses the page cache a
        mapping reads through)."""
        return self._swap is None or not self._swap.o_direct

    def map_file(self, fd: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of the file from byte `offset`, as a tensor over a private mapping of
        it: no copy, no zero-filled pages (the kernel maps its page cache, reading ahead from the
        disk what is not there: MADV_WILLNEED). Private: a write into the tensor copies that page
        and never reaches the file. Unmapped when the tensor's storage dies. Checked against the
        file's checksums before it returns, on the calling thread: checking in pieces over the I/O
        threads did not pay when the caller waits anyway (`bench diskio`: 0.83-0.86 against
        0.81-0.95 GB/s cold); see submit_map for the overlapped form."""
        return self._map(fd, offset, numel, dtype, pieces=False)[0]

    def submit_map(self, fd: int, offset: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[Future]]:
        """map_file's tensor at once, and the futures of its checks (none without checksums), in
        VERIFY_BYTES pieces over the I/O threads: the tensor may be read only once they complete.
        A fetch that maps ahead of its gather and joins them at the gather overlaps the disk reads
        (the checks fault the pages in) with compute; checked at the fetch, on the graph thread, a
        cold weight is read while the graph waits (`bench diskio`, overlap rows)."""
        return self._map(fd, offset, numel, dtype, pieces=True)

    def _map(self, fd: int, offset: int, numel: int, dtype: torch.dtype, pieces: bool):
        import mmap

        nbytes = numel * dtype.itemsize
        self.stats["bytes_read"] += nbytes
        if nbytes == 0:
            return torch.empty(0, dtype=dtype), []
        sums = self._sums_of(fd)
        src = self._source_of(fd) if sums is None else None
        start, end = offset, offset + nbytes
        if sums is not None:  # map whole blocks, to check them before the graph reads them
            first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
            self._verify_covered(fd, sums, first, last, offset, end)
            start, end = first * BLOCK_BYTES, last * BLOCK_BYTES + sums[last][0]
        elif src is not None:  # the same, the last block clipped to the file's size at load
            self.check_size(fd, offset, nbytes)
            first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
            start, end = first * BLOCK_BYTES, sum(src.block(last))
        self.check_size(fd, start, end - start)  # a mapping past the file's end is a SIGBUS when read
        lead = start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, lead + end - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=start - lead)
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_WILLNEED)
        futures = []
        if sums is not None or src is not None:
            arr = np.frombuffer(mm, dtype=np.uint8, count=end - start, offset=lead)
            los = range(start, end, VERIFY_BYTES)
            if sums is not None:
                check, args = self._verify_mapped, (fd, sums, arr, start)
            else:
                check, args = self._verify_source_mapped, (src, arr, start, offset, offset + nbytes)
            if not pieces or len(los) == 1:
                check(*args, start, end)
            else:
                futures = [self.pool.submit(check, *args, lo, min(end, lo + VERIFY_BYTES)) for lo in los]
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=lead + offset - start)
        return torch.from_numpy(arr).view(dtype), futures

    def read_file(self, fd: int, t: torch.Tensor, offset: int = 0) -> None:
        """The file's bytes from `offset` into t (contiguous, on the CPU), checked against their
        checksums; t's storage stays resizable."""
        self.check_size(fd, offset, t.numel() * t.element_size())
        self._run_chunks(self._read_chunk, fd, t, t.numel() * t.element_size(), offset)
        self.stats["bytes_read"] += t.numel() * t.element_size()


def _join(futures: list[Future]) -> None:
    """Wait for every future; then raise the first error, if any (none is left running)."""
    errors = []
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _when_all_done(futures: list[Future], fn) -> None:
    """Call fn once, after the last of the futures completes (at once if all are done)."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_f):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            fn()

    for f in futures:
        f.add_done_callback(one_done)


def _opened_direct(fd: int) -> bool:
    """Whether `fd` was opened with O_DIRECT (one fcntl per chunk, under a microsecond). Asked of
    the descriptor, not of the engine: an O_DIRECT engine also reads files it did not open so, a
    checkpoint read in place (plain preadv into the tensor: no page-aligned bounce and its copy,
    which made those reads 35% slower from the page cache) and, in a forked child, its parent's
    swap files, opened with the parent's flags."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _direct_body(view, off: int, n: int, base: int) -> int:
    """How many of bytes [off, off+n) of `view` an O_DIRECT request can move in place: the whole
    pages from the start, when the file position and the memory address both fall on a page (0
    otherwise: the bytes go through an aligned buffer)."""
    if (base + off) % ALIGN or (view.ctypes.data + off) % ALIGN:
        return 0
    return n - n % ALIGN


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """An empty flat CPU tensor whose data start on a page: O_DIRECT reads and writes reach it
    without a copy (pinned memory is page-aligned already)."""
    if pin_memory:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift:shift + nbytes].view(dtype)


class HostBuffers:
    """Page-aligned host buffers for an engine's reads, recycled: a buffer whose tensor dies goes
    back here and serves the next read of its size. A fresh buffer costs a zero-filled page fault
    per 4 KiB, measured at 1.4-1.6 GB/s of first touches on this 2-core machine: a streamed
    forward of a 1.1B model (4.4 GB of weights, each fetched into a fresh buffer) spent ~3 s of
    CPU on it, beside the matmuls, against ~1.2 s for every checksum (`bench diskio`).
    What is kept free is bounded (`max_free` bytes, `per_size` buffers of one size): the peak RSS
    grows by at most that much."""

    def __init__(self, max_free: int = 256 << 20, per_size: int = 2) -> None:
        self.max_free = max_free
        self.per_size = per_size
        self._free: dict[int, list] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.stats = {"taken": 0, "reused": 0}

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of `numel` elements on whole pages (contents undefined)."""
        import mmap

        nbytes = numel * dtype.itemsize
        size = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            kept = self._free.get(size)
            mm = kept.pop() if kept else None
            if mm is not None:
                self._free_bytes -= size
            self.stats["taken"] += 1
            self.stats["reused"] += mm is not None
        if mm is None:
            mm = mmap.mmap(-1, size)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # the array lives as long as the tensor's storage (torch.from_numpy holds it), whichever
        # views Inductor or autograd re-wrap: when it dies, the memory is free for the next read
        weakref.finalize(arr, self._give, size, mm)
        return torch.from_numpy(arr).view(dtype)

    def _give(self, size: int, mm) -> None:
        with self._lock:
            kept = self._free.setdefault(size, [])
            if len(kept) < self.per_size and self._free_bytes + size <= self.max_free:
                kept.append(mm)
                self._free_bytes += size
        # else dropped: unmapped once the dying array lets go of it (it still exports it here)

    def clear(self) -> None:
        with self._lock:
            self._free, self._free_bytes = {}, 0


def _round_up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


_aligned_local = threading.local()


def _aligned(n: int):
    """A page-aligned, reusable (per I/O thread) buffer of at least n bytes, as a numpy view."""
    import mmap

    import numpy as np

    buf = getattr(_aligned_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = mmap.mmap(-1, max(n, CHUNK_BYTES))
        _aligned_local.buf = buf
    return np.frombuffer(buf, dtype=np.uint8, count=n)


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        written = os.pwrite(fd, mv, off)
        mv, off = mv[written:], off + written


def _pread_all(fd: int, mv: memoryview, off: int, upto_eof: bool = False) -> None:
    """Fill mv from the file at off; `upto_eof`: zeros past the file's end (a page being rewritten)."""
    while len(mv):
        got = os.preadv(fd, [mv], off)
        if got == 0:
            if upto_eof:
                mv[:] = bytes(len(mv))
                return
            raise _EndOfFile()
        mv, off = mv[got:], off + got


class _EndOfFile(Exception):
    """A read met the file's end: the caller names the file."""
