"""Peak memory of loading a Llama checkpoint, for tests/test_loading.py (and by hand, larger):

    python tests/workers/load_rss.py save DIR [LAYERS HIDDEN VOCAB]   # save_pretrained, sharded
    python tests/workers/load_rss.py zinf DIR OFFLOAD_DIR             # meta + zinf_compile.load_pretrained
    python tests/workers/load_rss.py hf DIR                           # transformers' from_pretrained

Each load prints one JSON line: the checkpoint's bytes, the growth of VmHWM over the RSS before the
load while it loads and then reads every parameter once (a checksum: the float64 sum of each, one at
a time, a managed one gathered from its shard), and that checksum, to compare the two loads by.
Imports, and zinf's meta-device model, come before the baseline: only the load's memory counts.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from bench import _rss  # noqa: E402


def config(layers: int = 12, hidden: int = 512, vocab: int = 4096) -> "tf.LlamaConfig":
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    return cfg


def checksum(model) -> float:
    total = 0.0
    for p in model.parameters():
        total += float(p.detach().sum(dtype=torch.float64))  # a managed parameter is gathered for this read
    return total


def measure(load) -> dict:
    _rss.trim()
    base = _rss.rss()
    _rss.reset_hwm()
    model = load()
    total = checksum(model)
    growth = _rss.hwm() - base
    return {"growth": growth, "checksum": total, "params": sum(p.numel() for p in model.parameters())}


def main(mode: str, path: str, *rest: str) -> None:
    torch.set_num_threads(1)
    if mode == "save":
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(config(*map(int, rest)))
        model.save_pretrained(path, max_shard_size="40MB")
        return
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    cfg = tf.AutoConfig.from_pretrained(path)
    if mode == "zinf":
        import zinf_compile
        import zinf_compile.backend  # noqa: F401  (imports count before the load, not in it)

        with torch.device("meta"):
            model = tf.LlamaForCausalLM(cfg)

        def load():
            return zinf_compile.load_pretrained(model, path, options={"offload": "nvme", "offload_dir": rest[0]})
    else:
        def load():
            return tf.LlamaForCausalLM.from_pretrained(path)
    out = measure(load)
    print(json.dumps(dict(out, checkpoint_bytes=nbytes)))


if __name__ == "__main__":
    main(*sys.argv[1:])
