"""`zinf plan`, `zinf show`: offline plans of the examples, and their pictures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from zinf_compile.cli import main
from zinf_compile.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "examples", "mlp.py") + ":build"
GPT = os.path.join(ROOT, "examples", "gpt.py") + ":build"


def test_plan_writes_plan_report_and_table(tmp_path, capsys):
    rc = main(["plan", GPT, "--arg", "batch=4", "--arg", "seq=64", "--arg", "layers=2", "--arg", "hidden=128",
               "--budget", "8.5MiB", "--target", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for row in ("peak before", "peak after", "lower bound", "bytes moved (nvme)", "predicted stall", "actions"):
        assert row in out
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.graphs == ("forward", "backward")
    assert plan.peak_after <= plan.budget == int(8.5 * 2**20) < plan.peak_before
    counts = plan.action_counts()
    assert counts["offload"] == counts["prefetch"] == counts["wait"] > 0
    assert f"offload {counts['offload']}" in out
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2
    for f in ("timeline.png", "lanes.png", "graph.dot"):
        assert (tmp_path / f).stat().st_size > 0


def test_plan_inference_and_show(tmp_path, capsys):
    assert main(["plan", MLP, "--inference", "--out", str(tmp_path), "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.graphs == ("inference",) and plan.is_empty()
    assert main(["show", str(tmp_path / "plan.json"), "--out", str(tmp_path / "pics")]) == 0
    assert (tmp_path / "pics" / "report.html").exists()
    assert "wrote html" in capsys.readouterr().out


def test_plan_impossible_budget_exits_2_naming_the_bound(tmp_path, capsys):
    assert main(["plan", MLP, "--budget", "1KB", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "lower bound on peak device memory is" in err and "impossible" in err
    assert not (tmp_path / "plan.json").exists()


def test_bad_factory_and_args(tmp_path, capsys):
    assert main(["plan", "no/such/file.py:build", "--out", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["plan", MLP, "--arg", "batch", "--out", str(tmp_path)]) == 2
    assert "--arg expects key=value" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    """The installed command, as a user types it."""
    exe = os.path.join(os.path.dirname(sys.executable), "zinf")
    assert os.path.exists(exe), "the zinf console script is not installed"
    golden = os.path.join(ROOT, "tests", "golden", "gpt_plan.json")
    assert json.loads(open(golden).read())["actions"]
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "plan" in r.stdout and "calibrate" in r.stdout, r.stderr
    r = subprocess.run([exe, "plan", "nowhere.py:f"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_calibrate_writes_a_profile_that_plans_use(tmp_path, capsys):
    from zinf_compile.cost import load_profile

    out = tmp_path / "local.json"
    assert main(["calibrate", "--out", str(out), "--offload-dir", str(tmp_path), "--mib", "8"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "local" and prof.device == "cpu"
    assert prof.flops > 1e8 and prof.nvme_read_bw > 1e6 and prof.nvme_write_bw > 1e6 and prof.mem_bw > 1e7
    assert sorted(os.listdir(tmp_path)) == ["local.json"]  # the probe file is gone
    assert "wrote" in capsys.readouterr().out


def test_plan_for_a_gpu_target_frees_device_memory_with_the_cpu_tier(tmp_path, capsys):
    """Traced on this CPU, planned for an H100: CPU memory is another tier there (review found the
    plan judged the tier by the trace device and claimed it freed nothing)."""
    assert main(["plan", GPT, "--arg", "batch=4", "--arg", "seq=64", "--arg", "layers=2", "--arg", "hidden=128",
                 "--arg", "heads=2", "--budget", "9MiB", "--target", "h100-80gb", "--out", str(tmp_path),
                 "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.device == "cuda" and plan.tier == "cpu"
    assert plan.peak_after <= plan.budget < plan.peak_before
    assert not any("frees no memory" in n for n in plan.notes)


# -- parameters (ZeRO-3) in the offline plan -------------------------------------------------------

MLP_SMALL_BATCH = ["--arg", "batch=16"]  # 1 MiB of weights (4 x 256 KiB) against 16 KiB activations


def test_plan_params_offload_writes_parameter_actions_and_report(tmp_path, capsys):
    assert main(["plan", MLP, *MLP_SMALL_BATCH, "--params", "offload", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert [p.name for p in plan.params] == ["0.weight", "2.weight", "4.weight", "6.weight"]  # 8.weight: 1 KiB
    assert all(p.tier == "nvme" and p.world == 1 and p.shard_nbytes == p.nbytes == 256 << 10 for p in plan.params)
    counts = plan.action_counts()
    assert counts["gather"] == counts["release"] >= 4 and counts["reduce"] == 4
    assert counts.get("fetch", 0) >= 1  # NVMe shards are read ahead of their gathers
    assert "managed parameters  4: 1.00 MiB whole" in out
    assert f"parameter gathers   {counts['gather']} per step" in out
    html = (tmp_path / "report.html").read_text()
    table = html.split("<h2>Managed parameters</h2>")[1].split("<h2>")[0]
    assert all(f"<td>{p.name}</td>" in table for p in plan.params)
    assert (tmp_path / "lanes.png").stat().st_size > 0


def test_plan_params_auto_manages_them_when_resident_does_not_fit(tmp_path, capsys):
    assert main(["plan", MLP, *MLP_SMALL_BATCH, "--budget", "1MiB", "--out", str(tmp_path), "--no-report"]) == 0
    captured = capsys.readouterr()
    assert "parameters (auto): all resident need 2.04 MiB > budget 1.00 MiB; 3 of 4 candidate parameter(s) managed" \
        in captured.err
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert len(plan.params) == 3 and plan.peak_after <= plan.budget == 1 << 20  # the fewest that fit
    assert {"gather", "release", "reduce"} <= set(plan.action_counts())


def test_plan_offline_resident_auto_offload():
    """One factory planned per --params choice through the backend's pipeline."""
    import pytest

    from zinf_compile.capture import plan_offline
    from zinf_compile.cost import load_profile
    from zinf_compile.errors import BudgetError

    from mlp import build

    prof = load_profile("cpu")
    with pytest.raises(BudgetError):
        plan_offline(build, {"batch": 16}, 1 << 20, prof, "nvme", params="resident")
    roomy = plan_offline(build, {"batch": 16}, 1 << 30, prof, "nvme", params="auto")
    assert [p.name for p in roomy.params][:2] == ["0.weight", "0.bias"]
    assert not roomy.plan.params and not roomy.managed
    assert "parameters (auto): all resident fit" in roomy.plan.notes[0]
    forced = plan_offline(build, {"batch": 16}, 1 << 30, prof, "cpu", params="offload")  # the CPU tier: no fetches
    assert len(forced.plan.params) == len(forced.managed) == 4 and "fetch" not in forced.plan.action_counts()


def test_plan_inference_params_offload(tmp_path):
    assert main(["plan", MLP, *MLP_SMALL_BATCH, "--inference", "--params", "offload", "--out", str(tmp_path),
                 "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.graphs == ("inference",) and len(plan.params) == 4
    counts = plan.action_counts()
    assert counts["gather"] == counts["release"] == 4 and "reduce" not in counts


def test_plan_gather_dtype_reads_half_the_bytes(tmp_path):
    """`--gather-dtype bfloat16`: the plan's gathers read the parameters' bf16 copies, half of what
    float32 shards move through the tier per forward."""
    moved = {}
    for extra in ((), ("--gather-dtype", "bfloat16")):
        out = tmp_path / (extra[-1] if extra else "float32")
        assert main(["plan", MLP, *MLP_SMALL_BATCH, "--inference", "--params", "offload", "--offload", "nvme",
                     "--out", str(out), "--no-report", *extra]) == 0
        plan = Plan.load(str(out / "plan.json"))
        assert len(plan.params) == 4
        moved[extra[-1] if extra else "float32"] = plan.bytes_moved["nvme"]
    assert moved["bfloat16"] * 2 == moved["float32"] > 0, moved


def test_plan_with_activation_offloads_and_managed_parameters(tmp_path):
    """Both levers in one plan: the parameters' traffic adds to the activations' in bytes_moved."""
    assert main(["plan", GPT, "--arg", "batch=4", "--arg", "seq=64", "--arg", "layers=2", "--arg", "hidden=128",
                 "--budget", "6MiB", "--target", "cpu", "--params", "offload", "--out", str(tmp_path),
                 "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    counts = plan.action_counts()
    assert counts.get("offload", 0) > 0 and counts.get("gather", 0) > 0
    activations = sum(2 * a.nbytes for a in plan.actions if a.kind == "offload")
    params = sum(p.shard_nbytes for a in plan.actions if a.kind in ("gather", "reduce")
                 for p in plan.params if -1 - p.pid == a.group)
    assert plan.bytes_moved["nvme"] == activations + params
    assert plan.peak_after <= plan.budget


# -- memory-centric tiling in the offline plan -------------------------------------------------------

TILED = os.path.join(ROOT, "examples", "tiled.py") + ":build"
SMALL_BIG = ["--arg", "batch=16", "--arg", "d_in=24", "--arg", "width=600", "--arg", "d_out=10",
             "--params", "offload", "--offload", "nvme"]  # big.weight: 600 x 600 fp32, 1.37 MiB


def test_plan_tiles_a_weight_larger_than_the_budget_and_shows_it(tmp_path, capsys):
    assert main(["plan", TILED, *SMALL_BIG, "--budget", "1MiB", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(str(tmp_path / "plan.json"))  # the tiles survive the JSON round trip
    tiles = {(t.graph, t.axis, t.grad): t for t in plan.tiles}
    assert set(tiles) == {("forward", "N", False), ("backward", "K", False), ("backward", "M", True)}
    t = tiles[("forward", "N", False)]
    assert t.param == "big.weight" and t.count >= 2 and t.tile_shape == (-(-600 // t.count), 600)
    assert plan.peak_after <= plan.budget == 1 << 20
    assert f"tiled forward {t.op}" in out and f"{t.count} tiles along N, weight tile {t.tile_shape[0]}x600" in out
    html = (tmp_path / "report.html").read_text()
    assert "tiles along K" in html  # the report's summary lists them too
    capsys.readouterr()
    assert main(["show", str(tmp_path / "plan.json"), "--out", str(tmp_path / "shown")]) == 0
    assert f"{t.count} tiles along M" in capsys.readouterr().out


def test_plan_without_tiling_names_the_bound_and_max_tile_bytes_forces_tiles(tmp_path, capsys):
    assert main(["plan", TILED, *SMALL_BIG, "--budget", "1MiB", "--tiling", "off", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "lower bound" in err and "1.00 MiB is impossible" in err
    # forced: every managed weight over 200 KB in tiles of at most 200 KB, even with no budget pressure
    assert main(["plan", TILED, *SMALL_BIG, "--max-tile-bytes", "200KB", "--out", str(tmp_path), "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.tiles and all(t.tile_nbytes <= 200_000 for t in plan.tiles)
    assert {t.count for t in plan.tiles} == {-(-600 * 600 * 4 // 200_000)}


FACTORY = GPT
TINY = ["--arg", "layers=1", "--arg", "hidden=64", "--arg", "seq=16", "--arg", "batch=2"]


def test_bad_inputs_exit_2_with_one_message(tmp_path, capsys):
    """A user's mistake is one line saying what is wrong, exit 2, never a traceback."""
    plan_path = tmp_path / "plan.json"
    assert main(["plan", FACTORY, *TINY, "--out", str(tmp_path), "--no-report"]) == 0
    good = json.loads(plan_path.read_text())
    cases = {
        "missing.json": None,
        "garbage.json": "not json {",
        "list.json": "[1, 2]",
        "empty.json": "{}",
        "future.json": json.dumps({**good, "version": 99}),
        "nofield.json": json.dumps({k: v for k, v in good.items() if k != "steps"}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        capsys.readouterr()
        assert main(["show", str(path)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("zinf: error: ") and name in err and "Traceback" not in err, (name, err)
    for args in (["--arg", "=5"], ["--arg", "layers=many"], ["--arg", "nonsense=1"]):
        capsys.readouterr()
        assert main(["plan", FACTORY, *args, "--out", str(tmp_path), "--no-report"]) == 2, args
        err = capsys.readouterr().err
        assert "zinf: error: " in err and "Traceback" not in err, (args, err)


def test_bad_options_name_the_mistake():
    import pytest

    import zinf_compile
    from zinf_compile.config import ZinfConfig

    for bad in ("budget=1GB", 5, [("budget", "1GB")]):
        with pytest.raises(zinf_compile.ZinfConfigError, match="options must be a dict"):
            ZinfConfig.from_options(bad)


_LAYERDROP = '''
import torch
from torch import nn


class Drop(nn.Module):
    """Two layers, each skipped in train mode when a draw falls below `p` (Hugging Face's LayerDrop)."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = torch.relu(layer(x))
        return x.sum()


def build(p=0.0):
    return Drop(p), (torch.randn(8, 64),)
'''


def test_plan_decides_layerdrop_branches_by_the_draws_range(tmp_path, capsys, recwarn):
    """`torch.rand([]) < 0.0` is False for every draw: the plan follows the layer (both linears in
    the graph) and warns that a real compile breaks the graph there; `< 0.5` cannot be decided
    without a value: exit 2 naming what the model did."""
    factory = tmp_path / "drop.py"
    factory.write_text(_LAYERDROP)
    assert main(["plan", f"{factory}:build", "--out", str(tmp_path / "a"), "--no-report"]) == 0
    plan = Plan.load(str(tmp_path / "a" / "plan.json"))
    assert plan.graphs == ("forward", "backward")
    warned = [str(w.message) for w in recwarn if "random draw" in str(w.message)]
    assert warned and warned[0].startswith("zinf plan: the model branches in Python on a random draw at 1 place(s) (drop.py:"), warned
    assert "lt 0.0 is always False" in warned[0]
    capsys.readouterr()
    assert main(["plan", f"{factory}:build", "--arg", "p=0.5", "--out", str(tmp_path / "b"), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "reads a tensor's value in Python" in err and "Traceback" not in err
    assert not (tmp_path / "b" / "plan.json").exists()
