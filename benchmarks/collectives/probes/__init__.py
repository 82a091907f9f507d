"""The probes of ``benchmarks/collectives/probe.py``, one module a mode."""
