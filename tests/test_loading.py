"""Models built on the meta device: `zinf_compile.load_pretrained` (HF safetensors, single and sharded,
straight into shards) and `zinf_compile.materialize` (the eager initialisation replayed into shards).

A small HF Llama (tests/hf_models.py, hidden 128) saved with save_pretrained: rebuilt on meta and
loaded, its logits equal from_pretrained's bit for bit; a compile keeps the loaded parameters
managed. Peak memory of a load is measured in a subprocess (tests/workers/load_rss.py) on a larger
Llama, against from_pretrained's in the same way. A Llama initialised on meta starts bit-identical to
one built eagerly with the same seed and trains like it (zinf against Inductor, bit for bit).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zinf_compile
from zinf_compile.errors import ZinfError
from zinf_compile.planner import PERSIST_BYTES
from zinf_compile.runtime.state import STORE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import hf_models  # noqa: E402


def _llama_config(tied: bool = False, inter: int = hf_models.INTER):
    cfg = hf_models.hf_config("llama")
    cfg.tie_word_embeddings = tied
    cfg.intermediate_size = inter
    return cfg


def _meta_llama(cfg, how: str = "device"):
    import transformers as tf

    return _on_meta(tf.LlamaForCausalLM, cfg, how)


def _on_meta(cls, cfg, how: str = "device"):
    """`cls(cfg)` built on the meta device: under `torch.device("meta")` or accelerate's
    init_empty_weights (`how="accelerate"`, buffers stay real)."""
    if how == "device":
        with torch.device("meta"):
            return cls(cfg)
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls(cfg)


def _eager_and_meta(cls, cfg, seed: int, how: str = "device"):
    """The same model built eagerly and on meta, each right after manual_seed(seed): materialize
    replays the eager draws, so the two must end equal."""
    torch.manual_seed(seed)
    eager = cls(cfg)
    torch.manual_seed(seed)
    return eager, _on_meta(cls, cfg, how)


def _opts(offload_root: str, sub: str) -> dict:
    return {"offload": "nvme", "offload_dir": os.path.join(offload_root, sub)}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Llama saved as several safetensors shards with their index."""
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    hf_models.hf_model("llama", seed=0).save_pretrained(path, max_shard_size="300KB")
    return str(path)


def _no_meta(model) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"still on meta: {left}"


def test_sharded_checkpoint_loads_into_shards(sharded, offload_root):
    import transformers as tf

    files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    model = _meta_llama(_llama_config(), "device")  # buffers on meta too (the rotary inv_freq)
    assert zinf_compile.load_pretrained(model, sharded, options=_opts(offload_root, "sharded")) is model
    _no_meta(model)
    for name, p in model.named_parameters():
        big = p.numel() * p.element_size() >= PERSIST_BYTES
        assert STORE.is_managed(p) == big, name
        if big:
            assert p.untyped_storage().nbytes() == 0, name  # nothing of it in memory
    ref = tf.LlamaForCausalLM.from_pretrained(sharded)
    ids = hf_models.hf_batch("llama")["input_ids"]
    assert torch.equal(_logits(model.eval(), ids), _logits(ref.eval(), ids))
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


def test_tied_single_file_in_bf16(tmp_path, offload_root):
    """One model.safetensors in bfloat16, lm_head tied to the embedding (saved once): loaded into an
    fp32 model built with accelerate's init_empty_weights, as from_pretrained converts it."""
    import transformers as tf

    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(_llama_config(tied=True)).to(torch.bfloat16)
    ref.save_pretrained(tmp_path)
    assert os.listdir(tmp_path).count("model.safetensors") == 1
    with open(tmp_path / "model.safetensors", "rb") as f:
        assert b"lm_head.weight" not in f.read(int.from_bytes(f.read(8), "little"))
    model = _meta_llama(_llama_config(tied=True), "accelerate")
    zinf_compile.load_pretrained(model, tmp_path, options=_opts(offload_root, "tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight and STORE.is_managed(model.lm_head.weight)
    assert model.lm_head.weight.dtype == torch.float32
    expect = tf.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = hf_models.hf_batch("llama")["input_ids"]
    assert torch.equal(_logits(model.eval(), ids), _logits(expect.eval(), ids))


def test_a_compile_keeps_loaded_parameters_managed(sharded, offload_root):
    """Loaded shards meet the backend as managed parameters (the planner's `forced`): a budget that
    would keep every parameter resident (params="auto", 100% of the unplanned peak) leaves them
    managed, and the compiled logits match the eager ones."""
    model = _meta_llama(_llama_config(), "device")
    opts = _opts(offload_root, "compiled")
    zinf_compile.load_pretrained(model, sharded, options=opts)
    managed = {n for n, p in model.named_parameters() if STORE.is_managed(p)}
    ids = hf_models.hf_batch("llama")["input_ids"]
    eager = _logits(model.eval(), ids)
    compiled = torch.compile(model, backend="zinf", options={**opts, "budget": "100%"})
    out = _logits(compiled, ids)
    assert {n for n, p in model.named_parameters() if STORE.is_managed(p)} == managed
    assert STORE.stats["gathers"] >= len(managed)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


# -- clear errors, before anything is written -------------------------------------------------------

def _untouched(model) -> None:
    assert all(p.is_meta for p in model.parameters())


def test_missing_key_names_it(sharded, tmp_path, offload_root):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_models.hf_model("llama").state_dict().items()
             if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = _meta_llama(_llama_config())
    with pytest.raises(ZinfError, match=r"lacks 1 tensor.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        zinf_compile.load_pretrained(model, tmp_path, options=_opts(offload_root, "err"))
    _untouched(model)


def test_shape_mismatch_names_the_key(sharded, offload_root):
    model = _meta_llama(_llama_config(inter=384))
    with pytest.raises(ZinfError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight': \(256, 128\) in the "
                                        r"checkpoint, \(384, 128\) in the model"):
        zinf_compile.load_pretrained(model, sharded, options=_opts(offload_root, "err"))
    _untouched(model)


def test_missing_file_names_it(sharded, tmp_path, offload_root):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(sharded, copy)
    with open(copy / "model.safetensors.index.json") as f:
        gone = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(copy / gone)
    model = _meta_llama(_llama_config())
    with pytest.raises(ZinfError, match=f"checkpoint file .*{gone} does not exist"):
        zinf_compile.load_pretrained(model, copy, options=_opts(offload_root, "err"))
    _untouched(model)
    with pytest.raises(ZinfError, match=r"no checkpoint in .*empty: neither model\.safetensors nor"):
        os.mkdir(tmp_path / "empty")
        zinf_compile.load_pretrained(model, tmp_path / "empty")


@pytest.mark.parametrize("in_place", [False, True])
def test_truncated_file_names_it_before_anything_is_written(sharded, tmp_path, offload_root, in_place):
    """A shard cut short (a copy or a write that stopped): the header still lists every tensor, so
    only the file's size tells. The load names the file and the tensor past its end, and leaves the
    model on meta (read in place, it would otherwise fail at the first forward)."""
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(sharded, copy)
    with open(copy / "model.safetensors.index.json") as f:
        cut = sorted(set(json.load(f)["weight_map"].values()))[-1]
    size = os.path.getsize(copy / cut)
    os.truncate(copy / cut, size - 4)
    model = _meta_llama(_llama_config())
    with pytest.raises(ZinfError, match=rf"{cut} is truncated: it has {size - 4} bytes, tensor '.*' ends at byte {size}"):
        zinf_compile.load_pretrained(model, copy, options=_opts(offload_root, "err"), in_place=in_place)
    _untouched(model)


def test_damaged_header_names_the_tensor(tmp_path, offload_root):
    """A header whose byte range disagrees with the tensor's shape and dtype is refused, naming it."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4, 4)}, str(tmp_path / "x.safetensors"))
    raw = (tmp_path / "x.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = raw[8:8 + n].replace(b"[4,4]", b"[4,5]")
    (tmp_path / "x.safetensors").write_bytes(raw[:8] + head + raw[8 + n:])
    from zinf_compile.loading import Checkpoint

    with pytest.raises(ZinfError, match=r"tensor 'a' spans bytes 0\.\.64, but F32 \[4, 5\] takes 80"):
        Checkpoint(tmp_path / "x.safetensors")


# -- peak memory of a load ---------------------------------------------------------------------------

def _has_hwm() -> bool:
    try:
        with open("/proc/self/status") as f:
            return "VmHWM" in f.read() and os.path.exists("/proc/self/clear_refs")
    except OSError:
        return False


@pytest.mark.skipif(not _has_hwm(), reason="needs Linux's VmHWM and clear_refs (gVisor's /proc has neither)")
def test_load_peak_memory_is_a_fraction_of_the_model(tmp_path):
    """A 12-layer Llama (176 MB of fp32 weights in 40 MB shards): loading it into zinf's shards and
    reading every parameter once grows the peak RSS by under a quarter of the model (the largest
    tensor is 8 MiB); from_pretrained, measured the same way, by more than the whole model (so the
    meter sees a whole model when there is one). Both loads give the same values (checksums)."""
    worker = os.path.join(HERE, "workers", "load_rss.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(*args) -> dict:
        r = subprocess.run([sys.executable, worker, *map(str, args)], capture_output=True, text=True, env=env,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}

    ck = tmp_path / "ck"
    run("save", ck)
    ours = run("zinf", ck, tmp_path / "offload")
    theirs = run("hf", ck)
    size = ours["checkpoint_bytes"]
    assert size > 150e6 and ours["params"] * 4 <= size
    assert ours["checksum"] == theirs["checksum"]
    assert theirs["growth"] > size, theirs
    assert ours["growth"] < size / 4, ours


@pytest.mark.skipif(not _has_hwm(), reason="needs Linux's VmHWM and clear_refs (gVisor's /proc has neither)")
def test_materialize_peaks_at_one_copy_of_the_largest_parameter(tmp_path):
    """A 64 MiB fp32 embedding built on meta and initialised twice (written, read back, written
    again): materialize grows the peak RSS by about the embedding alone (its shard is written
    straight from its storage; main's padded copy before each write made it about twice, 2.08x
    measured), plus, under O_DIRECT, the engine's bounded bounce buffers (one chunk per I/O thread:
    a parameter's pages are not page-aligned); the CPU tier's shard is a second copy by design
    (3.0x before). The values equal an eager build's with the same seed on every path."""
    from zinf_compile.runtime.engine import CHUNK_BYTES

    worker = os.path.join(HERE, "workers", "materialize_rss.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, worker, str(tmp_path / "offload"), "64", "nvme", "direct", "cpu"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = {d["mode"]: d for d in map(json.loads, r.stdout.strip().splitlines())}
    assert sorted(got) == ["cpu", "direct", "nvme"] and all(d["equal"] for d in got.values()), got
    size = got["nvme"]["param_bytes"]
    assert size == 64 << 20
    assert got["nvme"]["growth"] < 1.4 * size, got
    assert got["direct"]["growth"] < 1.4 * size + got["direct"]["io_threads"] * CHUNK_BYTES, got
    assert got["cpu"]["growth"] < 2.4 * size, got


# -- initialising from scratch ------------------------------------------------------------------------

@pytest.mark.parametrize("name,how,tied", [("llama", "device", False), ("llama", "device", True),
                                           ("qwen2", "accelerate", False), ("t5", "accelerate", False),
                                           ("bart", "accelerate", False)])
def test_materialize_equals_eager_init(name, how, tied, offload_root):
    """The same random numbers as eager construction with the same seed, in the same places (a tied
    head drawn for and dropped, as eager tying drops it)."""
    cfg = hf_models.hf_config(name)
    if tied:
        cfg.tie_word_embeddings = True
    cls = type(hf_models.hf_model(name))
    eager, model = _eager_and_meta(cls, cfg, 7, how)
    zinf_compile.materialize(model, options=_opts(offload_root, "init"))
    _no_meta(model)
    assert sum(STORE.is_managed(p) for p in model.parameters()) >= 10
    want, got = eager.state_dict(), zinf_compile.full_state_dict(model)
    assert sorted(want) == sorted(got)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    after_materialize = torch.rand(())
    torch.manual_seed(7)
    cls(cfg)
    assert after_materialize == torch.rand(())  # as many random numbers drawn as eager construction draws
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_materialize_reads_a_reinitialised_shard_in_place(offload_root, monkeypatch):
    """A parameter initialised twice (the embedding: nn.Embedding's reset_parameters, then Llama's
    _init_weights) is read back from its NVMe shard straight into its own storage, never into a
    second full-size buffer, and the values still equal eager construction's."""
    import transformers as tf

    from zinf_compile.runtime.params import Entry

    fresh = []
    real = Entry.read_shard
    monkeypatch.setattr(Entry, "read_shard", lambda self, *a, **k: fresh.append(self.name) or real(self, *a, **k))
    eager, model = _eager_and_meta(tf.LlamaForCausalLM, _llama_config(), 7)
    zinf_compile.materialize(model, options=_opts(offload_root, "reread"))
    assert fresh == []
    assert STORE.is_managed(model.model.embed_tokens.weight)
    with torch.no_grad():
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(a.detach().clone(), b), name


def test_materialize_chooses_o_direct_from_what_it_shards(offload_root, monkeypatch):
    """materialize writes the swap files, so it makes their O_DIRECT choice (a file keeps its flags;
    no later compile can): with o_direct="auto", from the bytes of every parameter it shards, x4
    for their gradients and two optimizer states (grad mode on, trainable), against the free page
    cache. Facts saying they outgrow it: the shards are O_DIRECT files; one byte more room: not."""
    import fcntl

    from zinf_compile import backend

    import transformers as tf

    cfg = _llama_config()
    from zinf_compile.planner import direct_io as real

    for slack, want in ((-1, True), (0, False)):
        seen = []

        def facts(option, nbytes, room, slack=slack):
            seen.append(nbytes)
            return real(option, nbytes, nbytes + slack)
        monkeypatch.setattr(backend, "direct_io", facts)
        eager, model = _eager_and_meta(tf.LlamaForCausalLM, cfg, 7)
        big = sum(p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= PERSIST_BYTES)
        zinf_compile.materialize(model, options=_opts(offload_root, f"direct{slack}"))
        assert seen == [4 * big]
        e = STORE.entry(model.model.layers[0].mlp.up_proj.weight)
        assert e.engine.direct is want
        assert bool(fcntl.fcntl(e.fd, fcntl.F_GETFL) & os.O_DIRECT) is want
        got = zinf_compile.full_state_dict(model)  # read back through those files: eager's values
        assert [k for k, v in eager.state_dict().items() if not torch.equal(v, got[k])] == []


def test_materialize_refuses_a_parameter_nothing_initialises(offload_root):
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(256, 128))  # no reset_parameters: meta has no values

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(128, 256)
            self.scale = Scale()

    with torch.device("meta"):
        net = Net()
    with pytest.raises(ZinfError, match=r"no initialisation wrote parameter\(s\) 'scale\.w'"):
        zinf_compile.materialize(net, options=_opts(offload_root, "init"))
    assert net.scale.w.is_meta and type(net.scale.w) is torch.nn.Parameter


def test_meta_initialised_llama_trains_like_eager(offload_root):
    """Initialised on meta into NVMe shards and trained 3 AdamW steps with zinf (a budget that also
    offloads activations), against the eager-built model under Inductor: bit-identical losses and
    parameters (decisions.md, "Determinism in tests")."""
    import transformers as tf

    torch.use_deterministic_algorithms(True)
    try:
        batch = hf_models.hf_batch("llama")
        cfg = hf_models.hf_config("llama")
        ref, model = _eager_and_meta(tf.LlamaForCausalLM, cfg, 3)
        opts = {**_opts(offload_root, "train"), "budget": int(4.4 * (1 << 20))}
        zinf_compile.materialize(model, options=opts)
        ref_fn = torch.compile(ref, backend="inductor")
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        fn = torch.compile(model, backend="zinf", options=opts)
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
        losses = {"ref": [], "zinf": []}
        for _ in range(3):
            for key, f, o in (("ref", ref_fn, ref_opt), ("zinf", fn, opt)):
                loss = f(**batch).loss
                loss.backward()
                o.step()
                o.zero_grad()
                losses[key].append(loss.item())
        assert losses["zinf"] == losses["ref"], losses
        want, got = ref.state_dict(), zinf_compile.full_state_dict(model)
        assert [k for k in want if not torch.equal(want[k], got[k])] == []
        assert any(p.moves() for p in zinf_compile.last_plans())  # activations offloaded too
    finally:
        torch.use_deterministic_algorithms(False)
        zinf_compile.reset()


def test_in_place_reads_the_checkpoint_and_copies_it_on_training(sharded, tmp_path, offload_root):
    """in_place=True: the shards are the checkpoint's own bytes (no swap file written), logits equal
    from_pretrained's; a training step (eager, through runtime.access) moves each stepped shard to a
    swap file first, steps like torch's AdamW on from_pretrained's model, and leaves the checkpoint's
    files as they were."""
    import hashlib
    import shutil

    import transformers as tf

    copy = tmp_path / "ck"
    shutil.copytree(sharded, copy)

    def digest() -> str:
        h = hashlib.sha256()
        for f in sorted(os.listdir(copy)):
            h.update((copy / f).read_bytes())
        return h.hexdigest()

    before = digest()
    model = _meta_llama(_llama_config())
    zinf_compile.load_pretrained(model, copy, options=_opts(offload_root, "inplace"), in_place=True)
    entries = [STORE.entry(p) for p in model.parameters() if STORE.is_managed(p)]
    assert len(entries) == 16 and all(e.source and e.source.startswith(str(copy)) and not e.file_nos
                                      for e in entries)
    ref = tf.LlamaForCausalLM.from_pretrained(copy)
    batch = hf_models.hf_batch("llama")
    assert torch.equal(_logits(model.eval(), batch["input_ids"]), _logits(ref.eval(), batch["input_ids"]))

    model.train(), ref.train()
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(**batch).loss.backward()
        o.step()
        o.zero_grad()
    assert all(e.source is None and e.file_nos for e in entries)  # each moved to a swap file
    want, got = ref.state_dict(), zinf_compile.full_state_dict(model)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert digest() == before


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
def test_gather_dtype_after_load_reads_bf16_copies_of_the_checkpoint(sharded, tmp_path, offload_root, in_place):
    """load_pretrained with gather_dtype="bfloat16": the masters are the checkpoint's float32 values
    (in place: its own bytes, never written), the compiled forward gathers bfloat16 copies (made at
    the first gather in place) and equals from_pretrained's model with its managed weights rounded."""
    import hashlib
    import shutil

    import transformers as tf

    copy = tmp_path / "ck"
    shutil.copytree(sharded, copy)
    before = hashlib.sha256(b"".join((copy / f).read_bytes() for f in sorted(os.listdir(copy)))).hexdigest()
    opts = dict(_opts(offload_root, "gather-bf16"), gather_dtype="bfloat16", params="offload")
    model = _meta_llama(_llama_config())
    zinf_compile.load_pretrained(model, copy, options=opts, in_place=in_place)
    managed = [p for p in model.parameters() if STORE.is_managed(p)]
    assert len(managed) == 16 and all(STORE.entry(p).gather_dtype == torch.bfloat16 for p in managed)
    assert all(bool(STORE.entry(p).source) == in_place for p in managed)
    ref = tf.LlamaForCausalLM.from_pretrained(copy).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.numel() * p.element_size() >= 64 << 10:
                p.copy_(p.to(torch.bfloat16).float())
    ids = hf_models.hf_batch("llama")["input_ids"]
    got = _logits(torch.compile(model.eval(), backend="zinf", options=opts), ids)
    torch.testing.assert_close(got, _logits(ref, ids), rtol=1e-5, atol=1e-5)
    assert all(STORE.entry(p).copy_ok for p in managed)
    masters = zinf_compile.full_state_dict(model)
    want = tf.LlamaForCausalLM.from_pretrained(copy).state_dict()
    assert [k for k in want if not torch.equal(want[k], masters[k])] == []  # float32, not rounded
    assert hashlib.sha256(b"".join((copy / f).read_bytes() for f in sorted(os.listdir(copy)))).hexdigest() == before
    zinf_compile.reset()


def test_resident_option_materializes_in_memory(sharded):
    """options={"params": "resident"}: no shard at all, every tensor real, the same values."""
    import transformers as tf

    model = _meta_llama(_llama_config())
    zinf_compile.load_pretrained(model, sharded, options={"params": "resident"})
    _no_meta(model)
    assert not any(STORE.is_managed(p) for p in model.parameters())
    want = tf.LlamaForCausalLM.from_pretrained(sharded).state_dict()
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    cfg = hf_models.hf_config("llama")
    eager, fresh = _eager_and_meta(tf.LlamaForCausalLM, cfg, 5)
    zinf_compile.materialize(fresh, options={"params": "resident"})
    assert not any(STORE.is_managed(p) for p in fresh.parameters())
    assert all(torch.equal(eager.state_dict()[k], v) for k, v in fresh.state_dict().items())


# -- checkpoints read in place: the file must stay the one loaded (SourceFile, engine.py) ----------

def _in_place(sharded, tmp_path, offload_root, sub: str, verify: str = "first-read"):
    """A copy of the sharded Llama's checkpoint, loaded in place into a model built on meta."""
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(sharded, copy)
    model = _meta_llama(_llama_config())
    more = {} if verify == "first-read" else {"verify": verify}  # the default, as most users load
    zinf_compile.load_pretrained(model, copy, options=_opts(offload_root, sub), in_place=True, **more)
    return model.eval(), copy


def _where(model, name: str) -> tuple[str, int, int]:
    """The file a parameter is read from in place, its first byte there and its length."""
    e = STORE.entry(dict(model.named_parameters())[name])
    assert e.source is not None
    return e.source, e.base, e.shard_nbytes


def _damage(path: str, how: str, lo: int, n: int) -> None:
    """Change a checkpoint file under a model reading it: one byte of [lo, lo+n) flipped, 4 KiB of
    it zeroed, the file cut in the middle of it, or all its tensors' bytes rewritten in place (the
    same size, header and inode); ", mtime kept" sets the mtime back after (what a failing disk, or
    a copy that keeps times, leaves: only the digests can tell)."""
    st = os.stat(path)
    if how.startswith("truncated"):
        os.truncate(path, lo + n // 2)
    else:
        with open(path, "r+b") as f:
            if how.startswith("flipped"):
                f.seek(lo + n // 2)
                byte = f.read(1)[0]
                f.seek(lo + n // 2)
                f.write(bytes([byte ^ 0x10]))
            elif how.startswith("zeroed"):
                f.seek(lo + n // 4)
                f.write(bytes(4096))
            else:
                head = 8 + int.from_bytes(f.read(8), "little")
                body = torch.randn((st.st_size - head) // 4, generator=torch.Generator().manual_seed(9))
                f.seek(head)
                f.write(body.numpy().tobytes())
    if how.endswith("mtime kept"):
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


HOWS = ["flipped", "zeroed", "truncated", "rewritten", "flipped, mtime kept", "zeroed, mtime kept",
        "rewritten, mtime kept"]


@pytest.mark.parametrize("how", HOWS)
def test_a_checkpoint_changed_under_an_in_place_model_is_an_error(sharded, tmp_path, offload_root, how):
    """A safetensors file read in place, changed after the model's first forward (reads, eager): the
    next forward raises SwapCorruptionError naming the file and a parameter read from it, and
    saying what to do; with the mtime set back, only the digests recorded at the first read can
    tell, and the error names the damaged weight. Untouched, and again once restored, the logits
    are those of the first forward."""
    from zinf_compile.errors import SwapCorruptionError

    model, _ = _in_place(sharded, tmp_path, offload_root, "changed")
    ids = hf_models.hf_batch("llama")["input_ids"]
    first = _logits(model, ids)
    assert torch.equal(_logits(model, ids), first)  # untouched: the same
    name = "model.layers.1.mlp.up_proj.weight"
    path, lo, n = _where(model, name)
    with open(path, "rb") as f:
        saved = f.read()
    st = os.stat(path)
    try:
        _damage(path, how, lo, n)
        with pytest.raises(SwapCorruptionError) as info:
            _logits(model, ids)
        msg = str(info.value)
        assert path in msg and "parameter '" in msg and "Restore or re-download the checkpoint" in msg, msg
        if how.endswith("mtime kept"):
            assert name in msg and "differ from what zinf read there first" in msg, msg
        else:
            assert ("truncated" if how == "truncated" else "mtime changed") in msg, msg
    finally:
        with open(path, "r+b") as f:
            f.write(saved)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert torch.equal(_logits(model, ids), first)
    zinf_compile.reset()


def test_verify_load_digests_the_checkpoint_before_its_first_read(sharded, tmp_path, offload_root):
    """verify="load" reads every in-place tensor once at load: a byte changed after the load and
    before any forward, mtime kept (what trust on first read would take as it is), is an error
    at the first forward; a bad value of verify is refused."""
    from zinf_compile.errors import SwapCorruptionError, ZinfConfigError

    with pytest.raises(ZinfConfigError, match="verify"):
        zinf_compile.load_pretrained(_meta_llama(_llama_config()), sharded, in_place=True, verify="always")
    model, _ = _in_place(sharded, tmp_path, offload_root, "verifyload", verify="load")
    name = "model.layers.0.self_attn.q_proj.weight"
    path, lo, n = _where(model, name)
    with open(path, "rb") as f:
        saved = f.read()
    _damage(path, "flipped, mtime kept", lo, n)
    with pytest.raises(SwapCorruptionError, match=r"differ from what zinf read there first") as info:
        _logits(model, hf_models.hf_batch("llama")["input_ids"])
    assert path in str(info.value) and name in str(info.value)
    st = os.stat(path)
    with open(path, "r+b") as f:  # restored: reset gives the parameters their data back
        f.write(saved)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    zinf_compile.reset()


def test_a_checkpoint_changed_between_two_loads_in_one_process(sharded, tmp_path, offload_root):
    """The same path loaded in place twice in one process. Rewritten in place while the first
    model still reads it: the second load refuses (they would share one descriptor and its digests),
    and the first model's next read raises. After reset, it loads the new bytes (no stale digest).
    Replaced (os.replace: a new file at the path) under a running model: the model keeps reading
    the file it loaded, still there; a new load reads the new file, or says it cannot, never the
    old file's values."""
    import gc

    import transformers as tf

    from zinf_compile.errors import SwapCorruptionError

    ids = hf_models.hf_batch("llama")["input_ids"]
    first, copy = _in_place(sharded, tmp_path, offload_root, "twice")
    versions = []
    for seed in (1, 2):
        other = tmp_path / f"v{seed}"
        hf_models.hf_model("llama", seed=seed).save_pretrained(other, max_shard_size="300KB")
        assert sorted(os.listdir(other)) == sorted(os.listdir(copy))
        versions.append((other, _logits(tf.LlamaForCausalLM.from_pretrained(other).eval(), ids)))
    files = [f for f in os.listdir(copy) if f.endswith(".safetensors")]

    (v1, want1), (v2, want2) = versions
    for f in files:  # rewritten in place: the same inodes
        with open(copy / f, "r+b") as out:
            out.write((v1 / f).read_bytes())
            out.truncate()
    with pytest.raises(ZinfError, match="changed since an earlier load_pretrained read it in place") as info:
        zinf_compile.load_pretrained(_meta_llama(_llama_config()), copy, options=_opts(offload_root, "twice"),
                                     in_place=True)
    assert str(copy) in str(info.value)
    with pytest.raises(SwapCorruptionError):
        _logits(first, ids)
    del first
    gc.collect()
    zinf_compile.reset()
    second = _meta_llama(_llama_config()).eval()
    zinf_compile.load_pretrained(second, copy, options=_opts(offload_root, "twice"), in_place=True)
    assert torch.equal(_logits(second, ids), want1)

    for f in files:  # replaced: new inodes at the paths
        os.replace(v2 / f, copy / f)
    assert torch.equal(_logits(second, ids), want1)  # the files it loaded, still open
    third = _meta_llama(_llama_config()).eval()  # a new load reads the new files (a new descriptor)
    zinf_compile.load_pretrained(third, copy, options=_opts(offload_root, "twice"), in_place=True)
    assert torch.equal(_logits(third, ids), want2)
    del second, third
    gc.collect()
    zinf_compile.reset()
