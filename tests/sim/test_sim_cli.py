"""dtrain simulate collective|train and dtrain plan: the command line on presets, JSON and tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.cli.main import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_collective_reports_time_and_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "simulate", "collective", "--topology", "h100-node", "--bytes", "1G")
    assert data["ranks"] == 8 and data["bytes"] == 2**30
    # ring all-reduce moves 2 (p-1)/p of the buffer through each GPU's NVLink 4 (450 GB/s a direction) and
    # reduces (p-1)/p of it, reading two operands and writing one at the H100's 3.35 TB/s
    wire_s, reduce_s = 2 * 7 / 8 * 2**30 / 450e9, 7 / 8 * 2**30 * 3 / 3.35e12
    assert data["time_s"] == pytest.approx(wire_s + reduce_s, rel=0.02)
    assert data["bottleneck"].endswith("nvswitch")


def test_hierarchical_beats_ring_across_oversubscribed_racks(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["simulate", "collective", "--topology", "4-rack", "--bytes", "64M", "--ranks", "32"]
    ring = run_json(capsys, *common, "--algorithm", "ring", "--placement", "oblivious")
    hierarchical = run_json(capsys, *common, "--algorithm", "hierarchical")
    assert hierarchical["time_s"] < ring["time_s"]


def test_simulate_train_prints_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "2", "--tp", "4", "--global-batch", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "one training step" in out and "tp_comm_s" in out and "links over the step" in out


def test_simulate_train_counts_a_straggler(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--zero", "1"]
    base = run_json(capsys, *argv)
    slow = run_json(capsys, *argv, "--slow-rank", "5:2")
    assert slow["step_s"] - base["step_s"] == pytest.approx(base["compute_s"], rel=1e-6)


def test_simulate_train_takes_megatron_exchanges_and_uneven_stages(capsys: pytest.CaptureFixture[str]) -> None:
    # gpt2-xl's 48 layers and 2 embeddings over 5 stages: 9, 10, 10, 10, 9
    argv = ["simulate", "train", "--topology", "h100-node", "--model", "gpt2-xl", "--vocab", "50257", "--pp", "5",
            "--global-batch", "10"]  # fmt: skip
    uneven = run_json(capsys, *argv, "--embedding-layers", "1")
    assert uneven["layout"]["embedding_layers"] == 1
    held = run_json(capsys, *argv, "--embedding-layers", "1", "--synchronous-p2p")
    assert held["step_s"] > uneven["step_s"]
    assert main(argv) == 2  # 48 layers do not split into 5 equal stages
    assert "do not split" in "".join(capsys.readouterr())


def test_simulate_train_prices_zb_v_below_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    # a transformer's T_F, T_B and T_W differ; ZB-V's order is built for the stages' own
    argv = ["simulate", "train", "--topology", "h100-node", "--pp", "4", "--global-batch", "16", "--json"]
    v, h1, one = (run_json(capsys, *argv[:-1], "--schedule", s) for s in ("zb-v", "zb-h1", "1f1b"))
    assert v["step_s"] < h1["step_s"] < one["step_s"] and v["bubble"] < h1["bubble"] < one["bubble"]
    # with free messages and equal stages each runs at its theory's bubble, Qi et al.'s for ZB-H1 and ZB-V
    for data in (v, h1, one):
        assert data["bubble"] == pytest.approx(data["bubble_theory"], abs=0.003)
    assert h1["bubble_theory"] < one["bubble_theory"] == pytest.approx(3 / 19)


def test_simulate_train_takes_every_pipeline_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--pp", "4", "--global-batch", "16"]
    steps, bubbles = {}, {}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"):
        data = run_json(capsys, *argv, "--schedule", schedule)
        assert data["layout"]["chunks"] == (2 if schedule in ("interleaved-1f1b", "zb-v") else 1)
        steps[schedule] = data["step_s"]
        bubbles[schedule] = data["bubble"]
        # the bubble is the simulated one: the slowest stage's idle share of the pipeline's span
        assert data["bubble"] == pytest.approx(1 - data["compute_s"] / data["pipeline_s"], abs=1e-9)
        assert 0 < data["bubble_theory"] < 1
    assert steps["interleaved-1f1b"] < steps["1f1b"] and steps["zb-h1"] < steps["1f1b"]
    assert bubbles["interleaved-1f1b"] < bubbles["1f1b"] and bubbles["zb-h1"] < bubbles["1f1b"]
    grouped = run_json(capsys, *argv, "--schedule", "interleaved-1f1b", "--microbatch-group", "8", "--chunks", "4")
    assert grouped["layout"]["microbatch_group"] == 8 and grouped["layout"]["chunks"] == 4
    assert main([*argv, "--schedule", "interleaved-1f1b", "--microbatch-group", "6"]) == 2
    assert "in a multiple of pp=4" in "".join(capsys.readouterr())


def test_plan_lists_the_fastest_layouts_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--topology", "h100-node", "--global-batch", "16", "--top", "3")
    steps = [p["step_s"] for p in data["plans"]]
    assert len(steps) == 3 and steps == sorted(steps)
    assert all(p["fits"] for p in data["plans"]) and data["too_big"] > 0


def test_simulate_and_plan_take_megatron_lms_rank_order(capsys: pytest.CaptureFixture[str]) -> None:
    from dtrain.cli import sim as sim_cli
    from dtrain.sim.placement import PLACEMENTS

    assert sim_cli.PLACEMENTS == PLACEMENTS
    rail = ["--topology", "h100-rail", "--set", "racks=1", "--set", "servers_per_rack=2"]
    argv = ["simulate", "train", *rail, "--tp", "4", "--pp", "2", "--dp", "2", "--global-batch", "8"]
    ours, theirs = run_json(capsys, *argv), run_json(capsys, *argv, "--placement", "megatron")
    assert ours["placement"] == "aware" and theirs["placement"] == "megatron"
    # dp 2 on two servers: the replicas share a server (NVLink) instead of crossing the network; the stages don't
    assert theirs["dp_comm_s"] < ours["dp_comm_s"] / 4 and theirs["pp_message_s"] > ours["pp_message_s"]
    plans = run_json(capsys, "plan", *rail, "--global-batch", "8", "--micro-batches", "1", "--top", "200",
                     "--exhaustive", "--placements", "aware,megatron")["plans"]  # fmt: skip
    placed = {}
    for p in plans:
        placed.setdefault(p["layout"], []).append(p["placement"])
    # a layout with both a pipeline and data parallelism is tried in each order, any other once (the same devices)
    for layout, hows in placed.items():
        both = " pp1 " not in layout and not layout.startswith("dp1 ")
        assert sorted(hows) == (["aware", "megatron"] if both else ["aware"]), (layout, hows)
    assert any(len(hows) == 2 for hows in placed.values())
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--placement", "rows"])
    assert stopped.value.code == 2 and "argument --placement: invalid choice: 'rows'" in capsys.readouterr().err
    assert main(["plan", *rail, "--global-batch", "8", "--placements", "aware,rows"]) == 2
    assert "--placements: among aware,megatron,oblivious, got aware,rows" in "".join(capsys.readouterr())


def test_plan_of_a_run_config_refuses_what_dtrain_train_does_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml")
    for flag in ("--tp-comm-overlap", "--distributed-optimizer", "--overlap-p2p-comm"):
        assert main(["plan", "--topology", "h100-node", "--config", config, flag]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"dtrain: error: {flag}: not with --config (dtrain train "
                                                     "does not run it; its plan would not hold)"]  # fmt: skip


def test_plan_searches_the_zero_bubble_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--topology", "h100-node", "--global-batch", "16", "--top", "40", "--exhaustive"]
    every = [p["layout"] for p in run_json(capsys, *argv)["plans"]]
    for name in ("zb-h1", "zb-v", "interleaved-1f1b"):
        assert any(name in layout for layout in every), name
    assert not any(("zb-" in layout) and ("zero2" in layout or "zero3" in layout) for layout in every)
    only = [p["layout"] for p in run_json(capsys, *argv, "--schedules", "zb-v", "--zero", "0,1,2")["plans"]]
    piped = [layout for layout in only if " pp1 " not in layout]
    assert piped and all("zb-vx2" in layout and "zero2" not in layout for layout in piped)
    for bad in ("nope", "zb-v,zb-v", ""):
        with pytest.raises(SystemExit) as stopped:
            main([*argv, "--schedules", bad])
        assert stopped.value.code == 2 and "argument --schedules: expected" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "train", "--topology", "h100-node", "--dp", "3", "--global-batch", "8"]) == 2
    captured = capsys.readouterr()
    assert "not a multiple of dp x micro_batch" in captured.out + captured.err
    assert main(["simulate", "collective", "--topology", "no-such-preset", "--bytes", "1M"]) == 2


def test_the_simulator_imports_no_torch() -> None:
    code = (
        "import sys, dtrain.sim, dtrain.sim.planner, dtrain.sim.fit, dtrain.sim.peer_model; "
        "print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_algorithm_all_compares_every_algorithm_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "simulate", "collective", "--topology", "h100-node", "--bytes", "64M", "--algorithm", "all")
    names = [r["algorithm"] for r in data["algorithms"]]
    assert {"ring", "tree", "halving_doubling", "direct", "star"} <= set(names)
    assert [r["time_s"] for r in data["algorithms"]] == sorted(r["time_s"] for r in data["algorithms"])


def test_a_calibration_file_sets_the_software_costs(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    calibration = tmp_path / "calibration.json"
    link = {"alpha_s": 1e-3, "beta_s_per_byte": 1e-12, "gamma_s_per_byte": 0.0}
    calibration.write_text(json.dumps({"intra": link, "inter": None}))
    common = ["simulate", "collective", "--topology", "h100-node", "--bytes", "8K", "--algorithm", "ring"]
    free = run_json(capsys, *common)
    slow = run_json(capsys, *common, "--calibration", str(calibration))
    assert slow["time_s"] - free["time_s"] == pytest.approx(14 * 1e-3, rel=0.01)  # 2 (p - 1) rounds of alpha


# -- dtrain simulate ps ------------------------------------------------------------------------------------------

STAR = """
name = "ps-star"
{nodes}
[[node]]
name = "sw"
kind = "switch"
{links}
"""


def ps_star(tmp_path, gbyte_per_s: float = 1.0) -> str:
    """Two machines with a GPU (workers) and two with a CPU (servers) on one switch, every link alike, no
    latency: the uniform network of the closed forms."""
    nodes, links = [], []
    for name, kind, server in [("a/gpu0", "gpu", "a"), ("b/gpu0", "gpu", "b"), ("c/cpu0", "cpu", "c"),
                               ("d/cpu0", "cpu", "d")]:  # fmt: skip
        device = 'device = "h100-sxm"\n' if kind == "gpu" else ""
        nodes.append(f'[[node]]\nname = "{name}"\nkind = "{kind}"\nserver = "{server}"\n{device}')
        links.append(f'[[link]]\na = "{name}"\nb = "sw"\nkind = "ethernet100"\ngbyte_per_s = {gbyte_per_s}\n'
                     "latency_s = 0.0\n")  # fmt: skip
    path = tmp_path / "star.toml"
    path.write_text(STAR.format(nodes="\n".join(nodes), links="\n".join(links)))
    return str(path)


def test_simulate_ps_of_a_dense_model_equals_the_closed_form(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    data = run_json(capsys, "simulate", "ps", "--topology", ps_star(tmp_path), "--servers", "2",
                    "--server-placement", "apart", "--dense-bytes", "8M")  # fmt: skip
    assert data["workers"] == ["a/gpu0", "b/gpu0"] and data["servers"] == ["c/cpu0", "d/cpu0"]
    # each worker pushes 8 MiB (half to each server) up its link, then pulls it back: two phases of P / B
    assert data["time_s"] == pytest.approx(2 * 8 * 2**20 / 1e9, rel=1e-6)
    assert [s["push_bytes"] for s in data["server_loads"]] == [8 * 2**20, 8 * 2**20]
    assert data["imbalance"] == {"bytes": 1.0, "pulls": 1.0, "requests": 1.0}


def test_simulate_ps_counts_params_and_the_optimizer(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    argv = ["simulate", "ps", "--topology", ps_star(tmp_path), "--workers", "a/gpu0", "--servers", "c/cpu0"]
    free = run_json(capsys, *argv, "--params", "1e6")
    slow = run_json(capsys, *argv, "--params", "1e6", "--apply-gbyte-per-s", "2")
    assert free["dense_bytes"] == 4e6 and free["time_s"] == pytest.approx(2 * 4e6 / 1e9)
    assert slow["time_s"] - free["time_s"] == pytest.approx(4e6 / 2e9)  # one apply of the 4 MB shard
    hosted = run_json(capsys, *argv, "--params", "1e6", "--host-gbyte-per-s", "4")
    # push and pull reply: each worked on by its sender and its receiver, 4 MB at 4 GB/s each time
    assert hosted["time_s"] - free["time_s"] == pytest.approx(4 * 4e6 / 4e9)


def test_simulate_ps_places_servers_beside_or_apart_from_the_workers(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["simulate", "ps", "--topology", "4-rack", "--set", "racks=1", "--workers", "16", "--dense-bytes", "1M"]
    beside = run_json(capsys, *common, "--servers", "2")
    apart = run_json(capsys, *common, "--servers", "3", "--server-placement", "apart")
    assert beside["servers"] == ["s0/cpu0", "s1/cpu0"]  # the workers are on s0 and s1's GPUs
    assert apart["servers"] == ["s2/cpu0", "s2/cpu1", "s3/cpu0"]


def test_simulate_ps_table_shows_step_servers_and_bottleneck(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    argv = ["simulate", "ps", "--topology", ps_star(tmp_path), "--servers", "c/cpu0,d/cpu0", "--batch", "64",
            "--ids-per-example", "4", "--key-space", "1000", "--zipf", "1.2", "--hot-keys", "8",
            "--hot-replicas", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "parameter-server step on ps-star: 2 workers, 2 servers, sync" in out
    assert "128 Zipf(1.2) ids a worker" in out  # 64 examples over 2 workers, 4 ids each
    assert "servers" in out and "c/cpu0" in out and "busiest links" in out and "bottleneck" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dense-bytes", "1M", "--workers", "999"], "--workers 999: topology"),
        (["--dense-bytes", "1M", "--servers", "99", "--server-placement", "apart"], "--servers 99: only 30 CPUs"),
        (["--dense-bytes", "1M", "--servers", "nowhere"], "--servers: 'nowhere': not a node of topology '4-rack'"),
        (["--dense-bytes", "1M", "--workers", "nope"],
         "--workers: 'nope': not a node of topology '4-rack' (its GPUs: s0/gpu0 to s15/gpu7)"),
        (["--dense-bytes", "1M", "--workers", "s0/gpu0,s0/gpu0"], "--workers names s0/gpu0 more than once"),
        (["--dense-bytes", "1M", "--servers", "s0/cpu0,s0/cpu0"], "--servers names s0/cpu0 more than once"),
        (["--dense-bytes", "1M", "--workers", "0"], "--workers 0: a count must be at least 1"),
        (["--dense-bytes", "1M", "--servers", "-2"], "--servers -2: a count must be at least 1"),
        (["--workers", "4"], "nothing to move"),
        (["--rows-per-worker", "100"], "need --key-space"),
        (["--dense-bytes", "1M", "--replicas", "3"], "--replicas 3: servers in each shard's chain"),
        (["--dense-bytes", "1M", "--replicas", "0"], "--replicas 0: servers in each shard's chain"),
        (["--dense-bytes", "1M", "--hot-replicas", "1"], "--hot-replicas 1: other servers a hot row is copied to"),
        (["--dense-bytes", "1M", "--hot-keys", "-1"], "--hot-keys -1: must be a whole number >= 0"),
        (["--rows-per-worker", "-5", "--key-space", "10"], "--rows-per-worker -5: must be a whole number >= 0"),
        (["--rows-per-worker", "5", "--key-space", "-10"], "--key-space -10: must be a whole number >= 0"),
        (["--rows-per-worker", "5", "--key-space", "10", "--row-bytes", "0"], "--row-bytes 0: must be a whole"),
        (["--rows-per-worker", "5", "--key-space", "10", "--zipf", "-1"], "--zipf -1.0: the Zipf exponent"),
        (["--rows-per-worker", "5", "--key-space", "10", "--zipf", "nan"], "--zipf nan: the Zipf exponent"),
        (["--batch", "64", "--key-space", "10", "--ids-per-example", "0"], "--ids-per-example 0: must be a whole"),
        (["--batch", "0", "--key-space", "10"], "--batch 0: must be a whole number >= 1"),
        (["--params", "1e6", "--bytes-per-param", "0"], "--bytes-per-param 0: must be a whole number >= 1"),
        (["--dense-bytes", "1M", "--seed", "-1"], "--seed -1: must be a whole number >= 0"),
        (["--dense-bytes", "1M", "--links", "-1"], "--links -1: must be a whole number >= 0"),
        (["--dense-bytes", "1M", "--apply-gbyte-per-s", "0"], "--apply-gbyte-per-s must be > 0"),
        (["--dense-bytes", "1M", "--apply-gbyte-per-s", "inf"], "--apply-gbyte-per-s must be > 0 (and finite)"),
        (["--dense-bytes", "1M", "--host-gbyte-per-s", "-1"], "--host-gbyte-per-s must be > 0"),
        (["--dense-bytes", "1M", "--set", "racks=0"], "racks"),
    ],
)  # fmt: skip
def test_simulate_ps_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str], extra, message: str) -> None:
    assert main(["simulate", "ps", "--topology", "4-rack", "--workers", "8", *extra]) == 2
    said = "".join(capsys.readouterr())
    assert said.startswith("dtrain: error: ") and message in said
    assert said.count("\n") == 1 and "Traceback" not in said


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--mode", "quorum"], "invalid choice: 'quorum'"),
        (["--dense-bytes", "lots"], "not a size in bytes: 'lots'"),
        (["--dense-bytes", "1M", "--params", "5"], "not allowed with argument"),
        (["--rows-per-worker", "8", "--batch", "64"], "not allowed with argument"),
    ],
)
def test_simulate_ps_rejects_bad_flags_before_simulating(capsys: pytest.CaptureFixture[str], bad, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "ps", "--topology", "4-rack", *bad])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_simulate_train_takes_tp_comm_overlap_with_sequence_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--tp", "8", "--global-batch", "2", "--sequence-parallel"]
    plain = run_json(capsys, *argv)
    overlapped = run_json(capsys, *argv, "--tp-comm-overlap")
    assert overlapped["step_s"] < plain["step_s"]
    assert main(argv[:-1] + ["--tp-comm-overlap"]) == 2
    assert "--tp-comm-overlap needs --sequence-parallel" in "".join(capsys.readouterr())
    margin = run_json(capsys, *argv, "--tp-comm-overlap", "--ub-sm-margin", "proj_fprop=24,fc2_fprop=20")
    assert margin["step_s"] > overlapped["step_s"]  # two forward products on 108 of the 132 multiprocessors or so
    for bad, message in (
        (["--tp-comm-overlap", "--ub-sm-margin", "proj_fprop"], "is not NAME=SMS"),
        (["--ub-sm-margin", "proj_fprop=24"], "needs --tp-comm-overlap"),
        (["--tp-comm-overlap", "--ub-sm-margin", "qkv_wgrad=4"], "ub_sm_margin: qkv_wgrad"),
    ):
        assert main([*argv, *bad]) == 2
        assert message in "".join(capsys.readouterr())


def test_simulate_train_prices_a_synchronous_amax_reduction_of_fp8_layers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-rail", "--dp", "4", "--tp", "2", "--pp", "2", "--global-batch",
            "16", "--micro-batch", "1", "--sequence-parallel", "--fp8"]  # fmt: skip
    plain = run_json(capsys, *argv)
    synchronous = run_json(capsys, *argv, "--amax-reduction", "synchronous")
    assert plain["amax_s"] == 0.0 < synchronous["amax_s"] <= synchronous["step_s"] - plain["step_s"] + 1e-12
    assert main([*argv[:-1], "--amax-reduction", "synchronous"]) == 2
    assert "--amax-reduction: needs --fp8" in "".join(capsys.readouterr())


def test_plan_prices_interleaved_plans_with_megatron_core_overlaps(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--topology", "h100-node", "--params", "4e8", "--layers", "8", "--hidden", "2048", "--heads", "16",
            "--global-batch", "16", "--micro-batches", "1", "--zero", "0", "--recompute", "none", "--placements",
            "aware", "--max-tp", "1", "--top", "40", "--exhaustive"]  # fmt: skip

    def interleaved(*extra: str) -> dict:
        return {p["layout"]: p for p in run_json(capsys, *argv, *extra)["plans"] if "interleaved" in p["layout"]}

    plain, overlapped = interleaved(), interleaved("--overlap-grad-reduce", "--overlap-p2p-comm")
    assert plain and plain.keys() == overlapped.keys()
    for name, p in plain.items():  # each chunk's reduction after its own last backward: the first chunk's shows
        assert 0 < overlapped[name]["dp_exposed_s"] < p["dp_exposed_s"]
    assert main([*argv, "--overlap-param-gather"]) == 2
    assert "--overlap-param-gather needs --overlap-grad-reduce" in "".join(capsys.readouterr())


@pytest.mark.parametrize("pp", ["1", "2"])
def test_zero2_overlaps_its_reduce_scatter_with_backward_under_overlap_grad_reduce(capsys, pp: str) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "4", "--pp", pp, "--global-batch", "16",
            "--zero", "2"]  # fmt: skip
    after = run_json(capsys, *argv)
    under = run_json(capsys, *argv, "--overlap-grad-reduce")
    assert after["dp_exposed_s"] == pytest.approx(after["dp_comm_s"])  # after backward
    assert under["dp_comm_s"] == pytest.approx(after["dp_comm_s"])
    assert under["dp_exposed_s"] < after["dp_exposed_s"] and under["step_s"] < after["step_s"]
    gathered = run_json(capsys, *argv, "--overlap-grad-reduce", "--overlap-param-gather")
    assert gathered["dp_exposed_s"] < under["dp_exposed_s"]


def test_overlap_grad_reduce_is_refused_with_zero3_naming_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "4", "--global-batch", "16", "--zero", "3"]
    assert main([*argv, "--overlap-grad-reduce"]) == 2
    said = "".join(capsys.readouterr())
    assert said == ("dtrain: error: --overlap-grad-reduce: not with --zero 3, whose reduce-scatter and weight "
                    "all-gathers the simulator prices after backward (use --zero 0, 1 or 2)\n")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--dp", "0"], "--dp"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--tp", "two"], "--tp"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "0"], "--global-batch"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--micro-batch", "0"],
         "--micro-batch"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--chunks", "-1"], "--chunks"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--layers", "0"], "--layers"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--vocab", "-1"], "--vocab"),
        (["simulate", "train", "--topology", "h200-4gpu", "--global-batch", "8", "--links", "-1"], "--links"),
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M", "--pipeline", "0"], "--pipeline"),
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M", "--local-size", "0"],
         "--local-size"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "-8"], "--global-batch"),
    ],
)  # fmt: skip
def test_a_bad_whole_number_names_its_flag_in_one_line(capsys, argv, flag: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    said = "".join(capsys.readouterr())
    assert exit_.value.code == 2 and f"error: argument {flag}: expected a whole number" in said
    assert said.count("\n") == 1


def test_fp8_and_fused_accumulation_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--model", "llama-7b", "--tp", "8", "--global-batch", "2",
            "--sequence-parallel"]  # fmt: skip
    plain = run_json(capsys, *argv)
    fp8 = run_json(capsys, *argv, "--fp8")
    fused = run_json(capsys, *argv, "--grad-accumulation-fusion")
    assert fp8["layout"]["fp8"] and fp8["compute_s"] < plain["compute_s"]
    assert fused["compute_s"] < plain["compute_s"]
    assert fp8["memory_gb"] != plain["memory_gb"]
    fp8_weights = run_json(capsys, *argv, "--fp8", "--fp8-params")
    assert fp8_weights["layout"]["fp8_params"] and fp8_weights["memory_gb"] < fp8["memory_gb"]
    assert main([*argv, "--fp8-params"]) == 2
    assert "--fp8-params: needs --fp8" in "".join(capsys.readouterr())
    a100 = ["simulate", "train", "--topology", "dgx-a100", "--tp", "8", "--global-batch", "2", "--fp8"]
    assert main(a100) == 2
    assert "fp8: device s0/gpu0 has no FP8 products" in "".join(capsys.readouterr())
    plan = ["plan", "--topology", "h100-node", "--params", "4e8", "--layers", "8", "--hidden", "2048", "--heads",
            "16", "--global-batch", "16", "--micro-batches", "1", "--zero", "0", "--placements", "aware",
            "--fp8"]  # fmt: skip
    plans = run_json(capsys, *plan)["plans"]
    assert plans and all(p["layout"].endswith("fp8") or " fp8" in p["layout"] for p in plans)
    assert main(["plan", "--topology", "h100-node", "--config", "configs/tiny-cpu.toml", "--fp8"]) == 2
    assert "--fp8: not with --config" in "".join(capsys.readouterr())


def test_contention_is_priced_unless_turned_off(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8"]
    paid = run_json(capsys, *argv)
    free = run_json(capsys, *argv, "--no-contention")
    assert paid["contention_s"] > 0 and free["contention_s"] == 0
    assert paid["step_s"] == pytest.approx(free["step_s"] + paid["contention_s"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "0"], "--bytes must be at least 1"),
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M", "--ranks", "1"], "--ranks must be"),
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M", "--placement", "s0/gpu0,s0/gpu0"],
         "names s0/gpu0 more than once"),
        (["simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M", "--calibration", "/no/such.json"],
         "--calibration /no/such.json: not a dtrain calibration file (no such file)"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--micro-batches", "0"], "--micro-batches"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--devices", "99"], "--devices: 99 but"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--devices", "0"], "--devices: must be >= 1"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--max-tp", "0"], "--max-tp: must be >= 1"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--placements", ""], "--placements"),
        (["simulate", "ps", "--topology", "h200-4gpu", "--params", "inf"], "--params must be a finite count"),
        (["simulate", "collective", "--topology", "h100-node", "--bytes", "64M", "--algorithm", "native",
          "--alpha-us", "1000"], "--alpha-us: the software costs of our algorithms; native is NCCL's own"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8",
          "--distributed-optimizer"], "--distributed-optimizer: ZeRO stage 1's way to reduce (--zero 1), got --zero 0"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--overlap-grad-reduce",
          "--overlap-param-gather"], "--overlap-param-gather: needs sharded weights"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--straggler-sigma",
          "-1"], "--straggler-sigma -1.0: must be a finite number >= 0"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--slow-rank", "8:2"],
         "--slow-rank: rank 8 outside the layout's 8 ranks"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--slow-rank", "0:0.5"],
         "--slow-rank 0:0.5: a rank >= 0 and a finite factor >= 1"),
        (["simulate", "train", "--topology", "h100-node", "--dp", "8", "--global-batch", "8", "--efficiency", "1.5"],
         "--efficiency 1.5: a share of peak"),
        (["plan", "--topology", "h200-4gpu", "--global-batch", "8", "--efficiency", "0"], "--efficiency 0.0"),
        (["simulate", "train", "--topology", "h100-node", "--tp", "2", "--global-batch", "8", "--kernels", "dtrain",
          "--sequence-parallel"], "--kernels dtrain: dtrain.models runs neither FP8 (--fp8), sequence parallelism"),
        (["plan", "--topology", "h100-node", "--global-batch", "8", "--kernels", "dtrain", "--fp8"],
         "--kernels dtrain: dtrain.models runs no FP8 (--fp8)"),
    ],
)  # fmt: skip
def test_bad_sizes_ranks_and_plan_flags_are_one_line_naming_the_flag(capsys, argv, message) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err and "Traceback" not in captured.out + captured.err


def test_a_parameter_count_follows_the_shape_the_simulator_prices(capsys: pytest.CaptureFixture[str]) -> None:
    """Compute is priced from the shape, memory and MFU from the parameter count: a count the shape does not hold
    is refused, and a new shape without one holds what it holds (so no plan passes 100% MFU)."""
    argv = ["plan", "--topology", "h100-node", "--model", "llama-7b", "--global-batch", "64", "--zero", "3"]
    assert main([*argv, "--params", "28e9"]) == 2
    assert "the shape (--layers 32, --hidden 4096" in "".join(capsys.readouterr())
    deeper = run_json(capsys, *argv, "--layers", "64", "--top", "3")
    assert deeper["model"]["parameters"] == pytest.approx(2 * 6.7e9)
    assert all(0 < p["mfu"] < 1 for p in deeper["plans"])


def test_every_simulate_command_takes_preset_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set KEY=VALUE` changes a preset for `simulate collective`, `simulate train` and `plan` as for
    `simulate ps`; an unknown key is one line naming the preset's keys."""
    base = ["simulate", "collective", "--topology", "4-rack", "--bytes", "1M"]
    assert run_json(capsys, *base, "--set", "racks=2")["ranks"] * 2 == run_json(capsys, *base)["ranks"]
    one_rack = run_json(capsys, *base, "--set", "racks=1")["ranks"]
    train = ["simulate", "train", "--topology", "4-rack", "--set", "racks=1", "--global-batch", str(2 * one_rack)]
    assert run_json(capsys, *train, "--dp", str(one_rack))["layout"]["dp"] == one_rack
    assert main([*train, "--dp", str(2 * one_rack)]) == 2  # more ranks than one rack has
    capsys.readouterr()
    assert main([*base, "--set", "bogus=2"]) == 2
    assert "unknown parameter 'bogus'" in "".join(capsys.readouterr())


def test_simulate_train_prices_flashattention_2_dearer_than_cudnns_and_flashattention_1_dearer_still(capsys) -> None:
    from dtrain.cli import sim as sim_cli
    from dtrain.sim.compute import ATTENTION_KERNELS

    assert sim_cli.ATTENTION_KERNELS == ATTENTION_KERNELS
    # context parallelism runs flash attention (the ring's kernels)
    argv = ["simulate", "train", "--topology", "h100-node", "--model", "llama-7b", "--tp", "4", "--cp", "2",
            "--global-batch", "4", "--seq", "8192"]  # fmt: skip
    own, cudnn, fa2, fa1 = (run_json(capsys, *argv, *extra) for extra in ((), ("--attention-kernel", "cudnn"),
                            ("--attention-kernel", "fa2"), ("--attention-kernel", "fa1")))  # fmt: skip
    assert own["step_s"] == cudnn["step_s"] < fa2["step_s"] < fa1["step_s"]
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--attention-kernel", "fa3"])
    assert refused.value.code == 2
    assert "--attention-kernel" in capsys.readouterr().err


def test_simulate_json_never_prints_infinity(capsys, monkeypatch) -> None:
    from dtrain.cli import sim as sim_cli

    real = sim_cli._step_data
    monkeypatch.setattr(sim_cli, "_step_data", lambda result: {**real(result), "tokens_per_s": float("inf")})
    argv = ["simulate", "train", "--topology", "h100-node", "--model", "llama-7b", "--tp", "8", "--global-batch", "4"]
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "dtrain: error: tokens_per_s comes out as inf: the inputs are out of range\n"
