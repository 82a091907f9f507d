"""`python -m dtrain.train ...` (and `torchrun -m dtrain.train ...`, as DESIGN.md writes it): `dtrain train`."""

import sys

from dtrain.cli.main import main

raise SystemExit(main(["train", *sys.argv[1:]]))
