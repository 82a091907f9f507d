"""One pass of a pull round: ``outs[:] = base (op) sources[0] (op) sources[1] ...``.

On CUDA with Triton, one kernel reads the base and up to three peer windows, combines them in registers
(half types in float32) and stores to one or two outputs, so a round's transfer, its reduction and the
second store cost one pass over the data. Elsewhere, or for more sources, torch operations do the same in
a few passes. The choice is this rank's alone: both compute the same values, so ranks may differ.

``DTRAIN_COMM_TRITON=0`` turns the kernel off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.comm.peer.pull import wants_kernel
from dtrain.env import comm_env

__all__ = ["combine", "exchange", "gather", "triton_ready", "wants_kernel"]

_OPS = {"sum": 0, "avg": 0, "prod": 1, "max": 2, "min": 3}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)
_SCALED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_SOURCES = 3
_BLOCK = 4096
_state: dict[str, object] = {}  # the compiled kernel: process-wide, one per process whatever the group


def _build():
    import triton

    # Triton resolves the functions a kernel calls from the globals of the kernel's own module
    from dtrain.comm.peer import triton as peer_triton

    return triton, peer_triton.pull_kernel, peer_triton.gather_kernel, peer_triton.exchange_kernel


def triton_ready() -> bool:
    """Whether the fused kernel is usable in this process (Triton importable and not turned off)."""
    if "kernel" not in _state:
        if not comm_env().triton:
            _state["kernel"] = None
        else:
            try:
                _state["kernel"] = _build()
            except Exception:  # no Triton (CPU builds of torch): torch operations do the work
                _state["kernel"] = None
    return _state["kernel"] is not None


def _launch(outs, base, sources, op: str, scale: float | None = None) -> None:
    triton, kernel = _state["kernel"][:2]
    out0 = outs[0]
    n = out0.numel()
    upcast = out0.dtype in (torch.float16, torch.bfloat16)
    pad = list(sources) + [sources[0]] * (_MAX_SOURCES - len(sources))
    kernel[(triton.cdiv(n, _BLOCK),)](
        out0, outs[1] if len(outs) > 1 else out0, base if base is not None else out0, *pad, n,
        1.0 if scale is None else scale,
        HAS_OUT1=len(outs) > 1, HAS_BASE=base is not None, NSRC=len(sources), OP=_OPS[op],
        UPCAST=upcast, SCALED=scale is not None, BLOCK=_BLOCK,
    )  # fmt: skip


def _torch_combine(outs, base, sources, op: str, scale: float | None = None) -> None:
    from dtrain.comm.p2p.runtime import REDUCE_OPS

    target = outs[0]
    if base is None:  # a copy: exactly one source
        target.copy_(sources[0])
    else:
        if op in ("sum", "avg") and base.data_ptr() != target.data_ptr():
            torch.add(base, sources[0], out=target)
            rest = sources[1:]
        else:
            if base.data_ptr() != target.data_ptr():
                target.copy_(base)
            rest = sources
        for s in rest:
            REDUCE_OPS[op](target, s)
    if scale is not None:
        target.mul_(scale)
    for other in outs[1:]:
        other.copy_(target)


def combine(
    outs: list[torch.Tensor],
    base: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    op: str,
    remote: bool = False,
    scale: float | None = None,
) -> None:
    """Write ``base (op) sources...`` (or the one source, for a copy) into every tensor of ``outs``, multiplied by
    ``scale`` where one is given (in the same pass where the kernel runs: an average's division costs no pass of
    its own). ``remote``: an output is a peer's memory (a push), where the kernel's one pass is what was measured to
    be fast."""
    if not outs or not sources:
        return
    nbytes = outs[0].numel() * outs[0].element_size()
    wanted = wants_kernel(len(outs), len(sources), nbytes, has_base=base is not None, remote=remote)
    fused = wanted and outs[0].is_cuda and outs[0].dtype in _KERNEL_DTYPES and triton_ready()
    if fused:
        # the kernel scales in float32: a float64 or integer output is scaled by torch afterwards, as it would be
        inside = scale if outs[0].dtype in _SCALED_DTYPES else None
        try:
            first = sources[:_MAX_SOURCES] if len(sources) > _MAX_SOURCES else sources
            whole = len(first) == len(sources)
            _launch(outs if whole else outs[:1], base, first, op, inside if whole else None)
        except Exception:  # a Triton that cannot compile here (the first launch): nothing was written
            _state["kernel"] = None
        else:
            rest = sources[len(first) :]
            while rest:  # more peers than one kernel reads: fold them in, three at a time
                step, rest = rest[:_MAX_SOURCES], rest[_MAX_SOURCES:]
                _launch(outs if not rest else outs[:1], outs[0], step, op, None if rest else inside)
            if scale is not None and inside is None:
                for out in outs:
                    out.mul_(scale)
            return
    _torch_combine(outs, base, sources, op, scale)


#: Words a program of the gather kernel copies.
_GATHER_BLOCK = 2048
#: Word sizes the gather kernel copies in, widest first, and their dtypes.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_bytes(*quantities: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every one of ``quantities`` (byte offsets, sizes and
    addresses): the gather kernel's unit of copy."""
    for size, _ in _WORDS:
        if all(q % size == 0 for q in quantities):
            return size
    return 1


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous ``tensor`` as one flat uint8 tensor. A tensor of one element is contiguous
    whatever its stride (``x[:, 0]`` of a (1, 2) tensor: stride 2), which a view to bytes refuses; its element is
    where its storage offset says, so the flat view is taken with stride 1."""
    flat = tensor.as_strided((tensor.numel(),), (1,)) if tensor.numel() <= 1 else tensor.view(-1)
    return flat.view(torch.uint8)


def gather(out: torch.Tensor, pointers: torch.Tensor, offset: int, nbytes: int, blocks: int, root: int = -1) -> bool:
    """One kernel: byte block ``r`` of the flat contiguous CUDA tensor ``out`` (``nbytes`` each, ``blocks`` of
    them) = ``nbytes`` at byte ``offset`` of rank ``r``'s window (of rank ``root``'s for every block where
    ``root >= 0``); ``pointers``: the windows' addresses, an int64 tensor on the device. The kernel reads the
    peers' addresses on the device, so the host neither asks CUDA about peer memory nor copies from it (copies out
    of four peers' mapped windows cost 26-41 us of host time on H100s, this kernel's launch 18 us). False, with nothing
    written, where the kernel cannot run (no Triton, turned off, or a first launch that fails to compile)."""
    if not triton_ready():
        return False
    word = word_bytes(offset, nbytes, out.data_ptr())
    dtype = dict(_WORDS)[word]
    n, at = nbytes // word, offset // word
    words = flat_bytes(out).view(dtype)
    triton, _, kernel = _state["kernel"][:3]
    grid = ((n + _GATHER_BLOCK - 1) // _GATHER_BLOCK, blocks, 1)
    # what Triton compiles a variant for: the word, the constants, the output's 16-byte alignment, 64-bit indices
    key = (dtype, root >= 0, out.data_ptr() % 16 == 0, max(at + n, n * blocks) >= 1 << 31, out.device)
    compiled = _GATHER_COMPILED.get(key)
    if compiled is not None:
        try:
            # the compiled kernel's own launcher: Triton's per-call argument binding and cache lookup cost ~20 us
            # of host time, more than the copy of a small collective
            stream = torch.cuda.current_stream(out.device).cuda_stream
            compiled.run(
                *grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                pointers, words, at, n, max(root, 0), root >= 0, _GATHER_BLOCK,
            )  # fmt: skip
            return True
        except Exception:  # a Triton whose compiled kernels launch another way: bind every call
            _GATHER_COMPILED.clear()
            _GATHER_COMPILED["direct"] = None
    try:
        compiled = kernel[grid](pointers, words, at, n, max(root, 0), ONE_SOURCE=root >= 0, BLOCK=_GATHER_BLOCK)
    except Exception:  # a Triton that cannot compile here (the first launch): nothing was written
        _state["kernel"] = None
        return False
    if "direct" not in _GATHER_COMPILED and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        _GATHER_COMPILED[key] = compiled
    return True


#: Compiled variants of the gather kernel launched without Triton's binding (:func:`gather`); ``"direct"``: a
#: direct launch failed once, so every call goes through Triton's binding.
_GATHER_COMPILED: dict = {}


#: Elements a program of the exchange kernel copies at a time, the most programs one call runs, and the most
#: (program, peer) pairs (:func:`exchange_programs`). Each program holds ``world`` slots of the signal pad. The
#: kernel alone beside NCCL's call, 8 MiB, H100s (benchmarks/results/probe-exchange-programs-h100x{4,2}.txt): on 4
#: GPUs 64 programs ran the all-gather, all-to-all and reduce-scatter at 1.06-1.28x NCCL's speed where 32 ran them
#: at 0.84-1.21x; on 2 GPUs 128 programs at 1.58-1.65x where 32 ran them at 0.85-1.13x. Fewer programs were never
#: faster; the broadcast on 4 GPUs is bound by its root's links whatever the count.
EXCHANGE_BLOCK = 2048
EXCHANGE_PROGRAMS = 128
EXCHANGE_PAIRS = 256

#: Programs of the two-shot all-reduce (within the pad's room): its reduce-scatter round reads more than the
#: one-pass forms and gains from more programs in flight. The kernel alone beside NCCL's all-reduce
#: (benchmarks/results/probe-exchange-programs-two-shot-h100x{4,2}.txt): on 4 H100s 256 programs ran it at
#: 1.00x at 4 MiB and 0.95x at 8 where 64 ran it at 0.95x and 0.88x; on 2 at 1.21x at 8 MiB and 1.02x at 16
#: where 128 ran it at 1.16x and 0.95x; never slower than 64 or 128 beyond the rounding of a few microseconds.
TWO_SHOT_PROGRAMS = 256


def exchange_programs(world: int, channels: int) -> int:
    """Programs for an exchange kernel on ``world`` GPUs whose signal pad holds ``channels`` barrier channels: at
    most :data:`EXCHANGE_PROGRAMS` and :data:`EXCHANGE_PAIRS` over ``world`` (64 on 4 GPUs, 128 on 2)."""
    return max(1, min(EXCHANGE_PROGRAMS, EXCHANGE_PAIRS // world, channels))


#: The exchange kernel's forms (:func:`exchange`).
EXCHANGE_FORMS = {
    "gather": 0, "exchange": 0, "broadcast": 1, "scatter": 2, "reduce": 3, "two_shot": 4, "relay": 5, "rooted": 6,
    "gather_to": 7, "scatter_from": 8,
}  # fmt: skip

#: Forms whose input is ``world`` blocks of ``nbytes``, and forms that sum (in ``dtype``'s elements).
_BLOCK_FORMS = ("exchange", "scatter", "two_shot", "scatter_from")
_SUM_FORMS = ("scatter", "reduce", "two_shot", "rooted")


def exchange(
    pointers: torch.Tensor,
    pads: torch.Tensor,
    rank: int,
    nbytes: int,
    world: int,
    form: str,
    spins: int,
    programs: int = EXCHANGE_PROGRAMS,
    root: int = 0,
    dtype: torch.dtype | None = None,
):
    """A function ``launch(out, inp, at) -> bool`` that runs a whole one-pass collective as one kernel: copy
    ``inp`` into this rank's window at byte ``at``, pass one barrier on the signal pads, and read what ``form``
    takes from the peers' windows into ``out`` (contiguous CUDA tensors):

    - ``gather``: the all-gather of ``nbytes`` a rank (block ``r`` of ``out`` from rank ``r``);
    - ``exchange``: the all-to-all of ``world`` blocks of ``nbytes`` (block ``r`` of ``out`` from block ``rank``
      of rank ``r``'s input);
    - ``broadcast``: ``nbytes`` from rank ``root`` (which alone copies in) into every other rank's ``out``;
    - ``scatter``: the sum over the ranks of block ``rank`` of ``world`` blocks of ``nbytes`` of ``dtype``
      (float32 accumulation), the reduce-scatter;
    - ``reduce``: the sum over the ranks of their ``nbytes`` of ``dtype``, the one-shot all-reduce (``out`` may be
      ``inp``);
    - ``two_shot``: the sum over the ranks of their ``world`` blocks of ``nbytes`` of ``dtype``, each rank summing
      its own block and reading the others from their owners after a second barrier, the two-shot all-reduce
      (``out`` may be ``inp``);
    - ``relay``: ``nbytes`` from rank ``root`` into every other rank's ``out``, each of those taking a share from
      the root and the rest from the others after a second barrier (three ranks or more).
    - ``rooted``: the sum over the ranks of their ``nbytes`` of ``dtype`` into rank ``root``'s ``out`` (``out`` may
      be ``inp``), the reduce; every other rank only puts its input in.
    - ``gather_to``: the gather of ``nbytes`` a rank into rank ``root``'s ``out`` (block ``r`` from rank ``r``);
      every other rank only puts its input in;
    - ``scatter_from``: block ``rank`` of rank ``root``'s ``world`` blocks of ``nbytes`` into every rank's ``out``,
      the scatter (only the root puts its input in).

    ``pointers`` and ``pads``: every rank's window and signal-pad address, int64 tensors on the device;
    ``spins``: the rounds a wait at the barrier lasts before it gives up; ``programs``: at most this many programs
    (each copies a strided share of the chunks), within the pad's room. One launch where the three-step pass
    (:func:`gather`) makes three: the copy in, the barrier and the reads. ``launch`` answers False, with nothing
    written, where the kernel cannot run (no Triton, turned off, or a first launch that fails to compile); None
    in place of the function where Triton is missing.

    After a variant's first launch the compiled kernel is launched directly, with the tensors' addresses and the
    raw stream: binding the arguments through Triton and asking torch for the stream object cost more host time
    than the copy of a small collective."""
    if not triton_ready() or "exchange_error" in _state:
        return None
    code = EXCHANGE_FORMS[form]
    if form == "relay" and world < 3:
        raise ValueError("exchange: a relayed broadcast needs three ranks or more (two: the broadcast form)")
    blocks = world if form in _BLOCK_FORMS else 1
    lanes = 1 << max(0, (world - 1).bit_length())
    device = pointers.device
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch
    compiled: dict = {}  # (unit, out aligned, inp aligned) -> the compiled kernel
    # the unit of copy: the widest word that divides the offset and the size, which every rank shares (its grid and
    # each program's chunks follow from it, and the barrier pairs program p of every rank); a sum needs the elements
    summed = form in _SUM_FORMS
    units = [(dtype.itemsize, dtype)] if summed else list(_WORDS)
    grids = {size: (max(1, min(programs, -(-(nbytes // size) // EXCHANGE_BLOCK))), 1, 1) for size, _ in units}
    # whether this rank's ``out`` is written (not: the reduce's and the gather's other ranks, the broadcasts' root)
    writes = not (form in ("rooted", "gather_to") and rank != root or form in ("broadcast", "relay") and rank == root)

    def launch(out: torch.Tensor, inp: torch.Tensor, at: int) -> bool:
        out_at, inp_at = out.data_ptr(), inp.data_ptr()
        size = units[0][0] if summed else word_bytes(at, nbytes)
        if out_at % size or inp_at % size:  # this rank's tensors sit off that word: aligned stand-ins
            ins = inp.clone() if inp_at % size else inp
            outs = ins if out_at == inp_at else (torch.empty_like(out) if out_at % size else out)
            if not launch(outs, ins, at):
                return False
            if writes and outs is not out:
                out.copy_(outs)
            return True
        key = (size, out_at % 16 == 0, inp_at % 16 == 0)
        kernel = compiled.get(key)
        if kernel is not None:
            try:
                kernel.run(
                    *grids[size], raw_stream(index), kernel.function, kernel.packed_metadata, None, None, None,
                    pointers, pads, out_at, inp_at, rank, at // size, nbytes // size, spins, root,
                    world, lanes, blocks, code, EXCHANGE_BLOCK,
                )  # fmt: skip
                return True
            except Exception:  # a Triton whose compiled kernels launch another way: bind every call
                compiled.clear()
                compiled["bind"] = None
        if "exchange_error" in _state:
            return False
        unit = dict(units)[size]
        outs = flat_bytes(out).view(unit)
        ins = flat_bytes(inp).view(unit)
        try:
            kernel = _state["kernel"][3][grids[size]](
                pointers, pads, outs, ins, rank, at // size, nbytes // size, spins, root,
                WORLD=world, LANES=lanes, BLOCKS=blocks, FORM=code, BLOCK=EXCHANGE_BLOCK,
            )  # fmt: skip
        except Exception as err:  # a Triton that cannot compile it (the first launch): nothing was written
            _state["exchange_error"] = f"{type(err).__name__}: {err}"
            return False
        if "bind" not in compiled and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            compiled[key] = kernel
        return True

    return launch
