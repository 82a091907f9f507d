"""Usage: torchrun --nproc-per-node 2 benchmarks/collectives/probe.py channel-latency [--hops 32] [--replays 20]

The device latency of one message on a peer channel (dtrain.comm.peer.channels) as a pipeline stage meets it: a
kernel makes a payload, the payload goes to the next GPU, whose next kernel uses it. Ranks 0 and 1 pass one
tensor back and forth ``--hops`` times a round; each hop is a kernel on the received tensor (``y = x + 1``, read
from the slot where it landed, as a stage computes on a message in place) and a send of ``y``. A round is
recorded as one CUDA graph a rank and replayed ``--replays`` times; the time of a hop is a replay's time over
the hops. Beside it: the same kernels with no message (one GPU's chain of ``y = x + 1``), so what a message adds
to a hop is the difference, and NCCL's ``send`` / ``recv`` in the same recorded chain.

Variants, for 64 KiB, 512 KiB and 4 MiB payloads of float32: each of the channels' engines (``stream``: a copy
engine on the channel's stream after an event; ``inline``: a copy engine on the compute stream; ``kernel``: an
elementwise kernel on the compute stream storing into the peer's slot), then NCCL. Every variant's result is
checked: after a round rank 0 holds the start value plus the number of hops.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dtrain.comm.peer.channels import ENGINES, Channel, PeerChannels


def _round(chans, rank: int, x0: torch.Tensor, hops: int, engine: str) -> torch.Tensor:
    """One round of ``hops`` messages (rank 0 sends the even ones, rank 1 the odd ones); returns rank 0's last
    value (rank 1: its last sent)."""
    out = x0
    mine, theirs = rank, 1 - rank
    sends = [i for i in range(hops) if i % 2 == rank]
    takes = [i for i in range(hops) if i % 2 != rank]
    x, sent = x0, []
    for i in range(hops):
        if i % 2 == rank:
            y = x + 1
            sent.append(chans.send(mine, y, last=i == sends[-1], engine=engine))
            out = y
        else:
            x = chans.post(theirs, x0.shape, x0.dtype, last=i == takes[-1], lend=True).wait()
    if rank == 0 and hops % 2 == 0:
        out = x + 0  # the last message, back on rank 0
    for done in sent:  # the channel's stream (engine "stream") joins the caller's
        done.wait()
    chans.release()
    return out


def _nccl_round(rank: int, x0: torch.Tensor, hops: int, box: torch.Tensor, group) -> torch.Tensor:
    x, out = x0, x0
    for i in range(hops):
        if i % 2 == rank:
            y = x + 1
            dist.send(y, 1 - rank, group=group)
            out = y
        else:
            dist.recv(box, 1 - rank, group=group)
            x = box
    if rank == 0 and hops % 2 == 0:
        out = x + 0
    return out


def _timed_graph(fn, replays: int, group) -> tuple[float, torch.Tensor]:
    """Record ``fn`` (after two eager calls), replay it; seconds a replay (the slower rank's) and its output."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph.replay()  # once before timing
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = torch.tensor([start.elapsed_time(end) / 1e3 / replays], device=out.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return seconds.item(), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hops", type=int, default=32, help="messages a round (even: the round ends on rank 0)")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    if rank > 1:
        dist.barrier()
        dist.destroy_process_group()
        return
    hops = args.hops
    if rank == 0:
        print(f"{torch.cuda.get_device_name(device)} x {world}, torch {torch.__version__}; ranks 0 and 1, {hops} hops")
        print(f"{'bytes':>9} {'variant':>8} {'us a hop':>9} {'kernel us':>9} {'message us':>10} {'checked':>8}")
    for nbytes in (64 << 10, 512 << 10, 4 << 20):
        numel = nbytes // 4
        x0 = torch.zeros(numel, device=device)
        # the chain's kernels alone, on this GPU
        alone = torch.zeros(numel, device=device)

        def chain(a=alone):
            y = a
            for _ in range(hops):
                y = y + 1
            return y

        graph_s, _ = _timed_graph(chain, args.replays, pair)
        kernel_us = graph_s / hops * 1e6
        rows = []
        for engine in (*ENGINES, "nccl"):
            if engine == "nccl":
                box = torch.empty(numel, device=device)
                fn = lambda x0=x0, box=box: _nccl_round(rank, x0, hops, box, pair)  # noqa: E731
            else:
                chans = PeerChannels(pair, device, [Channel(0, 1, nbytes, hops), Channel(1, 0, nbytes, hops)])
                fn = lambda chans=chans, x0=x0, engine=engine: _round(chans, rank, x0, hops, engine)  # noqa: E731
            try:
                seconds, out = _timed_graph(fn, args.replays, pair)
            except RuntimeError as e:  # NCCL's send and recv may not record on this build
                rows.append((engine, float("nan"), f"failed: {str(e).splitlines()[0][:60]}"))
                continue
            ok = torch.tensor([1 if rank != 0 or bool((out == hops).all()) else 0], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pair)
            hop_us = seconds / hops * 1e6
            rows.append((engine, hop_us, "yes" if ok.item() else "NO"))
        if rank == 0:
            for engine, hop_us, ok in rows:
                print(
                    f"{nbytes:>9} {engine:>8} {hop_us:>9.2f} {kernel_us:>9.2f} {hop_us - kernel_us:>10.2f} {ok:>8}",
                    flush=True,
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
