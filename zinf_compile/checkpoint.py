"""Model and optimizer state of a model zinf compiles, with its parameters managed (sharded, offloaded).

    full_state_dict(model)                   -> {name: CPU tensor}, managed parameters gathered (collective)
    load_state_dict(model, state_dict)       each managed parameter takes its shard; the rest as torch does
    save_checkpoint(path, model, optimizer)  a directory, streamed one parameter at a time
    load_checkpoint(path, model, optimizer)  its inverse; resuming from it is exact

`model` may be the compiled module (`torch.compile(...)`) or the module itself: names are the
module's own (no "_orig_mod." prefix), so a state dict goes to and from the uncompiled model.

Checkpoint layout (`path/`), version 2:

    CURRENT               "v-<host>-<pid>-<token> <crc32 of its manifest>": the version that loads
    v-.../manifest.json   format, version, world size, every state-dict entry (name, kind, shape,
                          dtype, managed or not, alias of another name for tied parameters, file),
                          and every file's size, crc32, tensor name and tensors (shape, dtype)
    v-.../optim.pt        the optimizer's class and param groups (hyperparameters; parameters by name)
    v-.../rank00000/t00003.pt  entry 3 as rank 0 holds it: {"shard": flat shard} for a managed
                          parameter (one file per rank), {"tensor": ...} for the rest (rank 0 only),
                          "name", and "optim": (form, state) of that parameter (step, exp_avg, ...)

A save survives a kill at any instant (LevelDB's CURRENT file, SQLite's rule): it writes a new
version folder beside the current one, fsyncs every file and folder, then replaces CURRENT by an
atomic rename (fsync'd). Before that rename the old checkpoint loads, after it the new one; the old
version, and folders of saves killed midway (their process gone), are removed by the save that
follows. A failed save (a full disk: "no space left on device", naming the file) leaves the old
checkpoint as it was and nothing of its own. Only one parameter's shard and states are in memory at
a time (NVMe-tier states are read from their files one parameter at a time).

A load checks every file it will read (size, crc32, the tensors' name, shapes and dtypes against the
manifest) before it changes the model or optimizer: a damaged, truncated or swapped file is an error
naming it, and the model and optimizer stay as they were. The checks cost one more read of the
files (the page cache usually serves the second). Loading needs the world size the checkpoint was
saved with.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn

from zinf_compile.errors import ZinfError
from zinf_compile.optim import _point
from zinf_compile.runtime.params import Entry, world
from zinf_compile.runtime.state import STORE
from zinf_compile.runtime.swapdir import _HOST, _alive

__all__ = ["full_state_dict", "load_state_dict", "save_checkpoint", "load_checkpoint"]

FORMAT = "zinf-checkpoint"
VERSION = 2
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
OPTIM = "optim.pt"
_PREFIX = "_orig_mod."


def _module(model) -> nn.Module:
    """The module behind a compiled one (its state dict's names have no "_orig_mod." prefix)."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    if not isinstance(model, nn.Module):
        raise TypeError(f"zinf: expected a torch.nn.Module, got {type(model).__name__}")
    return model


def _entry(t) -> Entry | None:
    return STORE.entry(t) if isinstance(t, nn.Parameter) else None


def _compact(t: torch.Tensor) -> torch.Tensor:
    """t alone in its storage (a view of a padded buffer would save the padding)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _shard_of(full: torch.Tensor, e: Entry) -> torch.Tensor:
    """This rank's flat shard of a whole parameter, zero-padded, in the shard's dtype."""
    return e.slice_of(full.detach().reshape(-1).to("cpu", e.shard_dtype))


def _strip_prefix(state_dict: dict, own) -> dict:
    keys = list(state_dict)
    if keys and all(k.startswith(_PREFIX) for k in keys) and not any(k.startswith(_PREFIX) for k in own):
        return {k[len(_PREFIX):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def _key_error(what: str, missing, unexpected) -> ZinfError:
    parts = []
    if missing:
        parts.append(f"missing key(s): {', '.join(map(repr, missing))}")
    if unexpected:
        parts.append(f"unexpected key(s): {', '.join(map(repr, unexpected))}")
    return ZinfError(f"zinf: {what} does not match the model: " + "; ".join(parts))


# -- state dicts ---------------------------------------------------------------------------------
def full_state_dict(model) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every tensor on the CPU and managed parameters whole. With
    torch.distributed initialised it gathers over the ranks: every rank must call it, and every
    rank gets the whole dict. Resident tensors are shared, as torch's state_dict shares them."""
    own = _module(model).state_dict(keep_vars=True)
    out, gathered = {}, {}
    for k, t in own.items():
        e = _entry(t)
        if e is None:
            out[k] = t.detach().cpu()
            continue
        if e.index not in gathered:  # tied parameters: gathered once
            gathered[e.index] = _compact(STORE.full(e).detach().cpu())
        out[k] = gathered[e.index]
    return out


def load_state_dict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a whole state dict (torch's format, e.g. `full_state_dict`'s or an uncompiled model's):
    each managed parameter takes this rank's shard of its tensor, the rest go through torch's
    `load_state_dict`. Keys are checked strictly. Not collective."""
    module = _module(model)
    own = module.state_dict(keep_vars=True)
    sd = _strip_prefix(state_dict, own)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise _key_error("state dict", missing, unexpected)
    managed = {}
    for k, t in own.items():
        e = _entry(t)
        if e is None:
            continue
        v = sd[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != e.shape:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ZinfError(f"zinf: state dict's {k!r} has shape {shape}; the parameter has {e.shape}")
        managed[k] = e
    result = module.load_state_dict({k: v for k, v in sd.items() if k not in managed}, strict=False)
    left = sorted(set(result.missing_keys) - set(managed))
    if left or result.unexpected_keys:
        raise _key_error("state dict", left, result.unexpected_keys)
    done = set()
    for k, e in managed.items():
        if e.index not in done:
            done.add(e.index)
            e.write_shard(_shard_of(sd[k], e))


# -- checkpoints ---------------------------------------------------------------------------------
def _rank_dir(root: str, r: int) -> str:
    return os.path.join(root, f"rank{r:05d}")


def _check_optimizer(optimizer):
    from zinf_compile.optim import ZinfOptimizer

    if optimizer is not None and not isinstance(optimizer, ZinfOptimizer):
        raise TypeError("zinf: checkpoints take the optimizer zinf_compile.optim.optimizer(...) makes, "
                        f"not {type(optimizer).__name__}")


def _param_names(own: dict) -> dict[int, str]:
    """id(parameter) -> its first name (tied parameters have several)."""
    names = {}
    for k, t in own.items():
        if isinstance(t, nn.Parameter):
            names.setdefault(id(t), k)
    return names


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(value):
    """Rank 0's value on every rank."""
    if _multi():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _gather(value) -> list:
    """Every rank's value, in rank order, on every rank."""
    if _multi():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


def _all_ok(err: BaseException | None) -> str | None:
    """Every rank's outcome: None if all succeeded, else the first failure's message."""
    msg = None if err is None else f"rank {world()[0]}: {type(err).__name__}: {err}"
    return next((m for m in _gather(msg) if m is not None), None)


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Sink:
    """A new file written through os.write: checksummed as it is written, fsync'd when closed; an
    OS error (a full disk) is kept, so that torch.save's zip writer, which turns it into its own
    message ("unexpected pos ..."), cannot hide it."""

    def __init__(self, file: str, ckpt: str) -> None:
        self.file, self.ckpt = file, ckpt
        self.crc, self.nbytes, self.error = 0, 0, None
        self.fd = self._os(os.open, file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _os(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            self.error = e
            raise _disk_error(self.ckpt, self.file, e) from None

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        self.crc = zlib.crc32(mv, self.crc)
        self.nbytes += len(mv)
        while len(mv):
            mv = mv[self._os(os.write, self.fd, mv):]
        return len(b)

    def flush(self) -> None:
        pass

    def close(self) -> dict:
        """fsync and close; the file's record for the manifest."""
        try:
            self._os(os.fsync, self.fd)
        finally:
            os.close(self.fd)
        return {"bytes": self.nbytes, "crc32": self.crc}

    def abandon(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _disk_error(ckpt: str, file: str, e: OSError) -> ZinfError:
    what = (e.strerror or str(e)).lower()
    return ZinfError(f"zinf: saving the checkpoint {ckpt!r} failed: {what} (writing {file!r}); the checkpoint "
                     "that was there (if any) is intact and nothing of this save is left")


def _write_file(file: str, ckpt: str, obj=None, text: str | None = None) -> dict:
    """`obj` (torch.save) or `text` into a new file, fsync'd; returns {"bytes", "crc32"}."""
    sink = _Sink(file, ckpt)
    try:
        if text is not None:
            sink.write(text.encode())
        else:
            try:
                torch.save(obj, sink)
            except BaseException:
                if sink.error is not None:
                    raise _disk_error(ckpt, file, sink.error) from None
                raise
        return sink.close()
    except BaseException:
        sink.abandon()
        raise


def _describe(obj, prefix: str = "") -> dict:
    """Every tensor in a payload: its key path -> [shape, dtype] (what the manifest records and a
    load checks the file's contents against)."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = [list(obj.shape), str(obj.dtype).removeprefix("torch.")]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_describe(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_describe(v, f"{prefix}.{i}"))
    return out


def _is_checkpoint_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return not names or CURRENT in names or MANIFEST in names or all(_ours(n) for n in names)


def _ours(name: str) -> bool:
    return name.startswith(("v-", ".CURRENT-"))


def _version_name(token: str) -> str:
    return f"v-{_HOST}-{os.getpid()}-{token}"


def _dead_or_mine(name: str) -> bool:
    """Whether a version folder or pointer file of `name` (v-<host>-<pid>-<token>) belongs to a save
    that is over: this process's, or one of a process of this host that is gone."""
    parts = name.lstrip(".").split("-")
    if len(parts) != 4 or parts[1] != _HOST or not parts[2].isdigit():
        return False
    pid = int(parts[2])
    return pid == os.getpid() or not _alive(pid)


def save_checkpoint(path: str, model, optimizer=None) -> None:
    """Write the model's (and the optimizer's) state to directory `path`, replacing a checkpoint
    there. With several processes every rank must call it (each writes its shards)."""
    _check_optimizer(optimizer)
    rank, size = world()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not _is_checkpoint_dir(path):
        raise ZinfError(f"zinf: {path!r} exists and is not a zinf checkpoint: refusing to replace it")
    module = _module(model)
    own = module.state_dict(keep_vars=True)
    if optimizer is not None:
        optimizer._sync()
    version = _agree(_version_name(secrets.token_hex(4)))
    tmp = os.path.join(path, version)
    made: list[str] = []  # missing folders this call creates (removed again if it fails)
    err = None
    try:
        if rank == 0:
            made = _makedirs(path)
            os.mkdir(tmp)
    except BaseException as e:  # noqa: BLE001  (every rank learns of it, then it is raised)
        err = e
    failed = _all_ok(err)  # the folder exists before any rank writes
    if failed is None:
        try:
            os.makedirs(_rank_dir(tmp, rank), exist_ok=True)
            entries, files = _write_shards(tmp, path, rank, size, own, optimizer)
            _fsync_dir(_rank_dir(tmp, rank))
            _point("save:shards-written")
            files = {k: v for part in _gather(files) for k, v in part.items()}
            if rank == 0:
                if optimizer is not None:
                    meta = _optim_meta(optimizer, own)
                    files[OPTIM] = dict(_write_file(os.path.join(tmp, OPTIM), path, meta), tensors=_describe(meta))
                manifest = {"format": FORMAT, "version": VERSION, "world": size, "entries": entries,
                            "optimizer": None if optimizer is None else OPTIM, "files": files}
                text = json.dumps(manifest, indent=1)
                _write_file(os.path.join(tmp, MANIFEST), path, text=text)
                _fsync_dir(tmp)
        except BaseException as e:  # noqa: BLE001
            err = e
        failed = _all_ok(err)
    if failed is None and rank == 0:
        try:
            _point("save:before-switch")
            _switch(path, version, zlib.crc32(text.encode()), made)
            _point("save:after-switch")
        except BaseException as e:  # noqa: BLE001
            failed, err = f"rank 0: {type(e).__name__}: {e}", e
        if failed is None:
            try:
                _remove_stale(path, keep=version)  # the new checkpoint is in place either way
            except OSError:
                pass
    failed = _agree(failed)  # rank 0's verdict, on every rank
    if failed is None:
        return
    if rank == 0 and _current(path) != version:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
    if isinstance(err, ZinfError) or (err is not None and not isinstance(err, Exception)):
        raise err  # zinf's own message; or KeyboardInterrupt and the like, as they are
    raise ZinfError(f"zinf: saving the checkpoint {path!r} failed ({failed}); nothing was written") from err


def _switch(path: str, version: str, manifest_crc: int, made: list[str]) -> None:
    """Point CURRENT at `version`: a new pointer file, fsync'd, renamed over the old one (atomic),
    then the folder fsync'd. Before the rename the old checkpoint loads, after it the new one."""
    tmp = os.path.join(path, f".CURRENT-{version[2:]}")
    try:
        _write_file(tmp, path, text=f"{version} {manifest_crc}\n")
        os.replace(tmp, os.path.join(path, CURRENT))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(path)
    for d in made:  # folders this save made: their entries in their parents must last too
        _fsync_dir(os.path.dirname(d))


def _current(path: str) -> str | None:
    try:
        with open(os.path.join(path, CURRENT)) as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def _remove_stale(path: str, keep: str) -> None:
    """What is not the current checkpoint: older versions, folders of saves killed midway (their
    process gone), the files of a version-1 checkpoint. A live process's save is left alone."""
    for name in os.listdir(path):
        if name in (CURRENT, keep):
            continue
        full = os.path.join(path, name)
        complete = os.path.exists(os.path.join(full, MANIFEST))
        if name.startswith("v-") and (complete or _dead_or_mine(name)):
            shutil.rmtree(full, ignore_errors=True)
        elif name.startswith(".CURRENT-") and _dead_or_mine(name):
            os.remove(full)
        elif name in (MANIFEST, OPTIM) or (name.startswith("rank") and name[4:].isdigit()):
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)  # version 1's layout


def _makedirs(d: str) -> list[str]:
    """mkdir -p; returns the directories it made, outermost first."""
    missing = []
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    made = []
    for m in reversed(missing):
        os.mkdir(m)
        made.append(m)
    return made


def _write_shards(tmp: str, ckpt: str, rank: int, size: int, own: dict, optimizer) -> tuple[list, dict]:
    """One file per state-dict entry this rank holds; returns the manifest's entries and this
    rank's files' records (bytes, crc32, name, tensors)."""
    entries, first, files = [], {}, {}
    stepped = {id(p) for p in optimizer._all_params()} if optimizer is not None else set()
    for i, (k, t) in enumerate(own.items()):
        e = _entry(t)
        rec = {"name": k, "kind": "param" if isinstance(t, nn.Parameter) else "buffer",
               "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
               "managed": e is not None, "file": f"t{i:05d}.pt"}
        if id(t) in first:  # a tied parameter: saved under its first name
            rec["alias_of"] = first[id(t)]
            rec.pop("file")
            entries.append(rec)
            continue
        first[id(t)] = k
        if e is not None:
            rec["shard_numel"] = e.shard_numel
        entries.append(rec)
        if e is None and rank != 0:
            continue  # resident tensors are the same on every rank: rank 0 saves them
        payload = {"name": k, **({"shard": e.read_shard()} if e is not None else {"tensor": t.detach().cpu()})}
        if optimizer is not None and id(t) in stepped:
            got = optimizer._export_param_state(t)
            payload["optim"] = None if got is None else {"form": got[0], "state": dict(got[1])}
        rel = os.path.join(os.path.basename(_rank_dir(tmp, rank)), rec["file"])
        done = _write_file(os.path.join(tmp, rel), ckpt, payload)
        files[rel] = dict(done, name=k, tensors=_describe(payload))
        del payload
    return entries, files


def _optim_meta(optimizer, own: dict) -> dict:
    names = _param_names(own)
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        missing = [p for p in g["params"] if id(p) not in names]
        if missing:
            raise ZinfError(f"zinf: the optimizer's group {gi} has {len(missing)} parameter(s) that are not the "
                            "model's: a checkpoint names parameters by the model's names")
        hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        groups.append(dict(hyper, params=[names[id(p)] for p in g["params"]]))
    cls = optimizer.inner_class
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups}


def _crc_of(file: str, chunk: int = 8 << 20) -> tuple[int, int]:
    """(bytes, crc32) of a file, read in chunks."""
    crc, n = 0, 0
    buf = bytearray(chunk)
    with open(file, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                return n, crc
            crc = zlib.crc32(memoryview(buf)[:got], crc)
            n += got


def _load(file: str, mmap: bool = True) -> dict:
    """A checkpoint file's payload. mmap: its tensors over a mapping of the file (read when
    used: a read error there is a SIGBUS); otherwise read now, a read error an error naming it."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise ZinfError(f"zinf: checkpoint file {file!r} is missing (was the checkpoint copied whole?)") from None
    except Exception as err:
        raise ZinfError(f"zinf: checkpoint file {file!r} cannot be read ({type(err).__name__}: {err})") from None


def _open_manifest(path: str) -> tuple[str, dict]:
    """(the current version's folder, its manifest), checked against the CURRENT pointer's checksum."""
    try:
        with open(os.path.join(path, CURRENT)) as f:
            pointer = f.read().split()
    except FileNotFoundError:
        if os.path.exists(os.path.join(path, MANIFEST)):
            raise ZinfError(f"zinf: {path!r} is a version-1 zinf checkpoint (no checksums): this zinf loads "
                            f"version {VERSION}; load it with the zinf that saved it and save it again") from None
        raise ZinfError(f"zinf: {path!r} is not a zinf checkpoint (no {CURRENT})") from None
    if len(pointer) != 2 or not pointer[0].startswith("v-") or not pointer[1].isdigit():
        raise ZinfError(f"zinf: checkpoint file {os.path.join(path, CURRENT)!r} is damaged")
    root = os.path.join(path, pointer[0])
    file = os.path.join(root, MANIFEST)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ZinfError(f"zinf: checkpoint file {file!r} is missing (was the checkpoint copied whole?)") from None
    if zlib.crc32(raw) != int(pointer[1]):
        raise ZinfError(f"zinf: checkpoint file {file!r} is damaged (its checksum does not match)")
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise ZinfError(f"zinf: checkpoint file {file!r} is damaged (not JSON)") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ZinfError(f"zinf: {path!r} is not a version-{VERSION} zinf checkpoint")
    return root, manifest


def _verify(root: str, manifest: dict, rels) -> None:
    """Each file: its size and checksum, then its contents (the tensor's name, each tensor's shape
    and dtype) against the manifest. Raises naming the first damaged file."""
    records = manifest.get("files", {})
    rels = list(rels)
    for rel in rels:
        if rel not in records:
            raise ZinfError(f"zinf: checkpoint file {os.path.join(root, rel)!r} is not in its manifest")

    def crc(rel):
        try:
            return _crc_of(os.path.join(root, rel))
        except FileNotFoundError:
            return None

    # zlib.crc32 lets go of the GIL: files are checksummed in parallel
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        sums = list(pool.map(crc, rels))
    for rel, got in zip(rels, sums):
        file = os.path.join(root, rel)
        rec = records[rel]
        if got is None:
            raise ZinfError(f"zinf: checkpoint file {file!r} is missing (was the checkpoint copied whole?)")
        nbytes, crc = got
        if nbytes != rec["bytes"]:
            raise ZinfError(f"zinf: checkpoint file {file!r} is damaged: {nbytes} bytes, {rec['bytes']} written "
                            "(truncated?)")
        if crc != rec["crc32"]:
            raise ZinfError(f"zinf: checkpoint file {file!r} is damaged (its checksum does not match)")
        payload = _load(file)
        if "name" in rec and (not isinstance(payload, dict) or payload.get("name") != rec["name"]):
            raise ZinfError(f"zinf: checkpoint file {file!r} holds {payload.get('name')!r}, not {rec['name']!r} "
                            "(files swapped?)")
        if _describe(payload) != rec["tensors"]:
            raise ZinfError(f"zinf: checkpoint file {file!r} does not hold the tensors its manifest lists")
        del payload


def load_checkpoint(path: str, model, optimizer=None) -> None:
    """Load what `save_checkpoint` wrote into `model` (and `optimizer`), managed or not yet (call it
    before or after the first forward). Not collective, but every rank needs every rank's files
    for parameters it does not manage. Every file this rank reads is checked (size, checksum,
    contents against the manifest) before the model or optimizer is touched: a damaged checkpoint
    leaves both as they were, and the error names the file. Then everything to apply is read
    (read() calls, not mappings: a read error is an exception naming the file) and kept (in
    memory; a managed parameter's in the NVMe tier in swap files) before the first change, so a
    read error midway changes nothing either. The optimizer's states are loaded at
    its next step when nothing is managed yet (straight to where the parameters then live); its
    hyperparameters now."""
    _check_optimizer(optimizer)
    path = os.path.abspath(os.fspath(path))
    root, manifest = _open_manifest(path)
    rank, size = world()
    if manifest["world"] != size:
        raise ZinfError(f"zinf: checkpoint {path!r} was saved by {manifest['world']} process(es); this run has "
                        f"{size}. Its shards are split for {manifest['world']}: load it with that many, or "
                        "gather it with full_state_dict in such a run and load that with load_state_dict")
    module = _module(model)
    own = module.state_dict(keep_vars=True)
    recs = {r["name"]: r for r in manifest["entries"]}
    missing = [k for k in own if k not in recs]
    unexpected = [k for k in recs if k not in own]
    if missing or unexpected:
        raise _key_error(f"checkpoint {path!r}", missing, unexpected)
    for k, t in own.items():
        r = recs[k]
        if tuple(r["shape"]) != tuple(t.shape) or r["dtype"] != str(t.dtype).removeprefix("torch."):
            raise ZinfError(f"zinf: checkpoint's {k!r} is {r['dtype']}{tuple(r['shape'])}; the model's is "
                            f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}")
        if "alias_of" in r and own.get(r["alias_of"]) is not t:
            raise ZinfError(f"zinf: checkpoint ties {k!r} to {r['alias_of']!r}; the model does not")
    reader = _Reader(root, rank, size)
    meta = None
    if optimizer is not None:
        if manifest.get("optimizer") is None:
            raise ZinfError(f"zinf: checkpoint {path!r} holds no optimizer state")
        _verify(root, manifest, [OPTIM])
        meta = torch.load(os.path.join(root, OPTIM), map_location="cpu", weights_only=True)
        _check_groups(optimizer, meta, own)
    _verify(root, manifest, sorted({rel for k, t in own.items() if "alias_of" not in recs[k]
                                    for rel in reader.files(recs[k], _entry(t))}))
    if optimizer is not None and optimizer._any_managed():
        optimizer._sync()
        _reserve_states(optimizer, own, recs, manifest, reader, path)
    # -- checked. Everything the load applies is read now, before anything changes: a read error
    # (EIO) on a file that passed its check fails here, naming the file, with nothing changed
    reader.mmap = False  # read() calls: an error is an exception, where a mapping's is a SIGBUS
    staged = _Staged()
    try:
        values = []
        for k, t in own.items():
            r = recs[k]
            if "alias_of" in r:
                continue
            e = _entry(t)
            values.append((t, e, staged.keep(reader.shard(r, e) if e is not None else reader.whole(r), e, "shard")))
        states = []
        if optimizer is not None:
            params = [(own[n], recs[n]) for n in dict.fromkeys(n for g in meta["param_groups"] for n in g["params"])]
            for p, r in params:
                e = _entry(p)
                got = reader.optim(r, e)
                if got is not None:
                    form, st = got
                    got = form, {key: staged.keep(v, e, f"optimizer state {key!r}") if _per_elem(key, v) else v
                                 for key, v in st.items()}
                states.append((p, got))
        # -- read: from here on the model and optimizer change
        for t, e, value in values:
            if e is not None:
                e.write_shard(staged.get(value))
            else:
                with torch.no_grad():
                    t.copy_(staged.get(value))
    except BaseException:
        staged.release()
        raise
    if optimizer is None:
        staged.release()
        return
    for g, saved in zip(optimizer.param_groups, meta["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})

    def load_states():
        try:
            optimizer._clear_state()
            for p, got in states:
                if got is not None:
                    form, st = got
                    optimizer._import_param_state(p, form, {k: staged.get(v) for k, v in st.items()})
        finally:
            staged.release()

    if optimizer._any_managed():
        optimizer._sync()
        load_states()
    else:
        optimizer._defer(load_states)


class _Staged:
    """What a load applies, read from the checkpoint before anything changes. In memory, except a
    managed parameter's in the NVMe tier (its shard, its optimizer states): those go to swap files
    of its engine (checksummed like any record), so staging needs one tensor's memory at a time,
    not the model's. `release` hands the files back."""

    def __init__(self) -> None:
        self._files: list[tuple] = []  # (engine, file number, fd)

    def keep(self, t: torch.Tensor, e: Entry | None, what: str):
        if e is None or e.tier != "nvme":
            return t
        swap = e.engine.swap
        n, fd = swap.acquire(f"{what} of parameter {e.name!r}, being loaded from a checkpoint")
        self._files.append((e.engine, n, fd))
        e.engine.write_file(fd, t.detach().reshape(-1).contiguous())
        return _InFile(e.engine, fd, tuple(t.shape), t.dtype)

    @staticmethod
    def get(v):
        if not isinstance(v, _InFile):
            return v
        out = torch.empty(v.shape, dtype=v.dtype)
        v.engine.read_file(v.fd, out.view(-1))
        return out

    def release(self) -> None:
        """Hand the staging files back, emptied (a free swap file keeps its size until reused)."""
        files, self._files = self._files, []
        for engine, n, fd in files:
            if engine._swap is not None:
                try:
                    os.ftruncate(fd, 0)
                except OSError:
                    pass
                engine._swap.release(n)


class _InFile:
    """A staged tensor in a swap file."""

    def __init__(self, engine, fd: int, shape: tuple, dtype: torch.dtype) -> None:
        self.engine, self.fd, self.shape, self.dtype = engine, fd, shape, dtype


def _reserve_states(optimizer, own: dict, recs: dict, manifest: dict, reader: "_Reader", path: str) -> None:
    """Give each NVMe-tier optimizer state the load will write its file's space now (a fresh
    optimizer has no state files yet): a full disk fails here, before anything changed, not
    half-way through the optimizer's states."""
    for k, t in own.items():
        r = recs[k]
        if "alias_of" in r or not isinstance(t, nn.Parameter):
            continue
        try:
            kind, e, _ = optimizer._where(t)
        except ZinfError:
            continue  # not one of the optimizer's parameters
        if kind != "nvme":
            continue
        tensors = manifest["files"].get(reader.files(r, e)[0], {}).get("tensors", {})
        for key, (shape, _) in tensors.items():
            numel = 1
            for d in shape:
                numel *= d
            if not key.startswith("optim.state.") or key.count(".") != 2 or not shape or numel not in (
                    e.shard_numel, e.numel):
                continue
            fd = e.state_fd(key.split(".")[2])
            try:
                os.posix_fallocate(fd, 0, e.shard_nbytes)
            except OSError as err:
                raise ZinfError(f"zinf: loading the checkpoint {path!r} failed: {(err.strerror or str(err)).lower()} "
                                f"(making room for the optimizer state of {k!r} in the NVMe swap folder "
                                f"{e.engine.swap.path!r}); nothing was loaded") from None


def _check_groups(optimizer, meta: dict, own: dict) -> None:
    names = _param_names(own)
    groups = optimizer.param_groups
    if len(groups) != len(meta["param_groups"]):
        raise ZinfError(f"zinf: checkpoint's optimizer has {len(meta['param_groups'])} param group(s); this one "
                        f"has {len(groups)}")
    for gi, (g, saved) in enumerate(zip(groups, meta["param_groups"])):
        mine = [names.get(id(p)) for p in g["params"]]
        if mine != saved["params"]:
            raise ZinfError(f"zinf: the optimizer's param group {gi} holds other parameters than the "
                            f"checkpoint's ({mine[:3]}... vs {saved['params'][:3]}...)")


class _Reader:
    """Reads entries of a checkpoint in the form the model and optimizer need them now: a managed
    parameter's shard (this rank's file, or sliced from a whole tensor), or a whole tensor (rank 0's
    file, or this parameter's shards from every rank's file)."""

    def __init__(self, root: str, rank: int, size: int) -> None:
        self.root, self.rank, self.size = root, rank, size
        self.mmap = True  # tensors over mappings of the files (see _load)

    def _rel(self, r: dict, rank: int) -> str:
        return os.path.join(os.path.basename(_rank_dir(self.root, rank)), r["file"])

    def files(self, r: dict, e: Entry | None) -> list[str]:
        """The files (relative to the version's folder) this rank reads for entry `r`."""
        if not r["managed"]:
            return [self._rel(r, 0)]
        if e is not None:
            return [self._rel(r, self.rank)]
        return [self._rel(r, k) for k in range(self.size)]

    def _file(self, r: dict, rank: int) -> dict:
        return _load(os.path.join(self.root, self._rel(r, rank)), self.mmap)

    def _own(self, r: dict) -> dict:
        return self._file(r, self.rank if r["managed"] else 0)

    def shard(self, r: dict, e: Entry) -> torch.Tensor:
        if not r["managed"]:
            return _shard_of(self._own(r)["tensor"], e)
        shard = self._own(r)["shard"]
        if shard.numel() != e.shard_numel:
            raise ZinfError(f"zinf: checkpoint's shard of {r['name']!r} has {shard.numel()} elements; this "
                            f"rank's has {e.shard_numel}")
        return shard

    def whole(self, r: dict) -> torch.Tensor:
        if not r["managed"]:
            return self._own(r)["tensor"]
        return self._concat([self._file(r, k)["shard"] for k in range(self.size)], r)

    @staticmethod
    def _concat(shards, r: dict) -> torch.Tensor:
        numel = 1
        for d in r["shape"]:
            numel *= d
        return torch.cat([s.reshape(-1) for s in shards])[:numel].view(r["shape"])

    def optim(self, r: dict, e: Entry | None):
        """(form, state) of this parameter's optimizer state, or None."""
        got = self._own(r).get("optim")
        if got is None:
            return None
        form, st = got["form"], got["state"]
        if form == "shard" and e is None and self.size > 1:
            # a parameter managed when saved, resident now: its states whole, from every rank's shard
            per_rank = [self._file(r, k)["optim"]["state"] for k in range(self.size)]
            st = {key: (self._concat([s[key] for s in per_rank], r) if _per_elem(key, v) else v)
                  for key, v in st.items()}
            form = "full"
        return form, st


def _per_elem(key, v) -> bool:
    return isinstance(v, torch.Tensor) and key != "step" and v.dim() >= 1
