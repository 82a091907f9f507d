"""``dtrain bench pipeline``: the pipeline bubble of each schedule, measured beside its theory, and
torch.distributed.pipelining's step time on the same model and micro-batches: the same schedule where torch has it,
its 1F1B beside ZB-H1 (which it has not; the row's ``torch_schedule`` names the class).

The model is ``--layers`` x (Linear(width, width) + GELU), MSE loss, one seed on every rank. Per schedule and
micro-batch count ``m``: ``step_s``, the slowest rank's ``train_step`` (median of ``--steps`` after ``--warmup``);
``busy_s``, each rank's own forward and backward of its ``m`` micro-batches alone, back to back (on the CPU one
rank at a time, as ranks share cores); ``bubble`` = 1 - sum(busy_s) / (p x step_s), everything not computing
(waiting and messages) counting as bubble, as in the theory (:func:`~dtrain.parallel.pipeline_schedules.
theoretical_bubble`). The theory holds stages of equal compute; where they differ (the first stage computes no
input gradient for its first layer), the lighter stages also wait for the slowest, which no schedule can remove:
``busy_ms_per_stage`` gives each rank's own, and ``bubble_slowest`` (``bubble_slowest_steady``) = 1 - max(busy_s) /
step_s, the slowest stage's idle share, is what the schedule leaves on the stage that sets the pace. On the CPU:
``--nproc`` Gloo ranks; under torchrun: one GPU a rank, NCCL.

Where the bubble goes, from one more step with the stage link's clocks on (:meth:`~dtrain.parallel.
pipeline_parallel_communications.StageLink.step_report`): ``messages_per_step`` (payload messages between
stages), per stage ``recv_waits_per_stage``, ``recv_wait_ms_per_stage`` (``wait_clock`` "device": how long the
GPU's compute stream stood waiting for receives, from CUDA events; "host": the CPU's blocking waits),
``send_post_ms_per_stage`` and ``host_issue_ms_per_stage`` (the host's time to issue the step: near ``step_ms``
on a GPU, the host sets the pace), ``actions_per_stage`` and ``host_issue_us_per_action_per_stage`` (the same
time per F, B or W action).

``--transport`` and ``--lookahead`` (comma-separated lists) make variants of each schedule and ``m``, timed one
after another in the same launch: the process groups' send and recv (``group``) against peer channels (``peer``;
``auto``, the default, is what ``PipelineParallel`` picks), and how many actions ahead a stage posts its receives.
Each row names the transport that carried its messages (``transport``) and the receives posted ahead
(``lookahead``).

``--graphs`` adds variants replayed from CUDA graphs: ``actions`` (each forward and backward one graph, the host
driving the messages between them) and ``step`` (a stage's whole step one graph, messages included, on the peer
channels: the host launches one graph a step and the stages wait for each other on the devices alone). A ``step``
row has no stream waits to time (``wait_clock`` null) and its ``host_issue_ms_per_stage`` is the replay's launch.

``--profile DIR`` runs cProfile (host wall clock) around each rank's timed ``train_step`` calls and writes
``DIR/<schedule>-m<m>-rank<r>.prof`` (read with ``python -m pstats``), to see where the host's time per action
goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import time

__all__ = ["add_parser", "run"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
TORCH_SCHEDULES = {  # ours -> the torch.distributed.pipelining class timed beside it (the row's torch_schedule)
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    # torch has no single-chunk ZB-H1: beside it, its 1F1B, the schedule ZB-H1 reorders with the same memory
    # (Qi et al. 2024, section 3.1)
    "zb-h1": "Schedule1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
}


def _whole_numbers(text: str) -> list[int]:
    """A comma-separated list of whole numbers (argparse names the flag where one is not)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        bad = next(x for x in text.split(",") if not x.strip().lstrip("+-").isdigit())
        raise argparse.ArgumentTypeError(f"not a whole number: {bad!r} (give them comma-separated, e.g. 4,8)") from None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pipeline", help="measure each pipeline schedule's bubble against its theory (and torch's)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    p.add_argument("--schedules", type=lambda t: t.split(","), default=None,
                   help=f"comma-separated, from {', '.join(SCHEDULES)} (default: each that runs on the stages and "
                        "--layers)")  # fmt: skip
    p.add_argument("--microbatches", type=_whole_numbers, default=[4, 8])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument("--out", default=None, help="JSON lines, one row per schedule and m (rank 0 writes)")
    p.add_argument("--profile", default=None, metavar="DIR", help="one cProfile file a rank, schedule and m")
    p.add_argument(
        "--transport",
        type=lambda t: t.split(","),
        default=["auto"],
        help="comma-separated, each a variant: 'auto' (the default: peer channels between stages of one host), "
        "'group' (the process groups' send and recv), 'peer' (peer channels)",
    )
    p.add_argument(
        "--lookahead",
        type=_whole_numbers,
        default=None,
        help="comma-separated actions ahead whose receives a stage posts; each a variant (default: the link's own)",
    )
    p.add_argument(
        "--in-place",
        type=lambda t: t.split(","),
        default=["yes"],
        help="comma-separated, each a variant: 'yes' (the default: on peer channels whose ring holds the whole step "
        "a stage computes on each message in its slot), 'no' (on a copy taken out of the slot)",
    )
    p.add_argument(
        "--send-engine",
        type=lambda t: t.split(","),
        default=["stream"],
        help="comma-separated, each a variant (repeats allowed): where a message's copy into a peer channel that "
        "holds the whole step runs: 'stream' (the default: a copy engine, on the channel's stream), 'inline' (a "
        "copy engine, on the compute stream), 'kernel' (a kernel on the compute stream storing into the peer's slot)",
    )
    p.add_argument(
        "--grad-fusion",
        type=lambda t: t.split(","),
        default=["auto"],
        help="comma-separated, each a variant: 'yes' (1F1B's, GPipe's and interleaved 1F1B's weight gradients added "
        "into .grad by their GEMMs from the second micro-batch on; not with --graphs actions), 'no' (made apart and "
        "added by autograd), 'auto' (the default, as dtrain train: yes where the step is one graph)",
    )
    p.add_argument(
        "--microbatch-group",
        type=_whole_numbers,
        default=[0],
        help="interleaved-1f1b: comma-separated micro-batch groups, each a variant (0: the stages' count, the "
        "default); a group that is not a multiple of the stages or does not divide the micro-batches is skipped",
    )
    p.add_argument(
        "--graphs",
        nargs="?",
        const="actions",
        default="",
        type=lambda t: [x for x in t.split(",") if x],
        help="also time each schedule replayed from CUDA graphs (GPUs), comma-separated variants: 'actions' (each "
        "forward and backward a graph; what --graphs alone times) and 'step' (the whole step one graph a stage, on "
        "peer channels)",
    )
    return p


def _check(args: argparse.Namespace) -> None:
    if args.batch < 1:
        raise ValueError(f"--batch: must be at least 1, got {args.batch}")
    bad = [s for s in args.schedules or () if s not in SCHEDULES]
    if bad:
        raise ValueError(f"--schedules: unknown {', '.join(bad)}; accepted: {', '.join(SCHEDULES)}")
    if any(m < 1 or args.batch % m for m in args.microbatches):
        raise ValueError(f"--microbatches {args.microbatches}: each must be positive and divide --batch {args.batch}")
    for flag in ("--layers", "--width", "--warmup", "--steps", "--nproc"):
        value = getattr(args, flag[2:])
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    bad = [x for x in args.transport if x not in ("auto", "group", "peer")]
    if bad:
        raise ValueError(f"--transport: unknown {', '.join(bad)}; accepted: auto, group, peer")
    bad = [x for x in args.graphs if x not in ("actions", "step")]
    if bad:
        raise ValueError(f"--graphs: unknown {', '.join(bad)}; accepted: actions, step")
    bad = [x for x in args.in_place if x not in ("yes", "no")]
    if bad:
        raise ValueError(f"--in-place: unknown {', '.join(bad)}; accepted: yes, no")
    bad = [x for x in args.grad_fusion if x not in ("yes", "no", "auto")]
    if bad:
        raise ValueError(f"--grad-fusion: unknown {', '.join(bad)}; accepted: yes, no, auto")
    bad = [x for x in args.send_engine if x not in ("stream", "inline", "kernel")]
    if bad:
        raise ValueError(f"--send-engine: unknown {', '.join(bad)}; accepted: stream, inline, kernel")
    if min(args.microbatch_group) < 0:
        raise ValueError(f"--microbatch-group {args.microbatch_group}: each must be 0 or more")
    if args.lookahead is not None and min(args.lookahead) < 0:
        raise ValueError(f"--lookahead {args.lookahead}: each must be 0 or more")
    from dtrain.env import under_torchrun

    if not under_torchrun():  # the stages are --nproc ranks: a schedule named that has no case to run is refused
        from dtrain.parallel.pipeline_schedules import chunks_per_stage

        p = args.nproc

        def runs(name: str) -> str | None:
            """Why ``name`` runs no case on ``p`` stages (None: it runs)."""
            chunks = chunks_per_stage(name) * p
            if args.layers < chunks:
                return f"--layers {args.layers}: {name} on {p} stages needs at least {chunks} (a layer a chunk)"
            if name == "interleaved-1f1b" and all(m % p for m in args.microbatches):
                listed = ",".join(map(str, args.microbatches))
                return (f"--microbatches {listed}: interleaved-1f1b on {p} stages takes micro-batches in groups of "
                        f"{p}; none is a multiple of {p}")  # fmt: skip
            return None

        named = args.schedules is not None
        reasons = {name: runs(name) for name in (args.schedules if named else SCHEDULES)}
        if named or all(reasons.values()):
            why = next((why for why in reasons.values() if why), None)
            if why:
                raise ValueError(why)
        args.schedules = [name for name, why in reasons.items() if not why]
    elif args.schedules is None:
        args.schedules = list(SCHEDULES)
    if args.graphs:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--graphs: CUDA graphs need GPUs; this run measures on the CPU")
    from dtrain.cli.paths import check_dir_out, check_file_out

    if args.profile:
        check_dir_out("--profile", args.profile)
    if args.out:
        check_file_out("--out", args.out)


def run(args: argparse.Namespace) -> int:
    _check(args)  # before torch is imported and any rank starts
    from dtrain.launch import run_ranks, under_torchrun

    if args.out and int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w"):
            pass
        os.replace(args.out + ".tmp", args.out)
    if under_torchrun():
        run_ranks(_rank_main, 0, args)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        run_ranks(_rank_main, args.nproc, args)
    return 0


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(args, device):
    import torch
    from torch import nn

    torch.manual_seed(0)
    with device:
        return nn.Sequential(*(nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)))


def _time(step, device, args, profile: cProfile.Profile | None = None) -> float:
    """The slowest rank's median seconds of ``step()`` (``profile`` on around the timed ones)."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        if profile is not None and i >= args.warmup:
            profile.enable()
        step()
        if profile is not None:
            profile.disable()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def _time_steady(step, device, args) -> float:
    """The slowest rank's seconds a step over ``args.steps`` steps run back to back, as a training loop runs them
    (one synchronization before and after the run, none between steps): the period of the steady state, in which
    a step's host work before its first kernel (a recorded step's launch, say) overlaps the step before it."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / args.steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _busy(pipe, args, m: int, device) -> float:
    """This rank's seconds of forward and backward of ``m`` micro-batches through its chunks, alone, as the
    variant runs them: eagerly, through the pipeline's captured CUDA graphs where it has them (``graphs=True``),
    or all of them recorded as one graph (``graphs="step"``, whose step is one graph too); under a split backward
    (ZB-H1, ZB-V) B defers the weight gradients and W runs them, as in the step. So a step's bubble is measured
    against the compute it runs."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    x = torch.randn(args.batch // m, args.width, device=device)
    graphed = getattr(pipe, "_graphed", None) or {}
    store = pipe.weight_grads  # a split backward: B defers the weight gradients, W runs them as the step does

    def once() -> None:
        for mb in range(m):
            for c, chunk in enumerate(pipe.chunks):
                run = graphed.get((c, mb))
                if run is None:  # the first chunk's input needs no gradient, as in the step
                    out = chunk(x.detach().requires_grad_(not chunk.is_first))
                    with store.deferring((c, mb)) if store is not None else contextlib.nullcontext():
                        F.mse_loss(out, x).backward() if chunk.is_last else out.backward(x)
                    if store is not None:
                        store.flush((c, mb))
                    continue
                inp = x.detach().requires_grad_(not chunk.is_first)  # as the graphs were captured
                if chunk.is_last:
                    run(inp, x).backward()  # the graph's forward includes the loss
                else:
                    run(inp).backward(x)
                if (c, mb) in pipe._recorded_w:  # a B graph: its W, the weight-gradient GEMMs, runs apart
                    pipe.weight_grads.run(pipe._recorded_w[c, mb])

    if getattr(pipe, "_step_graph", None) is not None:  # the whole step is one graph: so is its compute
        once = _graphed(once, device)

    def timed() -> float:
        once()
        runs = []
        for _ in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            once()
            _sync(device)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    if device.type == "cuda":
        result = timed()
    else:  # ranks share the cores: one at a time
        result = 0.0
        for turn in range(dist.get_world_size()):
            if dist.get_rank() == turn:
                result = timed()
            dist.barrier()
    for q in pipe.parameters():
        q.grad = None
    return result


def _graphed(fn, device):  # noqa: ANN001, ANN202
    """``fn``'s work recorded as one CUDA graph; returns the graph's replay. Recorded as the pipeline records its
    own (:func:`dtrain.parallel.step_graph.quiet_capture`: after the watchdog threads have seen the last work
    finish, with dtrain's watchdog looking at no event and the garbage collector off)."""
    import torch

    from dtrain.parallel import step_graph

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # warm-up, off the graph
    torch.cuda.current_stream(device).wait_stream(side)
    graph = step_graph.new_graph()
    with step_graph.quiet_capture(torch.device(device)):
        step_graph.record(graph, fn)
    return graph.replay


def _outcome(pipe, x, y) -> tuple[float, float]:
    """One more step's loss and the sum of squares of every stage's gradients (summed over the ranks): the same
    for every schedule and with or without graphs, since the parameters never change between the steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
    grad_sq = sum((q.grad.double() ** 2).sum() for q in pipe.parameters() if q.grad is not None)
    total = torch.as_tensor(grad_sq, dtype=torch.float64, device=loss.device).reshape(1)
    dist.all_reduce(total)
    for q in pipe.parameters():
        q.grad = None
    return loss.item(), total.item()


def _comm_report(pipe, step, device) -> dict:
    """One more step with the link's device clocks on: per stage, the messages it sent and received, how long
    it waited for receives (on a GPU the compute stream's stall, from CUDA events around each stream wait; on the
    CPU the host's blocking wait), how long posting its sends took, and how long the host took to issue the whole
    step (on a GPU: where that nears ``step_ms``, the host, not the device, sets the pace)."""
    import torch
    import torch.distributed as dist

    pipe.link.measure_device = True
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    step()
    host_s = time.perf_counter() - start
    _sync(device)
    pipe.link.measure_device = False
    report = pipe.link.step_report()  # under graphs="step": what the recorded step sent, received and issued
    wait = report["device_wait_s"] if report["device_wait_s"] is not None else report["recv_wait_s"]
    whole = getattr(pipe, "_step_graph", None) is not None  # no stream wait of a replayed step can be timed
    actions = len(pipe.actions)
    mine = torch.tensor(
        [report["sends"], report["recvs"], wait, report["send_s"], host_s, actions], dtype=torch.float64, device=device
    )
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = torch.stack(every).cpu().tolist()
    return {
        "messages_per_step": int(sum(r[0] for r in rows)),
        "wait_clock": None if whole else "device" if report["device_wait_s"] is not None else "host",
        "recv_waits_per_stage": [int(r[1]) for r in rows],
        "recv_wait_ms_per_stage": None if whole else [round(r[2] * 1e3, 3) for r in rows],
        "send_post_ms_per_stage": None if whole else [round(r[3] * 1e3, 3) for r in rows],
        "host_issue_ms_per_stage": [round(r[4] * 1e3, 3) for r in rows],
        "actions_per_stage": [int(r[5]) for r in rows],
        "host_issue_us_per_action_per_stage": [round(r[4] / r[5] * 1e6, 1) for r in rows],
    }


def _torch_step(name: str, model, args, m: int, device, x, y):
    """A step function of torch.distributed.pipelining's ``name`` schedule on the same cut, or None."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from dtrain.parallel.pipeline_parallel import partition_layers
    from dtrain.parallel.pipeline_schedules import PLACEMENT, chunks_per_stage, virtual_stage

    torch_name = TORCH_SCHEDULES.get(name, "")
    cls = getattr(pipelining, torch_name, None)
    if cls is None:
        return None
    p, rank = dist.get_world_size(), dist.get_rank()
    ours = next(k for k, v in TORCH_SCHEDULES.items() if v == torch_name)  # the schedule torch's class runs
    v = chunks_per_stage(ours)
    placement = PLACEMENT.get(ours, "loop")
    cuts = partition_layers(model, v * p)
    indices = [virtual_stage(rank, c, p, placement) for c in range(v)]
    stages = [pipelining.PipelineStage(model[cuts[u].start : cuts[u].stop], u, v * p, device) for u in indices]
    schedule = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=F.mse_loss)
    first, last = 0 in indices, v * p - 1 in indices

    def step() -> None:
        kwargs = {"target": y} if last else {}
        schedule.step(x, **kwargs) if first else schedule.step(**kwargs)

    return step


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from dtrain.launch import rank_device
    from dtrain.parallel.pipeline_parallel import PipelineParallel
    from dtrain.parallel.pipeline_schedules import (
        SPLIT_BACKWARD,
        chunks_per_stage,
        theoretical_bubble,
        validate_schedule,
    )

    device = rank_device()
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)
    for name in args.schedules:
        v = chunks_per_stage(name)
        for m in args.microbatches:
            if (name == "interleaved-1f1b" and m % p) or args.layers < v * p:
                continue  # interleaved takes micro-batches in groups of p; every chunk needs a layer
            torch_s, torch_steady_s, torch_done = None, None, False
            modes = [False] + ([{"actions": True, "step": "step"}[g] for g in args.graphs] if cuda else [])
            lookaheads = args.lookahead if args.lookahead is not None else [None]
            groups = [None]
            if name == "interleaved-1f1b":  # the valid groups, each once (0 is the stages' count)
                groups = sorted({g or p for g in args.microbatch_group if (g or p) % p == 0 and m % (g or p) == 0})
                groups = [None if g == p else g for g in groups]

            def fusions(graphs, name=name) -> list[bool | str]:  # noqa: ANN001
                if name in SPLIT_BACKWARD or graphs is True:  # W fuses already; per-action graphs cannot
                    return [False]
                chosen = {"yes": True, "no": False, "auto": True if graphs == "step" else "auto"}
                return list(dict.fromkeys(chosen[f] for f in args.grad_fusion))

            # the whole step as one graph needs the peer channels
            variants = [
                (g, t, a, k, i == "yes", e, f)
                for k in groups
                for g in modes
                for t in args.transport
                for a in lookaheads
                for i in args.in_place
                for e in args.send_engine
                for f in fusions(g)
                if g != "step" or t != "group"
            ]
            for graphs, transport, lookahead, group, in_place, engine, fusion in variants:
                pipe = PipelineParallel(
                    _model(args, device),
                    dist.group.WORLD,
                    num_microbatches=m,
                    schedule=name,
                    graphs=graphs,
                    lookahead=lookahead,
                    transport=transport,
                    microbatch_group=group,
                    in_place=in_place,
                    send_engine=engine,
                    grad_accumulation_fusion=fusion,
                )

                def step(pipe=pipe) -> None:
                    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
                    for q in pipe.parameters():
                        q.grad = None

                profile = cProfile.Profile() if args.profile else None
                step_s = _time(step, device, args, profile)
                steady_s = _time_steady(step, device, args)
                if profile is not None:
                    os.makedirs(args.profile, exist_ok=True)
                    tail = {False: "", True: "-graphs", "step": "-step-graph"}[graphs]
                    tail += "-peer" if transport == "peer" else ""
                    tail += "" if lookahead is None else f"-lookahead{lookahead}"
                    tail += "" if group is None else f"-group{group}"
                    tail += "" if in_place else "-copied"
                    tail += "" if engine == "stream" else f"-{engine}"
                    tail += {True: "-fused", False: "", "auto": "-fused-auto"}[fusion]
                    path = os.path.join(args.profile, f"{name}{tail}-m{m}-rank{rank}.prof")
                    profile.dump_stats(path + ".tmp")
                    os.replace(path + ".tmp", path)
                comm_row = _comm_report(pipe, step, device)
                loss, grad_sq = _outcome(pipe, x, y)
                # the stages' compute alone, as this variant runs it (eager, or the captured graphs)
                mine = torch.tensor([_busy(pipe, args, m, device)], dtype=torch.float64, device=device)
                every = [torch.zeros_like(mine) for _ in range(p)]
                dist.all_gather(every, mine)
                busy_per_stage = [t.item() for t in every]
                busy_s = sum(busy_per_stage)
                if not args.no_torch and not torch_done:
                    made = _torch_step(name, _model(args, device), args, m, device, x, y)
                    torch_s, torch_done = (_time(made, device, args) if made is not None else None), True
                    torch_steady_s = _time_steady(made, device, args) if made is not None else None
                row = {
                    "schedule": name,
                    "graphs": graphs,
                    "transport": pipe.link.transport_in_use,
                    "lookahead": pipe.link.lookahead,
                    # messages computed on in their peer-channel slots (True), or on copies
                    "in_place": pipe.link.receives_in_place,
                    # where the copies into whole-step peer channels ran (None: no such channel)
                    "send_engine": _engine_in_use(pipe.link),
                    # weight gradients added into .grad by their GEMMs: True, False or "auto" (eagerly, the layers
                    # of EAGER_FUSION_MACS or more); ZB-H1's and ZB-V's W does so too
                    "grad_accumulation_fusion": True if name in SPLIT_BACKWARD else fusion,
                    # weight gradients the variant's runs (timed steps, compute alone) added in place outside W
                    "fused_weight_gradients": pipe.fused_accumulation.fused if pipe.fused_accumulation else 0,
                    "stages": p,
                    "microbatches": m,
                    "microbatch_group": group if group is not None else (p if name == "interleaved-1f1b" else None),
                    # (chunk, micro-batch) activations the first stage holds at its peak, by its schedule
                    "held_first_stage": validate_schedule(pipe.actions, m, v) if rank == 0 else None,
                    "bubble_theory": round(theoretical_bubble(p, m, v, schedule=name), 4),
                    "bubble_measured": round(1 - busy_s / (p * step_s), 4),
                    "step_ms": round(step_s * 1e3, 3),
                    # steps run back to back (the steady state's period) and the bubble by it
                    "step_ms_steady": round(steady_s * 1e3, 3),
                    "bubble_steady": round(1 - busy_s / (p * steady_s), 4),
                    "busy_ms_per_stage": [round(b * 1e3, 3) for b in busy_per_stage],
                    "bubble_slowest": round(1 - max(busy_per_stage) / step_s, 4),
                    "bubble_slowest_steady": round(1 - max(busy_per_stage) / steady_s, 4),
                    "busy_from": "graphs" if pipe._graphed or pipe._step_graph is not None else "eager",
                    "loss": loss,
                    "grad_sq": grad_sq,
                    "torch_step_ms": None if torch_s is None else round(torch_s * 1e3, 3),
                    "torch_step_ms_steady": None if torch_steady_s is None else round(torch_steady_s * 1e3, 3),
                    "torch_schedule": TORCH_SCHEDULES.get(name) if torch_s is not None else None,
                    **comm_row,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "layers": args.layers,
                    "width": args.width,
                    "batch": args.batch,
                }
                _report(row, rank, args, torch_s)


def _engine_in_use(link) -> str | None:
    """The engine of the link's sends into peer channels that hold the whole step ("stream" where none does; None
    off the peer channels)."""
    engines = link.send_engines_in_use
    return None if not engines else next((e for e in engines if e != "stream"), "stream")


def _report(row: dict, rank: int, args: argparse.Namespace, torch_s: float | None) -> None:
    """Rank 0 prints the row and appends it to ``--out``."""
    if rank != 0:
        return
    name = row["schedule"] + {False: "", True: " graphs", "step": " step-graph"}[row["graphs"]]
    name += " peer" if row["transport"] == "peer" else ""
    name += f" la{row['lookahead']}"
    p, m = row["stages"], row["microbatches"]
    name += f" g{row['microbatch_group']}" if row.get("microbatch_group") not in (None, p) else ""
    name += " copied" if row["transport"] == "peer" and not row.get("in_place") else ""
    name += f" {row['send_engine']}" if row.get("send_engine") not in (None, "stream") else ""
    if row["schedule"] not in ("zb-h1", "zb-v") and row["grad_accumulation_fusion"]:
        name += " fused" if row["grad_accumulation_fusion"] is True else " fused-auto"
    print(
        f"{name:>24} p={p} m={m:<3} bubble theory {row['bubble_theory']:.3f} measured "
        f"{row['bubble_measured']:.3f}  step {row['step_ms']:.2f} ms  back to back {row['step_ms_steady']:.2f} ms "
        f"(bubble {row['bubble_steady']:.3f}, slowest stage {row['bubble_slowest_steady']:.3f})  torch "
        + (
            "-"
            if torch_s is None
            else f"{row['torch_step_ms']:.2f} ms, back to back {row['torch_step_ms_steady']:.2f} "
            f"({row['torch_schedule']})"
        )
        + f"  loss {row['loss']:.6g} grad^2 {row['grad_sq']:.6g}"
        + f"  messages {row['messages_per_step']}  {row['wait_clock']} wait ms/stage "
        + " ".join(f"{w:.2f}" for w in row["recv_wait_ms_per_stage"] or [])
        + "  host issue ms/stage "
        + " ".join(f"{h:.2f}" for h in row["host_issue_ms_per_stage"]),
        flush=True,
    )
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
