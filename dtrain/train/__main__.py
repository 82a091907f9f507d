"""``python -m dtrain.train ...`` and ``torchrun --nproc-per-node N -m dtrain.train ...``: ``dtrain train``."""

import sys

from dtrain.cli.main import main

raise SystemExit(main(["train", *sys.argv[1:]]))
