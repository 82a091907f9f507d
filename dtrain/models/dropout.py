"""Dropout whose masks do not depend on how the batch and the model are split.

``torch.nn.Dropout`` draws its mask from the device's generator, one draw a call: a replica, a pipeline stage
or a tensor-parallel rank draws the masks of its own rows, layers and heads from the same sequence as every
other, so the masks of a split run are not those of one process (two replicas drop the same values of their
different rows; two tensor-parallel ranks drop the same attention probabilities of their different heads), and
a job trains differently on every layout.

:class:`Dropout` keeps a value when a hash of where it sits is above ``p``: the step's key (from the run's seed
and the step, :func:`set_step`), the dropout's site (its place among the model's dropouts, numbered when the
model is built) and the value's coordinates in the global batch (its row in the step's batch, then its indices
along the other dimensions, a head's counted among the model's heads). A rank computes only the bits of the
values it holds, from their coordinates: the row of its first row comes from :func:`rows` (set by the parallel
strategies for every micro-batch), the offset of its first head from the module. So every layout draws the mask
one process draws for the same global batch, a recomputed forward draws the masks of its forward, and a resumed
run those of the run it continues, without saving any generator's state.

Until :func:`set_step` is called (and after :func:`untracked`), :class:`Dropout` is ``torch.nn.Dropout``: the
device's generator, its fused kernel. The step's key and the first row live in one small int64 tensor a device,
updated in place, so a compiled block or a recorded CUDA graph reads the current step's values.

The hash is a 32-bit integer mixer (xorshift-multiply rounds, after Wellons' "hash prospector" family) computed
in int64 tensors, each product under 2**63; coordinates are folded in one dimension at a time, so the work is
one mix a value plus one a row, not a counter per value. A value is kept when its hash is at least
``round(p * 2**32)``: with probability ``1 - p`` to 2**-32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Dropout",
    "dropout",
    "keep_mask",
    "number_sites",
    "restored",
    "rows",
    "set_step",
    "site_salt",
    "snapshot",
    "step_key",
    "threshold",
    "tracked",
    "untracked",
]

_M = 0xFFFFFFFF
_C1, _C2, _C3 = 0x7FEB352D, 0x68E31DA5, 0x1B873593  # odd, under 2**31: a product of a 32-bit value fits int64
_SITE = 0x9E3779B1 & 0x7FFFFFFF  # the golden ratio's odd multiplier, set apart sites of neighbouring numbers

_tracked = False  # False: torch's own dropout
_key = 0  # the step's key, written into every device's state
_rows = [0, 0]  # the first row: an outer level (a replica's chunk) plus an inner one (a micro-batch)
_depth = 0
_states: dict[torch.device, torch.Tensor] = {}  # device -> int64 [key, outer first row, inner first row]


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit mix of an int64 tensor of values in ``[0, 2**32)``; the same function as on Python ints."""
    for c, shift in ((_C1, 16), (_C2, 15), (_C3, 16)):
        x = x ^ (x >> shift)
        x = (x * c) & _M
    return x ^ (x >> 15)


def _mix(x: int) -> int:
    x &= _M
    for c, shift in ((_C1, 16), (_C2, 15), (_C3, 16)):
        x ^= x >> shift
        x = (x * c) & _M
    return x ^ (x >> 15)


def step_key(seed: int, step: int) -> int:
    """The 32-bit key of step ``step`` of a run seeded ``seed`` (both non-negative ints)."""
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"dropout {name}: expected a non-negative int, got {value!r}")
    return _mix(_mix(_mix(seed & _M) ^ (seed >> 32)) + step)


def set_step(seed: int, step: int) -> None:
    """Draw every :class:`Dropout`'s masks from now on as step ``step`` of a run seeded ``seed`` (on every rank:
    the same key for the same step). The current GPU's state is made here, if not yet, so that no state is first
    made inside a CUDA graph's recording."""
    global _key, _tracked
    _key, _tracked = step_key(seed, step), True
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state(torch.device("cuda", torch.cuda.current_device()))
    for st in _states.values():
        st[0].fill_(_key)


def untracked() -> None:
    """Back to torch's own dropout (the device's generator) until the next :func:`set_step`."""
    global _tracked
    _tracked = False


def tracked() -> bool:
    """Whether masks are drawn from the step's key (a :func:`set_step` is in force). Compiled code guards on this
    flag, which changes when a run starts and ends, not on the key, which changes every step."""
    return _tracked


@contextlib.contextmanager
def rows(first: int) -> Iterator[None]:
    """Within the block, the batch a model is handed starts at row ``first`` of the step's global batch (one
    process on the whole batch: 0). The parallel strategies set it for each replica's chunk and, nested inside,
    for each micro-batch: a nested ``rows`` counts from the outer one's row, and each level has its own entry
    in the device's state, so a recorded graph that sets the inner one reads the outer one as it is at replay."""
    global _depth
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"dropout rows: expected a non-negative int, got {first!r}")
    if _depth >= len(_rows):
        raise ValueError(f"dropout rows: at most {len(_rows)} nested levels")
    level, before = _depth, _rows[_depth]
    _set_row(level, first)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        _set_row(level, before)


def _set_row(level: int, first: int) -> None:
    # written every time, not only on a change: inside a graph's recording the write is what the replay runs
    _rows[level] = first
    for st in _states.values():
        st[1 + level].fill_(first)


def state(device: torch.device) -> torch.Tensor:
    """The int64 ``[key, outer first row, inner first row]`` tensor on ``device`` (made on first use, then
    updated in place)."""
    device = torch.device(device)
    found = _states.get(device)
    if found is None:
        found = torch.empty(3, dtype=torch.int64, device=device)  # written by kernels: no copy from the host
        for i, value in enumerate((_key, *_rows)):
            found[i].fill_(value)
        _states[device] = found
    return found


def snapshot(device: torch.device) -> tuple[bool, dict[torch.device, torch.Tensor]]:
    """Whether masks are tracked, and copies of every device's state (``device``'s made first), for a recomputed
    forward to draw its forward's masks (:func:`restored`)."""
    state(device)
    return _tracked, {d: tensor.clone() for d, tensor in _states.items()}


@contextlib.contextmanager
def restored(saved: tuple[bool, dict[torch.device, torch.Tensor]]) -> Iterator[None]:
    """Within the block, tracking, the key and the first rows are as ``saved`` (:func:`snapshot`) holds them;
    afterwards as they were."""
    global _tracked
    was, states = saved
    before = {device: _states[device].clone() for device in states if device in _states}
    tracked_before, _tracked = _tracked, was
    for device, tensor in states.items():
        if device in _states:
            _states[device].copy_(tensor)
    try:
        yield
    finally:
        _tracked = tracked_before
        for device, tensor in before.items():
            _states[device].copy_(tensor)


def site_salt(site: int) -> int:
    """The 32-bit value site ``site`` adds to the step's key."""
    return (site * _SITE) & _M


def _keep(shape: Sequence[int], p: float, salt: torch.Tensor, st: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    h = mix32((st[0] + salt) & _M)
    for d, n in enumerate(shape):
        index = torch.arange(n, dtype=torch.int64, device=st.device)
        if d == 0:
            index = index + (st[1] + st[2])
        elif d < len(offsets) and offsets[d]:
            index = index + int(offsets[d])
        h = mix32((h.unsqueeze(-1) + index) & _M)
    return h >= threshold(p)


def threshold(p: float) -> int:
    """The least hash kept at probability ``p`` (in ``[0, 1)``): ``round(p * 2**32)``, at most ``2**32 - 1``."""
    return min(round(p * 2**32), _M)


def keep_mask(
    shape: Sequence[int], p: float, site: int, device: torch.device, offsets: Sequence[int] = ()
) -> torch.Tensor:
    """The bool mask of the values to keep of a tensor of ``shape`` whose first dimension is the batch's rows,
    at dropout site ``site``; ``offsets[d]`` (d >= 1) is the index of this tensor's first entry along dimension
    ``d`` in the whole (unsplit) tensor."""
    st = state(device)
    return _keep(shape, p, torch.tensor(site_salt(site), dtype=torch.int64, device=st.device), st, offsets)


def dropout(x: torch.Tensor, p: float, salt: torch.Tensor, training: bool, offsets: Sequence[int] = ()) -> torch.Tensor:
    """``x`` with the values the hash drops zeroed and the rest scaled by ``1 / (1 - p)``, ``salt`` the site's
    (:func:`site_salt`, an int64 tensor on ``x``'s device); torch's ``F.dropout`` while untracked.

    On a GPU, outside ``torch.compile``, one fused kernel (:mod:`dtrain.models.dropout_kernel`) draws the mask and
    applies it, and backward draws it again from the key and rows its forward saw, so no mask is kept; the
    kernel's bits are the tensor hash's. Elsewhere the hash runs as tensor operations (fused by the compiler
    under ``torch.compile``)."""
    if not training or p == 0.0:
        return x
    if not _tracked:
        return F.dropout(x, p, training=True)
    if p == 1.0:
        return torch.zeros_like(x)
    st = state(x.device)
    kernel = x.is_cuda and x.dtype != torch.float64 and 1 <= x.dim() <= 4 and len(offsets) <= x.dim()
    if kernel and not torch.compiler.is_compiling():
        from dtrain.models import dropout_kernel

        if dropout_kernel.available():
            return dropout_kernel.HashDropout.apply(x, st, salt, threshold(p), 1.0 / (1.0 - p), tuple(offsets))
    keep = _keep(x.shape, p, salt, st, offsets)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose mask is a function of the step, its ``site`` and each value's place in the global
    batch (module docstring). ``site`` is numbered by the model that holds it (:func:`number_sites`); its salt
    is a buffer, so that a compiled block serves every site without compiling again."""

    salt: torch.Tensor

    def __init__(self, p: float = 0.5, site: int = 0) -> None:
        super().__init__(p)
        self.register_buffer("salt", torch.tensor(0, dtype=torch.int64), persistent=False)
        self.site = site

    @property
    def site(self) -> int:
        return self._site

    @site.setter
    def site(self, value: int) -> None:
        self._site = value
        with torch.no_grad():
            self.salt.fill_(site_salt(value))

    def forward(self, x: torch.Tensor, offsets: Sequence[int] = ()) -> torch.Tensor:
        return dropout(x, self.p, self.salt, self.training, offsets)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"


def number_sites(model: nn.Module) -> nn.Module:
    """Number ``model``'s :class:`Dropout` modules 0, 1, ... in the order ``modules()`` gives them (in place;
    returns ``model``). Call it on the whole model, before it is split."""
    for i, module in enumerate(m for m in model.modules() if isinstance(m, Dropout)):
        module.site = i
    return model
