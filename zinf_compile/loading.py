"""Models larger than RAM: built on the meta device, each parameter materialized straight into its
shard, one at a time.

    with torch.device("meta"):                      # or accelerate's init_empty_weights()
        model = LlamaForCausalLM(config)
    zinf_compile.load_pretrained(model, "ckpt/", options=opts)   # HF safetensors, single or sharded
    # or, to train from scratch: zinf_compile.materialize(model, options=opts)
    model = torch.compile(model, backend="zinf", options=opts)

Pass the same options to both calls: they name the tier and the offload folder the shards go to.
A parameter of `PERSIST_BYTES` or more becomes a managed parameter (its shard in the tier, its
storage freed, as the backend's take-over leaves it); smaller ones and buffers are ordinary tensors
on the device. A compile then finds those parameters managed already and keeps them so (the
planner's `forced`), whatever the budget: the model may not fit in memory whole.
`options={"params": "resident"}` materializes everything in memory instead.

`load_pretrained` reads each tensor from its file into one buffer of its own (no mapping of the
file, which would count its pages in the process's memory), converts it to the parameter's dtype
and writes the shard. `materialize` replays the initialisation eager construction runs, in its
order, so the random numbers are the same as an eager build's with the same seed: every module's
`reset_parameters` (children first, as constructors run), and for a Hugging Face model its
`_init_weights` in `post_init`'s order. A module's initialisation reaches its parameters through
`runtime.access`: each one it touches is checked out (its storage back, its value from the shard)
for that call and written back after it (docs/decisions.md, "Meta-device models").
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from zinf_compile.errors import ZinfConfigError, ZinfError

__all__ = ["load_pretrained", "materialize"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# -- safetensors, read one tensor at a time -------------------------------------------------------

@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file
    nbytes: int


def _header(path: str) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header (8 bytes of length, then JSON)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise ZinfError(f"zinf: {path} is not a safetensors file (shorter than its header)")
            n = int.from_bytes(raw, "little")
            if 8 + n > size:
                raise ZinfError(f"zinf: {path} is not a safetensors file, or is truncated: its header says "
                                f"{n} bytes of header, the file has {size} bytes")
            head = json.loads(f.read(n))
    except FileNotFoundError:
        raise ZinfError(f"zinf: checkpoint file {path} does not exist") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ZinfError(f"zinf: {path} is not a safetensors file ({err})") from None
    out = {}
    for key, info in head.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ZinfError(f"zinf: {path}: tensor {key!r} has dtype {info['dtype']}, which zinf cannot read")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        lo, hi = info["data_offsets"]
        # checked here, before anything is written: a short file (a copy or a write cut off) would
        # otherwise fail half-way through a load, or, read in place, at the first forward
        if hi - lo != math.prod(shape) * dtype.itemsize or lo < 0:
            raise ZinfError(f"zinf: {path}: tensor {key!r} spans bytes {lo}..{hi}, but {info['dtype']} {list(shape)} "
                            f"takes {math.prod(shape) * dtype.itemsize} (a damaged header)")
        if 8 + n + hi > size:
            raise ZinfError(f"zinf: {path} is truncated: it has {size} bytes, tensor {key!r} ends at byte {8 + n + hi}")
        out[key] = StoredTensor(path, dtype, shape, 8 + n + lo, hi - lo)
    return out


class Checkpoint:
    """A Hugging Face safetensors checkpoint: `model.safetensors`, or shards listed by
    `model.safetensors.index.json` (a folder holding either, or the path of either file)."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
            if os.path.exists(index):
                path = index
            elif os.path.exists(single):
                path = single
            else:
                found = sorted(os.listdir(path))[:8]
                raise ZinfError(f"zinf: no checkpoint in {path}: neither {SINGLE} nor {INDEX} is there "
                                f"(it holds {found}); zinf loads safetensors checkpoints (save_pretrained's "
                                "default format)")
        elif not os.path.exists(path):
            raise ZinfError(f"zinf: checkpoint {path} does not exist")
        self.path = path
        self.tensors: dict[str, StoredTensor] = {}
        if path.endswith(".json"):
            with open(path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ZinfError(f"zinf: {path} has no weight_map (not a safetensors index)")
            folder = os.path.dirname(path)
            headers = {}
            for key, name in weight_map.items():
                file = os.path.join(folder, name)
                if file not in headers:
                    if not os.path.exists(file):
                        raise ZinfError(f"zinf: checkpoint file {file} does not exist (the index {path} lists "
                                        f"it for {key!r})")
                    headers[file] = _header(file)
                if key not in headers[file]:
                    raise ZinfError(f"zinf: {file} has no tensor {key!r} (the index {path} says it does)")
                self.tensors[key] = headers[file][key]
        else:
            self.tensors = _header(path)

    def read(self, key: str) -> torch.Tensor:
        """Tensor `key` in a fresh buffer of its own (read, never mapped)."""
        t = self.tensors[key]
        buf = torch.empty(t.nbytes, dtype=torch.uint8)
        with open(t.file, "rb", buffering=0) as f:
            f.seek(t.start)
            view, got = memoryview(buf.numpy()), 0
            while got < t.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise ZinfError(f"zinf: {t.file} ends inside tensor {key!r} (truncated file?)")
                got += n
        return buf.view(t.dtype).view(t.shape) if t.nbytes else torch.empty(t.shape, dtype=t.dtype)


# -- where a model's parameters and buffers sit ---------------------------------------------------

@dataclass(eq=False)
class _Slot:
    """One parameter or buffer object, and every (module, attribute) holding it (tied weights: more
    than one). Its name is its first, as named_parameters gives it."""

    obj: torch.Tensor
    names: list[str] = field(default_factory=list)
    homes: list[tuple[nn.Module, str]] = field(default_factory=list)
    persistent: bool = True  # buffers: saved in a state dict

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def nbytes(self) -> int:
        return self.obj.numel() * self.obj.element_size()

    def put(self, new: torch.Tensor, kind: str) -> None:
        for module, attr in self.homes:
            getattr(module, kind)[attr] = new
        self.obj = new


def _slots(model: nn.Module, kind: str) -> list[_Slot]:
    """Every parameter (kind "_parameters") or buffer ("_buffers") object of `model`, in
    named_parameters order."""
    by_id: dict[int, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=True):
        for attr, t in getattr(module, kind).items():
            if t is None:
                continue
            s = by_id.setdefault(id(t), _Slot(t))
            s.names.append(f"{prefix}.{attr}" if prefix else attr)
            s.homes.append((module, attr))
            if kind == "_buffers" and attr in module._non_persistent_buffers_set:
                s.persistent = False
    return list(by_id.values())


def _new_param(value: torch.Tensor, old: nn.Parameter) -> nn.Parameter:
    """A parameter of `old`'s class and requires_grad over `value`, with `old`'s attributes."""
    cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    try:
        new = cls(value, requires_grad=old.requires_grad)
    except TypeError:  # a subclass with another constructor
        new = nn.Parameter(value, requires_grad=old.requires_grad)
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k not in new.__dict__})
    return new


class _Placer:
    """Puts parameter values where the options say: a shard in the tier (large ones) or memory."""

    def __init__(self, options: dict | None, device: str | torch.device, params=()) -> None:
        from zinf_compile.backend import Session
        from zinf_compile.config import ZinfConfig

        self.cfg = ZinfConfig.from_options(options)
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ZinfError("zinf: device must be a real device (where the model will compute), not meta")
        self.session = None
        if self.cfg.params != "resident":
            # the swap files are written here, so their O_DIRECT choice is made here (a file keeps its
            # flags): from the bytes of every parameter this will shard, as a compile counts them
            from zinf_compile.backend import file_bytes
            from zinf_compile.planner import PERSIST_BYTES

            big = [p for p in params if p.numel() * p.element_size() >= PERSIST_BYTES]
            nbytes = file_bytes(sum(p.numel() * p.element_size() for p in big), any(p.requires_grad for p in big))
            self.session = Session.start(self.cfg, self.device.type, file_bytes=nbytes)
        self.master = getattr(torch, self.cfg.master_dtype) if self.cfg.master_dtype else None
        self.gather = getattr(torch, self.cfg.gather_dtype) if self.cfg.gather_dtype else None
        self.watched: dict[int, list[tuple[int, int]]] = {}  # fd read in place -> byte ranges this load reads

    def sharded(self, t: torch.Tensor) -> bool:
        from zinf_compile.planner import PERSIST_BYTES

        return self.session is not None and t.numel() * t.element_size() >= PERSIST_BYTES

    def manage(self, p: nn.Parameter, name: str, value: torch.Tensor | None = None) -> None:
        """Take `p` over into its shard (the backend's take-over), from its own data or `value`."""
        from zinf_compile.runtime.state import STORE

        STORE.manage(STORE.identify(p, name), self.session.tier, self.session.engine_key, self.master,
                     budget=self.cfg.budget, value=value, gather_dtype=self.gather)

    def place(self, slot: _Slot, value: torch.Tensor) -> None:
        """Parameter `slot` takes `value` (of its shape and dtype, on the CPU)."""
        from zinf_compile.runtime.state import STORE

        old = slot.obj
        if old.is_meta and self.sharded(old):
            # born without storage: the shard is written from the value read, never copied into it
            new = _new_param(_storageless(old, self.device), old)
            slot.put(new, "_parameters")
            self.manage(new, slot.name, value)
            return
        if old.is_meta:
            new = _new_param(value.to(self.device), old)
            slot.put(new, "_parameters")
        else:  # a real parameter keeps its object (an optimizer or the user may hold it)
            with torch.no_grad():
                old.copy_(value)
            new = old
        if self.sharded(new) and not STORE.is_managed(new):
            self.manage(new, slot.name)

    def in_place(self, p: torch.Tensor, stored: StoredTensor) -> bool:
        """Whether parameter `p` can be read where `stored` lies (see load_pretrained)."""
        from zinf_compile.runtime.params import world

        return (p.is_meta and self.sharded(p) and self.session.tier == "nvme" and self.master is None
                and stored.dtype == p.dtype and stored.start % p.element_size() == 0 and world()[1] == 1)

    def check_sources(self, paths) -> None:
        """Before anything of them is read in place: a file parameters of an earlier load still
        read in place (this engine's, through the descriptor this load would share) must not have
        changed since that load, whose digests would then meet other bytes (SourceFile)."""
        from zinf_compile.runtime.state import STORE, get_engine

        if not paths:
            return
        eng = get_engine(self.session.engine_key)
        for path in paths:
            now = os.stat(path)
            users = [x for x in STORE.entries() if x.source == path and x.engine_key == eng.key and x.fd is not None]
            for fd in {x.fd for x in users}:
                st, src = os.fstat(fd), eng.source(fd)
                if src is not None and os.path.samestat(st, now) and (why := src.changed(st)) is not None:
                    names = [x.name for x in users if x.fd == fd]
                    raise ZinfError(f"zinf: {path} changed since an earlier load_pretrained read it in place ({why}), "
                                    f"and {len(names)} parameter(s) of that load still read it ({_listed(names)}): "
                                    "they cannot share it with this load. Drop that model (or call "
                                    "zinf_compile.reset()) before loading the file again")

    def place_in_place(self, slot: _Slot, stored: StoredTensor) -> None:
        """Parameter `slot`, storageless, managed with its shard where `stored` lies; from now on
        every read of those bytes is checked (OffloadEngine.watch_source: digests on first read)."""
        from zinf_compile.runtime.state import STORE

        new = _new_param(_storageless(slot.obj, self.device), slot.obj)
        slot.put(new, "_parameters")
        path = os.path.abspath(stored.file)
        e = STORE.manage_in_place(STORE.identify(new, slot.name), self.session.engine_key, path,
                                  stored.start, stored.dtype, gather_dtype=self.gather)
        eng, renew = e.engine, False
        if e.fd not in self.watched:  # the first tensor of this file in this load
            st = os.fstat(e.fd)  # the file at `path` now: manage_in_place reopens one replaced since
            src = eng.source(e.fd)
            renew = src is not None and src.changed(st) is not None  # changed since a load now gone
        eng.watch_source(e.fd, path, e.name, stored.start, stored.nbytes, renew=renew)
        self.watched.setdefault(e.fd, []).append((stored.start, stored.start + stored.nbytes))

    def digest_sources(self) -> None:
        """load_pretrained(verify="load"): read what this load reads in place once, now, recording
        every block's digest."""
        from zinf_compile.runtime.state import get_engine

        if not self.watched:
            return
        eng = get_engine(self.session.engine_key)
        for fd, ranges in self.watched.items():
            eng.digest_source(fd, ranges)


def _storageless(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `like`'s shape, stride and dtype on `device` whose storage holds nothing (its
    allocation is never touched before it is freed)."""
    t = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


# -- loading a checkpoint --------------------------------------------------------------------------

def _key_map(model: nn.Module, keys, names: set[str]) -> dict[str, str]:
    """checkpoint key -> the model's name for it: as is, or with a Hugging Face base-model prefix
    added or removed (a LlamaModel checkpoint into LlamaForCausalLM, and back)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = {}
    for k in keys:
        for cand in (k, f"{prefix}.{k}" if prefix else k, k.removeprefix(f"{prefix}.") if prefix else k):
            if cand in names:
                out[k] = cand
                break
    return out


def _listed(keys, limit: int = 8) -> str:
    keys = list(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(map(repr, keys[:limit])) + more


VERIFY = ("first-read", "load")


def load_pretrained(model: nn.Module, path: str | os.PathLike, options: dict | None = None, *,
                    device: str | torch.device = "cpu", in_place: bool = False,
                    verify: str = "first-read") -> nn.Module:
    """Load a Hugging Face safetensors checkpoint (`save_pretrained`'s folder: one file, or shards
    with their index) into `model`, whose parameters may be on the meta device: each parameter of
    64 KiB or more goes straight into its zinf shard (the tier and folder of `options`, the same
    options the model is then compiled with), one tensor in memory at a time; smaller ones and
    buffers into memory on `device`. Values are converted to each parameter's dtype. Tied
    parameters (one object under several names) load from whichever name the checkpoint has.
    Every key, shape and file is checked before anything is written: a missing key, a shape that
    differs, a missing file raise a ZinfError naming it. Keys the model lacks are warned about.
    `in_place=True` (the NVMe tier, one rank): a parameter whose stored dtype is its own is not
    copied at all; its shard is its bytes in the checkpoint file, read where they lie (mapped on a
    CPU device) and never written: the first gradient or write of it moves it to a swap file of its
    own first (inference reads the checkpoint; training works too).
    A safetensors file has no checksums, so zinf cannot know its bytes were right; what it checks
    (option "checksums", on by default) is that the file stays the one it loaded: every read or
    mapping of an in-place shard checks the file's size and mtime against those at load, and the
    xxh3-64 digest of each 256 KiB block against the one recorded at the block's first read, so a
    file rewritten, truncated or damaged after that raises SwapCorruptionError naming the file and the
    parameter. `verify="first-read"` (default) reads nothing at load: a block changed before its first
    read without its mtime changing (a rewrite that keeps the mtime, a disk returning other bytes) is
    taken as it is then. `verify="load"` reads every in-place tensor once at load and records its
    digests: that gap closes, at the cost of reading them (disk speed; measured in
    docs/decisions.md, "Checkpoints read in place: digests on first read"). Returns `model`."""
    if verify not in VERIFY:
        raise ZinfConfigError(f"verify: expected one of {VERIFY}, got {verify!r}")
    ckpt = Checkpoint(path)
    _tie(model)
    params, buffers = _slots(model, "_parameters"), _slots(model, "_buffers")
    by_name = {n: s for s in params + buffers for n in s.names}
    kinds = {id(s): "_parameters" for s in params} | {id(s): "_buffers" for s in buffers}
    kmap = _key_map(model, ckpt.tensors, set(by_name))
    covered = {id(by_name[n].obj) for n in kmap.values()}
    missing = [s.name for s in params if id(s.obj) not in covered]
    missing += [s.name for s in buffers if s.persistent and s.obj.is_meta and id(s.obj) not in covered
                and not _rebuildable(s)]
    if missing:
        raise ZinfError(f"zinf: {ckpt.path} lacks {len(missing)} tensor(s) the model has: {_listed(missing)}")
    wrong = [f"{k!r}: {tuple(ckpt.tensors[k].shape)} in the checkpoint, {tuple(by_name[n].obj.shape)} in the model"
             for k, n in kmap.items() if tuple(ckpt.tensors[k].shape) != tuple(by_name[n].obj.shape)]
    if wrong:
        raise ZinfError(f"zinf: {ckpt.path}: {len(wrong)} shape mismatch(es): {'; '.join(wrong[:8])}")
    unexpected = [k for k in ckpt.tensors if k not in kmap]
    if unexpected:
        warnings.warn(f"zinf: {ckpt.path} holds {len(unexpected)} tensor(s) the model does not use: "
                      f"{_listed(unexpected)}", stacklevel=2)
    placer = _Placer(options, device, [s.obj for s in params])
    done: set[int] = set()
    order = sorted(kmap, key=lambda k: (ckpt.tensors[k].file, ckpt.tensors[k].start))  # sequential reads
    if in_place:
        placer.check_sources({os.path.abspath(ckpt.tensors[k].file) for k in order
                              if kinds[id(by_name[kmap[k]])] == "_parameters"
                              and placer.in_place(by_name[kmap[k]].obj, ckpt.tensors[k])})
    for k in order:
        slot = by_name[kmap[k]]
        if id(slot.obj) in done:
            continue  # a tied parameter's other name
        if in_place and kinds[id(slot)] == "_parameters" and placer.in_place(slot.obj, ckpt.tensors[k]):
            placer.place_in_place(slot, ckpt.tensors[k])
            done.add(id(slot.obj))
            continue
        value = ckpt.read(k).to(slot.obj.dtype)
        if kinds[id(slot)] == "_buffers":
            slot.put(value.to(device), "_buffers")
        else:
            placer.place(slot, value)
        done.add(id(slot.obj))
        del value
    if verify == "load":
        placer.digest_sources()
    _rebuild_meta_buffers(model, device)
    return model


def _tie(model: nn.Module) -> None:
    """A Hugging Face model's tied weights made one object, as from_pretrained does after loading
    (a model built under init_empty_weights may not be tied yet: BERT's head)"""
    if _is_hf(model):
        model.tie_weights()


# -- buffers no checkpoint holds ------------------------------------------------------------------

def _rebuildable(slot: _Slot) -> bool:
    return getattr(slot.homes[0][0], "config", None) is not None


def _params_on_meta():
    """accelerate's init_empty_weights(include_buffers=False) where installed (a module rebuilt for
    its buffers then allocates no parameters), else nothing (they are allocated and dropped)."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        return contextlib.nullcontext()
    return init_empty_weights(include_buffers=False)


def _rebuild_meta_buffers(model: nn.Module, device) -> None:
    """Buffers left on the meta device (a model built under torch.device("meta"); HF's rotary
    embeddings keep `inv_freq` out of checkpoints) come from a fresh instance of their module on
    `device`: only for a module built from a config (`type(m)(m.config)`, as HF modules are; its
    parameters on meta meanwhile, see _params_on_meta); any other meta buffer is an error that
    names it."""
    for prefix, module in model.named_modules():
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        metas = [f"{prefix}.{a}" if prefix else a for a, b in module._buffers.items() if b is not None and b.is_meta]
        if getattr(module, "config", None) is None:
            raise ZinfError(f"zinf: buffer(s) {_listed(metas)} are on the meta device and no checkpoint holds them; "
                            "build the model with accelerate's init_empty_weights() (it keeps buffers real) "
                            "or give them values before loading")
        try:
            with torch.device(device), _params_on_meta():
                fresh = type(module)(module.config)
        except Exception as err:
            raise ZinfError(f"zinf: buffer(s) {_listed(metas)} are on the meta device and rebuilding their module "
                            f"{type(module).__name__}(config) failed ({err}); build the model with accelerate's "
                            "init_empty_weights() (it keeps buffers real)") from err
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = fresh._buffers[attr]
        for attr, v in list(vars(module).items()):  # tensors kept as plain attributes (original_inv_freq)
            if isinstance(v, torch.Tensor) and v.is_meta and isinstance(vars(fresh).get(attr), torch.Tensor):
                module.__dict__[attr] = vars(fresh)[attr]


# -- initialising from scratch --------------------------------------------------------------------

def _is_hf(m: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(m, tf.PreTrainedModel)


def _has_nan(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether floating-point `t` holds a NaN (an element no initialisation wrote), checked a
    chunk at a time: torch.isnan(t) whole is a mask of numel bytes, a quarter of an fp32
    parameter on top of it (measured: materialize's peak 1.29x the largest parameter with it)."""
    if not t.is_floating_point():
        return False
    flat = t.detach().reshape(-1)
    return any(bool(flat[i:i + chunk].isnan().any()) for i in range(0, flat.numel(), chunk))


class _Initializer:
    """Replays a model's initialisation on parameters that live in shards (see the module's doc)."""

    def __init__(self, model: nn.Module, placer: _Placer) -> None:
        self.model, self.placer = model, placer
        self.slots = _slots(model, "_parameters")
        self.owner: dict[int, tuple[nn.Module, str]] = {}  # parameter -> the home that initialises it
        self.ours: dict[int, _Slot] = {}  # parameters this call made (from meta ones), by id
        self.pending: set[int] = set()  # ours, large, not written by any initialisation yet
        self.checked: list[torch.Tensor] = []

    def start(self) -> None:
        """Every meta parameter becomes a real one: large ones with their storage freed and the
        managed class (nothing in memory), small ones in memory; all NaN until initialised."""
        from zinf_compile.runtime.access import mark

        for s in self.slots:
            old = s.obj
            if not old.is_meta:
                continue
            big = self.placer.sharded(old)
            new = _new_param(_storageless(old, self.placer.device) if big else
                             torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=self.placer.device),
                             old)
            if big:
                mark(new)
                self.pending.add(id(new))
            elif new.is_floating_point():
                with torch.no_grad():
                    new.fill_(math.nan)
            s.put(new, "_parameters")
            self.ours[id(new)] = s
        self.owner = {id(s.obj): s.homes[0] for s in self.slots}

    def undo(self, metas: dict[int, torch.Tensor]) -> None:
        """After a failure: parameters never written get their meta originals back."""
        from zinf_compile.runtime.access import unmark

        for s in self.slots:
            if id(s.obj) in self.pending:
                unmark(s.obj)
                s.put(metas[id(s)], "_parameters")

    # checking parameters out for one call
    def checkout(self, t: torch.Tensor) -> None:
        from zinf_compile.runtime.access import unmark
        from zinf_compile.runtime.state import STORE

        if any(t is c for c in self.checked):
            return
        unmark(t)
        e = STORE.entry(t)
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            if e is not None and not e.read_whole_into(t):
                t.copy_(STORE.full(e))
            elif e is None and t.is_floating_point():
                t.fill_(math.nan)
        self.checked.append(t)

    def checkin(self) -> None:
        from zinf_compile.runtime.access import mark
        from zinf_compile.runtime.state import STORE

        checked, self.checked = self.checked, []
        for t in checked:
            e = STORE.entry(t)
            if e is not None:
                with torch.no_grad():
                    e.write_whole(t)
                t.untyped_storage().resize_(0)
                mark(t)
            elif not _has_nan(t):
                self.manage(t)
            else:  # not (wholly) written by this call
                t.untyped_storage().resize_(0)
                mark(t)

    def manage(self, t: torch.Tensor) -> None:
        slot = self.ours[id(t)]
        self.placer.manage(t, slot.name)
        self.pending.discard(id(t))

    def run(self, module: nn.Module, fn) -> None:
        """fn() (one module's initialisation) with every parameter it touches checked out; a direct
        parameter this module does not own (a tied weight first held elsewhere) or that was real
        before (not ours to initialise) is a scratch copy for the call: the random numbers are drawn
        as eager construction draws them, and the value is dropped, as eager tying drops it."""
        from zinf_compile.runtime.access import checking_out

        swapped = {}
        for attr, p in module._parameters.items():
            if p is None:
                continue
            if self.owner.get(id(p)) != (module, attr) or id(p) not in self.ours:
                swapped[attr] = p
                module._parameters[attr] = nn.Parameter(torch.empty_like(p, device=self.placer.device),
                                                        requires_grad=p.requires_grad)
        try:
            with checking_out(self.checkout), torch.no_grad():
                fn()
        finally:
            module._parameters.update(swapped)
            self.checkin()

    def replay(self) -> None:
        seen: set[int] = set()
        done: set[int] = set()

        def hf_init(m: nn.Module, owner: nn.Module) -> None:  # PreTrainedModel.smart_apply's order
            for c in m.children():
                hf_init(c, c if _is_hf(c) else owner)
            if id(m) not in done:
                done.add(id(m))
                self.run(m, functools.partial(owner._init_weights, m))

        def construct(m: nn.Module) -> None:  # children are built (and reset) before their parent
            if id(m) in seen:
                return
            seen.add(id(m))
            for c in m.children():
                construct(c)
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if callable(reset) and next(m.parameters(recurse=False), None) is not None:
                self.run(m, reset)
            if _is_hf(m):  # post_init at the end of its constructor
                hf_init(m, m)

        construct(self.model)


def materialize(model: nn.Module, options: dict | None = None, *,
                device: str | torch.device = "cpu") -> nn.Module:
    """Give every parameter of `model` on the meta device its initial value, as eager construction
    would with the same random state, straight into its zinf shard (64 KiB or more; the tier and
    folder of `options`, the same options the model is then compiled with) or into memory on
    `device` (smaller ones); buffers left on meta are rebuilt (see load_pretrained). The
    initialisation replayed is each module's `reset_parameters` and, for a Hugging Face model,
    `_init_weights` in post_init's order; a parameter neither writes raises a ZinfError naming it
    (load it with load_pretrained instead). Parameters that are not on meta keep their values.
    Returns `model`."""
    _tie(model)
    placer = _Placer(options, device, [p for p in model.parameters() if p.is_meta])
    init = _Initializer(model, placer)
    metas = {id(s): s.obj for s in init.slots}
    init.start()
    try:
        init.replay()
        unset = [s.name for s in init.slots if id(s.obj) in init.pending or
                 (id(s.obj) in init.ours and s.obj.is_floating_point() and not placer.sharded(s.obj)
                  and bool(torch.isnan(s.obj.detach()).any()))]
        if unset:
            raise ZinfError(f"zinf: no initialisation wrote parameter(s) {_listed(unset)} (their modules have no "
                            "reset_parameters, and no Hugging Face _init_weights covers them); load them from a "
                            "checkpoint with zinf_compile.load_pretrained")
    except BaseException:
        init.undo(metas)
        raise
    _rebuild_meta_buffers(model, device)
    return model
