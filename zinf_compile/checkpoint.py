"""Model and optimizer state of a model zinf compiles, with its parameters managed (sharded, offloaded).

    full_state_dict(model)                   -> {name: CPU tensor}, managed parameters gathered (collective)
    load_state_dict(model, state_dict)       each managed parameter takes its shard; the rest as torch does
    save_checkpoint(path, model, optimizer)  a directory, streamed one parameter at a time
    load_checkpoint(path, model, optimizer)  its inverse; resuming from it is exact

`model` may be the compiled module (`torch.compile(...)`) or the module itself: names are the
module's own (no "_orig_mod." prefix), so a state dict goes to and from the uncompiled model.

Checkpoint layout (`path/`):

    manifest.json         format, version, world size, every state-dict entry (name, kind, shape,
                          dtype, managed or not, alias of another name for tied parameters, file)
    optim.pt              the optimizer's class and param groups (hyperparameters; parameters by name)
    rank00000/t00003.pt   entry 3 as rank 0 holds it: {"shard": flat shard} for a managed parameter
                          (one file per rank), {"tensor": ...} for the rest (rank 0 only), and
                          "optim": (form, state) of that parameter (step count, exp_avg, ...)

Saving writes into a temporary directory next to `path` and renames it into place at the end: a
failed save leaves no partial checkpoint (and an older checkpoint at `path` untouched). Only one
parameter's shard and states are in memory at a time (NVMe-tier states are read from their files one
parameter at a time). Loading needs the world size the checkpoint was saved with.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn

from zinf_compile.errors import ZinfError
from zinf_compile.runtime.params import Entry, world
from zinf_compile.runtime.state import STORE

__all__ = ["full_state_dict", "load_state_dict", "save_checkpoint", "load_checkpoint"]

FORMAT = "zinf-checkpoint"
VERSION = 1
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


def _agree(value):
    """Rank 0's value on every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _all_ok(err: BaseException | None) -> str | None:
    """Every rank's outcome: None if all succeeded, else the first failure's message."""
    msg = None if err is None else f"rank {world()[0]}: {type(err).__name__}: {err}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        msgs = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, msg)
        return next((m for m in msgs if m is not None), None)
    return msg


def save_checkpoint(path: str, model, optimizer=None) -> None:
    """Write the model's (and the optimizer's) state to directory `path`, replacing a checkpoint
    there. With several processes every rank must call it (each writes its shards)."""
    _check_optimizer(optimizer)
    rank, size = world()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not (os.path.isdir(path) and (
            os.path.exists(os.path.join(path, MANIFEST)) or not os.listdir(path))):
        raise ZinfError(f"zinf: {path!r} exists and is not a zinf checkpoint: refusing to replace it")
    module = _module(model)
    own = module.state_dict(keep_vars=True)
    if optimizer is not None:
        optimizer._sync()
    token = _agree(secrets.token_hex(4))
    parent, base = os.path.split(path)
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    made: list[str] = []  # missing parents this call creates (removed again if it fails)
    err = None
    try:
        if rank == 0:
            made = _makedirs(parent)
    except BaseException as e:  # noqa: BLE001  (every rank learns of it, then it is raised)
        err = e
    failed = _all_ok(err)  # the parent exists before any rank writes
    if failed is None:
        try:
            os.makedirs(_rank_dir(tmp, rank), exist_ok=True)
            manifest = _write_shards(tmp, rank, size, own, optimizer)
            if rank == 0:
                if optimizer is not None:
                    torch.save(_optim_meta(optimizer, own), os.path.join(tmp, OPTIM))
                with open(os.path.join(tmp, MANIFEST), "w") as f:
                    json.dump(manifest, f, indent=1)
        except BaseException as e:  # noqa: BLE001
            err = e
        failed = _all_ok(err)
    if failed is None and rank == 0:
        try:
            _move_into_place(tmp, path, token)
        except BaseException as e:  # noqa: BLE001
            failed, err = f"rank 0: {type(e).__name__}: {e}", e
    failed = _agree(failed)  # rank 0's verdict, on every rank
    if failed is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
    if isinstance(err, ZinfError) or (err is not None and not isinstance(err, Exception)):
        raise err  # zinf's own message; or KeyboardInterrupt and the like, as they are
    raise ZinfError(f"zinf: saving the checkpoint {path!r} failed ({failed}); nothing was written") from err


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


def _move_into_place(tmp: str, path: str, token: str) -> None:
    if os.path.isdir(path) and os.listdir(path):
        old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{token}")
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)  # the old checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def _write_shards(tmp: str, rank: int, size: int, own: dict, optimizer) -> dict:
    """One file per state-dict entry this rank holds; returns the manifest."""
    entries, first = [], {}
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
        payload = {"shard": e.read_shard()} if e is not None else {"tensor": t.detach().cpu()}
        if optimizer is not None and id(t) in stepped:
            got = optimizer._export_param_state(t)
            payload["optim"] = None if got is None else {"form": got[0], "state": dict(got[1])}
        torch.save(payload, os.path.join(_rank_dir(tmp, rank), rec["file"]))
        del payload
    return {"format": FORMAT, "version": VERSION, "world": size, "entries": entries,
            "optimizer": None if optimizer is None else OPTIM}


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


def _load(file: str) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ZinfError(f"zinf: checkpoint file {file!r} is missing (was the checkpoint copied whole?)") from None


def load_checkpoint(path: str, model, optimizer=None) -> None:
    """Load what `save_checkpoint` wrote into `model` (and `optimizer`), managed or not yet (call it
    before or after the first forward). Not collective, but every rank needs every rank's files
    for parameters it does not manage. The optimizer's states are loaded at its next step when
    nothing is managed yet (straight to where the parameters then live); its hyperparameters now."""
    _check_optimizer(optimizer)
    path = os.path.abspath(os.fspath(path))
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ZinfError(f"zinf: {path!r} is not a zinf checkpoint (no {MANIFEST})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ZinfError(f"zinf: {path!r} is not a version-{VERSION} zinf checkpoint")
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
    reader = _Reader(path, rank, size)
    for k, t in own.items():
        r = recs[k]
        if "alias_of" in r:
            if own[r["alias_of"]] is not t:
                raise ZinfError(f"zinf: checkpoint ties {k!r} to {r['alias_of']!r}; the model does not")
            continue
        e = _entry(t)
        if e is not None:
            e.write_shard(reader.shard(r, e))
        else:
            with torch.no_grad():
                t.copy_(reader.whole(r))
    if optimizer is None:
        return
    if manifest.get("optimizer") is None:
        raise ZinfError(f"zinf: checkpoint {path!r} holds no optimizer state")
    meta = torch.load(os.path.join(path, OPTIM), map_location="cpu", weights_only=True)
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
    for g, saved in zip(groups, meta["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})

    params = [(own[n], recs[n]) for n in dict.fromkeys(n for g in meta["param_groups"] for n in g["params"])]

    def load_states():
        optimizer._clear_state()
        for p, r in params:
            got = reader.optim(r, _entry(p))
            if got is not None:
                optimizer._import_param_state(p, *got)

    if optimizer._any_managed():
        optimizer._sync()
        load_states()
    else:
        optimizer._defer(load_states)


class _Reader:
    """Reads entries of a checkpoint in the form the model and optimizer need them now: a managed
    parameter's shard (this rank's file, or sliced from a whole tensor), or a whole tensor (rank 0's
    file, or this parameter's shards from every rank's file)."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path, self.rank, self.size = path, rank, size

    def _file(self, r: dict, rank: int) -> dict:
        return _load(os.path.join(_rank_dir(self.path, rank), r["file"]))

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
