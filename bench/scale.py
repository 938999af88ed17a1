"""Models larger than RAM, measured: inference of a Llama whose fp32 weights are >= 1.5x RAM, and
training of one whose parameters + gradients + optimizer states are >= 2.5x RAM (or the largest the
free disk allows, with the numbers that say why).

    python -m bench scale [--parts infer,train] [--dir /var/tmp/zinf-scale] [--infer-ratio 1.5]
                          [--train-ratio 2.5] [--budget 3GiB] [--train-budget 3GiB] [--seq 16]

RAM is MemTotal of /proc/meminfo (`--mem` overrides it, to try the pipeline at a small scale).

infer   A Llama-shaped checkpoint (LlamaForCausalLM's state dict: hidden 8192, MLP 22016, 64 heads,
        8 KV heads, vocab 32000, untied; as many layers as make the fp32 weights >= ratio x RAM) is
        written as sharded safetensors with its index without ever holding the model: the model is
        built on the meta device for its names and shapes, each shard's header is written first,
        then each tensor is drawn (seeded per tensor: N(0, 0.02), norms 1), written and dropped.
        A fresh process then builds the model on meta, reads its RSS (the process's own overhead:
        Python, torch, transformers, zinf imported), `load_pretrained(..., in_place=True)` (the
        shards read where they lie in the safetensors files), compiles with backend="zinf" and the
        budget, and runs forwards of batch 1, `--seq` tokens under no_grad: the first (compiles),
        `--forwards` with the page cache as the previous forward left it (warm: the files are
        larger than RAM, so most of each forward still comes from the disk), `--forwards` with the
        page cache dropped before each (cold). It reads VmHWM (peak RSS) over the load, over the
        first forward (the compile's memory included) and over the later forwards, and the disk's
        direct read bandwidth (`dd if=<a shard> iflag=direct bs=16M`). Logits are checked finite
        and against a reference: the same model run eagerly one decoder layer at a time, each
        layer's weights read with safetensors' own reader before it runs and dropped after (its
        memory is one layer, not the model). The recipe itself is checked at a small
        size: a checkpoint written the same way, loaded by transformers' from_pretrained, against
        the streamed reference and zinf.
train   After the inference files are deleted: a Llama (hidden 5120, MLP 13824, 40 heads, vocab
        32000) built on meta, `materialize`d into NVMe shards (HF's own initialisation), compiled
        with backend="zinf" and trained 3 steps on one batch with zinf's optimizer over
        torch.optim.SGD(momentum=0.9), `commit="param"` (`--commit`). The disk decides the size.
        Committing per parameter, the disk holds parameters + gradients + momenta (12 bytes per
        parameter) plus one parameter's spare records (the largest, here the embedding: its weight
        and momentum); so the largest size that fits is free disk - `--reserve` - `--margin` - that.
        With `--commit step` (all or nothing) each step's new parameters and states go beside the
        old ones, so at its peak the disk holds 2 x parameters + gradients + 2 x states: 5 x 4 bytes
        per parameter for 12 counted (ratio 5/3; AdamW 7/4; plain SGD 3/2), and the largest
        size is (free disk - reserve - margin) / (5/3). When ratio x RAM does not fit, the record
        says so with these numbers and the run takes the largest that fits. A thread watches the
        free space and stops the run (SIGTERM: the swap folder goes) below the reserve.
        `--optimizer adamw` trains with torch.optim.AdamW (16 bytes per parameter counted), `--cold 1`
        drops the page cache before each step, `--step-in-backward 1` steps in the backward (needs
        `--commit step`). The worker measures the disk with dd (direct writes, direct reads, and
        both at once) and reports each later step against its I/O bound: bytes read / read rate +
        bytes written / write rate, bytes moved / the mixed rate, and the overlapped bound (the
        slower side alone), with a compute estimate (6 x parameters x tokens at a matmul's rate).

Writes <out>/scale.json (a part run alone keeps the other part's last record). Every file it writes
goes at the end, also on failure; `--keep` keeps the checkpoint and `--reuse` runs on a kept one
(writing 38 GB takes ~10 minutes here). Progress goes to stdout: run it in the background with its
output in a file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench import _harness, _rss

GB, GiB, MiB = 10**9, 2**30, 2**20
INFER = dict(hidden=8192, intermediate=22016, heads=64, kv_heads=8, vocab=32000)
TRAIN = dict(hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32000)
SMALL = dict(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1000, layers=2)
WRITTEN = "zinf-written.json"  # the writer's numbers, beside the checkpoint
DISK_PER_PARAM = {"sgd_momentum": (5, 3), "adamw": (7, 4), "sgd": (3, 2)}  # (disk, p+g+s) shard-sizes



def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no MemTotal in /proc/meminfo")


def disk_free(path: str) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


# -- the model ----------------------------------------------------------------------------------------

def llama_config(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    import torch
    import transformers as tf

    return tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=512, tie_word_embeddings=False, dtype=torch.float32)


def n_params(layers: int, shape: dict) -> int:
    """Parameters of LlamaForCausalLM with this shape, counted on the meta device."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        m = tf.LlamaForCausalLM(llama_config(layers, **shape))
    return sum(p.numel() for p in m.parameters())


def layers_for(target_params: int, shape: dict) -> int:
    """The fewest layers that make at least `target_params` parameters."""
    one, two = n_params(1, shape), n_params(2, shape)
    per, rest = two - one, one - (two - one)
    return max(1, math.ceil((target_params - rest) / per))


# -- a checkpoint written tensor by tensor --------------------------------------------------------------

def _value(key: str, shape, seed: int, i: int):
    import torch

    if key.endswith("norm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randn(shape, generator=g).mul_(0.02)


def write_checkpoint(path: str, cfg, seed: int = 0, shard_bytes: int = 4 * GB, every: float = 30.0) -> dict:
    """Sharded safetensors (+ index, + config.json) of LlamaForCausalLM(cfg)'s state dict, random
    (seeded per tensor), one tensor in memory at a time: each shard's header first (the shapes come
    from a model on the meta device), then each tensor drawn, written, dropped."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    items = [(k, tuple(t.shape)) for k, t in model.state_dict().items()]
    del model
    shards, cur, size = [], [], 0
    for k, shape in items:
        nbytes = math.prod(shape) * 4
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((k, shape))
        size += nbytes
    shards.append(cur)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    weight_map, total, i, t0, last = {}, 0, 0, time.perf_counter(), time.perf_counter()
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        head, off = {"__metadata__": {"format": "pt"}}, 0
        for k, shape in shard:
            nbytes = math.prod(shape) * 4
            head[k] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        raw = json.dumps(head, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # tensors start 8-byte aligned, as safetensors writes them
        with open(os.path.join(path, name), "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for k, shape in shard:
                t = _value(k, shape, seed, i)
                f.write(memoryview(t.numpy()).cast("B"))
                total += t.numel() * 4
                weight_map[k] = name
                i += 1
                del t
                if time.perf_counter() - last > every:
                    last = time.perf_counter()
                    log(f"  written {total / GB:.1f} GB ({total / GB / (last - t0):.2f} GB/s), shard {n}/{len(shards)}")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    stats = dict(bytes=total, files=len(shards), tensors=i, write_s=time.perf_counter() - t0, seed=seed)
    with open(os.path.join(path, WRITTEN), "w") as f:  # what --reuse reports
        json.dump(stats, f)
    return stats


def tf_config_matches(path: str, cfg) -> bool:
    """Whether the checkpoint in `path` was written for `cfg`'s shape."""
    with open(os.path.join(path, "config.json")) as f:
        have = json.load(f)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    return all(have.get(k) == getattr(cfg, k) for k in keys)


# -- the reference: eager, one decoder layer in memory at a time -----------------------------------------

def streamed_reference(path: str, ids):
    """LlamaForCausalLM's logits for `ids`, eagerly, each decoder layer's weights read (safetensors'
    own reader) right before it runs and dropped after; the embedding, norm and head are read first."""
    import torch
    import transformers as tf
    from accelerate import init_empty_weights
    from safetensors import safe_open

    cfg = tf.AutoConfig.from_pretrained(path)
    with init_empty_weights():  # buffers (rotary inv_freq) real, parameters on meta
        model = tf.LlamaForCausalLM(cfg).eval()
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]

    def read(prefix: str) -> dict:
        out = {}
        for k, file in where.items():
            if k.startswith(prefix):
                with safe_open(os.path.join(path, file), framework="pt") as fh:
                    out[k[len(prefix):]] = fh.get_tensor(k).clone()
        return out

    def load(module, prefix):
        module.load_state_dict(read(prefix), assign=True, strict=True)

    load(model.model.embed_tokens, "model.embed_tokens.")
    load(model.model.norm, "model.norm.")
    load(model.lm_head, "lm_head.")
    def drop(module, args, output):
        module.to("meta")  # returns None: the layer's output stays

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: load(m, f"model.layers.{i}."))
        layer.register_forward_hook(drop)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# -- workers (fresh processes) ------------------------------------------------------------------------

def _dd(file: str) -> dict:
    p = subprocess.run(["dd", f"if={file}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True,
                       text=True, timeout=1800)
    return dict(file=file if p.returncode else os.path.basename(file), **_dd_parse(p))


def _dd_parse(p) -> dict:
    """A finished dd's bytes, seconds and rate (from its stderr), or its error."""
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", p.stderr)
    if not m or p.returncode:
        return dict(error=p.stderr[-300:])
    return dict(bytes=int(m.group(1)), s=float(m.group(2)), Bps=int(m.group(1)) / float(m.group(2)))


def _ids(vocab: int, seq: int, seed: int):
    import torch

    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed + 1))


def infer_worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import accelerate  # noqa: F401  (imported before the overhead is read, as everything the run uses)
    import safetensors  # noqa: F401
    import transformers as tf

    import zinf_compile
    import zinf_compile.backend  # noqa: F401

    cfg = tf.AutoConfig.from_pretrained(args.ckpt)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = _ids(cfg.vocab_size, args.seq, args.seed)
    overhead = _rss.baseline()  # the process's own: interpreter, torch, transformers, zinf; no weights
    out = dict(weights=weights, overhead_rss=overhead, budget=args.budget, seq=args.seq)
    opts = {"offload": "nvme", "offload_dir": args.offload_dir, "budget": args.budget}
    log(f"worker: {weights / GB:.1f} GB of weights; RSS before loading {overhead / MiB:.0f} MiB; loading in place")
    t0 = time.perf_counter()
    zinf_compile.load_pretrained(model, args.ckpt, options=opts, in_place=True)
    out["load_s"] = time.perf_counter() - t0
    out["load_peak_over_overhead"] = _rss.hwm() - overhead
    log(f"worker: loaded in {out['load_s']:.1f} s, VmHWM +{out['load_peak_over_overhead'] / MiB:.0f} MiB")
    compiled = torch.compile(model.eval(), backend="zinf", options=opts)

    def forward():
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = compiled(input_ids=ids, use_cache=False).logits
        return logits, time.perf_counter() - t0

    logits, out["first_forward_s"] = forward()  # compiles
    out["first_forward_peak_over_overhead"] = _rss.hwm() - overhead  # the compile's memory included
    log(f"worker: first forward (with the compile) {out['first_forward_s']:.1f} s")
    _rss.trim()
    _rss.reset_hwm()  # from here: the forwards' own peak (out["forwards_peak_over_overhead"])
    out["warm_forward_s"], out["cold_forward_s"] = [], []
    for _ in range(args.forwards):
        logits, s = forward()
        out["warm_forward_s"].append(s)
        log(f"worker: warm forward {s:.1f} s")
    for _ in range(args.forwards):
        if not _harness.drop_caches():
            raise SystemExit("the cold forwards drop the page cache: run as root")
        logits, s = forward()
        out["cold_forward_s"].append(s)
        log(f"worker: cold forward {s:.1f} s")
    out["forwards_peak_over_overhead"] = _rss.hwm() - overhead
    out["peak_over_overhead"] = max(out["forwards_peak_over_overhead"], out["first_forward_peak_over_overhead"],
                                    out["load_peak_over_overhead"])
    out["engine_bytes"] = _harness.engine_bytes()
    out["plans"] = [dict(graphs=p.graphs, budget=p.budget, peak_before=p.peak_before, peak_after=p.peak_after,
                         lower_bound=p.lower_bound, actions=p.action_counts(), tiles=len(p.tiles))
                    for p in zinf_compile.last_plans()]
    out["logits_finite"] = bool(torch.isfinite(logits).all())
    out["logits_absmax"] = float(logits.abs().max())
    out["logits_std"] = float(logits.std())
    shards = sorted(f for f in os.listdir(args.ckpt) if f.endswith(".safetensors"))
    out["dd_direct"] = _dd(os.path.join(args.ckpt, shards[len(shards) // 2]))
    log(f"worker: dd iflag=direct {out['dd_direct'].get('Bps', 0) / GB:.2f} GB/s; streamed eager reference ...")
    if args.reference:
        t0 = time.perf_counter()
        ref = streamed_reference(args.ckpt, ids)
        out["reference_s"] = time.perf_counter() - t0
        out["max_abs_diff_vs_reference"] = float((logits - ref).abs().max())
        out["reference_absmax"] = float(ref.abs().max())
        log(f"worker: reference {out['reference_s']:.1f} s, max |zinf - reference| {out['max_abs_diff_vs_reference']:.2e}")
    return out


def recipe_worker(args) -> dict:
    """The small checkpoint: transformers' from_pretrained (eager) against the streamed reference and
    zinf (load_pretrained in place, compiled)."""
    import torch

    torch.set_num_threads(args.threads)
    import transformers as tf

    import zinf_compile
    import zinf_compile.backend  # noqa: F401

    cfg = tf.AutoConfig.from_pretrained(args.ckpt)
    ids = _ids(cfg.vocab_size, args.seq, args.seed)
    hf = tf.LlamaForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
    ref = streamed_reference(args.ckpt, ids)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    opts = {"offload": "nvme", "offload_dir": args.offload_dir, "budget": "50%"}
    zinf_compile.load_pretrained(model, args.ckpt, options=opts, in_place=True)
    compiled = torch.compile(model.eval(), backend="zinf", options=opts)
    with torch.no_grad():
        got = compiled(input_ids=ids, use_cache=False).logits
    return dict(reference_vs_from_pretrained=float((ref - want).abs().max()),
                zinf_vs_from_pretrained=float((got - want).abs().max()), absmax=float(want.abs().max()))




def _disk_watch(path: str, reserve: int, seen: dict) -> None:
    """Every second: the least free space seen; below `reserve`, SIGTERM this process (the swap
    folder goes at its exit)."""
    while True:
        free = disk_free(path)
        seen["min_free"] = min(seen.get("min_free", free), free)
        if free < reserve:
            log(f"worker: free disk {free / GB:.1f} GB < reserve {reserve / GB:.1f} GB: stopping")
            seen["stopped"] = True
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(1.0)


STATES = {"sgd_momentum": 1, "adamw": 2}  # optimizer states per parameter


def _make_optimizer(model, args):
    import torch

    import zinf_compile

    cls, hyper = ((torch.optim.AdamW, dict(lr=args.lr)) if args.optimizer == "adamw" else
                  (torch.optim.SGD, dict(lr=args.lr, momentum=0.9)))
    opt = zinf_compile.optimizer(model, cls, commit=args.commit, step_in_backward=bool(args.step_in_backward), **hyper)
    return opt, f"{cls.__name__}({', '.join(f'{k}={v:g}' for k, v in hyper.items())})"


_DD_WRITE = ["dd", "if=/dev/zero", "bs=16M", "oflag=direct", "conv=fsync"]


def _dd_write(folder: str, mib: int = 2048) -> dict:
    """The disk's direct write bandwidth (`dd oflag=direct bs=16M conv=fsync`), then its direct read
    bandwidth over the same file (`_dd`: iflag=direct, past the page cache), then both at once (that
    file read while another is written): the rate the device serves a step's mixed traffic at
    (`mixed_Bps`: both byte counts over the longer of the two). The files go."""
    f, g = os.path.join(folder, "dd-probe.bin"), os.path.join(folder, "dd-probe-2.bin")
    try:
        w = _dd_parse(subprocess.run(_DD_WRITE + [f"of={f}", f"count={mib // 16}"], capture_output=True, text=True,
                                     timeout=1800))
        out = dict(write=w, read=_dd(f))
        writer = subprocess.Popen(_DD_WRITE + [f"of={g}", f"count={mib // 16}"], stderr=subprocess.PIPE, text=True)
        r2 = _dd(f)
        _, err = writer.communicate(timeout=1800)
        w2 = _dd_parse(subprocess.CompletedProcess([], writer.returncode, "", err))
        if r2.get("Bps") and w2.get("Bps"):
            out["mixed"] = dict(read=r2, write=w2, Bps=(r2["bytes"] + w2["bytes"]) / max(r2["s"], w2["s"]))
        return out
    finally:
        for x in (f, g):
            if os.path.exists(x):
                os.remove(x)


def _matmul_rate(threads: int) -> float:
    """FLOP/s of a 2048^3 fp32 matmul on this process's threads (the compute estimate's rate)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048 ** 3 / (time.perf_counter() - t0)


def train_worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import transformers as tf

    import zinf_compile
    import zinf_compile.backend  # noqa: F401

    seen: dict = {}
    threading.Thread(target=_disk_watch, args=(args.offload_dir, args.reserve, seen), daemon=True).start()
    shape = {k: getattr(args, k) for k in TRAIN}
    cfg = llama_config(args.layers, **shape)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    per = 4 * (2 + STATES[args.optimizer])
    overhead = _rss.baseline()
    out = dict(params=n, layers=args.layers, param_bytes=4 * n, pgs_bytes=per * n, budget=args.train_budget,
               overhead_rss=overhead, seq=args.seq, commit=args.commit, cold=bool(args.cold),
               step_in_backward=bool(args.step_in_backward), free_disk_before=disk_free(args.offload_dir))
    out["bandwidth"] = _dd_write(args.offload_dir)
    log(f"worker: disk direct write/read {out['bandwidth']}")
    opts = {"offload": "nvme", "offload_dir": args.offload_dir, "budget": args.train_budget}
    log(f"worker: {n / 1e9:.2f} B parameters, p+g+states {per * n / GB:.1f} GB; materializing")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    zinf_compile.materialize(model, opts)
    out["materialize_s"] = time.perf_counter() - t0
    out["materialize_peak_over_overhead"] = _rss.hwm() - overhead
    out["o_direct"] = bool(_harness.engines_direct())
    log(f"worker: materialized in {out['materialize_s']:.1f} s, VmHWM +{out['materialize_peak_over_overhead'] / MiB:.0f} "
        f"MiB, O_DIRECT swap files: {out['o_direct']}")
    _rss.trim()
    _rss.reset_hwm()  # from here: the steps' own peak (the compiles included)
    compiled = torch.compile(model.train(), backend="zinf", options=opts)
    opt, out["optimizer"] = _make_optimizer(model, args)
    ids = _ids(cfg.vocab_size, args.seq, args.seed)
    out["losses"], out["step_s"], out["moved"] = [], [], []
    for step in range(args.steps):
        if args.cold:
            _harness.drop_caches()
        before = _harness.engine_bytes()
        t0 = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["step_s"].append(time.perf_counter() - t0)
        out["losses"].append(float(loss.detach()))
        out["moved"].append({k: v - before[k] for k, v in _harness.engine_bytes().items()})
        out.setdefault("swap_bytes_after_step", []).append(_harness.disk_usage(args.offload_dir))
        log(f"worker: step {step + 1}: loss {out['losses'][-1]:.4f}, {out['step_s'][-1]:.1f} s, read "
            f"{out['moved'][-1]['read'] / GB:.1f} GB, written {out['moved'][-1]['written'] / GB:.1f} GB, free disk "
            f"{disk_free(args.offload_dir) / GB:.1f} GB (least {seen.get('min_free', 0) / GB:.1f}), zinf's "
            f"files {out['swap_bytes_after_step'][-1] / GB:.1f} GB")
    out["steps_peak_over_overhead"] = _rss.hwm() - overhead
    out["peak_over_overhead"] = max(out["steps_peak_over_overhead"], out["materialize_peak_over_overhead"])
    out["min_free_disk"] = seen.get("min_free")
    # the drop in free space over the run (other users of the disk included)
    out["free_disk_drop"] = out["free_disk_before"] - out["min_free_disk"] if out["min_free_disk"] else None
    out["plans"] = [dict(graphs=p.graphs, budget=p.budget, peak_before=p.peak_before, peak_after=p.peak_after,
                         lower_bound=p.lower_bound, tiles=len(p.tiles)) for p in zinf_compile.last_plans()]
    out["matmul_flops"] = _matmul_rate(args.threads)
    return out


WORKERS = {"infer": infer_worker, "recipe": recipe_worker, "train": train_worker}


def _spawn(kind: str, args, extra: list[str], offload: str) -> dict:
    """Run worker `kind` in a fresh process (output to ours), its swap folder `offload`; its result."""
    os.makedirs(offload, exist_ok=True)
    result = os.path.join(os.path.dirname(offload), f"{kind}-result.json")
    cmd = [sys.executable, "-m", "bench.scale", "--worker", kind, "--offload-dir", offload, "--result", result,
           "--threads", str(args.threads), "--seq", str(args.seq), "--seed", str(args.seed), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_harness.env(args.threads), timeout=args.timeout)
    wall = time.perf_counter() - t0
    shutil.rmtree(offload, ignore_errors=True)
    if proc.returncode or not os.path.exists(result):
        raise RuntimeError(f"worker {kind} failed (exit {proc.returncode})")
    with open(result) as f:
        res = json.load(f)
    os.remove(result)
    res["process_wall_s"] = wall
    return res


# -- the parent -----------------------------------------------------------------------------------------

def part_infer(args, mem: int) -> dict:
    shape = dict(INFER, **json.loads(args.infer_shape or "{}"))
    target = args.infer_ratio * mem
    layers = layers_for(math.ceil(target / 4), shape)
    cfg = llama_config(layers, **shape)
    weights = 4 * n_params(layers, shape)
    big = os.path.join(args.dir, "ckpt")
    reusable = args.reuse and os.path.exists(os.path.join(big, WRITTEN)) and tf_config_matches(big, cfg)
    need = (0 if reusable else weights) + args.reserve
    free = disk_free(args.dir)
    log(f"infer: {layers} layers, {weights / GB:.1f} GB of fp32 weights = {weights / mem:.2f}x RAM "
        f"({mem / GB:.1f} GB); free disk {free / GB:.1f} GB")
    rec = dict(config=dict(shape, layers=layers), weights=weights, weights_vs_ram=weights / mem,
               budget=args.budget, free_disk_before=free)
    if need > free:
        rec["error"] = f"does not fit: {weights / GB:.1f} GB + reserve {args.reserve / GB:.0f} GB > free {free / GB:.1f} GB"
        log("infer: " + rec["error"])
        return rec
    small = os.path.join(args.dir, "small")
    try:
        log("infer: the recipe at a small size (from_pretrained against the streamed reference and zinf)")
        write_checkpoint(small, llama_config(**SMALL), seed=args.seed, shard_bytes=2 * MiB)
        rec["recipe_check"] = _spawn("recipe", args, ["--ckpt", small], os.path.join(args.dir, "swap-recipe"))
        rec["recipe_check"]["config"] = SMALL
        log(f"infer: recipe check {rec['recipe_check']}")
        if reusable:
            with open(os.path.join(big, WRITTEN)) as f:
                rec["write"] = dict(json.load(f), reused=True)
            log(f"infer: reusing the checkpoint in {big} ({rec['write']})")
        else:
            log(f"infer: writing the checkpoint to {big}")
            rec["write"] = write_checkpoint(big, cfg, seed=args.seed, shard_bytes=args.shard_bytes)
            log(f"infer: written {rec['write']}")
        if not _harness.drop_caches():
            raise SystemExit("bench scale drops the page cache (cold forwards): run as root")
        extra = ["--ckpt", big, "--budget", args.budget, "--forwards", str(args.forwards),
                 "--reference", str(int(args.reference))]
        run = _spawn("infer", args, extra, os.path.join(args.dir, "swap-infer"))
        rec.update(run)
        rec["checks"] = _infer_checks(rec)
    finally:
        shutil.rmtree(small, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(big, ignore_errors=True)
    return rec


def _infer_checks(r: dict) -> dict:
    from zinf_compile.units import parse_bytes

    budget = parse_bytes(r["budget"])
    c = dict(weights_at_least_1_5x_ram=r["weights_vs_ram"] >= 1.5, logits_finite=r["logits_finite"],
             peak_over_overhead_vs_budget=r["peak_over_overhead"] / budget,  # the compile included
             peak_within_budget_plus_overhead=r["peak_over_overhead"] <= budget)
    if "forwards_peak_over_overhead" in r:
        c["forwards_peak_over_overhead_vs_budget"] = r["forwards_peak_over_overhead"] / budget
    if "max_abs_diff_vs_reference" in r:
        c["logits_match_streamed_reference"] = r["max_abs_diff_vs_reference"] <= 1e-3 * max(1.0, r["reference_absmax"])
    rc = r.get("recipe_check")
    if rc:
        tol = 1e-4 * max(1.0, rc["absmax"])
        c["recipe_reference_matches_from_pretrained"] = rc["reference_vs_from_pretrained"] <= tol
        c["recipe_zinf_matches_from_pretrained"] = rc["zinf_vs_from_pretrained"] <= tol
    dd = r.get("dd_direct", {})
    if dd.get("Bps"):
        c["cold_forward_vs_weights_at_dd_rate"] = min(r["cold_forward_s"]) / (r["weights"] / dd["Bps"])
    return c


def part_train(args, mem: int) -> dict:
    shape = dict(TRAIN, **json.loads(args.train_shape or "{}"))
    free = disk_free(args.dir)
    usable = free - args.reserve - args.margin
    k = STATES[args.optimizer]
    per = 4 * (2 + k)  # bytes per parameter: parameter, gradient, states (fp32)
    disk, pgs = DISK_PER_PARAM[args.optimizer]
    # commit="param": the largest parameter's spare records (weight + its states), fp32
    spare = (1 + k) * 4 * shape["hidden"] * max(shape["vocab"], shape["intermediate"], shape["hidden"])
    if args.commit == "param":
        largest = usable - spare  # parameters + gradients + states, and one parameter's spares
        why = (f"{args.optimizer}, committed per parameter: the disk holds parameters + gradients + states "
               "and the largest parameter's spare records (weight and states)")
    else:
        largest = usable * pgs / disk  # parameters + gradients + states the disk can hold at the step's peak
        why = (f"{args.optimizer}, all or nothing per step: the disk holds {disk} shard-sizes per {pgs} counted "
               "(SGD+momentum 5/3, AdamW 7/4, plain SGD 3/2)")
    target = args.train_ratio * mem
    rec = dict(ram=mem, free_disk=free, reserve=args.reserve, margin=args.margin, usable_disk=usable,
               target_pgs_bytes=target, largest_pgs_bytes_that_fits=largest, commit=args.commit,
               train_ratio=args.train_ratio, optimizer_name=args.optimizer,
               disk_over_pgs=f"{disk}/{pgs}" if args.commit == "step" else f"1 + {spare} bytes", optimizer_why=why)
    rec["target_fits"] = target <= largest
    for name, (d, p) in DISK_PER_PARAM.items():
        rec[f"disk_needed_for_target_{name}_commit_step"] = target * d / p
    rec[f"disk_needed_for_target_{args.optimizer}_commit_param"] = target + spare
    goal = target if rec["target_fits"] else largest
    layers = layers_for(math.floor(goal / per), shape)
    while not rec["target_fits"] and layers > 1 and per * n_params(layers, shape) > goal:
        layers -= 1
    n = n_params(layers, shape)
    peak = per * n + spare if args.commit == "param" else per * n * disk // pgs
    rec.update(config=dict(shape, layers=layers), params=n, pgs_bytes=per * n, pgs_vs_ram=per * n / mem,
               disk_peak_predicted=peak)
    need = target + spare if args.commit == "param" else target * disk / pgs
    log(f"train: RAM {mem / GB:.1f} GB; {target / GB:.1f} GB of p+g+s wanted ({args.train_ratio}x RAM) needs "
        f"{need / GB:.1f} GB of disk with {args.optimizer}, commit={args.commit}; free {free / GB:.1f} GB - reserve "
        f"{args.reserve / GB:.0f} - margin {args.margin / GB:.0f} = {usable / GB:.1f} GB usable: "
        f"{'fits' if rec['target_fits'] else 'does NOT fit'}; largest that fits {largest / GB:.1f} GB")
    log(f"train: running {layers} layers, {n / 1e9:.2f} B params, p+g+s {per * n / GB:.1f} GB "
        f"= {per * n / mem:.2f}x RAM, disk at the peak ~{peak / GB:.1f} GB")
    extra = ["--layers", str(layers), "--train-budget", args.train_budget, "--lr", str(args.lr), "--commit", args.commit,
             "--steps", str(args.steps), "--reserve", str(args.reserve), "--optimizer", args.optimizer,
             "--cold", str(int(args.cold)), "--step-in-backward", str(int(args.step_in_backward))]
    extra += [a for k in TRAIN for a in (f"--{k.replace('_', '-')}", str(shape[k]))]
    run = _spawn("train", args, extra, os.path.join(args.dir, "swap-train"))
    rec.update(run)
    rec["io"] = _train_io(rec)
    rec["checks"] = _train_checks(rec)
    return rec


def _train_io(r: dict) -> dict:
    """The steps after the first (which compiles) against their I/O bound: bytes read / the disk's
    direct read bandwidth + bytes written / its direct write bandwidth (one disk serves both), or
    the compute if larger: estimated as 6 x parameters x tokens FLOPs (forward and backward) at the
    rate of a 2048^3 matmul measured in the worker. Also the strictest bound, reads and writes
    overlapped on the device (each at its own rate, the slower side decides)."""
    bw = r.get("bandwidth", {})
    rd, wr = bw.get("read", {}).get("Bps"), bw.get("write", {}).get("Bps")
    later = list(range(1, len(r["step_s"])))
    if not (rd and wr and later):
        return dict(error="no bandwidth measured, or one step only")
    read = statistics.median(r["moved"][i]["read"] for i in later)
    written = statistics.median(r["moved"][i]["written"] for i in later)
    io = read / rd + written / wr
    compute = 6 * r["params"] * r["seq"] / r["matmul_flops"]
    step = statistics.median(r["step_s"][i] for i in later)
    bound = max(io, compute)
    # the strictest: a device that serves reads and writes at once, each at its own full rate
    overlapped = max(read / rd, written / wr, compute)
    mixed = bw.get("mixed", {}).get("Bps")
    extra = dict(mixed_Bps=mixed, mixed_bound_s=max((read + written) / mixed, compute),
                 step_vs_mixed_bound=step / max((read + written) / mixed, compute)) if mixed else {}
    return dict(read_per_step=read, written_per_step=written, moved_per_step=read + written, read_Bps=rd,
                write_Bps=wr, io_s=io, compute_estimate_s=compute, bound_s=bound, step_s=step,
                step_vs_bound=step / bound, moved_Bps=(read + written) / step,
                overlapped_bound_s=overlapped, step_vs_overlapped_bound=step / overlapped, **extra)


def _train_checks(r: dict) -> dict:
    """The losses: finite, decreasing on the one batch, and the first as a random initialisation
    predicts. HF initialises every linear weight N(0, 0.02) and the final norm to 1, so the head
    sees unit-RMS features and the logits are ~N(0, s^2) with s = 0.02 sqrt(hidden); then the cross
    entropy is about ln(vocab) + s^2 / 2 (E[logsumexp] of V such logits; the label's logit is 0 on
    average): 11.39 for hidden 5120 and vocab 32000."""
    ls, cfg = r["losses"], r["config"]
    expect = math.log(cfg["vocab"]) + (0.02 ** 2 * cfg["hidden"]) / 2
    c = dict(pgs_exceeds_ram=r["pgs_vs_ram"] > 1, pgs_at_least_ratio_x_ram=r["pgs_vs_ram"] >= r["train_ratio"],
             losses_finite=all(map(math.isfinite, ls)), first_loss_expected=expect,
             first_loss_near_expected=abs(ls[0] - expect) < 0.5, loss_decreases=ls[-1] < ls[0])
    if "step_vs_bound" in r.get("io", {}):
        c["step_vs_io_bound"] = r["io"]["step_vs_bound"]
        c["step_within_1_3x_bound"] = r["io"]["step_vs_bound"] <= 1.3
    return c


def parent(args) -> int:
    mem = args.mem or mem_total()
    os.makedirs(args.dir, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    from bench.params import _machine

    record = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=_machine(), ram=mem,
                  args={k: v for k, v in vars(args).items() if k not in ("worker", "result")})
    out_file = os.path.join(args.out, "scale.json")
    if os.path.exists(out_file):  # a part run alone keeps the other's last record
        with open(out_file) as f:
            old = json.load(f)
        record.update({p: old[p] for p in ("infer", "train") if p in old and p not in parts})
    try:
        for p in parts:
            try:
                record[p] = {"infer": part_infer, "train": part_train}[p](args, mem)
            except Exception as err:  # recorded, and the other part still runs
                log(f"{p}: failed: {err}")
                record[p] = dict(error=f"{type(err).__name__}: {err}")
            os.makedirs(args.out, exist_ok=True)
            with open(out_file, "w") as f:
                json.dump(record, f, indent=1)
            log(f"{p}: recorded in {out_file}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps({p: record[p].get("checks", record[p].get("error")) for p in parts}, indent=1))
    return 0 if all(all(v for v in record[p].get("checks", {"error": False}).values() if isinstance(v, bool))
                    for p in parts) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="infer,train")
    ap.add_argument("--dir", default="/var/tmp/zinf-scale", help="checkpoint and swap files (deleted at the end)")
    ap.add_argument("--mem", type=float, default=0, help="RAM in bytes (default: MemTotal)")
    ap.add_argument("--infer-ratio", type=float, default=1.5)
    ap.add_argument("--train-ratio", type=float, default=2.5)
    ap.add_argument("--budget", default="3GiB")
    ap.add_argument("--train-budget", default="3GiB")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--forwards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--commit", choices=("param", "step"), default="param",
                    help="the NVMe optimizer's commit: per parameter (one spare record on disk) or per step")
    ap.add_argument("--optimizer", choices=("sgd_momentum", "adamw"), default="sgd_momentum")
    ap.add_argument("--cold", type=int, default=0, help="drop the page cache before each training step (root)")
    ap.add_argument("--step-in-backward", type=int, default=0, help="zinf's optimizer stepping in the backward")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reserve", type=float, default=12 * GB, help="free disk never to go below (bytes)")
    ap.add_argument("--margin", type=float, default=4 * GB, help="more disk kept free when sizing training")
    ap.add_argument("--shard-bytes", type=float, default=4 * GB)
    ap.add_argument("--reference", type=int, default=1, help="run the streamed eager reference (1) or not (0)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (and --reuse it next time)")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--infer-shape", default="", help='JSON overrides of the inference model\'s shape, e.g. {"hidden": 512}')
    ap.add_argument("--train-shape", default="", help="JSON overrides of the trained model's shape")
    ap.add_argument("--timeout", type=int, default=6 * 3600)
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    # worker options
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--offload-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    for k, v in TRAIN.items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=v, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.reserve, args.margin, args.shard_bytes = int(args.reserve), int(args.margin), int(args.shard_bytes)
    if args.worker:
        res = WORKERS[args.worker](args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
