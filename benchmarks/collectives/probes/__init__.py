"""Usage: (a package: ``benchmarks/collectives/probe.py MODE`` runs its modules, one a mode)"""
