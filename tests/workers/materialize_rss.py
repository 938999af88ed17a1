"""Peak memory of materializing a model with one large parameter, for tests/test_loading.py:

    python tests/workers/materialize_rss.py OFFLOAD_DIR EMBED_MB MODE...

A MODE is "nvme" (buffered swap files), "direct" (O_DIRECT swap files) or "cpu" (the CPU tier).
The model, built on the meta device, is an embedding of EMBED_MB MiB of fp32 under a parent whose
own initialisation scales it again: the embedding is initialised twice (written to its shard, then
read back into its storage and written again), as HF models do with nn.Embedding's
reset_parameters and then _init_weights. For each mode, one JSON line: the embedding's bytes, the
growth of VmHWM over the RSS before `materialize` while it runs, the engine's io_threads, and
whether the float64 sum of the embedding read back from its shard equals an eager build's with the
same seed. Imports and the meta model come before the baseline: only materialize's memory counts.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bench import _rss  # noqa: E402


class Model(nn.Module):
    def __init__(self, rows: int, dim: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.scale = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # a parent's initialisation reaching a child's weight
        with torch.no_grad():
            self.scale.fill_(0.5)
            self.emb.weight.mul_(self.scale)


def main(offload_dir: str, embed_mb: str, *modes: str) -> None:
    import gc

    torch.set_num_threads(1)
    import zinf_compile
    import zinf_compile.backend  # noqa: F401  (imports count before the measurement, not in it)
    from zinf_compile.runtime.state import STORE

    rows = int(embed_mb) * (1 << 20) // (256 * 4)
    torch.manual_seed(0)
    want = float(Model(rows).emb.weight.detach().sum(dtype=torch.float64))
    for mode in modes:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Model(rows)
        options = {"offload": "cpu" if mode == "cpu" else "nvme", "offload_dir": os.path.join(offload_dir, mode),
                   "o_direct": mode == "direct"}
        _rss.trim()
        base = _rss.rss()
        _rss.reset_hwm()
        zinf_compile.materialize(model, options=options)
        growth = _rss.hwm() - base
        w = model.emb.weight
        e = STORE.entry(w)
        assert e is not None and w.untyped_storage().nbytes() == 0, "the embedding is not in its shard"
        assert e.engine.direct == (mode == "direct"), (mode, e.engine.direct)
        got = float(w.detach().sum(dtype=torch.float64))
        print(json.dumps({"mode": mode, "param_bytes": w.numel() * w.element_size(), "growth": growth,
                          "io_threads": e.engine.io_threads, "equal": got == want}), flush=True)
        del model, w, e
        gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:])
