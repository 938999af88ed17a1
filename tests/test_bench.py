"""The benchmark harness's own logic: the alternating order, the memory readings, the runner."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _harness  # noqa: E402


def test_alternate_rotates_the_order_each_repeat_and_rejects_unknown_contenders(capsys):
    seen = []
    after = []
    runs = _harness.alternate(["a", "b", "c"], ("a", "b", "c"), 3, lambda n: seen.append(n) or [{"n": n}],
                              lambda: after.append(len(seen)))
    assert seen == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # nobody always first, or always after one
    assert [r["n"] for r in runs] == seen and after == [3, 6, 9]
    with pytest.raises(SystemExit, match="unknown contender 'd'"):
        _harness.alternate(["a", "d"], ("a", "b"), 1, lambda n: [])


def _has_hwm() -> bool:
    from bench import _rss

    return sys.platform.startswith("linux") and "VmHWM" in _rss.status()


@pytest.mark.skipif(not _has_hwm(), reason="needs Linux's VmHWM (gVisor's /proc has none)")
def test_the_cpu_meter_sees_a_peak_that_is_gone_again():
    meter = _harness.Meter("cpu")
    held = meter.baseline()
    t = torch.ones(64 << 18)  # 64 MiB, touched
    del t
    peak = meter.peak()
    assert peak - held >= 60 << 20, (peak, held)
    assert meter.now() - held < 32 << 20  # freed: its own mapping (or trimmed) leaves the RSS


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does")
def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused_plainly():
    assert _harness.device("auto") == "cpu"
    with pytest.raises(SystemExit, match="no CUDA device"):
        _harness.device("cuda")


def test_each_rank_writes_its_own_result_and_run_reads_them_all(tmp_path, monkeypatch):
    """Under torchrun every rank serves its result to a file of its own (their stdout interleaves)."""
    import argparse
    import json

    out = str(tmp_path / "result.json")
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        args = argparse.Namespace(worker="w", result=out)
        assert _harness.serve(args, lambda a: {"rank": int(os.environ["RANK"])}) == 0
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    for rank in (0, 1):
        with open(_harness._result_path(out, rank, 2)) as f:
            assert json.load(f) == {"rank": rank}
    assert not os.path.exists(out)  # no single-process file when there are ranks
    assert _harness.serve(argparse.Namespace(worker=None, result=out), lambda a: {}) is None  # the parent


def test_tokens_keeps_the_largest_batch_within_the_budget_and_compares_losses_with_inductor():
    """bench tokens' summary (no processes run): the largest batch whose growth is within the
    budget, what stopped the doubling, and bit-identity with Inductor at the batches both ran."""
    from bench import tokens

    def run(name, batch, growth_mib, loss=1.0, planned=True):
        r = dict(contender=name, batch=batch, tokens=batch * 128, planned=planned)
        if planned:
            r.update(growth=growth_mib << 20, losses=[loss, loss], step_s=[0.1 * batch, 0.3 * batch])
        else:
            r["error"] = "BudgetError: no plan"
        return r

    runs = [run("inductor", 1, 20), run("zinf", 1, 20), run("inductor", 2, 40), run("zinf", 2, 30),
            run("inductor", 4, 80), run("zinf", 4, 50, loss=1.5), run("zinf", 8, 0, planned=False)]
    s = tokens.summarize(runs, ["inductor", "zinf"], 64 << 20)
    assert (s["inductor"]["largest_batch"], s["inductor"]["tokens"]) == (2, 256)
    assert s["inductor"]["stopped_by"].startswith("growth 80.0 MiB at batch 4")
    assert (s["zinf"]["largest_batch"], s["zinf"]["step_s_median"]) == (4, pytest.approx(0.8))
    assert s["zinf"]["stopped_by"].startswith("error: BudgetError")
    assert s["zinf"]["batches_compared_with_inductor"] == [1, 2, 4]  # inductor ran 4, over its budget
    assert not s["zinf"]["losses_bit_identical_to_inductor"] and s["zinf"]["max_loss_diff_vs_inductor"] == 0.5
    v = tokens._versus(runs, s)
    assert v["zinf_tokens_over_inductor"] == 2.0 and v["zinf_step_time_over_inductor"] == pytest.approx(1.0)
    # per token, each at its largest batch: inductor 0.4 s / 256, zinf 0.8 s / 512
    assert s["zinf"]["step_s_per_token"] == pytest.approx(0.8 / 512)
    assert v["step_per_token_over_inductor"] == {"inductor": pytest.approx(1.0), "zinf": pytest.approx(1.0)}
    assert not v["target_met"]  # 2x the tokens, not 4x
