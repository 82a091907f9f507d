"""A benchmark script's ``main()`` as one rank of a launch by torch's elastic agent
(tests/train/test_llama_benchmark.py): the agent sets the rank's variables as torchrun does, and the script sets its
process group up from them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys


def script_main(path: str, argv: list[str]) -> str:
    """Run the script at ``path`` as ``python path ARGV`` would, in this process; what it printed on stdout."""
    spec = importlib.util.spec_from_file_location("_launched_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    sys.argv = [path, *argv]
    with contextlib.redirect_stdout(printed):
        module.main()
    return printed.getvalue()
