"""``python -m dtrain.ps``: run the parameter-server role the environment names (see :mod:`dtrain.ps.launch`)."""

import sys

from dtrain.env import EnvError
from dtrain.ps.launch import main

try:
    status = main()
except EnvError as exc:  # a variable the launcher (or the user) set wrongly: one line, no traceback
    print(f"dtrain.ps: error: {exc}", file=sys.stderr)
    status = 2
raise SystemExit(status)
