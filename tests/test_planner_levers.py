"""Property tests of the planner's pure lever decisions, on small synthetic inputs (no FX graphs).

Every property is checked against a brute-force oracle that shares no code with zinf:

* parameters (`decide_params`, `managed_floor`, `resident_timeline`): the floor of a choice is
  recomputed here from the parameters' facts (for each parameter kept resident: its bytes less
  what it keeps when managed, everywhere; less its gathered copies; plus its kept gradient), and
  "auto" is checked against every subset of the parameters;
* tiles (`choose_tiles`): the least count that fits each over-budget step found by search, and
  the cheapest count between it and 4x it from a cost recomputed here;
* the prefetch walk (`_ahead`): where it stops, against the steps' compute and a recorded `fits`.

The facts are stand-ins (`types.SimpleNamespace`) with only the attributes each function reads.
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from props import props
from zinf_compile.analysis.params import Interval, ParamFact
from zinf_compile.cost import BUILTIN
from zinf_compile.passes.tiling import Candidate
from zinf_compile.planner import (MAX_TILES, TILE_OVERHEAD_S, _ahead, choose_tiles, decide_params, managed_floor,
                                  resident_timeline)

PROPS = props(150)  # the default keeps the file well under 30 s on CI

MAX_PARAMS = 8  # 2**8 subsets for the brute force


# -- A. parameters ----------------------------------------------------------------------------------

def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """The maximal runs of True in `flags`, as (first, last) inclusive."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - 1))
            start = None
    return out


@st.composite
def param_cases(draw, general: bool = False):
    """(facts, params, forced, budget). The analysed floor is built as the graphs would have it with
    every parameter managed: other bytes + each parameter's managed bytes + its gathered copies.

    Default ("tier frees the device"): a managed parameter keeps nothing on the device, its gathered
    copies do not overlap and hold its whole bytes, so keeping it resident never lowers the floor.
    `general`: it keeps a shard (a CPU tier on a CPU device: resident_bytes = nbytes / world), and
    its gathered copies may overlap or differ in size: keeping it resident may lower the floor."""
    n = draw(st.integers(1, 6))
    k = draw(st.integers(0, MAX_PARAMS))
    floor = [draw(st.integers(0, 200)) for _ in range(n)]
    live = [f + draw(st.integers(0, 50)) for f in floor]  # the gaps' bytes
    params: dict[int, ParamFact] = {}
    for i in range(k):
        pid = 3 * i + draw(st.integers(0, 2))  # ids out of order with the sizes: ties broken by id
        nbytes = 16 * draw(st.integers(1, 8))  # few sizes: many ties
        res = 0
        if general:
            res = -(-nbytes // draw(st.sampled_from((1, 2, 4, 8)))) if draw(st.booleans()) else 0
        flags = [draw(st.booleans()) for _ in range(n)]
        cut = [draw(st.integers(0, 3)) == 0 for _ in range(n)]  # a gap an offload may use
        gathered_live = [Interval(a, b, nbytes) for a, b in _runs(flags)]
        gathered = [Interval(a, b, nbytes) for a, b in _runs([f and not c for f, c in zip(flags, cut)])]
        if general and draw(st.booleans()):  # another copy, anywhere, of any size
            a = draw(st.integers(0, n - 1))
            iv = Interval(a, draw(st.integers(a, n - 1)), draw(st.integers(1, 2 * nbytes)))
            gathered.append(iv)
            gathered_live.append(iv)
        kept = []
        if draw(st.booleans()):  # the gradient autograd keeps to the end when resident
            kept.append(Interval(draw(st.integers(0, n - 1)), n - 1, nbytes * draw(st.sampled_from((1, 2)))))
        for t in range(n):
            floor[t] += res + sum(iv.nbytes for iv in gathered if iv.start <= t <= iv.end)
            live[t] += res + sum(iv.nbytes for iv in gathered_live if iv.start <= t <= iv.end)
        params[pid] = ParamFact(pid, f"p{pid}", nbytes, nbytes, res, tuple(gathered_live), tuple(gathered),
                                tuple(kept))
    forced = frozenset(p for p in params if draw(st.integers(0, 4)) == 0)
    facts = SimpleNamespace(steps=[None] * n, floor=np.array(floor, dtype=np.int64),
                            live=np.array(live, dtype=np.int64), buffers=(), gaps=(), step_of={})
    # budgets at the peaks of the choices (and one byte either side): where the decisions turn
    peaks = sorted({_peak(floor, params, managed) for managed in _choices(params, forced)})
    if draw(st.booleans()):
        budget = draw(st.sampled_from(peaks)) + draw(st.sampled_from((-1, 0, 0, 1)))
    else:
        budget = draw(st.integers(0, max(peaks) + 10))
    return facts, params, forced, budget


def _choices(params: dict[int, ParamFact], forced: frozenset[int]):
    """Every set of managed parameters that contains the forced ones."""
    free = sorted(set(params) - forced)
    for r in range(len(free) + 1):
        for combo in itertools.combinations(free, r):
            yield forced | frozenset(combo)


def _timeline(floor, params: dict[int, ParamFact], managed, gathered: str = "gathered_floor") -> list[int]:
    """The oracle: the analysed timeline plus, for each parameter kept resident, its whole bytes
    less what it keeps managed, less its gathered copies, plus its kept gradient."""
    out = [int(x) for x in floor]
    for pid, pf in params.items():
        if pid in managed:
            continue
        for t in range(len(out)):
            out[t] += pf.nbytes - pf.resident_bytes
            out[t] -= sum(iv.nbytes for iv in getattr(pf, gathered) if iv.start <= t <= iv.end)
            out[t] += sum(iv.nbytes for iv in pf.grad_kept if iv.start <= t <= iv.end)
    return out


def _peak(floor, params, managed) -> int:
    return max(_timeline(floor, params, managed))


def _fits(facts, params, managed, budget) -> bool:
    return _peak(facts.floor, params, managed) <= budget


@PROPS
@given(param_cases())
def test_auto_fits_exactly_when_some_choice_does(case):
    """Where keeping a parameter resident never lowers the floor: "auto" fits the budget exactly
    when some choice of managed parameters does; it keeps all resident (but the forced) when that
    fits, manages all when nothing fits; it contains the forced and nothing but the parameters."""
    facts, params, forced, budget = case
    got = decide_params(facts, params, budget, "auto", forced)
    some = any(_fits(facts, params, m, budget) for m in _choices(params, forced))
    event(f"a choice fits: {some}")
    assert forced <= got <= set(params)
    assert _fits(facts, params, got, budget) == some, (got, budget)
    if _fits(facts, params, forced, budget):
        assert got == forced
    if not some:
        assert got == set(params)


@PROPS
@given(param_cases())
def test_auto_keeps_no_parameter_managed_in_vain(case):
    """Where "auto" fits, keeping any one of its non-forced parameters resident breaks the budget
    (the un-cover step). How many it manages beside the fewest that fit is only recorded: largest
    first is no bound on it (test_auto_may_manage_many_where_one_would_do)."""
    facts, params, forced, budget = case
    got = decide_params(facts, params, budget, "auto", forced)
    if not _fits(facts, params, got, budget):
        return
    for pid in got - forced:
        assert not _fits(facts, params, got - {pid}, budget), (pid, got, budget)
    fewest = min(len(m - forced) for m in _choices(params, forced) if _fits(facts, params, m, budget))
    event(f"managed {len(got - forced)} where {fewest} would do")


@PROPS
@given(param_cases(general=True), st.randoms(use_true_random=False))
def test_decide_params_modes_and_determinism(case, rnd: random.Random):
    """Any parameter facts: "offload" manages all, "resident" only the forced; "auto" is what it
    is whatever the order of `params` and however often asked; when it does not fit, it manages
    all (and then all do not fit), and it fits whenever managing all does. `managed_floor` and
    `resident_timeline` are the oracle's timelines."""
    facts, params, forced, budget = case
    assert decide_params(facts, params, budget, "offload", forced) == set(params)
    assert decide_params(facts, params, budget, "resident", forced) == forced
    got = decide_params(facts, params, budget, "auto", forced)
    items = list(params.items())
    rnd.shuffle(items)
    assert decide_params(facts, dict(items), budget, "auto", forced) == got
    assert decide_params(facts, params, budget, "auto", forced) == got
    assert forced <= got <= set(params)
    if _fits(facts, params, forced, budget):
        assert got == forced
    if not _fits(facts, params, got, budget):
        assert got == set(params)
    if _fits(facts, params, set(params), budget):
        assert _fits(facts, params, got, budget)
    for managed in (got, forced, frozenset(params)):
        assert managed_floor(facts, params, managed).tolist() == _timeline(facts.floor, params, managed)
    # every parameter resident, on the live timeline (their gathered copies as live, gaps and all)
    assert resident_timeline(facts, params).tolist() == _timeline(facts.live, params, (), "gathered_live")




def _one_step(floor: int, *params: ParamFact):
    return SimpleNamespace(steps=[None], floor=np.array([floor]), live=np.array([floor])), {p.pid: p for p in params}


def test_auto_finds_the_choice_that_fits_when_managing_costs_memory():
    """A CPU tier on a CPU device, two ranks: a managed parameter keeps its half on the device.
    One step, 50 B of other memory, reads A (128 B) gathered whole; B (64 B) is not read there.

        all resident: 128 + 64 + 50 = 242; A managed: 64 + 128 + 64 + 50 = 306;
        B managed: 128 + 32 + 50 = 210; both managed: 64 + 128 + 32 + 50 = 274.

    With a budget of 210 only {B} fits; "auto" tries {A}, then {A, B}, and returns {A, B} (274)."""
    a = ParamFact(1, "a", 128, 64, 64, (Interval(0, 0, 128),), (Interval(0, 0, 128),), ())
    b = ParamFact(2, "b", 64, 32, 32, (), (), ())
    facts, params = _one_step(64 + 128 + 32 + 50, a, b)
    assert [_peak(facts.floor, params, m) for m in ((), {1}, {2}, {1, 2})] == [242, 306, 210, 274]
    got = decide_params(facts, params, 210, "auto")
    assert _fits(facts, params, got, 210), (sorted(got), _peak(facts.floor, params, got))


def test_auto_drops_every_parameter_made_unnecessary_when_managing_costs_memory():
    """One step. A (96 B, one rank on a CPU tier: it keeps all its bytes managed) is gathered there;
    B (96 B) and C (64 B) keep nothing managed and are not read there. Budget 193.

        all resident 257; {A} 353; {B} 161; {C} 193; {A, B} 257; {A, C} 289; {B, C} 97; {A, B, C} 193.

    "auto" manages A, B, C (193 fits), keeps C and B (193 + their bytes does not), drops A (97), and
    returns {B, C}, where either alone fits ({B} 161, {C} 193)."""
    a = ParamFact(1, "a", 96, 96, 96, (Interval(0, 0, 96),), (Interval(0, 0, 96),), ())
    b = ParamFact(2, "b", 96, 96, 0, (), (), ())
    c = ParamFact(3, "c", 64, 64, 0, (), (), ())
    facts, params = _one_step(193, a, b, c)
    got = decide_params(facts, params, 193, "auto")
    assert _fits(facts, params, got, 193)
    for pid in got:
        assert not _fits(facts, params, got - {pid}, 193), (sorted(got), pid)


def test_auto_may_manage_many_where_one_would_do():
    """Not a bound but a record of the heuristic (largest first, then un-cover): four 128 B weights,
    each gathered at every step but one (its own), and a 16 B one never gathered. Keeping all
    resident is 16 B over the budget at every step; managing the small one alone fits. "auto"
    manages the four large ones (each frees only its own step) and keeps them all: 4 where 1 does
    (with m such weights: m where 1 does, so no "at most 2x the fewest + 1")."""
    m = 4
    floor = [128 * (m - 1)] * m
    params = {}
    for j in range(m):
        g = tuple(Interval(a, b, 128) for a, b in _runs([t != j for t in range(m)]))
        params[j + 1] = ParamFact(j + 1, f"w{j}", 128, 128, 0, g, g, ())
    params[9] = ParamFact(9, "s", 16, 16, 0, (), (), ())
    facts = SimpleNamespace(steps=[None] * m, floor=np.array(floor), live=np.array(floor))
    budget = floor[0] + 128
    assert _peak(floor, params, ()) == budget + 16 and _fits(facts, params, {9}, budget)
    got = decide_params(facts, params, budget, "auto")
    assert _fits(facts, params, got, budget)
    assert got == {1, 2, 3, 4}


# -- B. tiles ------------------------------------------------------------------------------------------

TILE_PROFILES = (("cpu", "nvme"), ("cpu", "cpu"), ("h200", "nvme"), ("h200", "cpu"))


@st.composite
def tile_cases(draw):
    """(floor, step_of, budget, cands, profile, tier): weights of a few rows sizes read by matmuls
    (nodes named m0, m1, ...: some not in `step_of`, as the matmuls of another graph)."""
    n = draw(st.integers(1, 8))
    floor = [draw(st.integers(0, 1 << 16)) for _ in range(n)]
    nodes = [f"m{i}" for i in range(draw(st.integers(1, 10)))]
    step_of = {m: draw(st.integers(0, n - 1)) for m in nodes if draw(st.integers(0, 5))}
    cands = {}
    for i in range(draw(st.integers(0, 4))):
        rows = draw(st.sampled_from((1, 2, 7, 16, 64, 100, 1000, 1000)))
        nbytes = rows * draw(st.sampled_from((4, 64, 1000, 4096)))
        uses = tuple(draw(st.lists(st.sampled_from(nodes), max_size=3, unique=True)))
        grads = tuple(draw(st.lists(st.sampled_from(nodes), max_size=2, unique=True)))
        for m in (*uses, *grads):  # the whole weight (or gradient) is on the floor where it is read
            if m in step_of:
                floor[step_of[m]] += nbytes
        pid = 2 * i + draw(st.integers(0, 1))
        cands[pid] = Candidate(pid, f"w{pid}", rows, nbytes, uses, grads, (),
                               draw(st.sampled_from((0, 1000, 1 << 20, 1 << 26))), (rows, nbytes // rows))
    top = max(floor)
    # mostly a budget a weight's size or less under the peak: where tiling the weight can fit
    widest = max((c.nbytes for c in cands.values()), default=1)
    budget = draw(st.one_of(st.integers(0, top + 10), st.integers(max(0, top - widest), top),
                            st.integers(max(0, top - widest), top)))
    name, tier = draw(st.sampled_from(TILE_PROFILES))
    return np.array(floor, dtype=np.int64), step_of, budget, cands, BUILTIN[name], tier


def _read_s(profile, nbytes: int, tier: str) -> float:
    """Seconds to read nbytes from the tier onto the device (the oracle's own, from the profile's
    bandwidths): a CPU tier on a CPU device is already there; the disk, then the host link."""
    if tier == "cpu":
        return 0.0 if profile.device == "cpu" else nbytes / profile.h2d_bw
    s = nbytes / profile.nvme_read_bw
    if profile.device != "cpu":
        s += nbytes / profile.h2d_bw
    return s


def _tile_s(c, t: int, profile, tier: str) -> float:
    """The predicted time of t tiles: each tile's fixed cost, the first tile's read (not hidden by
    an earlier one), a K split's float32 sum re-read and re-written once per further tile."""
    return t * TILE_OVERHEAD_S + _read_s(profile, c.nbytes // t, tier) + (t - 1) * 2 * c.k_bytes / profile.mem_bw


@PROPS
@given(tile_cases(), st.integers(1, 1 << 16))
def test_choose_tiles_with_a_tile_size(case, max_tile):
    """With a tile size: every weight larger than it, in as many tiles as keep each no larger (at
    most one row per tile); the floor and the budget do not matter."""
    floor, step_of, budget, cands, profile, tier = case
    got = choose_tiles(floor, step_of, budget, cands, profile, tier, max_tile)
    want = {}
    for pid, c in cands.items():
        if c.nbytes > max_tile:
            t = 1
            while t < c.rows and (c.nbytes + t - 1) // t > max_tile:
                t += 1
            want[pid] = t
    assert got == want


@PROPS
@given(tile_cases())
def test_choose_tiles_the_least_that_fits_then_the_cheapest(case):
    """Without: a weight is tiled only where a step of its matmuls has the floor over the budget;
    its count k is found here by search: the least k such that at each such step k tiles (two of a
    use: the one in use and the next; one of a gradient) fit where the whole weight was, i.e.
    tiles * nbytes <= k * (budget - (floor - nbytes)); tiled when 1 < k <= min(MAX_TILES, rows);
    the count is the cheapest in [k, min(rows, 4k, MAX_TILES)] (ties: the fewer tiles)."""
    floor, step_of, budget, cands, profile, tier = case
    got = choose_tiles(floor, step_of, budget, cands, profile, tier)
    assert set(got) <= set(cands)
    if max(floor) <= budget:
        assert got == {}
        return
    for pid, c in sorted(cands.items()):
        over = [(2 if m in c.uses else 1, budget - (int(floor[step_of[m]]) - c.nbytes))
                for m in (*c.uses, *c.grads) if m in step_of and floor[step_of[m]] > budget]
        need = next((k for k in range(1, MAX_TILES + 2)
                     if all(room > 0 and tiles * c.nbytes <= k * room for tiles, room in over)), MAX_TILES + 1)
        event(f"least count: {'1' if need == 1 else 'over' if need > min(MAX_TILES, c.rows) else 'tiled'}")
        if need == 1 or need > min(MAX_TILES, c.rows):
            assert pid not in got, (pid, need, got)
            continue
        assert pid in got, (pid, need)
        k = got[pid]
        span = range(need, min(c.rows, 4 * need, MAX_TILES) + 1)
        assert k in span, (k, need)
        for tiles, room in over:  # it fits each step over the budget
            assert tiles * c.nbytes <= k * room, (k, tiles, room)
        best = min(_tile_s(c, t, profile, tier) for t in span)
        assert _tile_s(c, k, profile, tier) == best, (k, [(t, _tile_s(c, t, profile, tier)) for t in span])
        assert all(_tile_s(c, t, profile, tier) > best for t in span if t < k)


# -- C. the prefetch walk --------------------------------------------------------------------------------

@PROPS
@given(st.data())
def test_ahead_hides_the_read_as_far_as_room_allows(data):
    """_ahead(times, use, lo, need, fits) -> p: lo <= p <= use; fits asked of use-1, use-2, ... in
    turn, each once, and true of every step in [p, use); it stops at lo, or where the compute of
    [p, use) hides `need` (and not a step later: [p+1, use) does not), or at a step without room."""
    n = data.draw(st.integers(1, 10))
    # whole seconds and halves: the walk's running sum and the oracle's are exact
    times = np.array([data.draw(st.integers(0, 8)) / 2 for _ in range(n)], dtype=np.float64)
    use = data.draw(st.integers(0, n - 1))
    lo = data.draw(st.integers(0, use))
    need = data.draw(st.integers(0, 24)) / 4
    room = [data.draw(st.integers(0, 5)) > 0 for _ in range(n)]
    asked: list[int] = []

    def fits(t: int) -> bool:
        asked.append(t)
        return room[t]

    p = _ahead(times, use, lo, need, fits)
    assert lo <= p <= use
    assert all(room[t] for t in range(p, use)), (p, room)
    hidden = sum(times[p:use].tolist())
    assert p == use or sum(times[p + 1:use].tolist()) < need  # no step further back than hides it
    stopped = "lo" if p == lo else "hidden" if hidden >= need else "room"
    event(f"stopped: {stopped}")
    if stopped == "room":
        assert not room[p - 1]
    assert asked == list(range(use - 1, p - 1 - (stopped == "room"), -1)), (asked, p, stopped)
