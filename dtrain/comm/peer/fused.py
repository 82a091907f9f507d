"""All-reduce in one kernel on CUDA symmetric memory: the one-shot and two-shot forms.

Two of our all-reduce schedules are, on the peer transport over NVLink, exactly what one kernel can run with
its barriers inside it (each a signal written into every peer's pad and awaited on the device, no launch of
its own):

- ``one_shot``: one round in which every rank reads every peer's whole buffer and reduces it locally. The
  kernel copies this rank's input into its window, signals, reads and sums the peers' windows, and signals
  again before the window may be written anew.
- ``direct`` (the two-shot form): every rank sums its own block from all peers (a direct reduce-scatter), then
  every rank reads every block from its owner (a direct all-gather).

torch's symmetric-memory kernels (``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` and
``two_shot_all_reduce_out``) implement both, for sums of float32 and bfloat16; they are what vLLM and SGLang run
for small all-reduces. Other reductions and dtypes, the CPU, and a torch without these kernels run the same
schedules through the general pull plan (:func:`dtrain.comm.peer.window.run_pull`), with a barrier and a pass a
round. ``DTRAIN_COMM_FUSED=0`` turns the kernels off.

The one-round schedules of the other collectives run the same way, as one pass over the peers' windows
(:func:`one_pass`), up to :data:`ONE_PASS_MAX_BYTES` a rank: the ``direct`` all-gather, reduce-scatter and
all-to-all, the ``star`` broadcast and the ``scatter_allgather`` one, and the ``star`` reduce, gather and scatter.
Each is one kernel, :func:`dtrain.comm.peer.kernels.exchange`: each rank copies its input into its window, the
ranks pass one barrier on the signal pads inside the kernel, and each reads what it needs from the peers' windows
(the reduce-scatter sums its block, the reduce's root the whole buffer; the scatter-allgather broadcast passes a
second barrier between its two rounds). The same kernel runs the one-shot all-reduce up to :data:`REDUCE_MAX_BYTES`
and the two-shot one, with a second barrier, up to :data:`TWO_SHOT_MAX_BYTES`. Launched straight from the compiled
kernel, a call through :mod:`dtrain.comm` costs 13-22 us of host time against 24-56 us for torch.distributed's NCCL
call (8 KiB a rank, 4 H200s, benchmarks/results/probe-one-pass-h200x4.txt), which is what decides a small
collective: 1.2-2.6x NCCL's speed from 8 KiB to 2 MiB (docs/results.md). Without Triton the pass is three steps:
the copy in, :meth:`PeerWindow.barrier`, and ``torch._foreach_copy_`` out of the peers' mapped windows (the
reduce-scatter: torch's one-shot kernel on this rank's block; the reduce: the root's sum of the windows). Calls
alternate between the two halves of the window, so the barrier of the next call is what tells a rank that its peers
have read the previous one; a call of another kind through the window first passes one more barrier
(:func:`settle`), and a call recorded in a CUDA graph opens and closes with a barrier of its own (a graph replays
the same half).
"""

from __future__ import annotations

import torch

from dtrain.comm.ir.schedule import Collective, Schedule
from dtrain.comm.peer import kernels, watchdog
from dtrain.env import comm_env

__all__ = [
    "FORMS", "ONE_PASS", "exchange_takes", "fused_form", "measured", "one_pass", "one_pass_form", "reducer",
    "run_fused", "settle", "supports",
]  # fmt: skip

#: Our all-reduce schedules that one kernel runs, and the kernel's form.
FORMS = {"one_shot": "one", "direct": "two"}

#: What torch's kernels reduce: sums (``avg`` is a sum and a division) of these dtypes.
_DTYPES = (torch.float32, torch.bfloat16)
_state: dict[str, bool] = {}


def _kernels_present() -> bool:
    if "present" not in _state:
        ops = getattr(torch.ops, "symm_mem", None)
        try:
            _state["present"] = bool(
                torch.cuda.is_available()
                and ops is not None
                and hasattr(ops, "one_shot_all_reduce_copy_out")
                and hasattr(ops, "two_shot_all_reduce_out")
            )
        except Exception:  # a namespace that cannot be asked (CPU builds)
            _state["present"] = False
    return _state["present"]


def supports(
    algorithm: str, dtype: torch.dtype, op: str, device: torch.device, numel: int | None = None, world: int = 1
) -> bool:
    """Whether an all-reduce by ``algorithm`` of ``dtype`` with ``op`` on ``device`` runs as one kernel; given
    ``numel`` (and the group's ``world``), whether one of ``numel`` elements does: torch's kernels take whole
    4-byte words only, so a bfloat16 buffer of an odd length runs as one kernel only where the exchange kernel takes
    it (:func:`exchange_takes`)."""
    if not (
        algorithm in FORMS
        and device.type == "cuda"
        and dtype in _DTYPES
        and op in ("sum", "avg")
        and comm_env().fused
        and _kernels_present()
    ):
        return False
    return numel is None or numel * dtype.itemsize % 4 == 0 or exchange_takes(FORMS[algorithm], numel, dtype, world)


def exchange_takes(form: str, numel: int, dtype: torch.dtype, world: int) -> bool:
    """Whether the exchange kernel runs an all-reduce of ``numel`` elements of ``dtype`` over ``world`` ranks in
    ``form`` ("one" or "two"), a window with room for it given (:func:`reducer`'s other conditions)."""
    nbytes = numel * dtype.itemsize
    if form == "one":
        return nbytes <= REDUCE_MAX_BYTES and kernels.triton_ready()
    return numel % world == 0 and nbytes <= TWO_SHOT_MAX_BYTES and kernels.triton_ready()


def measured(algorithm: str, tensor: torch.Tensor, world: int) -> bool:
    """Whether an all-reduce of ``tensor`` by ``algorithm`` (one of :data:`FORMS`), which :func:`supports`, runs as
    the kernel ``auto``'s rules measured: the two-shot form as the exchange kernel (Triton present, at most
    :data:`TWO_SHOT_MAX_BYTES`, blocks of equal size), not torch's two-shot kernel, which was slower than NCCL's."""
    if algorithm != "direct":
        return True
    nbytes = tensor.numel() * tensor.element_size()
    return tensor.numel() % world == 0 and nbytes <= TWO_SHOT_MAX_BYTES and kernels.triton_ready()


def fused_form(schedule: Schedule, work: torch.Tensor, op: str) -> str | None:
    """The kernel form ("one" or "two") that runs ``schedule`` on ``work``, or None (the general plan runs it)."""
    if schedule.collective is not Collective.ALL_REDUCE:
        return None
    if not supports(schedule.algorithm, work.dtype, op, work.device, work.numel(), schedule.world_size):
        return None
    return FORMS[schedule.algorithm]


def run_fused(form: str, work: torch.Tensor, window, launch=None) -> torch.Tensor:
    """Sum the flat contiguous ``work`` over the group in place through ``window`` (its group's CUDA window, at
    least ``work``'s size) in the ``form`` :func:`fused_form` gave (an ``avg`` is divided by the caller, as for
    every schedule). ``launch``: the exchange kernel's launch for this size and dtype (:func:`reducer`), where the
    caller keeps it; else it is looked up.

    An eager call first passes the barrier a one-pass call left pending (:func:`settle`). A call recorded in a CUDA
    graph opens with a barrier of its own instead: its replay cannot see what ran eagerly before it, and the
    barrier is what keeps its copy into the window from overwriting a half the peers may still be reading."""
    recorded = work.is_cuda and torch.cuda.is_current_stream_capturing()
    if launch is None:
        launch = reducer(window, work, form)
    if launch is not None:  # one kernel of ours, its barriers inside: the halves alternate as a one-pass call's
        half = window.nbytes // 2 // ALIGN * ALIGN
        bank = window.bank
        if recorded:
            window.barrier()
        else:
            window.bank = bank ^ 1
        if launch(work, work, bank * half):
            if recorded:
                window.barrier()
            else:
                window.pending = True
            return work
    if work.numel() * work.element_size() % 4:
        raise RuntimeError(
            f"all_reduce of {work.numel()} {work.dtype} elements: the exchange kernel could not take it (the "
            "window has no signal pads) and torch's kernels take whole 4-byte words only"
        )  # fused_form checked what it could on every rank alike; a window without pads is one on every rank too
    if recorded:
        window.barrier()
    else:
        settle(window)
    group_name = window.group_name
    mine = window.local(work.dtype, work.numel())
    if form == "one":
        # the kernel copies work into the window before its first barrier, and every element is read from
        # work by the thread that later writes it: work may be the output too
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(mine, work, "sum", group_name, work)
    else:
        mine.copy_(work)
        torch.ops.symm_mem.two_shot_all_reduce_out(mine, "sum", group_name, work)
    return work


#: The largest all-reduce the exchange kernel's one-shot form runs; torch's one-shot kernel runs larger ones. Side
#: by side on 4 and 2 H100s against torch.distributed's own call: ours at 1.26-2.21x NCCL's speed from 8 KiB to
#: 128 KiB where torch's kernel ran at 1.26-1.58x (collectives_defaults*-h100x*.jsonl, the launch before), and
#: at 1.63-2.31x once a kept call kept its launch (benchmarks/results/one_shot_ar{,_fresh}-h100x{4,2}.jsonl); at
#: 2 MiB ours at 0.86-1.64x with 32 programs, torch's at 1.40-1.67x.
REDUCE_MAX_BYTES = 256 << 10

#: The largest all-reduce the exchange kernel's two-shot form runs (its window holds two halves of it); torch's
#: two-shot kernel runs larger ones.
TWO_SHOT_MAX_BYTES = 64 << 20

#: The exchange kernel's form for each all-reduce form of this module, and the most bytes it takes.
_REDUCERS = {"one": ("reduce", REDUCE_MAX_BYTES), "two": ("two_shot", TWO_SHOT_MAX_BYTES)}


def reducer(window, work: torch.Tensor, form: str = "one"):
    """The exchange kernel's all-reduce of ``work``'s size and dtype through ``window`` in ``form`` ("one": the
    one-shot, "two": the two-shot; :func:`dtrain.comm.peer.kernels.exchange`, kept on the window), or None: no
    Triton, a window without the signal pads' addresses or without two halves of room for ``work``, more than
    the form's limit (:data:`REDUCE_MAX_BYTES`, :data:`TWO_SHOT_MAX_BYTES`), or a two-shot of a size the ranks'
    blocks do not divide (torch's two-shot kernel runs it)."""
    launchers = window.__dict__.setdefault("launchers", {})
    kernel_form, most = _REDUCERS[form]
    world = window.world_size
    key = (kernel_form, work.dtype, work.numel())
    if key not in launchers:
        nbytes = work.numel() * work.element_size()
        half = window.nbytes // 2 // ALIGN * ALIGN
        room = window.pointers is not None and getattr(window, "pads", None) is not None and nbytes <= half
        room = room and nbytes <= most and (form == "one" or work.numel() % world == 0)
        limit = window.stall_limit(None) + watchdog.GRACE
        spins = max(1, int(limit.total_seconds() * 1000)) * 1000  # a wait's round takes a microsecond or more
        blocks = world if form == "two" else 1
        programs = kernels.exchange_programs(world, window.channels)
        if form == "two":
            programs = max(1, min(kernels.TWO_SHOT_PROGRAMS, window.channels))
        launchers[key] = None if not room else kernels.exchange(
            window.pointers, window.pads, window.rank, nbytes // blocks, world, kernel_form, spins, programs,
            dtype=work.dtype,
        )  # fmt: skip
    return launchers[key]


#: The most bytes a rank puts into a one-pass call (an all-gather's input, a reduce-scatter's, all-to-all's or
#: broadcast's tensor). Above it the same schedule runs a round at a time: on 4 H100s the one pass read the peers
#: at 120-215 GB/s bus bandwidth from 32 MiB, below NCCL's 200-300 (benchmarks/results/one_pass-*-h100x4.jsonl).
ONE_PASS_MAX_BYTES = 8 << 20

#: The one-round schedules of the other collectives that one pass over the peers' windows runs, and its form.
ONE_PASS = {
    (Collective.ALL_GATHER, "direct"): "gather",
    (Collective.REDUCE_SCATTER, "direct"): "scatter",
    (Collective.ALL_TO_ALL, "direct"): "exchange",
    (Collective.BROADCAST, "star"): "broadcast",
    (Collective.BROADCAST, "scatter_allgather"): "relay",
    (Collective.REDUCE, "star"): "rooted",
    (Collective.GATHER, "star"): "gather_to",
    (Collective.SCATTER, "star"): "scatter_from",
}


def one_pass_form(
    collective: Collective, algorithm: str, dtype: torch.dtype, op: str, device: torch.device, nbytes: int = 0
):
    """The one-pass form that runs ``algorithm`` for ``collective`` of ``dtype`` with ``op`` on ``device``, each
    rank putting in ``nbytes``, or None (the general plan runs it): CUDA, at most :data:`ONE_PASS_MAX_BYTES`,
    ``DTRAIN_COMM_ONE_PASS`` on (the default), kernels present and not turned off (``DTRAIN_COMM_FUSED``); a
    reduce-scatter and a reduce only for the sums the one-shot kernel takes (:data:`_DTYPES`, ``sum`` and
    ``avg``), a bfloat16 reduce-scatter only where Triton runs the exchange kernel."""
    form = ONE_PASS.get((collective, algorithm))
    env = comm_env()
    if form is None or device.type != "cuda" or nbytes > ONE_PASS_MAX_BYTES:
        return None
    if not env.one_pass or not env.fused or not _kernels_present():
        return None
    if form in ("scatter", "rooted") and (dtype not in _DTYPES or op not in ("sum", "avg")):
        return None
    if form == "scatter" and dtype.itemsize < 4 and not kernels.triton_ready():
        return None  # torch's one-shot kernel, the pass without Triton, takes blocks of whole 4-byte words only
    return form


def settle(window) -> None:
    """Before a call that writes into ``window`` with no barrier first: wait, with one barrier, for the peers to
    finish reading the last one-pass call's half (every rank makes the same calls, so every rank passes it)."""
    if window.pending:
        window.pending = False
        window.barrier()


#: Bytes a half of the window is aligned to (the one-shot kernel reads 16-byte vectors).
ALIGN = 256


def reduce_block(block: torch.Tensor, group_name: str, out: torch.Tensor) -> None:
    """Sum ``block`` of this rank's window (a slice of the allocation) over the same slice of every peer's window
    into ``out``: torch's one-shot kernel, which reads the peers at the slice's offset and opens and closes with a
    barrier."""
    torch.ops.symm_mem.one_shot_all_reduce_out(block, "sum", group_name, out)


def one_pass(form: str, window, dtype: torch.dtype, numel: int, root: int = 0):
    """A function ``run(output, input)`` that runs one call of ``form`` through ``window`` on contiguous tensors:
    ``numel`` elements of ``dtype`` are what each rank puts in (an all-gather's input, a reduce-scatter's
    or all-to-all's input, the broadcast's or the reduce's tensor, which is ``output`` and ``input`` alike;
    ``root``: the broadcast's or scatter's source, the reduce's or gather's destination, a group rank; the reduce
    and the gather write the root's ``output`` alone; the scatter's root puts in ``numel``, ``world`` blocks,
    every other rank nothing). ``window`` must hold two halves of ``numel`` elements. A reduce-scatter's or reduce's
    ``avg`` is divided by the caller."""
    rank, world = window.rank, window.world_size
    if form == "relay" and world < 3:  # one rank takes the root's whole buffer: the broadcast form
        form = "broadcast"
    half = window.nbytes // 2 // ALIGN * ALIGN
    if numel * dtype.itemsize > half:
        raise ValueError(f"one_pass: {numel} elements of {dtype} need a window of two halves of that size")
    block = numel // world
    handle, channel, cuda = window._handle, 0, window.device.type == "cuda"

    def views(bank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        at = bank * half
        mine = window._mine[at : at + numel * dtype.itemsize].view(dtype)
        peers = [b[at : at + numel * dtype.itemsize].view(dtype) for b in window.buffers]
        if form == "exchange":  # this rank's block of every peer's input
            peers = [p[rank * block : (rank + 1) * block] for p in peers]
        elif form == "scatter":  # the one-shot kernel sums this rank's block over the peers' windows
            peers = [mine[rank * block : (rank + 1) * block]]
        elif form in ("broadcast", "relay"):
            peers = [peers[root]]
        elif form == "scatter_from":  # this rank's block of the root's input
            peers = [peers[root][rank * block : (rank + 1) * block]]
        return mine, peers

    with torch.inference_mode(False):  # kept for later calls, in inference mode or not
        banks = (views(0), views(1))
    # the gather kernel's source: where in a window, and how many bytes, is each peer's block
    offset, nbytes = (rank * block, block) if form == "exchange" else (0, numel)
    offset, nbytes = offset * dtype.itemsize, nbytes * dtype.itemsize
    pointers = window.pointers  # the windows' addresses on the device (CUDA windows)
    group_name = window.group_name
    limit = window.stall_limit(None) + watchdog.GRACE  # as PeerWindow.barrier: the watchdog reports first
    barrier_ms = max(1, int(limit.total_seconds() * 1000))
    # the exchange kernel: its programs hold ``world`` slots of the pad each, and a wait's round takes at least
    # a microsecond (one compare-and-swap at system scope)
    blocks = world if form in ("exchange", "scatter", "scatter_from") else 1
    launch = None
    if pointers is not None and getattr(window, "pads", None) is not None:
        launch = kernels.exchange(
            pointers, window.pads, rank, numel // blocks * dtype.itemsize, world, form, barrier_ms * 1000,
            kernels.exchange_programs(window.world_size, window.channels), root=root, dtype=dtype,
        )  # fmt: skip

    def barrier() -> None:
        handle.barrier(channel=channel, timeout_ms=barrier_ms)

    def run(output: torch.Tensor, input: torch.Tensor) -> None:
        # eager calls alternate halves: this call's barrier is what frees the half the call before last used. A
        # call recorded in a CUDA graph replays on one half whatever ran before it: it opens and closes with a
        # barrier of its own and leaves the eager calls' state as it was.
        recorded = cuda and torch.cuda.is_current_stream_capturing()
        bank = window.bank
        if recorded:
            barrier()
        else:
            window.bank = bank ^ 1
        if launch is not None and launch(output, input, bank * half):
            if recorded:
                barrier()
            else:
                window.pending = True
            return
        output, input = output.view(-1), input.view(-1)
        mine, peers = banks[bank]
        if form == "scatter":
            mine.copy_(input)
            reduce_block(peers[0], group_name, output)  # opens and closes with a barrier
            if not recorded:
                window.pending = False
            return
        rooted = form in ("broadcast", "relay", "scatter_from")  # without the kernel: copies from the root's window
        if not rooted or rank == root:
            mine.copy_(input)
        barrier()
        if form == "rooted":  # the root sums every window, in rank order, accumulated in float32
            if rank == root:
                output.copy_(torch.stack(peers).sum(0, dtype=torch.float32))
        elif form == "gather_to":  # the root alone takes every peer's block
            if rank == root:
                torch._foreach_copy_(list(output.view(world, -1).unbind(0)), peers)
        elif rooted:  # one copy: less host time than a Triton launch
            if rank != root or form == "scatter_from":
                output.copy_(peers[0])
        elif pointers is None or not kernels.gather(output, pointers, bank * half + offset, nbytes, world):
            # every peer's block into its place in the output: one multi-tensor copy (no Triton, or turned off)
            torch._foreach_copy_(list(output.view(world, -1).unbind(0)), peers)
        if recorded:
            barrier()
        else:
            window.pending = True

    return run
