"""A topology that cannot be built, from a file or from ``--set``, is refused in one line naming what is wrong."""

from __future__ import annotations

import pytest

from dtrain.cli.main import main
from dtrain.cluster import files
from dtrain.cluster.builders import ServerSpec
from dtrain.cluster.files import TopologyFileError


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtrain: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("value", ["[]", "{ name = 'x' }", "3"])
def test_a_preset_that_is_not_a_name_is_named(value: str) -> None:
    with pytest.raises(TopologyFileError, match="build.preset"):
        files.loads(f"[build]\npreset = {value}\n", source="bad.toml")


def test_a_file_that_builds_too_many_parts_is_refused_before_it_is_built(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    path = tmp_path / "huge.toml"
    path.write_text('[build]\npreset = "4-rack"\nracks = 100000\nservers_per_rack = 100\n')
    for argv in (["topology", str(path)], ["simulate", "collective", "--topology", str(path), "--bytes", "1M"],
                 ["calc", "oversubscription", "--topology", str(path)]):  # fmt: skip
        err = refused(capsys, *argv)
        assert str(path) in err and "[build]" in err and "at most 131,072" in err
    with pytest.raises(TopologyFileError, match="at most 10 are built"):
        files.load(path, max_parts=10)


@pytest.mark.parametrize("value", [3, "yes", None])
def test_gpudirect_rdma_is_true_or_false(value) -> None:
    with pytest.raises(ValueError, match="gpudirect_rdma"):
        ServerSpec(gpudirect_rdma=value)


def test_a_setting_of_the_wrong_type_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert "gpudirect_rdma" in refused(capsys, "topology", "dgx-a100", "--set", "gpudirect_rdma=3")
