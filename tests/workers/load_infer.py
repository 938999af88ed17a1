"""Inference of a Llama whose fp32 weights exceed what the process ever holds (not in CI: minutes, GBs
of disk). Measured by hand, numbers in docs/decisions.md:

    python tests/workers/load_infer.py make DIR [LAYERS HIDDEN VOCAB]   # a random checkpoint, tensor by tensor
    python tests/workers/load_infer.py run DIR OFFLOAD_DIR [BUDGET [in_place]]  # meta + load + zinf forwards

`make` writes sharded safetensors (with their index) without ever building the model: each tensor
is drawn, written and dropped (bench/scale.py's writer, which `python -m bench scale` uses for
checkpoints larger than RAM). `run` builds the model on meta, loads it into NVMe shards (or in place)
and runs two forwards compiled with zinf; it prints VmHWM growth over the RSS after imports at each
stage. (bench scale measures the in-place load at scale; this one compares it with a load into swap
files at a size that fits.)
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from bench import _rss  # noqa: E402
from bench.scale import llama_config, write_checkpoint  # noqa: E402

SHARD = 512 << 20


def config(layers: int, hidden: int, vocab: int) -> "tf.LlamaConfig":
    return llama_config(layers, hidden, hidden * 11 // 4, hidden // 128, hidden // 128, vocab)


def make(path: str, layers: str = "8", hidden: str = "2048", vocab: str = "32000") -> None:
    write_checkpoint(path, config(int(layers), int(hidden), int(vocab)), shard_bytes=SHARD)


def run(path: str, offload_dir: str, budget: str = "20%", in_place: str = "") -> None:
    import zinf_compile
    import zinf_compile.backend  # noqa: F401

    torch.set_num_threads(2)
    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    weights = sum(p.numel() * 4 for p in model.parameters())
    _rss.trim()
    base = _rss.rss()
    _rss.reset_hwm()
    out = {"weights_bytes": weights, "base_rss": base, "in_place": bool(in_place)}
    opts = {"offload": "nvme", "offload_dir": offload_dir, "budget": budget}
    t0 = time.perf_counter()
    zinf_compile.load_pretrained(model, path, options=opts, in_place=bool(in_place))
    out["load_s"] = time.perf_counter() - t0
    out["load_growth"] = _rss.hwm() - base
    ids = torch.randint(0, cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model.eval(), backend="zinf", options=opts)
    for i in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = compiled(input_ids=ids).logits
        out[f"forward{i}_s"] = time.perf_counter() - t0
    out["growth"] = _rss.hwm() - base
    out["logits_finite"] = bool(torch.isfinite(logits).all())
    out["plans"] = [{"budget": p.budget, "peak_before": p.peak_before, "peak_after": p.peak_after}
                    for p in zinf_compile.last_plans()]
    print(json.dumps(out))


if __name__ == "__main__":
    {"make": make, "run": run}[sys.argv[1]](*sys.argv[2:])
