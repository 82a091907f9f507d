"""Train a torch ``nn.Module`` through the parameter server: pull parameters, compute, push gradients.

Dense parameters are laid on keys ``0 ..`` in ``named_parameters`` order (:func:`dtrain.ps.keys.dense_slots`);
each embedding table named as sparse gets its own key range after them, one key per row, and only the rows a
batch uses are pulled and pushed (the sparse access pattern ps-lite was built for).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from dtrain.ps.keys import dense_slots
from dtrain.ps.worker import Worker

__all__ = ["PSModule", "key_space"]


def key_space(model: nn.Module, width: int, sparse: tuple[str, ...] = ()) -> tuple[list, dict[str, int], int]:
    """Dense slots, the first key of each sparse table, and the number of keys ``model`` needs."""
    params = dict(model.named_parameters())
    for name in sparse:
        if name not in params or params[name].dim() != 2 or params[name].shape[1] != width:
            raise ValueError(f"sparse table {name!r} must be a 2-D parameter of row width {width}")
    slots = dense_slots([(n, tuple(p.shape)) for n, p in params.items() if n not in sparse], width)
    first = slots[-1].first + slots[-1].rows if slots else 0
    tables = {}
    for name in sparse:
        tables[name] = first
        first += params[name].shape[0]
    return slots, tables, first


class PSModule:
    """``model``'s parameters live on the parameter server; :meth:`step` is one training iteration."""

    def __init__(self, worker: Worker, model: nn.Module, sparse: tuple[str, ...] = ()) -> None:
        self.worker, self.model = worker, model
        self.width = worker.config.width
        self.slots, self.tables, num_keys = key_space(model, self.width, sparse)
        if num_keys != worker.config.num_keys:
            raise ValueError(
                f"the model needs {num_keys} keys of width {self.width}, the job has {worker.config.num_keys}"
            )
        self.params = dict(model.named_parameters())
        self.dense_keys = np.concatenate([s.keys() for s in self.slots]) if self.slots else np.zeros(0, np.int64)
        self._rows: dict[str, np.ndarray] = {}

    def initial_values(self) -> np.ndarray:
        """Every key's starting row, from the model as built: ``(num_keys, width)``."""
        out = np.zeros((self.worker.config.num_keys, self.width), np.float32)
        with torch.no_grad():
            for s in self.slots:
                out[s.first : s.first + s.rows] = s.to_rows(self.params[s.name].detach().numpy(), self.width)
            for name, first in self.tables.items():
                table = self.params[name].detach().numpy()
                out[first : first + table.shape[0]] = table
        return out

    def initialize(self) -> None:
        """Worker 0: put the model's initial values on the servers."""
        self.worker.wait(self.worker.init(self.initial_values()))

    def pull(self, sparse_ids: dict[str, torch.Tensor] | None = None) -> None:
        """Fetch the dense parameters and the rows of ``sparse_ids`` into the model."""
        keys = [self.dense_keys]
        self._rows = {}
        for name, ids in (sparse_ids or {}).items():
            self._rows[name] = np.unique(ids.numpy().astype(np.int64))
            keys.append(self.tables[name] + self._rows[name])
        rows = self.worker.wait(self.worker.pull(np.concatenate(keys)))
        with torch.no_grad():
            for s in self.slots:
                value = s.from_rows(rows[s.first - self.slots[0].first : s.first - self.slots[0].first + s.rows])
                self.params[s.name].copy_(torch.from_numpy(value))
            at = self.dense_keys.size
            for name, ids in self._rows.items():
                self.params[name][torch.from_numpy(ids)] = torch.from_numpy(rows[at : at + ids.size])
                at += ids.size

    def push(self) -> list[str]:
        """Send the gradients of the dense parameters and of the pulled rows; wait for the acknowledgements."""
        keys, values = [self.dense_keys], []
        for s in self.slots:
            grad = self.params[s.name].grad
            values.append(s.to_rows(grad.numpy() if grad is not None else np.zeros(s.shape, np.float32), self.width))
        for name, ids in self._rows.items():
            keys.append(self.tables[name] + ids)
            values.append(self.params[name].grad[torch.from_numpy(ids)].numpy())
        return self.worker.wait(self.worker.push(np.concatenate(keys), np.concatenate(values)))

    def step(self, compute_loss: Callable[[], torch.Tensor], sparse_ids: dict[str, torch.Tensor] | None = None,
             after_backward: Callable[[], None] | None = None) -> tuple[float, list[str]]:  # fmt: skip
        """Pull, run ``compute_loss`` and backward, (``after_backward``,) push; the loss and push statuses."""
        self.pull(sparse_ids)
        self.model.zero_grad(set_to_none=False)
        loss = compute_loss()
        loss.backward()
        if after_backward is not None:
            after_backward()
        statuses = self.push()
        self.worker.tick()
        return float(loss.detach()), statuses
