"""``python -m dtrain.ps``: run the parameter-server role the environment names (see :mod:`dtrain.ps.launch`)."""

from dtrain.ps.launch import main

raise SystemExit(main())
