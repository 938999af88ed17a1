"""Managed parameters behave like torch parameters outside the graph (runtime/access.py): reading
them gives their value, writing them reaches the shards, eager code (the uncompiled model, a frame
Dynamo gave up on) computes with them and sends their gradients to the shards. Nothing crashes the
process, nothing is silently stale. One compiled MLP (both matrices managed, biases resident) and one
Hugging Face GPT-2 (tied embedding) are shared by the tests; two ranks run
tests/workers/dist_access.py. An HF Llama on both tiers and HF's Trainer: tests/test_access_hf.py."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import zinf_compile
from zinf_compile.runtime.access import ManagedMixin
from zinf_compile.runtime.state import STORE
from tests.hf_models import hf_batch, hf_model


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


def _value(p: torch.Tensor) -> torch.Tensor:
    e = STORE.entry(p)
    return STORE.full(e).clone() if e is not None else p.detach().clone()


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    zinf_compile.reset()
    model, ref = _mlp(), _mlp()
    cm = torch.compile(model, backend="zinf", options={
        "params": "offload", "offload": "nvme", "offload_dir": str(tmp_path_factory.mktemp("access"))})
    x = torch.randn(8, 128)
    cm(x).sum().backward()
    ref(x).sum().backward()
    assert all(STORE.is_managed(m.weight) for m in (model[0], model[2]))
    yield model, cm, ref, x
    zinf_compile.reset()


def test_managed_class_and_no_recompile(mlp):
    model, cm, ref, x = mlp
    w = model[0].weight
    assert isinstance(w, ManagedMixin) and isinstance(w, nn.Parameter)
    assert w.untyped_storage().nbytes() == 0  # still freed: the value lives in the shards
    cm(x).sum().backward()  # a fresh compile (the suite resets Dynamo per test) of managed parameters
    before = dict(torch._dynamo.utils.counters["stats"])
    cm(x).sum().backward()  # the class changed inside the backend call, before the guards were built
    assert dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs") == before.get("unique_graphs")
    assert isinstance(w, ManagedMixin)


def test_reads_give_the_value(mlp):
    model, _, ref, _ = mlp
    w, rw = model[0].weight, ref[0].weight
    assert torch.equal(w.norm(), rw.norm())
    assert torch.equal(w.detach(), rw.detach()) and torch.equal(w.data, rw.data)
    assert torch.equal(w[3], rw[3]) and torch.equal(w.t() @ torch.ones(256), rw.t() @ torch.ones(256))
    assert w.shape == rw.shape and w.dtype == rw.dtype and w.requires_grad
    assert "managed by zinf" in repr(w) and str(rw.detach()[0, 0].item())[:6] in repr(w)
    assert w.to("cpu") is w and w.float() is w and w.contiguous() is w  # no-op conversions: itself
    calls = []
    full = STORE.full
    try:
        STORE.full = lambda *a, **k: calls.append(a) or full(*a, **k)
        model.to("cpu")
        model.float()
        assert not calls  # Module.to of what it already is: nothing gathered (nor written back)
        w.sum()
        assert len(calls) == 1  # (the counter counts)
    finally:
        del STORE.full


def test_state_dict_save_load_deepcopy(mlp):
    model, _, ref, x = mlp
    sd = model.state_dict()
    want = ref.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in sd)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    buf = io.BytesIO()
    torch.save(model[0].weight, buf)  # a managed parameter pickled on its own: its value, a plain Parameter
    buf.seek(0)
    p = torch.load(buf, weights_only=False)
    assert type(p) is nn.Parameter and torch.equal(p, ref[0].weight)
    twin = copy.deepcopy(model)  # e.g. an EMA copy: plain parameters with the values
    assert type(twin[0].weight) is nn.Parameter and torch.equal(twin(x), ref(x))
    # load_state_dict mid-training refills the shards (no gather: copy_ of the whole value)
    doubled = {k: v.clone() * 2 for k, v in want.items()}
    model.load_state_dict(doubled)
    assert torch.equal(_value(model[0].weight), doubled["0.weight"])
    model.load_state_dict({k: v.clone() for k, v in want.items()})
    assert torch.equal(_value(model[2].weight), ref[2].weight.detach())


def test_writes_reach_the_shards(mlp):
    model, _, ref, _ = mlp
    w = model[2].weight
    keep = _value(w)
    with torch.no_grad():
        assert w.mul_(2) is w
        assert torch.equal(_value(w), keep * 2)
        w[0] = 7.0
        assert torch.equal(_value(w)[0], torch.full((256,), 7.0)) and torch.equal(_value(w)[1:], keep[1:] * 2)
        nn.init.zeros_(w)
        assert _value(w).abs().sum() == 0
        w.data = keep.clone()
    assert torch.equal(_value(w), keep)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.add_(1)  # as torch: no in-place on a leaf that takes gradients, with grad enabled
    with pytest.raises(zinf_compile.ZinfError, match="managed by zinf"):
        w.data = keep.double()


def test_eager_forward_computes_and_its_gradients_reach_the_shards(mlp):
    """The uncompiled model on managed parameters: the same output as eager, and the backward's
    gradient of each managed parameter lands in its shard (where zinf's optimizer reads it)."""
    model, _, ref, x = mlp
    for m in (model, ref):
        m.zero_grad()
    STORE.zero_grad()
    out = model(x)  # the module itself, not the compiled one
    want = ref(x)
    assert torch.equal(out, want)
    out.square().mean().backward()
    want.square().mean().backward()
    for mod, rmod in ((model[0], ref[0]), (model[2], ref[2])):
        e = STORE.entry(mod.weight)
        assert mod.weight.grad is None and torch.equal(e.read_grad()[: e.numel].view(e.shape), rmod.weight.grad)
        assert torch.equal(mod.bias.grad, rmod.bias.grad)


def test_dynamo_fallback_frame_runs_eagerly_on_managed_parameters(mlp):
    """Past the recompile limit Dynamo runs the frame eagerly: it must compute, not crash."""
    model, cm, ref, x = mlp
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False), torch.no_grad():
        cm(x)  # compiled (the suite resets Dynamo per test)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        y = torch.randn(5, 128)  # a new shape: over the limit, so Dynamo runs the frame eagerly
        assert torch.equal(cm(y), ref(y))  # eager's numbers exactly: it ran eagerly, on the managed values
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_hf_gpt2_state_dict_and_save_pretrained_round_trip(tmp_path):
    """GPT-2 (tied embedding) with its parameters managed: save_pretrained writes the values,
    from_pretrained reads them back into a plain model that computes the same loss."""
    zinf_compile.reset()
    model, ref = hf_model("gpt2"), hf_model("gpt2")
    batch = hf_batch("gpt2")
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "cpu"})
    cm(**batch).loss.backward()
    managed = [n for n, p in model.named_parameters() if STORE.is_managed(p)]
    assert "transformer.wte.weight" in managed
    sd, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    model.save_pretrained(tmp_path / "gpt2")
    import transformers as tf

    back = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    with torch.no_grad():
        assert torch.equal(back(**batch).loss, ref(**batch).loss)
    zinf_compile.reset()


def test_two_ranks_read_load_and_deepcopy(tmp_path, offload_root):
    """Over 2 gloo ranks (tests/workers/dist_access.py), every rank's reads gather the whole value:
    state_dict() and p.norm() on each rank equal zinf's own gather (full_state_dict) bit for bit and
    one process's training within tests/test_dist.py's bounds (the mean over ranks of two half-batch
    gradients rounds differently); load_state_dict writes each rank exactly its slice; the compiled
    step after it computes one process's loss on the loaded values; deepcopy works on every rank."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "access")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(root, "tests", "workers", "dist_access.py"), out, "nvme", os.path.join(offload_root, "access2")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(f"{out}.{r}.pt") for r in range(2)]
    sys.path.insert(0, os.path.join(root, "tests", "workers"))
    from dist_access import batch, loaded_state
    from dist_train import build

    x, y = batch()
    ref = build()  # one process, the whole batch, torch's AdamW
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    first = torch.nn.functional.mse_loss(ref(x), y)
    first.backward()
    opt.step()
    opt.zero_grad()
    want = {k: v.clone() for k, v in ref.state_dict().items()}  # the load below writes ref's tensors
    loaded = loaded_state()
    ref.load_state_dict(loaded)
    after_load = torch.nn.functional.mse_loss(ref(x), y)
    for got in ranks:
        assert got["world"] == 2 and got["managed"] == ["0.weight", "2.weight"]
        assert got["first"] == pytest.approx(first.item(), rel=1e-5)
        assert got["state"].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got["state"][k], ranks[0]["state"][k]) and torch.equal(got["state"][k], got["full"][k])
            torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-4, msg=k)
            assert torch.equal(got["norms"][k], got["state"][k].norm()), k
        for name, (shard, (lo, hi)) in got["shards"].items():
            flat = loaded[name].reshape(-1)
            valid = max(0, min(hi, flat.numel()) - lo)
            assert hi - lo == shard.numel() and torch.equal(shard[:valid], flat[lo:lo + valid]), name
        assert got["after_load"] == pytest.approx(after_load.item(), rel=1e-5)
        assert got["twin_plain"] and all(torch.equal(got["twin_state"][k], got["state_after"][k]) for k in want)
        twin = build()
        twin.load_state_dict(got["twin_state"])
        with torch.no_grad():
            assert torch.equal(got["twin_out"], twin(x))
    lo0, hi0 = ranks[0]["shards"]["0.weight"][1]
    lo1, _ = ranks[1]["shards"]["0.weight"][1]
    assert lo0 == 0 and hi0 == lo1  # each rank holds its own half
    for k in want:
        assert torch.equal(ranks[0]["twin_state"][k], ranks[1]["twin_state"][k])
