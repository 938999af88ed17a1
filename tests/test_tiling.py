"""Memory-centric tiling: the matmul rewrite on single ops (no Inductor), the weight's tiles in the
store, and a model with one layer larger than the budget trained under it."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from zinf_compile import ir
from zinf_compile.ir import TileMeta

from zinf_compile.passes.tiling import split_bounds, tile_matmul

aten = torch.ops.aten


def _graph(fn, *args) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _only(gm: fx.GraphModule, target) -> fx.Node:
    (n,) = gm.graph.find_nodes(op="call_function", target=target)
    return n


OPS = {
    "mm": (aten.mm.default, lambda a, b, c: torch.mm(a, b), lambda g: (g.randn(37, 29), g.randn(29, 41), None)),
    "addmm": (aten.addmm.default, lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=1.5),
              lambda g: (g.randn(37, 29), g.randn(29, 41), g.randn(41))),
    "addmm-2d-bias": (aten.addmm.default, lambda a, b, c: torch.addmm(c, a, b),
                      lambda g: (g.randn(37, 29), g.randn(29, 41), g.randn(37, 41))),
    "bmm": (aten.bmm.default, lambda a, b, c: torch.bmm(a, b), lambda g: (g.randn(3, 37, 29), g.randn(3, 29, 41), None)),
}


class _Gen:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", ["M", "N", "K"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_tiled_op_matches_the_untiled_op(op, axis, dtype):
    target, fn, make = OPS[op]
    a, b, c = make(_Gen(hash((op, axis)) % 1000))
    a, b = a.to(dtype), b.to(dtype)
    c = c.to(dtype) if c is not None else torch.zeros(())
    gm = _graph(fn, a, b, c)
    want = gm(a, b, c)
    node = _only(gm, target)
    size = {"M": a.shape[-2], "N": b.shape[-1], "K": a.shape[-1]}[axis]
    bounds = split_bounds(size, 4)
    assert [e - s for s, e in bounds] in ([10, 9, 9, 9], [11, 10, 10, 10], [8, 7, 7, 7])  # odd sizes, uneven tiles
    tile_matmul(gm.graph, node, axis, bounds)
    gm.graph.lint()
    gm.recompile()
    tiled = sum(1 for n in gm.graph.nodes if isinstance(ir.meta(n), TileMeta))
    assert tiled == 4
    got = gm(a, b, c)
    assert got.dtype == want.dtype and got.shape == want.shape
    # M/N tiles compute each element from the same dot product, but the BLAS picks its kernel by
    # shape and may order a block's sums differently (MKL does: a few ulp on 0.3% of elements);
    # K tiles add partial sums in float32. Either way: within a few eps of the sum of magnitudes.
    scale = (a.float().abs().unsqueeze(-1) * b.float().abs().unsqueeze(-3)).sum(-2)
    if op.startswith("addmm"):
        scale = 1.5 * scale + 0.5 * c.float().abs() if op == "addmm" else scale + c.float().abs()
    err = (got.float() - want.float()).abs()
    eps = torch.finfo(dtype).eps
    assert (err <= 4 * eps * scale).all(), float((err / scale).max() / eps)


def test_split_bounds_cover_the_range_in_order():
    for n in (1, 7, 64, 1001):
        for k in (1, 3, 8, 5000):
            b = split_bounds(n, k)
            assert b[0][0] == 0 and b[-1][1] == n and all(x[1] == y[0] for x, y in zip(b, b[1:]))
            assert len(b) == min(k, n) and max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


# -- the weight's tiles in the store ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tile_engines(offload_root):
    import os

    from zinf_compile.runtime.state import register_engine

    register_engine(987700, "nvme", os.path.join(offload_root, "tiles"), 2, False)
    register_engine(987701, "nvme", os.path.join(offload_root, "tiles-direct"), 2, True)  # O_DIRECT
    return {"nvme": 987700, "nvme-direct": 987701, "cpu": 987700}


@pytest.mark.parametrize("where", ["cpu", "nvme", "nvme-direct"])
def test_a_tile_is_read_and_its_gradient_added_without_the_rest(where, tile_engines):
    """Rows of a managed weight from its tier (unaligned offsets under O_DIRECT too), fetched ahead
    or not; gradient tiles into their rows, accumulated, zeros where no tile came."""
    from zinf_compile.runtime.state import STORE

    tier = "cpu" if where == "cpu" else "nvme"
    torch.manual_seed(1)
    w = torch.randn(37, 29)  # 29 * 4 bytes a row: no tile boundary is page-aligned
    p = torch.nn.Parameter(w.clone())
    e = STORE.manage(STORE.identify(p, f"w-{where}"), tier, tile_engines[where])
    read_before = e.engine.stats["bytes_read"]
    for s, t in [(0, 10), (10, 19), (19, 37), (5, 6)]:
        assert torch.equal(STORE.gather(p, rows=(s, t)), w[s:t])
        h = STORE.fetch(p, rows=(s, t))
        assert torch.equal(STORE.gather_from(p, h, rows=(s, t)), w[s:t])
    if tier == "nvme":  # each read was its tile's bytes, not the weight's
        assert e.engine.stats["bytes_read"] - read_before == 2 * (37 + 1) * 29 * 4
    g1, g2 = torch.randn(9, 29), torch.randn(9, 29)
    STORE.reduce_grad(p, g1, rows=(10, 19))
    STORE.reduce_grad(p, g2, rows=(10, 19))  # a second micro-batch accumulates
    STORE.reduce_grad(p, g1[:1], rows=(0, 1))
    want = torch.zeros(37, 29)
    want[10:19] = g1 + g2
    want[0:1] = g1[:1]
    assert torch.equal(e.read_grad().view(37, 29), want)  # zeros where no tile wrote
    STORE.zero_grad([e])
    assert e.read_grad() is None
    STORE.release(p)
    assert torch.equal(p.detach(), w)
    e.close_files()


def test_tiles_of_a_weight_sharded_over_ranks_say_so():
    """One rank only for now: a tile of a weight sharded over ranks is an error that names it."""
    from zinf_compile.errors import ZinfError
    from zinf_compile.runtime.params import Entry

    e = Entry(0, "blocks.0.w", (8, 4), torch.float32, torch.device("cpu"), True, 0, 2, "cpu", 0, None)
    with pytest.raises(ZinfError, match="blocks.0.w.*2 ranks.*tiling"):
        e.row_range((0, 4))


# -- a model with one layer larger than the budget, trained under it --------------------------------

BUDGET = 1 << 20  # 1 MiB; the big weight alone is 1.37 MiB


def _build():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from tiled import build

    return build(batch=16, d_in=24, width=600, d_out=10)


def _train(model, x, y, steps=3, backend=None, options=None):
    import zinf_compile
    from zinf_compile.checkpoint import full_state_dict

    f = model if backend is None else torch.compile(model, backend=backend, options=options)
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = f(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state_dict(model)


@pytest.fixture(scope="module")
def trained(offload_root):
    """3 AdamW steps of the model compiled with zinf under BUDGET (the big weight in the NVMe tier,
    tiled), with Inductor alone (untiled, unbudgeted) and in eager."""
    from zinf_compile import records
    from zinf_compile.runtime.state import STORE

    model, (x, y) = _build()
    records.reset()
    opts = {"budget": BUDGET, "offload": "nvme", "params": "offload", "offload_dir": offload_root}
    out = {"zinf": _train(model, x, y, backend="zinf", options=opts), "rec": records.compiles()[-1]}
    torch._dynamo.reset()
    out["inductor"] = _train(_build()[0], x, y, backend="inductor")
    out["eager"] = _train(_build()[0], x, y)
    yield out
    for p in model.parameters():
        STORE.release(p)


def test_the_big_layer_is_tiled_in_forward_and_backward(trained):
    plan = trained["rec"].plan
    tiles = {(t.graph, t.axis, t.grad): t for t in plan.tiles if t.param == "big.weight"}
    # forward: N (output features = the weight's rows); backward: the input's gradient along K,
    # the weight's gradient along M (its rows), each gradient tile reduced into its rows
    assert set(tiles) == {("forward", "N", False), ("backward", "K", False), ("backward", "M", True)}
    counts = {t.count for t in tiles.values()}
    assert len(counts) == 1 and counts.pop() >= 2
    assert all(t.tile_nbytes <= 600 * 600 * 4 / 2 + 600 * 4 for t in tiles.values())


def test_the_whole_weight_never_exists_and_its_tiles_are_fetched_ahead(trained):
    from zinf_compile.runtime.ops import fetch_rows, gather, gather_from, gather_rows, gather_rows_from, reduce_grad

    rec = trained["rec"]
    for role, gm in rec.graphs.items():
        whole = [n for n in gm.graph.nodes if n.target in (gather, gather_from, reduce_grad)
                 and getattr(ir.meta(n), "name", None) == "big.weight"]
        assert not whole, (role, whole)
        tiles = [n for n in gm.graph.nodes if n.target in (gather_rows, gather_rows_from)]
        assert tiles and all(n.meta["val"].numel() < 600 * 600 for n in tiles)
        assert gm.graph.find_nodes(op="call_function", target=fetch_rows)  # the next tile read ahead
        # one tile at a time: each tile's rows are read right before its matmul, never two ahead
        seq = [("g" if n.target in (gather_rows, gather_rows_from) else "m") for n in gm.graph.nodes
               if n.target in (gather_rows, gather_rows_from)
               or isinstance(ir.meta(n), TileMeta) and not ir.meta(n).grad]
        assert "gg" not in "".join(seq), (role, "".join(seq))
    kinds = rec.plan.action_counts()
    assert kinds["gather"] >= 3 * 2 and kinds["reduce"] >= 2


def test_the_plan_fits_the_budget_that_the_untiled_graph_cannot(trained, offload_root):
    from zinf_compile.errors import BudgetError

    rec = trained["rec"]
    assert rec.plan.peak_after <= BUDGET and rec.simulated_peak <= BUDGET
    model, (x, y) = _build()
    opts = {"budget": BUDGET, "offload": "nvme", "params": "offload", "tiling": "off", "offload_dir": offload_root}
    with pytest.raises(Exception) as info:
        torch.compile(model, backend="zinf", options=opts)(x, y)
    err = info.value
    while err is not None and not isinstance(err, BudgetError):
        err = err.__cause__ or err.__context__
    assert err.lower_bound > BUDGET  # untiled, the whole weight must be on the device at once
    assert all(p.untyped_storage().nbytes() for p in model.parameters())  # nothing taken over


def test_losses_and_parameters_match_untiled_inductor_and_eager(trained):
    """Tiling changes only the association of float32 sums: the forward splits N (exact per
    element), the input's gradient K and the weight's gradient M (partial sums added in another
    order). Inductor against eager is the same kind of change (its fused reductions and kernels
    sum in their own order), on the same machine, through the same 3 AdamW steps. So the spread
    between Inductor and eager, D (the largest over all tensors), is this machine's measure of what
    a reassociation does to this training, and the tolerances are that spread, not a number from
    one machine's rounding:
      zinf vs Inductor  <= D   (tiling is one more reassociation of the same sums)
      zinf vs eager     <= 2 D (the triangle inequality over Inductor, each leg at most D)
    AdamW is why D is not ~1 ulp: its update lr * m / (sqrt(v) + eps) divides by the gradient's
    own size, so an element whose gradient is at the rounding level moves by up to ~lr whatever
    the rounding; those rare elements set D on every machine alike (measured on the 2-core CI
    machine: D = 1.6e-5 on big.weight, zinf 7.3e-7 from Inductor and 1.6e-5 from eager; a float64
    run puts all three 1.9e-5 to 2.6e-5 from the exact result. An AVX-512/AMX Xeon put 1 of
    360,000 elements 2.2e-5 from eager, over the fixed 2e-5 this test used to allow).
    The check stays meaningful: a tile lost or doubled changes a block of whole gradient rows,
    which moves every element there by ~lr = 1e-3 a step, over 100x D. FLOOR keeps the check
    possible where Inductor happens to equal eager exactly (D = 0): the K-split's own rounding
    bound, gamma_K = K u / (1 - K u) relative on the gradient, carried through STEPS updates of
    at most lr each (an upper bound for a well-conditioned element)."""
    (zl, zs), (il, ist), (el, es) = trained["zinf"], trained["inductor"], trained["eager"]
    u, k, lr, steps = 2.0**-24, 600, 1e-3, len(zl)
    floor = steps * lr * 2 * (k * u / (1 - k * u))

    def spread(a, b):
        return max((a[n].double() - b[n].double()).abs().max().item() for n in a)

    d = max(spread(ist, es), floor)
    for n in es:
        torch.testing.assert_close(zs[n], ist[n], rtol=0, atol=d, msg=lambda m, n=n: f"{n}: {m} (D = {d:.3g})")
        torch.testing.assert_close(zs[n], es[n], rtol=0, atol=2 * d, msg=lambda m, n=n: f"{n}: {m} (D = {d:.3g})")
    # losses: the same argument over the 3 scalars, with the floor of a float32 sum of K terms
    dl = max(max(abs(a - b) for a, b in zip(il, el)), steps * k * u * max(map(abs, el)))
    for z, i, e in zip(zl, il, el):
        assert abs(z - i) <= dl and abs(z - e) <= 2 * dl, (zl, il, el, dl)


def test_a_weight_read_through_casts_is_tiled_and_its_gradient_reduced_by_rows(tile_engines):
    """autocast reads a weight as gather -> bf16 cast -> transpose, and its gradient comes back
    as mm -> fp32 cast -> transpose: tiles go through the same casts."""
    from zinf_compile.passes.params import param_meta
    from zinf_compile.passes.tiling import TileMatmuls, candidates
    from zinf_compile.runtime.ops import gather, gather_rows, reduce_grad, reduce_grad_rows
    from zinf_compile.runtime.state import STORE

    key = tile_engines["cpu"]
    torch.manual_seed(2)
    w = torch.randn(37, 29)
    p = torch.nn.Parameter(w.clone())
    pid = STORE.identify(p, "cast.w")
    e = STORE.manage(pid, "cpu", key)

    def f(p, x, gy):
        y = x @ gather(p, key, "cpu").to(torch.bfloat16).t()
        r = reduce_grad((gy.t() @ x).to(torch.float32), p)
        return y, r

    x, gy = torch.randn(5, 29).bfloat16(), torch.randn(5, 37).bfloat16()
    gm = make_fx(f, tracing_mode="fake")(torch.empty(37, 29), x, gy)
    ph = gm.graph.find_nodes(op="placeholder")[0]
    ph.meta["zinf"] = param_meta("cast.w", pid, 0, "cpu", engine=key)
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.args = ((out.args[0][0], None),)  # as ReduceGrads.drop_outputs leaves a backward
    (c,) = candidates(gm.graph).values()
    assert c.pid == pid and len(c.uses) == 1 and len(c.grads) == 1 and not c.others
    TileMatmuls(((pid, tuple(split_bounds(37, 3))),)).apply({"inference": gm}, None)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(gather_rows) == 3 and targets.count(reduce_grad_rows) == 3
    assert gather not in targets and reduce_grad not in targets
    y, _ = gm(p, x, gy)
    torch.testing.assert_close(y, x @ w.bfloat16().t(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(e.read_grad().view(37, 29), (gy.t() @ x).float(), rtol=1e-2, atol=1e-2)
    STORE.release(p)


def test_inference_tiles_the_big_layer_and_matches_eager(offload_root):
    from zinf_compile import records
    from zinf_compile.runtime.state import STORE

    model, (x, y) = _build()
    want = model(x, y)
    records.reset()
    opts = {"budget": 700 << 10, "offload": "nvme", "params": "offload", "offload_dir": offload_root}
    with torch.no_grad():
        got = torch.compile(model, backend="zinf", options=opts)(x, y)
    plan = records.compiles()[-1].plan
    assert plan.graphs == ("inference",) and plan.peak_after <= 700 << 10
    assert [(t.param, t.axis) for t in plan.tiles] == [("big.weight", "N")] and plan.tiles[0].count >= 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for p in model.parameters():
        STORE.release(p)


@pytest.mark.parametrize("inference", [True, False])
def test_a_gathered_weight_is_live_at_the_matmul_reading_its_transpose(inference):
    """The transpose of a gathered weight was traced on the parameter; unless its fake value is
    recomputed from the gather's, the analysis counts the whole weight dead before its matmul (the
    very step that needs it), and tiling (and every plan with managed weights) under-counts."""
    import os
    import sys

    from zinf_compile.analysis import analyze, graph_specs
    from zinf_compile.capture import plan_offline
    from zinf_compile.cost import load_profile
    from zinf_compile.passes.params import is_gather
    from zinf_compile.passes.tiling import weight_uses

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from tiled import build

    # every weight managed, gathered whole (the CPU tier: no fetches), nothing tiled
    done = plan_offline(build, dict(batch=4, d_in=24, width=600, d_out=10), 1 << 40, load_profile("cpu"), "cpu",
                        params="offload", inference=inference, tiling="off")
    graphs = done.graphs
    assert "big.weight" in [p.name for p in done.managed]
    facts = analyze(graph_specs(graphs, done.num_fwd_outputs))
    checked = 0
    for b in facts.buffers:
        g = b.aliases[0]
        if is_gather(g):
            for mm, _, _ in weight_uses(g):
                assert facts.step_of[mm] in b.use_steps, (g.name, mm.name, b.use_steps)
                checked += 1
    assert checked == (1 if inference else 2)  # the forward's matmul; and the input gradient's
    from zinf_compile.passes.tiling import candidates

    # the input gradient (backward) splits K: its float32 sum, [4, 600] fp32, is re-read per tile
    k = {role: sum(c.k_bytes for c in candidates(gm.graph).values()) for role, gm in graphs.items()}
    assert k == ({"inference": 0} if inference else {"forward": 0, "backward": 4 * 600 * 4})


def test_graph_gathers_map_the_shard_file_and_what_outlives_the_graph_does_not(tile_engines):
    """On a CPU device with buffered files a gather maps the shard's file (no copy, no zero-filled
    pages); the mapping is private (a write into the gathered tensor never reaches the file), and
    what may outlive a later write of the file (a state dict, a released parameter) is a copy."""
    from zinf_compile.runtime.state import STORE

    torch.manual_seed(3)
    w = torch.randn(64, 33)
    p = torch.nn.Parameter(w.clone())
    e = STORE.manage(STORE.identify(p, "mapped.w"), "nvme", tile_engines["nvme"])
    assert e.maps
    g = STORE.gather(p)
    assert torch.equal(g, w) and not g.untyped_storage().resizable()  # numpy-owned: the mapping
    g.add_(1.0)  # Inductor may reuse a gathered buffer for a later result
    assert torch.equal(STORE.gather(p), w) and torch.equal(STORE.gather(p, rows=(7, 9)), w[7:9])
    whole = STORE.full(e)
    e.write_shard(torch.zeros(64 * 33))  # the file changes (an optimizer step writes it)
    assert torch.equal(whole, w)
    assert torch.equal(STORE.gather(p), torch.zeros(64, 33))
    e.write_shard(w.reshape(-1))
    STORE.release(p)
    assert torch.equal(p.detach(), w)
    e.close_files()
    direct = STORE.manage(STORE.identify(p, "direct.w"), "nvme", tile_engines["nvme-direct"])
    assert not direct.maps and torch.equal(STORE.gather(p), w)  # O_DIRECT bypasses the page cache
    STORE.release(p)
    direct.close_files()


def test_no_tiles_where_tiling_cannot_make_the_step_fit():
    """A step over the budget even without the weight (here: a budget below everything else live)
    gets no tiles: they would only add overhead (a first version tiled such weights one row per
    tile, thousands of nodes)."""
    import numpy as np

    from zinf_compile.cost import BUILTIN
    from zinf_compile.passes.tiling import Candidate
    from zinf_compile.planner import MAX_TILES, choose_tiles

    floor, step_of = np.array([10, 500, 10]), {"mm": 1}
    c = Candidate(7, "w", rows=4096, nbytes=200, uses=("mm",))
    assert choose_tiles(floor, step_of, 250, {7: c}, BUILTIN["cpu"], "nvme") == {}  # 500 - 200 = 300 > 250
    picked = choose_tiles(floor, step_of, 400, {7: c}, BUILTIN["cpu"], "nvme")  # room 100 for 2 x 200 / T
    assert 4 <= picked[7] <= MAX_TILES
