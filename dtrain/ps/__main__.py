"""``python -m dtrain.ps``: run the parameter-server role the environment names (see :mod:`dtrain.ps.launch`).

Ends with one line on stderr and a non-zero status, never a traceback, when the environment is wrong (status 2)
or when a peer refuses, answers with something malformed, or does not answer in time (status 1); with one line
and status 130 on Ctrl-C."""

import sys

from dtrain.env import EnvError
from dtrain.ps.launch import main
from dtrain.ps.transport import PSError, PSTimeoutError


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


try:
    status = main()
except EnvError as exc:  # a variable the launcher (or the user) set wrongly
    print(f"dtrain.ps: error: {_line(exc)}", file=sys.stderr)
    status = 2
except (PSError, PSTimeoutError) as exc:  # a peer refused, sent something malformed, or went silent
    print(f"dtrain.ps: error: {_line(exc)}", file=sys.stderr)
    status = 1
except KeyboardInterrupt:  # Ctrl-C on a role started by hand: its sockets never linger, so it ends at once
    print("dtrain.ps: interrupted", file=sys.stderr)
    status = 130
raise SystemExit(status)
