"""Jobs the process pool runs for the collective tests: call dtrain.comm, compare with a reference.

Each rank makes every rank's input from a seed, so it can compute the expected result by itself in float64
(the single-process reference); for float32 data the same call through torch.distributed is compared too.
Inputs are small integers, so sums, products, maxima and minima are exact in every dtype, float16 and
bfloat16 included, and results must match exactly; ``avg`` and random float data compare with a tolerance.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.testing.pool import group_of

ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
              torch.uint8, torch.bool)  # fmt: skip
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "scan")
BLOCKED = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")


def _input(rank: int, numel: int, dtype: torch.dtype, seed: int, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if op == "prod":  # keep products small and exact: factors in {-1, 1, 2}
        values = torch.tensor([-1, 1, 2])[torch.randint(0, 3, (numel,), generator=g)]
    else:
        values = torch.randint(-4, 5, (numel,), generator=g)
    if dtype == torch.uint8:  # sums of up to 8 ranks stay under 256
        values = values.abs()
    if dtype == torch.bool:  # as many false as true, so that a product (all) and a minimum are not always true
        values = torch.randint(0, 2, (numel,), generator=g)
    return values.to(dtype)


def _combine(rows: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("sum", "avg"):
        out = rows.sum(0)
        return out / rows.shape[0] if op == "avg" else out
    if op == "prod":
        return rows.prod(0)
    return rows.amax(0) if op == "max" else rows.amin(0)


def _strided(values: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """``values`` itself, or an equal non-contiguous view (every other element of a bigger tensor)."""
    if contiguous:
        return values.clone()
    holder = torch.zeros(values.numel(), 2, dtype=values.dtype)
    holder[:, 0] = values
    return holder[:, 0]


def _expected(coll: str, inputs: list[torch.Tensor], rank: int, op: str, root: int) -> torch.Tensor | None:
    world = len(inputs)
    rows = torch.stack([x.double() for x in inputs])  # (world, numel)
    if coll == "all_reduce" or (coll == "reduce" and rank == root):
        return _combine(rows, op)
    if coll == "reduce":
        return inputs[rank].double()  # other ranks' tensors stay as they were
    if coll == "broadcast":
        return rows[root]
    if coll == "scan":
        return _combine(rows[: rank + 1], op)
    if coll == "all_gather" or (coll == "gather" and rank == root):
        return rows.reshape(-1)
    if coll == "reduce_scatter":
        return _combine(rows, op).reshape(world, -1)[rank]
    if coll == "scatter":
        return rows[root].reshape(world, -1)[rank]
    if coll == "all_to_all":
        return rows.reshape(world, world, -1)[:, rank].reshape(-1)
    return None


def _call(coll: str, inp: torch.Tensor, rank: int, world: int, op: str, root: int, group, algorithm: str, made=None):
    """Run one collective; return the tensor that holds this rank's result. ``made``: what becomes of each output
    tensor the call writes besides its input (default: it stays a plain tensor)."""
    m = inp.numel()
    made = made or (lambda t: t)
    if coll in ("all_reduce", "scan"):
        getattr(comm, coll)(inp, op=op, group=group, algorithm=algorithm)
        return inp
    if coll == "reduce":
        comm.reduce(inp, root, op=op, group=group, algorithm=algorithm)
        return inp
    if coll == "broadcast":
        comm.broadcast(inp, root, group=group, algorithm=algorithm)
        return inp
    if coll == "all_gather":
        out = made(torch.full((world * m,), -7, dtype=inp.dtype))
        comm.all_gather(out, inp, group=group, algorithm=algorithm)
        return out
    if coll == "gather":
        out = made(torch.full((world * m,), -7, dtype=inp.dtype)) if rank == root else None
        comm.gather(out, inp, root, group=group, algorithm=algorithm)
        return out
    if coll == "reduce_scatter":
        out = made(torch.full((m // world,), -7, dtype=inp.dtype))
        comm.reduce_scatter(out, inp, op=op, group=group, algorithm=algorithm)
        return out
    if coll == "scatter":
        out = made(torch.full((m // world,), -7, dtype=inp.dtype))
        comm.scatter(out, inp if rank == root else None, root, group=group, algorithm=algorithm)
        return out
    if coll == "all_to_all":
        out = made(torch.full((m,), -7, dtype=inp.dtype))
        comm.all_to_all(out, inp, group=group, algorithm=algorithm)
        return out
    raise ValueError(coll)


#: One dtype of each element width: what a schedule's byte offsets and chunk boundaries depend on.
WIDTH_DTYPES = (torch.bool, torch.float16, torch.float32, torch.int64)


def _cases(coll: str, world: int, every: bool = True):
    """(dtype, op, contiguous, root) to try: every dtype with one op, every op with float32 and int64 (and bool on
    2 ranks); with ``every`` false, one dtype of each width with one op and every op with float32 (the element-wise
    kernels are the same on any group, so a larger group checks what its own rounds change)."""
    ops = ("sum", "avg", "prod", "max", "min") if coll in REDUCING else ("sum",)
    roots = sorted({0, world - 1}) if coll in ("broadcast", "reduce", "gather", "scatter") else [0]
    cases = [(dtype, "sum", True, roots[-1]) for dtype in (ALL_DTYPES if every else WIDTH_DTYPES)]
    op_dtypes = (torch.float32, torch.int64, *([torch.bool] if world == 2 else [])) if every else (torch.float32,)
    cases += [(dtype, op, True, roots[0]) for op in ops[1:] for dtype in op_dtypes]
    cases += [(torch.float32, ops[-1], False, root) for root in roots]
    return [c for c in cases if not (c[1] == "avg" and not c[0].is_floating_point)]


def check_collective(
    coll: str,
    algorithm: str,
    world: int,
    sizes: list[int],
    seed: int = 0,
    local_size: int | None = None,
    every_dtype: bool = True,
) -> list[str]:
    """Every case of ``coll`` with ``algorithm`` on the group of ranks 0..world-1; returns the mismatches.

    ``local_size`` declares that many consecutive ranks a node (for hierarchical algorithms); ``every_dtype``
    false tries one dtype of each width (:func:`_cases`).
    """
    group = group_of(world)
    comm.set_local_size(local_size, group)
    rank = dist.get_rank(group)
    problems = []
    for size in sizes:
        numel = size * world if coll in BLOCKED else size
        for dtype, op, contiguous, root in _cases(coll, world, every_dtype):
            seed += 1
            inputs = [_input(r, numel, dtype, seed, op) for r in range(world)]
            mine = _strided(inputs[rank], contiguous)
            got = _call(coll, mine, rank, world, op, root, group, algorithm)
            if coll in BLOCKED and not torch.equal(mine.reshape(-1), inputs[rank].reshape(-1)):
                problems.append(f"{coll}/{algorithm} world={world} size={size} {dtype}: the input was changed")
            want = _expected(coll, inputs, rank, op, root)
            if want is None:
                continue
            if dtype == torch.bool:  # a sum is true where any is, a product where all are: torch's booleans
                want = want.to(torch.bool).double()
            tol = 1e-2 if op == "avg" and dtype in (torch.float16, torch.bfloat16) else 1e-6
            if not torch.allclose(got.double().reshape(-1), want.reshape(-1), rtol=tol, atol=tol):
                bad = (got.double().reshape(-1) - want.reshape(-1)).abs().argmax().item()
                problems.append(
                    f"{coll}/{algorithm} world={world} size={size} {dtype} op={op} contiguous={contiguous} "
                    f"root={root}: element {bad} is {got.reshape(-1)[bad].item()} "
                    f"not {want.reshape(-1)[bad].item()}"
                )
    return problems


def check_against_native(coll: str, algorithm: str, world: int, size: int, seed: int = 1) -> float:
    """Ours against torch.distributed on random float32 data; returns the largest relative difference."""
    group = group_of(world)
    rank = dist.get_rank(group)
    numel = size * world if coll in BLOCKED else size
    g = torch.Generator().manual_seed(seed * 31 + rank)
    data = torch.randn(numel, generator=g)
    results = [_call(coll, data.clone(), rank, world, "sum", 0, group, a) for a in (algorithm, "native")]
    if results[0] is None:
        return 0.0
    scale = results[1].abs().max().item() if results[1].numel() else 1.0
    return (results[0] - results[1]).abs().max().item() / max(scale, 1e-30) if results[0].numel() else 0.0


def run_barrier(world: int, late_rank: int, delay_s: float, algorithm: str = "dissemination") -> float:
    """Rank ``late_rank`` enters the barrier ``delay_s`` late; returns when this rank got out."""
    group = group_of(world)
    if dist.get_rank(group) == late_rank:
        time.sleep(delay_s)
    start = time.monotonic()
    comm.barrier(group=group, algorithm=algorithm)
    return time.monotonic() - start


def barrier_transport(world: int, algorithm: str) -> str:
    """The transport a barrier named ``algorithm`` ran on (``DTRAIN_COMM_TRANSPORT=auto``: a name may choose)."""
    from dtrain.comm import api

    group = group_of(world)
    seen = []
    real = api._via

    def spy(group, device, name):
        picked = real(group, device, name)
        seen.append(picked[1])
        return picked

    os.environ["DTRAIN_COMM_TRANSPORT"] = "auto"
    api._via = spy
    try:
        comm.barrier(group=group, algorithm=algorithm)
    finally:
        api._via = real
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return seen[-1]


def missing_peer(coll: str, algorithm: str, timeout_s: float, round_timeout_s: float = 0.0) -> str:
    """Ranks 0 and 1 form a fresh group with a ``timeout_s`` timeout; rank 1 never calls the collective.

    ``round_timeout_s`` > 0 sets DTRAIN_COMM_TIMEOUT for the call instead (the group's timeout stays long).
    """
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)
    if rank == 1:
        return ""
    if round_timeout_s:
        os.environ["DTRAIN_COMM_TIMEOUT"] = str(round_timeout_s)
    t = torch.ones(8)
    start = time.monotonic()
    try:
        if coll == "broadcast":
            comm.broadcast(t, 1, group=group, algorithm=algorithm)
        else:
            comm.all_reduce(t, group=group, algorithm=algorithm)
    except comm.CommTimeoutError as err:
        return f"{time.monotonic() - start:.1f}|{err}"
    finally:
        os.environ.pop("DTRAIN_COMM_TIMEOUT", None)
    return "no error"


def bad_input(case: str) -> str:
    """Call with bad local input on one rank alone (nothing may be sent); return the error text."""
    group = group_of(2)
    spare = torch.arange(8.0)  # what the overlapping calls slice
    calls = {
        "op": lambda: comm.all_reduce(torch.ones(4), op="mean", group=group),
        "torch_op": lambda: comm.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, group=group),
        "avg_int": lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), op="avg", group=group),
        "algorithm": lambda: comm.all_reduce(torch.ones(4), group=group, algorithm="butterfly"),
        "src": lambda: comm.broadcast(torch.ones(4), 5, group=group),
        "dst": lambda: comm.reduce(torch.ones(4), -1, group=group),
        "all_gather_size": lambda: comm.all_gather(torch.empty(7), torch.ones(4), group=group),
        "dtype_mismatch": lambda: comm.all_gather(torch.empty(8, dtype=torch.float64), torch.ones(4), group=group),
        "reduce_scatter_size": lambda: comm.reduce_scatter(torch.empty(3), torch.ones(4), group=group),
        "all_to_all_size": lambda: comm.all_to_all(torch.empty(3), torch.ones(3), group=group),
        "dtype": lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64), group=group),
        "not_tensor": lambda: comm.all_reduce([1.0, 2.0], group=group),
        "hierarchical_no_nodes": lambda: comm.all_reduce(torch.ones(4), group=group, algorithm="hierarchical"),
        "scatter_input": lambda: comm.scatter(torch.empty(2), torch.ones(5), 0, group=group),
        # (algorithms named: a call the group already made with the same sizes would skip its checks)
        "all_gather_overlap": lambda: comm.all_gather(spare, spare[1:5], group=group, algorithm="ring"),
        "reduce_scatter_overlap": lambda: comm.reduce_scatter(spare[1:5], spare, group=group, algorithm="ring"),
        "all_to_all_overlap": lambda: comm.all_to_all(spare[2:6], spare[:4], group=group, algorithm="direct"),
        "gather_overlap": lambda: comm.gather(spare, spare[2:6], 0, group=group, algorithm="star"),
        "scatter_overlap": lambda: comm.scatter(spare[3:7], spare, 0, group=group, algorithm="star"),
        "expanded": lambda: comm.all_reduce(torch.ones(1).expand(4), group=group, algorithm="ring"),
        "expanded_output": lambda: comm.all_gather(torch.zeros(1).expand(8), torch.ones(4), group=group),
        "src_float": lambda: comm.broadcast(torch.ones(4), 1.0, group=group, algorithm="tree"),
        "dst_text": lambda: comm.gather(torch.empty(8), torch.ones(4), "0", group=group, algorithm="star"),
    }
    before = torch.ones(4)
    try:
        calls[case]()
    except ValueError as err:
        assert torch.equal(before, torch.ones(4))
        return str(err)
    return "no error"


def after_bad_input_still_works() -> float:
    """The group still runs a correct all-reduce after the bad calls above sent nothing."""
    group = group_of(2)
    t = torch.full((5,), float(dist.get_rank(group) + 1))
    comm.all_reduce(t, group=group, algorithm="ring")
    return t[0].item()


def checked_calls(case: str) -> dict:
    """Under ``DTRAIN_COMM_CHECK=1``, on 2 ranks: ``case`` "sizes" (rank 1 all-reduces 6 elements where rank 0
    all-reduces 8), "collective" (rank 1 broadcasts where rank 0 all-reduces) or "matching" (both all-reduce 8, then
    all-gather 3 each, ring and auto); each rank's error message (None where it raised none), and what a matching
    ring all-reduce returns afterwards on the same group."""
    group = group_of(2)
    rank = dist.get_rank(group)
    before = os.environ.get("DTRAIN_COMM_CHECK")
    os.environ["DTRAIN_COMM_CHECK"] = "1"
    error, gathered = None, None
    try:
        t = torch.full((8 if rank == 0 or case != "sizes" else 6,), float(rank + 1))
        try:
            if case == "collective" and rank == 1:
                comm.broadcast(t, 0, group=group, algorithm="ring")
            else:
                comm.all_reduce(t, group=group, algorithm="ring")
            if case == "matching":
                out = torch.empty(6)
                comm.all_gather(out, torch.full((3,), float(rank)), group=group)
                gathered = out.tolist()
        except ValueError as err:
            error = str(err)
        after = torch.full((5,), float(rank + 1))
        comm.all_reduce(after, group=group, algorithm="ring")
    finally:
        if before is None:
            os.environ.pop("DTRAIN_COMM_CHECK", None)
        else:
            os.environ["DTRAIN_COMM_CHECK"] = before
    return {"error": error, "sum": t[0].item(), "gathered": gathered, "after": after[0].item()}


def world_copy_takes_world_node_size() -> float:
    """On a new group of every rank in world order, hierarchical all-reduce uses the world's node size."""
    copy = dist.new_group(list(range(dist.get_world_size())))  # every rank creates it, in the same order
    comm.set_local_size(2, None)
    try:
        x = torch.full((5,), float(dist.get_rank() + 1))
        comm.all_reduce(x, group=copy, algorithm="hierarchical")
        world = dist.get_world_size()
        return (x - world * (world + 1) / 2).abs().max().item()
    finally:
        comm.set_local_size(None, None)


def rank_and_world() -> tuple[int, int]:
    """This worker's rank and the pool's world size."""
    return dist.get_rank(), dist.get_world_size()


def repeated_calls_take_the_kept_path() -> dict:
    """Each of all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and reduce twice with the same
    arguments and new tensors: the second call runs what the first kept (dtrain.comm.state.FAST) without resolving
    the call again, and gives the same result; which of torch.distributed's functions the calls went through."""
    import torch

    from dtrain import comm
    from dtrain.comm import api
    from dtrain.comm.state import FAST

    group = group_of(2)
    rank, world = dist.get_rank(group), 2
    resolved = []
    prepare = api._prepare

    def counting(*args, **kwargs):
        resolved.append(args[0])
        return prepare(*args, **kwargs)

    api._prepare = counting
    # torch.distributed's functions: the first call of each goes through them, the second straight through the
    # process group's binding (dtrain.comm.native.direct), so the second round makes no call of them
    through_torch: list[str] = []
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_reduce")
    originals = {name: getattr(dist, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            through_torch.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counted(name))
    right = []
    try:
        for second in (False, True):
            if second:  # what the second calls send through torch.distributed's functions
                through_torch.clear()
            summed = torch.full((5,), float(rank + 1))
            comm.all_reduce(summed, "avg", group=group)
            right.append(summed.tolist() == [(world + 1) / 2] * 5)
            part = torch.arange(4, dtype=torch.float32) + 10 * rank
            full = torch.empty(4 * world)
            comm.all_gather(full, part, group=group)
            right.append(full.tolist() == [10.0 * r + i for r in range(world) for i in range(4)])
            out = torch.empty(2)
            comm.reduce_scatter(out, torch.ones(2 * world) * (rank + 1), group=group)
            right.append(out.tolist() == [world * (world + 1) / 2] * 2)
            swapped = torch.empty(world)
            comm.all_to_all(swapped, torch.arange(world, dtype=torch.float32) + 10 * rank, group=group)
            right.append(swapped.tolist() == [10.0 * r + rank for r in range(world)])
            sent = torch.full((3,), float(rank))
            comm.broadcast(sent, 1, group=group)
            right.append(sent.tolist() == [1.0] * 3)
            mine = torch.full((3,), float(rank + 1))  # Gloo may use a non-root's tensor: it is copied first
            comm.reduce(mine, 0, "sum", group=group)
            right.append(mine.tolist() == ([world * (world + 1) / 2] * 3 if rank == 0 else [float(rank + 1)] * 3))
    finally:
        api._prepare = prepare
        for name, original in originals.items():
            setattr(dist, name, original)
    return {
        "resolved": [str(c) for c in resolved],
        "right": all(right),
        "kept": len(FAST) >= 6,
        "through_torch": sorted(through_torch),
    }


def _guarded(kind: str, values: torch.Tensor, call: int) -> torch.Tensor:
    """``values`` in a tensor autograd guards against writes in place: ``kind`` "grad", a parameter on the first
    ``call`` and a plain tensor that requires grad after (which the kept path of a repeated call takes), or
    "inference", a tensor made under ``torch.inference_mode()`` (and written outside it)."""
    if kind == "grad":
        return torch.nn.Parameter(values.clone()) if call == 0 else values.clone().requires_grad_()
    with torch.inference_mode():
        return values.clone()


def guarded_tensors(kind: str, transport: str = "p2p") -> list[str]:
    """Every collective and algorithm on 2 ranks with every tensor of the call one autograd guards
    (:func:`_guarded`), three times with the same sizes (the last on the kept path), sums and averages; the
    mismatches with the reference, results that took autograd history, and inputs that changed."""
    group = group_of(2)
    rank, world = dist.get_rank(group), 2
    os.environ["DTRAIN_COMM_TRANSPORT"] = transport
    problems, seed = [], 0
    try:
        for coll in (*REDUCING, "broadcast", *BLOCKED):
            for algorithm in (a for a in comm.algorithms(coll) if a != "hierarchical"):
                for op in ("sum", "avg") if coll in REDUCING else ("sum",):
                    for call in range(3):
                        seed += 1
                        inputs = [_input(r, 3 * world, torch.float32, seed, op) for r in range(world)]
                        mine = _guarded(kind, inputs[rank], call)
                        made = lambda t, call=call: _guarded(kind, t, call)  # noqa: E731
                        got = _call(coll, mine, rank, world, op, 1, group, algorithm, made=made)
                        where = f"{coll}/{algorithm} op={op} call {call}"
                        if coll in BLOCKED and not torch.equal(mine.detach(), inputs[rank]):
                            problems.append(f"{where}: the input was changed")
                        want = _expected(coll, inputs, rank, op, 1)
                        if want is None:
                            continue
                        if got.grad_fn is not None:
                            problems.append(f"{where}: the result took autograd history ({got.grad_fn})")
                        if not torch.allclose(got.detach().double().reshape(-1), want.reshape(-1)):
                            problems.append(f"{where}: {got.detach().tolist()} not {want.tolist()}")
    finally:
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return problems


def inference_mode_first(transport: str) -> list[list[float]]:
    """On 3 ranks, from a fresh start (the group's state dropped, no work buffers kept): an all-gather (star: rank 0
    packs messages in a work buffer) and an all-reduce called under ``torch.inference_mode()``, then the same calls
    outside it; what each returned. What a call keeps for the next (work buffers, peer windows) must serve calls
    outside inference mode too."""
    from dtrain.comm import state
    from dtrain.comm.p2p import runtime

    group = group_of(3)
    rank = dist.get_rank(group)
    state.release(group)
    runtime._SCRATCH.buffers.clear()
    os.environ["DTRAIN_COMM_TRANSPORT"] = transport
    results = []
    try:
        for inside in (True, False):
            with torch.inference_mode(inside):
                gathered = torch.empty(6)
                comm.all_gather(gathered, torch.full((2,), float(rank)), group=group, algorithm="star")
                summed = torch.full((5,), float(rank + 1))
                comm.all_reduce(summed, group=group, algorithm="ring")
            results += [gathered.tolist(), summed.tolist()]
    finally:
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return results


def in_place_calls(world: int) -> list[str]:
    """Every algorithm of the collectives that write an output besides their input, called in place: the
    all-gather's input this rank's block of its output, the reduce-scatter's output this rank's block of its
    input, the all-to-all's output its input, the gather's input the root's own block of its output, the
    scatter's output the root's own block of its input. Each after an out-of-place call with the same sizes (which
    the kept path remembers); the mismatches with the reference."""
    group = group_of(world)
    rank = dist.get_rank(group)
    m, root, problems = 3, world - 1, []
    for coll in BLOCKED:
        for algorithm in comm.algorithms(coll):
            if algorithm == "hierarchical":
                continue
            for in_place in (False, True):
                n = m * world if coll in ("reduce_scatter", "scatter", "all_to_all") else m
                inputs = [_input(r, n, torch.float32, 7 + world, "sum") for r in range(world)]
                want = _expected(coll, inputs, rank, "sum", root)
                if not in_place:
                    got = _call(coll, inputs[rank].clone(), rank, world, "sum", root, group, algorithm)
                elif coll == "all_gather":
                    got = torch.full((world * m,), -7.0)
                    got[rank * m : (rank + 1) * m] = inputs[rank]
                    comm.all_gather(got, got[rank * m : (rank + 1) * m], group=group, algorithm=algorithm)
                elif coll == "reduce_scatter":
                    x = inputs[rank].clone()
                    comm.reduce_scatter(x[rank * m : (rank + 1) * m], x, group=group, algorithm=algorithm)
                    got = x[rank * m : (rank + 1) * m]
                elif coll == "all_to_all":
                    got = inputs[rank].clone()
                    comm.all_to_all(got, got, group=group, algorithm=algorithm)
                elif coll == "gather":
                    got = torch.full((world * m,), -7.0) if rank == root else None
                    mine = got[rank * m : (rank + 1) * m] if rank == root else inputs[rank].clone()
                    mine.copy_(inputs[rank])
                    comm.gather(got, mine, root, group=group, algorithm=algorithm)
                else:
                    whole = inputs[rank].clone() if rank == root else None
                    got = whole[rank * m : (rank + 1) * m] if rank == root else torch.full((m,), -7.0)
                    comm.scatter(got, whole, root, group=group, algorithm=algorithm)
                if want is not None and not torch.equal(got.double(), want):
                    problems.append(f"{coll}/{algorithm} in_place={in_place}: {got.tolist()} not {want.tolist()}")
    return problems


def integer_roots() -> list[list[float]]:
    """A broadcast, reduce, gather and scatter on 2 ranks with the root given as a NumPy integer and as a
    one-element integer tensor (what rank arithmetic often yields; torch.distributed takes them): the results."""
    import numpy as np

    group = group_of(2)
    rank = dist.get_rank(group)
    results = []
    for root in (np.int64(1), torch.tensor(1)):
        t = torch.full((3,), float(rank))
        comm.broadcast(t, root, group=group, algorithm="tree")
        s = torch.full((3,), float(rank + 1))
        comm.reduce(s, root, group=group, algorithm="ring")
        g = torch.empty(4) if rank == 1 else None
        comm.gather(g, torch.full((2,), float(rank)), root, group=group, algorithm="star")
        o = torch.empty(2)
        comm.scatter(o, torch.arange(4.0) if rank == 1 else None, root, group=group, algorithm="tree")
        results += [t.tolist(), s.tolist(), [] if g is None else g.tolist(), o.tolist()]
    return results


def torch_reduce_ops() -> list[list[float]]:
    """all_reduce, reduce, reduce_scatter and scan on 2 ranks with torch.distributed's ReduceOp for ``op``, each
    op against the same call with its name: the pairs of results."""
    group = group_of(2)
    rank = dist.get_rank(group)
    out = []
    for op, name in (
        (dist.ReduceOp.SUM, "sum"),
        (dist.ReduceOp.AVG, "avg"),
        (dist.ReduceOp.PRODUCT, "prod"),
        (dist.ReduceOp.MAX, "max"),
        (dist.ReduceOp.MIN, "min"),
    ):
        for given in (op, name):
            a = torch.tensor([1.0 + rank, 4.0 - rank])
            comm.all_reduce(a, op=given, group=group, algorithm="ring")
            r = torch.tensor([2.0 + rank, 1.0])
            comm.reduce(r, 0, op=given, group=group, algorithm="tree")
            rs = torch.empty(1)
            comm.reduce_scatter(rs, torch.tensor([1.0 + rank, 3.0 * rank]), op=given, group=group)
            sc = torch.tensor([5.0 - rank])
            comm.scan(sc, op=given, group=group)
            out.append(a.tolist() + r.tolist() + rs.tolist() + sc.tolist())
    return out


def bench_verify(world: int, sizes: list[int], broken: str | None = None) -> int:
    """``dtrain bench verify``'s check on the group of ranks 0..world-1: its failure count. ``broken`` names an
    all-reduce algorithm made to add 1 to its result (to negate a boolean one), for the check to find."""
    from dtrain.bench.verify import verify_on_rank

    right = comm.all_reduce

    def wrong(tensor, op="sum", group=None, algorithm="auto"):
        right(tensor, op, group, algorithm)
        if algorithm != broken:
            return tensor
        return tensor.logical_not_() if tensor.dtype == torch.bool else tensor.add_(1)

    comm.all_reduce = wrong
    try:
        return verify_on_rank(torch.device("cpu"), sizes, group=group_of(world))
    finally:
        comm.all_reduce = right
