"""dtrain simulate and dtrain plan refuse, in one line naming the flag, what they cannot simulate or would ignore."""

from __future__ import annotations

import json
import math

import pytest

from dtrain.cli.main import main
from dtrain.sim.collective import SoftwareCost


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line ``dtrain`` prints on stderr for ``argv``, which it must refuse with status 2."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtrain: error: ") and "\n" not in err, err
    return err


COLLECTIVE = ("simulate", "collective", "--topology", "h200-4gpu", "--bytes", "1M")


@pytest.mark.parametrize("name", ["call_s", "alpha_s", "alpha_peer_s", "gamma_s_per_byte", "launch_s"])
def test_a_software_cost_refuses_an_infinite_time(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SoftwareCost(**{name: math.inf})


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--alpha-us", "inf"), ("--alpha-us", "-1"), ("--alpha-peer-us", "nan"), ("--flow-cap-gbyte-per-s", "0"),
     ("--flow-cap-gbyte-per-s", "inf")],
)  # fmt: skip
def test_software_flags_out_of_range_are_named(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert flag in refused(capsys, *COLLECTIVE, flag, value)
    train = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--dp", "2", "--global-batch", "2")
    assert flag in refused(capsys, *train, flag, value)


def test_local_size_and_pipeline_are_refused_where_the_algorithm_ignores_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "--local-size" in refused(capsys, *COLLECTIVE, "--local-size", "2")  # ring has no nodes
    assert "--pipeline" in refused(capsys, *COLLECTIVE, "--pipeline", "4")  # nor does it pipeline
    assert "--local-size" in refused(capsys, *COLLECTIVE, "--algorithm", "native", "--local-size", "2")
    assert main([*COLLECTIVE, "--algorithm", "hierarchical", "--local-size", "2", "--json"]) == 0
    assert main([*COLLECTIVE, "--collective", "broadcast", "--pipeline", "4", "--json"]) == 0
    assert main([*COLLECTIVE, "--algorithm", "all", "--pipeline", "4", "--local-size", "2", "--json"]) == 0
    capsys.readouterr()


def test_an_unknown_tensor_parallel_algorithm_is_named_even_without_tensor_parallelism(
    capsys: pytest.CaptureFixture[str],
) -> None:
    train = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--global-batch", "1")
    assert "--tp-algorithm" in refused(capsys, *train, "--tp-algorithm", "bogus")
    assert "--tp-algorithm" in refused(capsys, *train, "--tp", "4", "--heads", "4", "--tp-algorithm", "bogus")
    assert "--dp-algorithm" in refused(capsys, *train, "--dp-algorithm", "bogus")


def test_more_micro_batches_than_are_simulated_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    train = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl")
    assert "--global-batch" in refused(capsys, *train, "--global-batch", str(10**11))
    plan = ("plan", "--topology", "h200-4gpu", "--model", "gpt2-xl")
    assert "--global-batch" in refused(capsys, *plan, "--global-batch", str(10**11))


def test_a_step_that_comes_out_infinite_is_refused_in_tables_too(capsys: pytest.CaptureFixture[str]) -> None:
    train = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--global-batch", "1")
    assert "step_s" in refused(capsys, *train, "--efficiency", "1e-320")


def test_zero_parameters_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    train = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--global-batch", "1")
    assert "--params" in refused(capsys, *train, "--params", "0")


def test_a_search_set_given_twice_ranks_each_plan_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--global-batch", "8", "--devices", "2",
            "--micro-batches", "1,1,2", "--zero", "0,0", "--placements", "aware,aware", "--recompute", "none,none",
            "--schedules", "1f1b", "--exhaustive", "--top", "100", "--json"]  # fmt: skip
    assert main(argv) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    keys = [(p["layout"], p["placement"]) for p in plans]
    assert plans and len(keys) == len(set(keys)), keys


PS = ("simulate", "ps", "--topology", "4-rack", "--workers", "4", "--servers", "2")


@pytest.mark.parametrize(
    ("flags", "named"),
    [(("--rows-per-worker", str(10**12), "--key-space", "100"), "--rows-per-worker"),
     (("--rows-per-worker", "10", "--key-space", str(10**20)), "--key-space"),
     (("--batch", str(10**13), "--key-space", "100"), "--batch"),
     (("--rows-per-worker", str(2**25), "--key-space", "100"), "--rows-per-worker"),
     (("--dense-bytes", "1M", "--hot-keys", "10"), "--hot-keys"),
     (("--dense-bytes", "1M", "--hot-replicas", "1"), "--hot-replicas")],
)  # fmt: skip
def test_a_parameter_server_step_out_of_range_is_named(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    assert named in refused(capsys, *PS, *flags)


def test_host_times_beside_a_calibration_are_refused(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    calibration = tmp_path / "calibration.json"
    link = {"alpha_s": 1e-3, "beta_s_per_byte": 1e-12, "gamma_s_per_byte": 0.0}
    calibration.write_text(json.dumps({"intra": link, "inter": None}))
    assert main([*COLLECTIVE, "--calibration", str(calibration), "--json"]) == 0
    capsys.readouterr()
    err = refused(capsys, *COLLECTIVE, "--calibration", str(calibration), "--alpha-us", "5")
    assert "--alpha-us" in err and "--calibration" in err


def test_more_ranks_than_devices_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--ranks 1000" in refused(capsys, *COLLECTIVE, "--ranks", "1000")


TRAIN = ("simulate", "train", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--heads", "32", "--global-batch", "4")


@pytest.mark.parametrize(
    ("flags", "named"),
    [(("--dp", "4", "--split-pipeline"), "--split-pipeline"),
     (("--dp", "4", "--synchronous-p2p"), "--synchronous-p2p"),
     (("--dp", "4", "--overlap-p2p-comm"), "--overlap-p2p-comm"),
     (("--dp", "4", "--balance", "flops"), "--balance"),
     (("--dp", "4", "--vocab", "1000", "--embedding-layers", "1"), "--embedding-layers"),
     (("--pp", "2", "--dp", "2", "--split-pipeline"), "--split-pipeline"),
     (("--pp", "2", "--dp", "2", "--schedule", "interleaved-1f1b", "--overlap-p2p-comm", "--synchronous-p2p"),
      "--synchronous-p2p"),
     (("--dp", "4", "--tp-algorithm", "ring"), "--tp-algorithm"),
     (("--tp", "2", "--pp", "2", "--split-pipeline", "--tp-algorithm", "one_shot"), "--tp-algorithm one_shot"),
     (("--tp", "4", "--dp-algorithm", "ring"), "--dp-algorithm"),
     (("--tp", "4", "--zero", "1"), "--zero"),
     (("--tp", "4", "--no-overlap"), "--no-overlap"),
     (("--dp", "2", "--pp", "2", "--no-overlap"), "--no-overlap"),
     (("--dp", "4", "--zero", "1", "--no-overlap"), "--no-overlap"),
     (("--dp", "4", "--zero", "1", "--dp-algorithm", "one_shot"), "--dp-algorithm one_shot"),
     (("--dp", "4", "--attention-kernel", "fa1"), "--attention-kernel"),
     (("--dp", "4", "--kernels", "megatron-lm", "--attention-kernel", "cudnn"), "--attention-kernel")],
)  # fmt: skip
def test_train_flags_the_layout_ignores_are_named(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    assert named in refused(capsys, *TRAIN, *flags)


def test_plan_flags_no_layout_uses_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    plan = ("plan", "--topology", "h200-4gpu", "--model", "gpt2-xl", "--global-batch", "8")
    assert "--attention-kernel" in refused(capsys, *plan, "--attention-kernel", "fa2")
    assert "--overlap-p2p-comm" in refused(capsys, *plan, "--schedules", "1f1b", "--overlap-p2p-comm")
    assert "--tp-algorithm" in refused(capsys, *plan, "--max-tp", "1", "--tp-algorithm", "direct")
    assert "--dp-algorithm one_shot" in refused(capsys, *plan, "--dp-algorithm", "one_shot")


@pytest.mark.parametrize(
    "flags",
    [("--top", "3"), ("--exhaustive",), ("--model", "gpt2-xl"), ("--layers", "4"), ("--seq", "128"),
     ("--vocab", "1000"), ("--params", "1e6")],
)  # fmt: skip
def test_plan_of_a_run_config_names_the_model_and_search_flags_it_ignores(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]
) -> None:
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml")
    err = refused(capsys, "plan", "--topology", "h100-node", "--config", config, *flags)
    assert flags[0] in err and "--config" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(("--dense-bytes", "1M", "--key-space", "100"), "--key-space"),
     (("--dense-bytes", "1M", "--zipf", "1.2"), "--zipf"),
     (("--dense-bytes", "1M", "--row-bytes", "64"), "--row-bytes"),
     (("--dense-bytes", "1M", "--permute"), "--permute"),
     (("--dense-bytes", "1M", "--seed", "3"), "--seed"),
     (("--dense-bytes", "1M", "--hot-keys", "4", "--hot-replicas", "1"), "--hot-keys"),
     (("--dense-bytes", "1M", "--ids-per-example", "4"), "--ids-per-example"),
     (("--rows-per-worker", "8", "--key-space", "100", "--ids-per-example", "4"), "--ids-per-example"),
     (("--batch", "10", "--key-space", "100"), "--batch 10"),
     (("--dense-bytes", "1M", "--bytes-per-param", "2"), "--bytes-per-param"),
     (("--dense-bytes", "1M", "--servers", "s0/cpu0", "--server-placement", "apart"), "--server-placement")],
)  # fmt: skip
def test_a_parameter_server_flag_the_step_ignores_is_named(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    assert named in refused(capsys, *PS, *flags)  # a second --servers takes the place of PS's


@pytest.mark.parametrize(
    ("setting", "named"),
    [("racks=two", "--set racks=two"), ("servers_per_rack=0", "--set servers_per_rack=0"),
     ("bogus=1", "--set bogus=1"), ("gpudirect_rdma=maybe", "--set gpudirect_rdma=maybe")],
)  # fmt: skip
def test_a_preset_setting_out_of_range_names_set(capsys: pytest.CaptureFixture[str], setting: str, named: str) -> None:
    assert named in refused(capsys, "simulate", "collective", "--topology", "4-rack", "--set", setting, "--bytes", "1M")


def test_a_topology_files_racks_are_at_least_one(tmp_path) -> None:
    from dtrain.cluster.files import loads

    for value in ("'two'", "0"):
        with pytest.raises(ValueError, match=r"build\.racks = .*whole number >= 1"):
            loads(f'[build]\npreset = "4-rack"\nracks = {value}\n')
    with pytest.raises(ValueError, match="servers with no NICs"):  # a server may have no NIC: the builder says why
        loads('[build]\npreset = "4-rack"\nnics = 0\n')
