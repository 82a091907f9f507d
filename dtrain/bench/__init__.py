"""Benchmarks that measure the machine: collectives against the cost model, and its calibration.

Every measurement is a JSON line (see :mod:`dtrain.bench.comm`); plots and tests read those.
"""

__all__: list[str] = []
