"""What ``dtrain.comm`` keeps per process group, in one object: :class:`GroupState`.

Every call on a group finds its state through :func:`group_state` (one weak-keyed registry: a group that is
destroyed and collected takes its state with it) and :func:`release` drops it. The default group is keyed by
``dist.group.WORLD`` itself, so after ``destroy_process_group`` and a new ``init_process_group`` the new world
starts afresh (it is another object).

Kept per group: the node size (:func:`dtrain.comm.set_local_size`), the ``auto`` choices its ranks checked
alike, whether it fell back from the peer transport, its point-to-point transport, its peer windows (per
device) and what is derived from them (prepared pull steps, captured graphs, kept work buffers), and whether
the peer transport can serve it (per device).

Process-wide, not per group (each says why where it is defined): the node size declared for the default group
before the group exists (:data:`DEFAULT_LOCAL_SIZE`), the count of symmetric-memory rendezvous
(``dtrain.comm.peer.window``; torch counts them per process), the watchdog threads (one per device, for every
group on it), CUDA-graph captures in progress, the point-to-point runtime's per-thread buffers and side streams
(per device and thread; one thread's calls run one at a time, whatever their group).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

__all__ = [
    "GroupState",
    "group_state",
    "find_state",
    "states",
    "release",
    "release_all",
    "DEFAULT_LOCAL_SIZE",
    "GENERATION",
    "FAST",
    "changed",
]

#: The node size declared for the default group (``set_local_size(n)`` without a group). Process-wide: a
#: launcher declares it before ``init_process_group`` makes the group, and it holds for every default group of
#: the process (a destroyed and re-made world keeps it). A one-element list so that it can be set in place.
DEFAULT_LOCAL_SIZE: list[int | None] = [None]

#: Counts the changes that can alter how a call resolves (a node size declared, a group's rules agreed, a group
#: moved off the peer transport, a state dropped): a group's resolved calls (:attr:`GroupState.calls`) hold only
#: while it stands where it stood when they were kept. Process-wide, as a node size declared without a group is.
GENERATION: list[int] = [0]

#: (group, algorithm, reduction, numel, dtype, device) -> (environment, generation, run): the one-kernel
#: all-reduces already made, run again without their checks and choices while the environment and
#: :data:`GENERATION` are those they were made under (``dtrain.comm.api._fast_all_reduce``). Process-wide and
#: dropped at every change, as what they hold (a window) may be replaced.
FAST: dict = {}


def changed() -> None:
    """Note a change that can alter how calls resolve (see :data:`GENERATION`)."""
    GENERATION[0] += 1
    FAST.clear()


class GroupState:
    """Everything ``dtrain.comm`` keeps for one process group."""

    def __init__(self) -> None:
        #: ranks per node for the hierarchical algorithms (explicit groups; the default group's is
        #: :data:`DEFAULT_LOCAL_SIZE`)
        self.local_size: int | None = None
        #: the kinds ("cpu", "cuda-peer", ...) whose ``auto`` choices the group's ranks checked alike
        self.agreed: set[str] = set()
        #: the device types whose cost parameters (the pipelining's) the group's ranks checked alike
        self.params_agreed: set[str] = set()
        #: kind -> the measured rules rank 0 sent (``None``: none), which every rank's ``auto`` follows
        self.rules: dict = {}
        #: (collective, bytes, world, kind, node size) -> what ``auto`` chose, kept
        self.choices: dict = {}
        #: ``DTRAIN_COMM_TRANSPORT=auto`` moved the group back to point-to-point (its peer window was refused)
        self.fell_back = False
        #: the point-to-point transport (``dtrain.comm.p2p.transport.transport_for``)
        self.transport: object | None = None
        #: device -> the group's peer window there (``dtrain.comm.peer.window.window_for``)
        self.windows: dict = {}
        #: device -> whether the peer transport can serve the group there
        self.available: dict = {}
        #: (schedule, rank, numel, dtype, window generation) -> prepared pull steps (slices of a window)
        self.prepared: dict = {}
        #: work buffers kept so that calls on fresh inputs replay their graph (``dtrain.comm.api._scratch``)
        self.scratch: dict = {}
        #: the captured graphs of the group's calls (a ``dtrain.comm.peer.graphs.GraphCache``, made on first use)
        self.graphs: object | None = None
        #: (collective, algorithm, bytes, device) -> (rank, world, chosen algorithm, node size) of calls already
        #: checked and resolved, so that a repeated call skips both (``dtrain.comm.api._prepare``); they hold for
        #: the environment and :data:`GENERATION` in :attr:`calls_at`
        self.calls: dict = {}
        self.calls_at: tuple | None = None

    def release_derived(self) -> None:
        """Drop what was made on the group's windows (prepared steps, graphs, kept work buffers): before a
        window is replaced or forgotten, as they would read its memory."""
        self.prepared.clear()
        changed()  # the one-kernel calls kept (FAST) hold a window
        if self.graphs is not None:
            self.graphs.release_all()
        self.scratch.clear()

    def drop_windows(self) -> None:
        """Forget the group's windows, first unmapping what any of them mapped of its peers' memory (the direct
        broadcast's mappings of their tensors' allocations, :mod:`dtrain.comm.peer.direct`)."""
        for held in list(self.windows.values()):
            unmap = getattr(held, "close", None)
            if unmap is not None:
                unmap()
        self.windows.clear()

    def release(self) -> None:
        """Drop everything held for the group (its windows too); the group starts afresh at its next call."""
        self.release_derived()
        self.drop_windows()
        self.available.clear()
        self.agreed.clear()
        self.params_agreed.clear()
        self.rules.clear()
        self.choices.clear()
        self.fell_back = False
        self.transport = None
        self.calls.clear()
        changed()


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _key(group):
    if group is None:
        import torch.distributed as dist

        return dist.group.WORLD
    return group


def group_state(group) -> GroupState:
    """The state of ``group`` (None: the default group), made on first use."""
    key = _key(group)
    if key is None:
        raise ValueError("dtrain.comm: no default process group; call torch.distributed.init_process_group first")
    state = _STATES.get(key)
    if state is None:
        state = _STATES[key] = GroupState()
    return state


def find_state(group) -> GroupState | None:
    """The state of ``group`` (None: the default group) if it has one; makes nothing (a question asked before
    any call, or with no default group, has the answers of a fresh group)."""
    try:
        return _STATES.get(_key(group))
    except TypeError:  # no default group (None), or an object that cannot be weakly referenced
        return None


def states() -> Iterator[GroupState]:
    """The state of every group that has one."""
    return iter(list(_STATES.values()))


def release(group) -> None:
    """Drop ``group``'s state (None: the default group's), windows and graphs included."""
    state = _STATES.pop(_key(group), None)
    if state is not None:
        state.release()


def release_all() -> None:
    """Drop every group's state."""
    for state in states():
        state.release()
    _STATES.clear()
