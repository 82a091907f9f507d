"""dtrain.sim.api_passes: the table of the API's own operations is what dtrain.comm.api really runs.

The API's functions run here on CPU tensors, with the group's rank and size given and the schedule stubbed out,
under a dispatch mode that records every aten operation. Views and allocations move no data and launch nothing;
every other operation is one pass. A change to api.py's copies, clones or divisions fails these tests.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.comm import api
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective
from dtrain.sim.api_passes import Pass, RankPasses, api_passes, rank_passes

WORLD = 4
NUMEL = 64  # float32: a 256-byte work buffer, 64-byte blocks
NBYTES = NUMEL * 4
KINDS = {
    "aten.clone.default": "clone",
    "aten.copy_.default": "copy",
    "aten.div_.Tensor": "div",
    "aten.ones.default": "fill",
}
SCHEDULE = object()  # marks where the schedule runs among the recorded operations


class _Recorder(TorchDispatchMode):
    """Every aten operation that writes data: (kind, bytes written), and ``SCHEDULE`` where the schedule ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not func.is_view and not name.startswith("aten.empty"):  # views and allocations launch nothing
            self.ops.append((KINDS.get(name, name), out.numel() * out.element_size()))
        return out


def _recorded(monkeypatch, collective: Collective, rank: int, op: str) -> RankPasses:
    """The API call of ``collective`` on rank ``rank`` of ``WORLD`` (root 0), as the passes it made."""
    recorder = _Recorder()
    monkeypatch.setattr(api, "group_info", lambda group, what: (rank, WORLD))
    monkeypatch.setattr(api, "_run", lambda *args, **kwargs: recorder.ops.append(SCHEDULE))
    monkeypatch.setattr(api, "_barrier_device", lambda group: torch.device("cpu"))
    algorithm = next(a for a in registry.names(collective) if not registry.needs_local_size(a))
    full, block = torch.ones(NUMEL), torch.ones(NUMEL // WORLD)
    out_full = torch.empty(NUMEL)
    root = rank == 0
    calls = {
        Collective.ALL_REDUCE: lambda: api.all_reduce(full, op, algorithm=algorithm),
        Collective.BROADCAST: lambda: api.broadcast(full, 0, algorithm=algorithm),
        Collective.REDUCE: lambda: api.reduce(full, 0, op, algorithm=algorithm),
        Collective.SCAN: lambda: api.scan(full, op, algorithm=algorithm),
        Collective.ALL_GATHER: lambda: api.all_gather(full, block, algorithm=algorithm),
        Collective.REDUCE_SCATTER: lambda: api.reduce_scatter(block, full, op, algorithm=algorithm),
        Collective.GATHER: lambda: api.gather(full if root else None, block, 0, algorithm=algorithm),
        Collective.SCATTER: lambda: api.scatter(block, full if root else None, 0, algorithm=algorithm),
        Collective.ALL_TO_ALL: lambda: api.all_to_all(out_full, full, algorithm=algorithm),
        Collective.BARRIER: lambda: api.barrier(),
    }
    with recorder:
        calls[collective]()
    at = recorder.ops.index(SCHEDULE)
    return RankPasses(
        before=tuple(Pass(*o) for o in recorder.ops[:at]), after=tuple(Pass(*o) for o in recorder.ops[at + 1 :])
    )


CASES = [
    (c, rank, op)
    for c in Collective
    for rank in ((0, 1) if c in (Collective.REDUCE, Collective.GATHER, Collective.SCATTER) else (1,))
    for op in (
        ("sum", "avg")
        if c in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.SCAN, Collective.REDUCE_SCATTER)
        else ("sum",)
    )
]


@pytest.mark.parametrize(("collective", "rank", "op"), CASES, ids=lambda v: str(v))
def test_the_table_lists_the_operations_the_api_runs_around_its_schedule(monkeypatch, collective, rank, op):
    nbytes = 4 if collective == Collective.BARRIER else NBYTES
    want = rank_passes(collective, nbytes, WORLD, rank, root=0 if collective in ROOTED_COLLECTIVES else None, op=op)
    assert _recorded(monkeypatch, collective, rank, op) == want


def test_reduce_scatter_clones_its_input_and_copies_its_block_out():
    passes = rank_passes(Collective.REDUCE_SCATTER, 1 << 20, 4, 2)
    assert passes == RankPasses(before=(Pass("clone", 1 << 20),), after=(Pass("copy", 1 << 18),))
    assert (passes.launches, passes.before_bytes, passes.after_bytes) == (2, 1 << 20, 1 << 18)


def test_only_the_ranks_that_hold_no_result_clone_a_reduce():
    schedule = registry.build(Collective.REDUCE, "tree", 4, root=2)
    passes = api_passes(schedule, 1024)
    assert [p.launches for p in passes] == [1, 1, 0, 1]


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="outside a group of 4"):
        rank_passes(Collective.ALL_GATHER, 1024, 4, 4)


def test_a_reduce_scatter_run_out_of_place_has_no_copy_and_the_api_takes_that_path_only_where_the_plan_allows(
    monkeypatch,
):
    from dtrain.sim.api_passes import rank_passes

    assert rank_passes(Collective.REDUCE_SCATTER, NBYTES, WORLD, 1, out_of_place=True) == RankPasses()
    assert rank_passes(Collective.REDUCE_SCATTER, NBYTES, WORLD, 1, op="avg", out_of_place=True) == RankPasses(
        after=(Pass("div", NBYTES // WORLD),)
    )
    # recorded: with the out-of-place path open, the API makes no clone and no copy
    recorder = _Recorder()
    monkeypatch.setattr(api, "group_info", lambda group, what: (1, WORLD))
    monkeypatch.setattr(api, "_out_of_place", lambda *args: True)
    monkeypatch.setattr(api, "_run", lambda *args, **kwargs: recorder.ops.append(SCHEDULE))
    output, input = torch.empty(NUMEL // WORLD), torch.ones(NUMEL)
    with recorder:
        api.reduce_scatter(output, input, algorithm="ring")
    assert recorder.ops == [SCHEDULE]
