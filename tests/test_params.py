"""Partitioned parameters (ZeRO-3) end to end: gather/release/reduce nodes, the store, the tiers.

One model with a tied weight (embedding = output head), a frozen layer and a trained layer is
compiled once with every large parameter managed and once with Inductor alone; the tests read that
run. Gradients must be bit-identical: a gather moves bytes, it computes nothing.
"""
from __future__ import annotations

import os
import resource
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile
from zinf_compile.errors import BudgetError, ZinfError
from zinf_compile.passes.params import is_gather
from zinf_compile.passes.verifier import saved_whole_parameters
from zinf_compile.runtime.ops import reduce_grad
from zinf_compile.runtime.state import STORE

VOCAB, WIDTH = 128, 128  # 64 KiB matrices: managed (backend.PERSIST_BYTES); biases stay resident


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # one Parameter used twice

    def forward(self, idx, targets):
        h = F.gelu(self.frozen(self.emb(idx)))
        logits = self.head(self.fc(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g)


def grads_of(model):
    """name -> the whole gradient, from p.grad or from the store's shard."""
    out = {}
    for name, p in model.named_parameters():
        e = STORE.entry(p)
        g = e.read_grad() if e is not None else p.grad
        out[name] = None if g is None else g.reshape(-1)[: p.numel()].view(p.shape).clone()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, offload_root):
    """Two forward/backward passes (gradients accumulate) of the zinf and the reference model."""
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counts compiles of this module's models only
    zinf_compile.reset()
    ref, model = Tied(), Tied()
    cref = torch.compile(ref)
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "params")}
    cm = torch.compile(model, backend="zinf", options=opts)
    ref_losses, losses = [], []
    for seed in (1, 2):
        idx, tgt = batch(seed)
        for fn, out in ((cref, ref_losses), (cm, losses)):
            loss = fn(idx, tgt)
            loss.backward()
            out.append(loss.detach())
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    recs = [r for r in zinf_compile.compiles() if "backward" in r.plan.graphs]
    yield dict(ref=ref, model=model, cm=cm, ref_losses=ref_losses, losses=losses, rec=recs[-1],
               unique_graphs=frames)
    torch.use_deterministic_algorithms(False)


def test_losses_and_grads_bit_identical(run):
    for a, b in zip(run["ref_losses"], run["losses"]):
        assert torch.equal(a, b)
    ref_g, g = grads_of(run["ref"]), grads_of(run["model"])
    assert set(ref_g) == set(g)
    for name in ref_g:
        if ref_g[name] is None:
            assert g[name] is None, name
        else:
            assert torch.equal(ref_g[name], g[name]), name


def test_large_parameters_are_managed_and_freed(run):
    model = run["model"]
    managed = {n for n, p in model.named_parameters() if STORE.is_managed(p)}
    assert managed == {"emb.weight", "frozen.weight", "fc.weight"}  # head.weight is emb.weight
    for n, p in model.named_parameters():
        if n in managed:
            assert p.untyped_storage().nbytes() == 0, n
            assert p.grad is None, n  # the gradient lives in the shard
    assert STORE.entry(model.frozen.weight).has_grad is False  # frozen: no gradient at all
    assert model.fc.bias.grad is not None  # small parameters stay resident, autograd as usual


def test_no_recompile_after_taking_parameters_over(run):
    # the reference and the zinf model: one graph each, though zinf freed parameter storages
    assert run["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["recompiles"]


def test_plan_lists_parameter_actions(run):
    plan = run["rec"].plan
    names = {p.name for p in plan.params}
    assert names == {"emb.weight", "frozen.weight", "fc.weight"}
    counts = plan.action_counts()
    assert counts["gather"] == counts["release"]
    assert counts["reduce"] == 2  # emb/head (tied: one gradient) and fc; frozen has none
    assert counts["gather"] >= 3 + 1  # each in forward; fc/emb/frozen again where backward reads them
    # NVMe shards are fetched ahead of their gathers (the first gather of each graph has no room)
    assert counts.get("fetch", 0) >= 1
    assert STORE.stats["fetches"] >= counts["fetch"]
    for a in plan.actions:
        if a.kind == "release":
            gather_step = next(g.step for g in plan.actions if g.kind == "gather" and g.tensor == a.tensor)
            assert a.step >= gather_step


def test_gathers_stand_next_to_their_use_and_are_not_saved(run):
    graphs = run["rec"].graphs
    for role in ("forward", "backward"):
        g = graphs[role].graph
        nodes = list(g.nodes)
        for n in [n for n in g.nodes if is_gather(n)]:
            first_user = min(n.users, key=nodes.index)
            between = nodes[nodes.index(n) + 1:nodes.index(first_user)]
            # nothing heavy between a gather and its first use (only zinf ops or views may sit there)
            assert all(getattr(b.target, "namespace", "") == "zinf" or b.op != "call_function"
                       or getattr(b.target, "is_view", False) for b in between), \
                (role, n.name, [b.name for b in between])
    assert not saved_whole_parameters(graphs["forward"])
    reduces = list(graphs["backward"].graph.find_nodes(op="call_function", target=reduce_grad))
    assert len(reduces) == 2


def test_full_gathers_the_parameter_and_release_gives_it_back(run):
    ref, model = run["ref"], run["model"]
    with torch.no_grad():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            e = STORE.entry(p)
            if e is not None:
                assert torch.equal(STORE.full(e), q), n
    p = nn.Parameter(torch.randn(128, 128))
    before = p.detach().clone()
    STORE.manage(STORE.identify(p, "p"), "nvme", next(_engines()))
    assert p.untyped_storage().nbytes() == 0
    STORE.release(p)
    assert not STORE.is_managed(p) and torch.equal(p.detach(), before)


def _engines():
    from zinf_compile.runtime.state import RUNTIME

    return (e.key for e in RUNTIME.engines.values() if e.tier == "nvme")


def test_inference_graph_gathers_without_gradients(offload_root):
    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))  # noqa: E731
    ref = build()
    torch.manual_seed(0)
    model = build()
    x = torch.randn(8, 64)
    cm = torch.compile(model, backend="zinf",
                       options={"params": "offload", "offload": "cpu", "offload_dir": offload_root})
    with torch.no_grad():
        expect = torch.compile(ref)(x)
        got = cm(x)
    assert torch.equal(expect, got)
    assert STORE.is_managed(model[0].weight) and STORE.is_managed(model[2].weight)
    plan = zinf_compile.last_plans()[-1]
    assert plan.graphs == ("inference",) and plan.action_counts().get("gather") == 2


def test_auto_manages_parameters_only_when_the_budget_needs_it(offload_root):
    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))  # noqa: E731
    x = torch.randn(32, 64)
    opts = {"offload": "nvme", "offload_dir": offload_root}
    roomy = build()
    with torch.no_grad():
        torch.compile(roomy, backend="zinf", options={**opts, "budget": "10MB"})(x)
    assert not STORE.is_managed(roomy[0].weight)
    tight = build()
    with torch.no_grad():
        torch.compile(tight, backend="zinf", options={**opts, "budget": "120KB"})(x)
    plan = zinf_compile.last_plans()[-1]
    assert STORE.is_managed(tight[0].weight) and plan.peak_after <= 120_000
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        with torch.no_grad():
            torch.compile(build(), backend="zinf", options={**opts, "budget": "60KB"})(x)
    err = info.value
    while err is not None and not isinstance(err, BudgetError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, BudgetError) and err.lower_bound > 60_000
    assert "lower bound" in str(err)


def test_a_failed_shard_write_keeps_the_parameter_and_says_why(offload_root):
    """A full disk (simulated: a file size limit) must not lose the parameter's data."""
    from zinf_compile.runtime.state import register_engine

    eng = register_engine(987654, "nvme", os.path.join(offload_root, "full"), 2, False)
    p = nn.Parameter(torch.randn(256, 256))
    before = p.detach().clone()
    pid = STORE.identify(p, "big")
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(ZinfError, match="writing .* failed"):
            STORE.manage(pid, "nvme", 987654)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not STORE.is_managed(p)
    assert p.untyped_storage().nbytes() == p.numel() * 4 and torch.equal(p.detach(), before)
    eng.close()
    assert not os.path.exists(os.path.join(offload_root, "full")) or not os.listdir(os.path.join(offload_root, "full"))


def test_a_second_instance_reusing_the_compiled_graph_gets_its_own_shards(offload_root):
    """Another instance of the same model: each instance's gradients go to its own shards. Dynamo
    guards a parameter's type, and managed parameters have their own class, so the second zinf
    instance (plain parameters) gets a compile of its own; Inductor's graph is reused."""
    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    torch._dynamo.utils.counters.clear()
    x = torch.randn(8, 64)
    opts = {"params": "offload", "offload": "nvme", "offload_dir": offload_root}
    models = [build(1), build(2)]
    refs = [build(1), build(2)]
    for m, r in zip(models, refs):
        torch.compile(m, backend="zinf", options=opts)(x).square().mean().backward()
        torch.compile(r)(x).square().mean().backward()
    # two zinf graphs (one per instance) and one Inductor graph reused for the second instance
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    for m, r in zip(models, refs):
        for (n, p), q in zip(m.named_parameters(), r.parameters()):
            e = STORE.entry(p)
            got = e.read_grad().view(q.shape) if e is not None else p.grad
            assert torch.equal(got, q.grad), n


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_mixed_precision_keeps_float32_master_shards(tier, offload_root):
    """A bf16 model with master_dtype="float32": the graph computes in bf16 from gathers of fp32
    master shards, gradients are kept and AdamW steps in fp32 (DeepSpeed's bf16 + ZeRO-3). The
    reference does the same by hand: bit-identical."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(torch.bfloat16)

    x = torch.randn(16, 128, dtype=torch.bfloat16)
    model, ref = build(), build()
    opts = {"params": "offload", "offload": tier, "offload_dir": offload_root, "master_dtype": "float32"}
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-2)
    cref = torch.compile(ref)
    weights = [ref[0].weight, ref[2].weight]
    masters = [w.detach().float().clone().requires_grad_() for w in weights]
    ref_opts = [torch.optim.AdamW(masters, lr=1e-2), torch.optim.AdamW([ref[0].bias, ref[2].bias], lr=1e-2)]
    for _ in range(3):
        loss = cm(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = cref(x).float().square().mean()
        ref_loss.backward()
        for w, m in zip(weights, masters):
            m.grad = w.grad.float()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for w, m in zip(weights, masters):
                w.copy_(m)
                w.grad = None
        assert torch.equal(loss, ref_loss)
    for w, m, p in zip(weights, masters, [model[0].weight, model[2].weight]):
        e = STORE.entry(p)
        assert e.shard_dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(e.read_shard().view(m.shape), m.detach())
    state = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert state[k].dtype == torch.bfloat16 and torch.equal(state[k], v), k


def test_a_parameter_sharing_its_storage_is_never_taken_over(offload_root):
    base = torch.randn(2, 128, 128)
    a, b = nn.Parameter(base[0]), nn.Parameter(base[1])  # views of one storage
    from zinf_compile.runtime.state import register_engine

    register_engine(987655, "nvme", offload_root, 2, False)
    with pytest.raises(ZinfError, match="shares its storage"):
        STORE.manage(STORE.identify(b, "b"), "nvme", 987655)
    assert torch.equal(b.detach(), base[1]) and torch.equal(a.detach(), base[0])


def test_graph_break_and_budget_retries_keep_every_shard_intact(offload_root):
    """Two graphs (a graph break), each planned by retrying choices under a tight budget: a
    retry's failure must not close the swap folder holding the first graph's shards."""
    class TwoHalves(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            self.b = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    model, ref = TwoHalves(), TwoHalves()
    x = torch.randn(32, 64)
    cm = torch.compile(model, backend="zinf", options={"offload": "nvme", "offload_dir": offload_root,
                                                       "budget": "120KB"})
    with torch.no_grad():
        expect = torch.compile(ref)(x)
        first, second = cm(x), cm(x)
    assert STORE.is_managed(model.a[0].weight) and STORE.is_managed(model.b[0].weight)
    assert torch.equal(first, expect) and torch.equal(second, expect)


def test_a_parameter_updated_in_place_by_the_graph_stays_resident(offload_root):
    class Decay(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(128, 128))

        def forward(self, x):
            self.w.mul_(0.5)
            return x @ self.w

    model = Decay()
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                       "offload_dir": offload_root})
    x = torch.ones(2, 128)
    with torch.no_grad():
        sums = [cm(x).sum().item() for _ in range(3)]
    assert sums == [128 * 128 * 2 * 0.5, 128 * 128 * 2 * 0.25, 128 * 128 * 2 * 0.125]
    assert not STORE.is_managed(model.w)


def test_autocast_does_not_save_bf16_copies_of_gathered_weights(offload_root):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "cpu",
                                                       "offload_dir": offload_root})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = cm(torch.randn(16, 128))
    y.float().square().mean().backward()
    rec = [r for r in zinf_compile.compiles() if "backward" in r.plan.graphs][-1]
    assert STORE.is_managed(model[0].weight) and STORE.is_managed(model[2].weight)
    assert saved_whole_parameters(rec.graphs["forward"]) == []


def test_a_parameter_compiled_resident_is_not_taken_over_later(offload_root):
    """A graph compiled while a parameter fitted keeps reading it directly (Dynamo's guards do not
    look at storage): a later compile that would need it managed says so instead of breaking it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    cm = torch.compile(model, backend="zinf", options={"offload": "nvme", "offload_dir": offload_root,
                                                       "budget": "180KB"}, dynamic=False)
    with torch.no_grad():
        cm(torch.randn(4, 64))  # fits with the parameters resident
    assert not STORE.is_managed(model[0].weight)
    with pytest.raises(Exception) as info, torch.no_grad():
        cm(torch.randn(64, 64))  # a recompile that would need them managed
    assert "reads them directly" in str(info.value) and "torch._dynamo.reset()" in str(info.value)
    assert not STORE.is_managed(model[0].weight)
    with torch.no_grad():
        cm(torch.randn(4, 64))  # the first graph still runs
    # the advice works in the same process: once Dynamo forgets that graph, the pins go with it
    import gc

    torch._dynamo.reset()
    gc.collect()
    x = torch.randn(32, 64)  # fits only with the parameters managed
    with torch.no_grad():
        want = model(x)
        got = cm(x)
    assert STORE.is_managed(model[0].weight)
    torch.testing.assert_close(got, want)
    for p in model.parameters():
        STORE.release(p)


def _store_engine(root):
    from zinf_compile.runtime.state import register_engine

    register_engine(987656, "nvme", os.path.join(root, "store"), 2, False)
    return 987656


def test_a_gradient_already_in_p_grad_joins_the_shard_at_take_over(offload_root):
    key = _store_engine(offload_root)
    p = nn.Parameter(torch.randn(128, 128))
    g = torch.randn(128, 128)
    p.grad = g.clone()
    e = STORE.manage(STORE.identify(p, "p"), "nvme", key)
    assert p.grad is None and torch.equal(e.read_grad(), g.reshape(-1))


def test_a_dead_parameter_hands_its_files_back(offload_root):
    import gc

    key = _store_engine(offload_root)
    from zinf_compile.runtime.state import get_engine

    swap = get_engine(key).swap
    p = nn.Parameter(torch.randn(128, 128))
    STORE.manage(STORE.identify(p, "p"), "nvme", key)
    free_before = len(swap._free)
    del p
    gc.collect()
    assert len(swap._free) == free_before + 1  # its shard's file, ready for reuse


def test_plans_size_master_shards_in_the_master_dtype():
    import torch.fx as fx

    from zinf_compile.analysis import GraphSpec, analyze
    from zinf_compile.analysis.params import param_facts
    from zinf_compile.passes.params import param_meta

    g = fx.Graph()
    p = g.placeholder("w")
    p.meta["val"] = torch.empty(128, 256, dtype=torch.bfloat16, device="meta")
    p.meta["zinf"] = param_meta("w", 7, 0, "nvme", master="float32")
    y = g.call_function(torch.ops.aten.clone.default, (p,))
    y.meta["val"] = torch.empty(128, 256, dtype=torch.bfloat16, device="meta")
    g.output(y)
    facts = analyze([GraphSpec("inference", fx.GraphModule(torch.nn.Module(), g))])
    pf = param_facts(facts, world=2)[7]
    assert pf.nbytes == 128 * 256 * 2 and pf.read_nbytes == 128 * 256 * 4 // 2


def test_fetches_that_hold_memory_are_kept_where_the_budget_has_room(offload_root):
    """With O_DIRECT a fetched shard is a buffer of the process until its gather. A wide first layer
    leaves no room for one at its steps, the narrow layers after it do: fetching every shard ahead
    breaks 14 MiB (15.2 MiB), so the planner fetches only where there is room instead of gathering
    every shard just in time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 256), nn.GELU(),
                          *[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
    x = torch.randn(512, 256)
    with torch.no_grad():
        want = model(x)
    budget = 14 << 20
    cm = torch.compile(model, backend="zinf", options={
        "budget": budget, "offload": "nvme", "params": "offload", "o_direct": True,
        "offload_dir": os.path.join(offload_root, "room")})
    with torch.no_grad():
        got = cm(x)
    rec = zinf_compile.compiles()[-1]
    assert any(n.startswith("fetches:") and "for want of room" in n for n in rec.plan.notes), rec.plan.notes
    assert 1 <= rec.plan.action_counts().get("fetch", 0) < rec.plan.action_counts()["gather"], rec.plan.action_counts()
    assert rec.plan.peak_after <= budget
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
