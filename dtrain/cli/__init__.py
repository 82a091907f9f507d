"""The ``dtrain`` command (see :mod:`dtrain.cli.main`)."""

__all__: list[str] = []
