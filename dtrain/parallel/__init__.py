"""Parallel training strategies on dtrain.comm: the rank grid, data, tensor and pipeline parallelism."""
