"""A rank of the exchange kernel's test under Triton's interpreter (tests/comm/test_one_pass.py): every rank's
window and signal pad are files in /dev/shm, mapped by every rank, and the kernel runs on the CPU, interpreted."""

from __future__ import annotations

import torch

HALF = 1 << 16  # each window holds two halves of this many bytes
PAD = 2048  # torch's signal pad: 2048 bytes of uint32 slots


def _skewed(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view one element into a new buffer: contiguous, but off every word wider than an
    element (a slice of a bigger tensor)."""
    held = torch.empty(t.numel() + 1, dtype=t.dtype)
    held[1:].copy_(t)
    return held[1:]


def run_rank(
    rank: int, world: int, stem: str, form: str, numel: int, dtype_name: str, programs: int, skew: bool = False
) -> None:
    """Four calls of ``form`` through the kernel, the sizes (and a broadcast's root) changing and the halves
    alternating; an AssertionError where a rank's result differs from the one computed here for every rank.
    ``skew``: rank 1's tensors sit one element into their buffers, the other ranks' on wide words."""
    from dtrain.comm.peer import kernels

    kernels.EXCHANGE_BLOCK = 128  # small chunks: several programs, each with several chunks
    dtype = getattr(torch, dtype_name)
    windows = [torch.from_file(f"{stem}-w{r}", True, 2 * HALF, dtype=torch.uint8) for r in range(world)]
    pads = [torch.from_file(f"{stem}-p{r}", True, PAD, dtype=torch.uint8) for r in range(world)]
    pointers = torch.tensor([w.data_ptr() for w in windows], dtype=torch.int64)
    signals = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    blocks = world if form in ("exchange", "scatter", "two_shot", "scatter_from") else 1
    for call in range(4):
        n = numel + call
        root = (world - 1 + call) % world  # the broadcasts' source and the reduce's root move from call to call

        def data(r: int, n: int = n, call: int = call) -> torch.Tensor:
            return (torch.arange(blocks * n) % 97 + 10 * r + 3 * call).to(dtype)

        launch = kernels.exchange(
            pointers, signals, rank, n * dtype.itemsize, world, form, 10**7, programs, root=root, dtype=dtype
        )
        assert launch is not None, kernels._state.get("exchange_error")
        inp = data(rank)
        if form in ("broadcast", "relay", "reduce", "two_shot", "rooted"):
            summed = form in ("reduce", "two_shot", "rooted")
            out = inp if summed or rank == root else torch.full((n,), -1.0).to(dtype)
            inp = out
        elif form == "gather_to":  # a rank but the root has no output: its input stands in, unwritten
            out = torch.full((world * n,), -1.0).to(dtype) if rank == root else inp
        elif form == "scatter_from":  # a rank but the root puts nothing in: its output stands in
            out = torch.full((n,), -1.0).to(dtype)
            inp = data(root) if rank == root else out
        else:
            out = torch.full(((1 if form == "scatter" else world) * n,), -1.0).to(dtype)
        if skew and rank == 1:
            same = out.data_ptr() == inp.data_ptr()
            out = _skewed(out)
            inp = out if same else _skewed(inp)
        assert launch(out, inp, (call % 2) * HALF), kernels._state.get("exchange_error")
        if form in ("broadcast", "relay"):
            want = data(root)
        elif form == "scatter":
            want = sum(data(r)[rank * n : (rank + 1) * n].float() for r in range(world)).to(dtype)
        elif form in ("reduce", "two_shot") or (form == "rooted" and rank == root):
            want = sum(data(r).float() for r in range(world)).to(dtype)
        elif form == "rooted":  # a rank but the reduce's root only puts its tensor in
            want = data(rank)
        elif form == "gather_to":
            want = torch.cat([data(r) for r in range(world)]) if rank == root else data(rank)
        elif form == "scatter_from":
            want = data(root)[rank * n : (rank + 1) * n]
        elif form == "exchange":
            want = torch.cat([data(r)[rank * n : (rank + 1) * n] for r in range(world)])
        else:
            want = torch.cat([data(r) for r in range(world)])
        wrong = (out != want).nonzero().flatten()  # which elements, for the failure's message
        assert torch.equal(out, want), (form, rank, call, root, n, wrong[:5].tolist(), wrong.numel())


def alone(stem: str, world: int, spins: int) -> None:
    """Rank 0 of ``world`` runs an all-gather through the kernel while no peer ever comes: its barrier waits
    ``spins`` rounds, then faults (the process ends by a signal); returning means it went on."""
    from dtrain.comm.peer import kernels

    windows = [torch.from_file(f"{stem}-w{r}", True, 2 * HALF, dtype=torch.uint8) for r in range(world)]
    pads = [torch.from_file(f"{stem}-p{r}", True, PAD, dtype=torch.uint8) for r in range(world)]
    pointers = torch.tensor([w.data_ptr() for w in windows], dtype=torch.int64)
    signals = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    launch = kernels.exchange(pointers, signals, 0, 64, world, "gather", spins, 1)
    launch(torch.empty(16 * world), torch.ones(16), 0)
