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
