"""dtrain: distributed deep-learning training on PyTorch, from the collectives up."""

__version__ = "0.1.0"
