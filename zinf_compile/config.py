"""ZinfConfig: every option and environment variable zinf reads, in one place."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from zinf_compile.errors import ZinfConfigError
from zinf_compile.units import parse_bytes

TIERS = ("cpu", "nvme")


def tier_frees_device(tier: str, device: str) -> bool:
    """Whether moving a tensor to `tier` frees memory on `device` (CPU memory is the same RAM as a
    CPU device: that tier frees nothing there)."""
    return not (tier == "cpu" and device == "cpu")


@dataclass(frozen=True)
class ZinfConfig:
    budget: int | None = None  # bytes of device memory; None = what the device has free
    budget_fraction: float | None = None  # "80%": that share of each graph's unplanned peak
    offload: str = "auto"  # "cpu" | "nvme" | "auto" (cpu when the device is a GPU, nvme on a CPU)
    offload_dir: str = ""  # where NVMe swap files go; a per-process folder is made inside
    profile: str = "auto"  # DeviceProfile name or JSON path; "auto" = calibrated file, else built-in
    io_threads: int = 4
    # O_DIRECT swap files: True, False, or "auto" (direct when the files outgrow the page cache)
    o_direct: bool | str = "auto"
    verify: bool = True  # run the verifier after every pass
    # Every record zinf writes to an NVMe swap file carries an xxh3-64 digest per 256 KiB, checked on each read:
    # a damaged file is an error naming it, never data trained on. False skips both: worth it only
    # where swap traffic dominates (with crc32, `python -m bench integrity` on 2 shared cores: a warm
    # streamed GPT forward +15%, +46%, -1%, a training step moving 1.6 GB +21% to +63%; xxh3 is
    # 7x faster, and a cold streamed forward costs about the same on and off: README).
    checksums: bool = True
    # On a CPU device, glibc keeps freed tensors resident once its dynamic mmap threshold has
    # grown (bench/ measured 88-208 MiB over a 64 MiB budget): zinf pins the threshold so large
    # tensors get their own mappings and freed memory really leaves. 0 leaves glibc alone.
    malloc_mmap_threshold: int = 128 << 10
    # Inductor's caches skip the partitioner and post-grad passes on a hit: the compile then leaves
    # no plan to inspect, dump or check. Off by default; True trades that for faster recompiles.
    cache: bool = False
    dump_dir: str | None = None  # ZINF_DUMP_DIR: dump plans and graphs of each compile
    # Parameters (ZeRO-3): "auto" shards and offloads them when the graph does not fit the budget
    # with them resident; "offload" always (every parameter of PERSIST_BYTES or more); "resident"
    # never. Managed parameters live in the offload tier, sharded over the default process group.
    params: str = "auto"
    # Mixed precision as ZeRO does it: under a bf16/fp16 model, managed parameters keep float32
    # master shards (and gradients and optimizer states) in their tier; gathers hand the graph the
    # model's dtype. None: shards in the parameter's own dtype.
    master_dtype: str | None = None
    # Low-precision gathers, as ZeRO-Infinity keeps fp16 parameters beside fp32 masters: managed
    # parameters also keep a copy of their shard in this dtype ("bfloat16" or "float16"), which the
    # graph's gathers read and widen to the parameter's dtype: a float32 shard streams half the
    # bytes. The shard stays the master that the optimizer steps (each step rewrites the copy),
    # checkpoints save and reads outside the graph see. Numerics: the model computes with weights
    # rounded to this dtype, as `p.to(bfloat16).to(p.dtype)` rounds them. None: gathers read the shard.
    gather_dtype: str | None = None
    # Memory-centric tiling of the matmuls of managed 2-d weights: "auto" when a weight gathered
    # whole does not fit next to what must stay live; "off"; {"max_tile_bytes": n} tiles every
    # managed weight larger than n into tiles of at most n bytes.
    tiling: str = "auto"
    max_tile_bytes: int | None = None
    # ZINF_DISABLE_PASSES=name,name: passes the driver skips (debugging only: a plan may then not hold)
    disabled_passes: tuple[str, ...] = ()

    OPTIONS = ("budget", "offload", "offload_dir", "profile", "io_threads", "o_direct", "verify",
               "malloc_mmap_threshold", "cache", "params", "master_dtype", "gather_dtype", "tiling",
               "checksums")

    @staticmethod
    def from_options(options: Mapping[str, Any] | None) -> "ZinfConfig":
        if options is not None and not isinstance(options, Mapping):
            raise ZinfConfigError(
                f"options must be a dict of zinf options, e.g. options={{'budget': '1GiB'}}; got "
                f"{type(options).__name__} {options!r}")
        options = dict(options or {})
        if any(not isinstance(k, str) for k in options):
            raise ZinfConfigError(f"option names must be strings, got {sorted(map(repr, options))}")
        unknown = sorted(set(options) - set(ZinfConfig.OPTIONS))
        if unknown:
            raise ZinfConfigError(
                f"unknown zinf option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(ZinfConfig.OPTIONS)}"
            )
        budget, fraction = options.get("budget"), None
        if isinstance(budget, str) and budget.strip().endswith("%"):
            try:
                fraction = float(budget.strip()[:-1]) / 100
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                raise ZinfConfigError(f"budget: a share of the unplanned peak must be in (0%, 100%], got {budget!r}")
            budget = None
        elif budget is not None and budget != "auto":
            budget = parse_bytes(budget, "budget")
        else:
            budget = None
        offload = options.get("offload", "auto")
        if offload not in (*TIERS, "auto"):
            raise ZinfConfigError(f"offload: expected 'cpu', 'nvme' or 'auto', got {offload!r}")
        offload_dir = options.get("offload_dir") or os.environ.get("ZINF_OFFLOAD_DIR") or os.path.join(
            tempfile.gettempdir(), "zinf"
        )
        if not isinstance(offload_dir, (str, os.PathLike)):
            raise ZinfConfigError(f"offload_dir: expected a path, got {offload_dir!r}")
        io_threads = options.get("io_threads", 4)
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise ZinfConfigError(f"io_threads: expected a positive int, got {io_threads!r}")
        o_direct = options.get("o_direct", "auto")
        if not (isinstance(o_direct, bool) or o_direct == "auto"):
            raise ZinfConfigError(f"o_direct: expected True, False or 'auto', got {options['o_direct']!r}")
        for flag in ("verify", "cache", "checksums"):
            if flag in options and not isinstance(options[flag], bool):
                raise ZinfConfigError(f"{flag}: expected True or False, got {options[flag]!r}")
        mmap_threshold = options.get("malloc_mmap_threshold", 128 << 10)
        if mmap_threshold not in (0, None, False):
            mmap_threshold = parse_bytes(mmap_threshold, "malloc_mmap_threshold")
        params = options.get("params", "auto")
        if params not in ("auto", "offload", "resident"):
            raise ZinfConfigError(f"params: expected 'auto', 'offload' or 'resident', got {params!r}")
        master = options.get("master_dtype")
        master = {"fp32": "float32", "float": "float32"}.get(master, master)
        if master not in (None, "float32", "float64"):
            raise ZinfConfigError(f"master_dtype: expected 'float32' (or None), got {options.get('master_dtype')!r}")
        gather = options.get("gather_dtype")
        gather = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(gather, gather)
        if gather not in (None, "bfloat16", "float16"):
            raise ZinfConfigError(f"gather_dtype: expected 'bfloat16' or 'float16' (or None), got "
                                  f"{options.get('gather_dtype')!r}")
        tiling, max_tile = options.get("tiling", "auto"), None
        if isinstance(tiling, Mapping):
            extra = sorted(set(tiling) - {"max_tile_bytes"})
            if extra or "max_tile_bytes" not in tiling:
                raise ZinfConfigError(f"tiling: expected {{'max_tile_bytes': n}}, got {tiling!r}")
            max_tile = parse_bytes(tiling["max_tile_bytes"], "tiling.max_tile_bytes")
            if max_tile <= 0:
                raise ZinfConfigError(f"tiling.max_tile_bytes must be positive, got {tiling['max_tile_bytes']!r}")
            tiling = "force"
        elif tiling not in ("auto", "off"):
            raise ZinfConfigError(f"tiling: expected 'auto', 'off' or {{'max_tile_bytes': n}}, got {tiling!r}")
        profile = options.get("profile", "auto")
        if not isinstance(profile, str):
            raise ZinfConfigError(f"profile: expected a profile name or a JSON path, got {profile!r}")
        return ZinfConfig(
            budget=budget,
            budget_fraction=fraction,
            offload=offload,
            offload_dir=os.path.abspath(os.fspath(offload_dir)),
            profile=profile,
            io_threads=io_threads,
            o_direct=o_direct,
            verify=bool(options.get("verify", True)),
            checksums=bool(options.get("checksums", True)),
            malloc_mmap_threshold=int(mmap_threshold or 0),
            cache=bool(options.get("cache", False)),
            dump_dir=os.environ.get("ZINF_DUMP_DIR") or None,
            params=params,
            master_dtype=master,
            gather_dtype=gather,
            tiling=tiling,
            max_tile_bytes=max_tile,
            disabled_passes=tuple(sorted(filter(None, os.environ.get("ZINF_DISABLE_PASSES", "").split(",")))),
        )

    def tier_for(self, device_type: str) -> str:
        if self.offload != "auto":
            return self.offload
        return "cpu" if device_type != "cpu" else "nvme"

    def key(self) -> str:
        """A stable digest of every field that changes generated code (FX graph cache key)."""
        text = repr(dataclasses.astuple(self))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

