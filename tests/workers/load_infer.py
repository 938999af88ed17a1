"""Inference of a Llama whose fp32 weights exceed what the process ever holds (not in CI: minutes, GBs
of disk). Measured by hand, numbers in docs/decisions.md:

    python tests/workers/load_infer.py make DIR [LAYERS HIDDEN VOCAB]   # a random checkpoint, tensor by tensor
    python tests/workers/load_infer.py run DIR OFFLOAD_DIR [BUDGET [in_place]]  # meta + load + zinf forwards

`make` writes sharded safetensors (with their index) without ever building the model: each tensor
is drawn, written and dropped. `run` builds the model on meta, loads it into NVMe shards and runs two
forwards compiled with zinf; it prints VmHWM growth over the RSS after imports at each stage.
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

SHARD = 512 << 20


def config(layers: int, hidden: int, vocab: int) -> "tf.LlamaConfig":
    return tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                          num_hidden_layers=layers, num_attention_heads=hidden // 128,
                          num_key_value_heads=hidden // 128, max_position_embeddings=512,
                          tie_word_embeddings=False, dtype=torch.float32)


def make(path: str, layers: str = "8", hidden: str = "2048", vocab: str = "32000") -> None:
    from safetensors.torch import save_file

    cfg = config(int(layers), int(hidden), int(vocab))
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    weight_map, part, size, n = {}, {}, 0, 0

    def flush():
        nonlocal part, size, n
        if part:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(part, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
            part, size = {}, 0

    for key, p in model.state_dict().items():
        t = torch.ones(p.shape) if key.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02
        part[key] = t
        size += t.numel() * 4
        if size >= SHARD:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(os.path.getsize(os.path.join(path, v))
                                                  for v in set(weight_map.values()))}, "weight_map": weight_map}, f)


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
