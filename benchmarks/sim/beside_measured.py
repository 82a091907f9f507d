"""Usage: python benchmarks/sim/beside_measured.py MODE [--out FILE]   (MODE: collectives, pipeline, dp)

The simulator's prediction beside each 4 x H100 (and 2 x H100) measurement of dtrain's benchmarks, row by row,
with the error ``predicted / measured - 1``. Nothing is fitted to the rows predicted here: every figure comes from
the simulator's defaults, the H100 compute curves dtrain ships, or a measurement in another results file (named
where it is used).

collectives  ``dtrain bench comm`` with the defaults (collectives_defaults[_fresh]-h100x{4,2}.jsonl): every
             NCCL call (``native``, ``torch``: torch.distributed's own, and ``auto`` where it resolved to NCCL)
             priced by dtrain.sim.nccl in the protocol NCCL's tuning log gives (Simple below 1 MiB), with NCCL's
             figures fitted on 4 x H200 calls captured as CUDA graphs (``validate.py captured``'s fit: the
             device's time, no H100 row). dtrain's own algorithms with the H100 peer figures of
             sim_validation-peer-h100x4.jsonl (``validate.py peer-h100``: micro-benchmarks, host replay time
             fitted on all_reduce-h100x4.jsonl): those the exchange kernel runs (all-gather, all-to-all and
             reduce-scatter ``direct``, broadcast ``star``, one_shot all-reduce up to 256 KiB; 8 MiB a rank at
             most) by dtrain.sim.peer_model.exchange_time, one kernel, with the host's time a call of
             probe-one-pass-h200x4.txt (through dtrain.comm, 4 x H200) and, for the all-reduce, of
             probe-one-shot-h100x4.txt (dtrain's ``auto`` back to back); torch's kernels (one_shot above 256 KiB,
             the two-shot ``direct`` all-reduce) by dtrain.sim.peer_model.peer_time as their pull plans, with the
             same all-reduce host time. Each row's ``pricing`` names the function. Two predictions a row: the
             device alone (``device_us``, launch and kernel) and with the host's time per call (``predicted_us`` =
             max(host, device), back-to-back calls overlapping the host's enqueue with the previous kernel): for
             NCCL the median ``host_us`` of NCCL's eager calls of at most 1 MiB per collective in
             captured-symmetric-h100x4.jsonl and captured-rooted-h100x4.jsonl (another launch on the same node,
             4 ranks; used for 2 ranks too). ``--nccl-figures FILE`` takes NCCL's fitted figures from an earlier
             output of this mode (the fit takes minutes).
pipeline     ``dtrain bench pipeline`` (bench_pipeline[-b4096]-h100x4.jsonl, its eager rows: 16 x (Linear(4096,
             4096) + GELU) in float32 on 4 stages, MSE loss): each stage's forward, input-gradient and
             weight-gradient time from
             dtrain.sim.compute's H100 model at the float32 peak of the device catalogue (the shipped curves are
             bfloat16 products, so the model's built-in matmul efficiency and wave quantisation price them), the
             activation between stages a flow over NVLink on the ``h100-node`` preset, the step and bubble from
             dtrain.sim.pipeline. ``predicted_ms`` adds the host's time to issue one action (the median
             ``host_issue_us_per_action_per_stage`` of the OTHER batch's file; an action costs the larger of its
             device time and that) to the device-only ``device_ms``.
dp           data parallel against DDP (dp_vs_ddp-graphs-h100x4-b{16,32}.jsonl: the 136M GPT of
             benchmarks/training/dp_zero.py under bf16 autocast, float32 gradients, AdamW) by dtrain.sim.step on
             ``h100-node``, 1 and 4 GPUs, as ``validate.py training-h100`` describes a model: flash attention,
             compute priced per operation on the shipped H100 curves, a bucketed ring all-reduce overlapping
             backward. The ``-graph`` rows, whose steps are recorded as CUDA graphs, run at the devices' pace: the
             simulator, which prices device time, is compared with them apart from the eager rows.

Each mode prints one row a measurement and the median / worst |error| per group; ``--out`` writes JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[0] / "results"
sys.path.insert(0, str(HERE / "validation"))

MIB = 1 << 20
COLLECTIVE_FILES = (
    "collectives_defaults-h100x4.jsonl",
    "collectives_defaults_fresh-h100x4.jsonl",
    "collectives_defaults-h100x2.jsonl",
    "collectives_defaults_fresh-h100x2.jsonl",
)
HOST_FILES = ("captured-symmetric-h100x4.jsonl", "captured-rooted-h100x4.jsonl")  # NCCL's eager host time a call
PEER_FIGURES = "sim_validation-peer-h100x4.jsonl"  # validate.py peer-h100's H100 PeerCost ("two sizes")
#: benchmarks/collectives/probe.py one-shot on 4 x H100: dtrain's ``auto`` all-reduce back to back, the fused
#: one-kernel path (one-shot, two-shot), at 8 KiB-16 MiB
FUSED_PROBE = "probe-one-shot-h100x4.txt"
FUSED = ("one_shot", "direct")  # all-reduces that run as one kernel (dtrain/comm/peer/fused.py)
#: benchmarks/collectives/probe.py one-pass on 4 x H200: the host's time a call of each one-pass collective through
#: dtrain.comm, 8 KiB a rank
ONE_PASS_PROBE = "probe-one-pass-h200x4.txt"
#: torch.distributed.pipelining's class of each of our schedules, where torch runs the same schedule
TORCH_SAME = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
              "zb-v": "ScheduleZBVZeroBubble"}  # fmt: skip
PIPELINE_FILES = ("bench_pipeline-h100x4.jsonl", "bench_pipeline-b4096-h100x4.jsonl")
DP_FILES = ("dp_vs_ddp-graphs-h100x4-b16.jsonl", "dp_vs_ddp-graphs-h100x4-b32.jsonl")
#: benchmarks/training/dp_zero.py's model: 12 layers, width 768, 12 heads, 4x GELU MLP, 32768-token vocabulary,
#: 512-token context, untied head
GPT_136M = {"layers": 12, "hidden": 768, "heads": 12, "sequence": 512, "vocab": 32768, "ffn_hidden": 3072}
PIPELINE_LAYERS, PIPELINE_WIDTH, PIPELINE_STAGES = 16, 4096, 4  # bench_pipeline's model (each row's fields)


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


# --- collectives -----------------------------------------------------------------------------------------------


def nccl_host_s() -> dict[str, float]:
    """Per collective, the median host time of NCCL's eager calls of at most 1 MiB in :data:`HOST_FILES`."""
    by: dict[str, list[float]] = {}
    for name in HOST_FILES:
        for r in load(name):
            if r["algorithm"] == "native" and r["nbytes"] <= MIB and r.get("host_us"):
                by.setdefault(r["collective"], []).append(r["host_us"] * 1e-6)
    return {c: statistics.median(v) for c, v in by.items()}


def fit_nccl_figures():
    """NCCL's figures as ``validate.py captured`` fits them on 4 x H200 graph captures (minutes)."""
    import captured
    import captured_base as s6

    records = [r for name in s6.GRAPH_RUNS for r in s6._records(name)]
    h200 = captured.with_ports(s6.h200_calibration(), captured.h200_fanin_curve())
    params, _ = captured.nccl_rows(records, s6.GRAPH_RUNS, s6.FIT_PROCESS, h200.local_bytes_per_s)
    return params


def nccl_figures_from(path: str | os.PathLike):
    """The NCCL figures of an earlier ``collectives`` output (its ``figures`` record)."""
    from dtrain.sim.nccl import NcclParams

    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("record") == "figures":
            return NcclParams(**r["nccl"])
    raise ValueError(f"--nccl-figures {path}: no 'figures' record (write one with this mode's --out)")


def peer_figures():
    """The H100 PeerCost of :data:`PEER_FIGURES` (validate.py peer-h100, "two sizes")."""
    from dtrain.sim.peer_model import PeerCost

    first = json.loads((RESULTS / PEER_FIGURES).read_text().splitlines()[0])["two sizes"]
    first["fanin_curve"] = tuple(tuple(p) for p in first.get("fanin_curve", ()))
    return PeerCost(**first)


def nccl_row_times(collective: str, nbytes: int, world: int, params, host_s: float) -> tuple[float, float, str]:
    """(device seconds, seconds with the host, protocol) of one NCCL call of ``nbytes`` on ``world`` H100s."""
    import captured_base as s6

    from dtrain.sim.nccl import simulate_nccl
    from dtrain.sim.transports import Transport

    protocol = s6._protocol(_protocols(), collective, nbytes) if nbytes >= MIB else "simple"
    topo = Transport(name="nvlink").topology(world)
    device = simulate_nccl(topo, collective, nbytes, params=dataclasses.replace(params, host_s=0.0),
                           protocol=protocol, root=0).time_s  # fmt: skip
    return device, max(host_s, device), protocol


_PROTOCOLS: dict = {}


def _protocols() -> dict:
    if not _PROTOCOLS:
        import captured_base as s6

        _PROTOCOLS.update(s6.nccl_protocols())
    return _PROTOCOLS


def fused_host_s() -> float:
    """The host's time a call of dtrain's one-kernel all-reduce: the median of :data:`FUSED_PROBE`'s ``auto``
    times of at most 1 MiB (host-bound: the fused kernel itself takes 12-25 us there, the probe's one_shot
    column)."""
    times = []
    for line in (RESULTS / FUSED_PROBE).read_text().splitlines():
        found = re.search(r"^\s*(\d+) KiB \w+ .*\bauto\s+([\d.]+) us", line)
        if found and int(found.group(1)) <= 1024:
            times.append(float(found.group(2)) * 1e-6)
    if not times:
        raise ValueError(f"{FUSED_PROBE}: no 'auto' times of at most 1024 KiB")
    return statistics.median(times)


def exchange_host_s() -> dict[str, float]:
    """Per collective, the host's time a call of the exchange kernel through dtrain.comm: :data:`ONE_PASS_PROBE`'s
    ``one-pass`` lines (all-gather, all-to-all, reduce-scatter, broadcast)."""
    out = {}
    for line in (RESULTS / ONE_PASS_PROBE).read_text().splitlines():
        found = re.search(r"^one-pass (\w+)\s+host\s+([\d.]+) us/call", line)
        if found:
            out[found.group(1)] = float(found.group(2)) * 1e-6
    if not out:
        raise ValueError(f"{ONE_PASS_PROBE}: no 'one-pass COLLECTIVE host US us/call' lines")
    return out


def rank_bytes(collective: str, nbytes: int, world: int) -> int:
    """The bytes a rank puts into a ``dtrain bench comm`` call of ``nbytes`` (dtrain.comm.tune.make_call: an
    all-gather's input is a ``world``-th of its output; every other collective's input is the whole buffer)."""
    return nbytes // world if collective == "all_gather" else nbytes


def collective_rows(
    params, host: dict[str, float], peer, fused_s: float, files=COLLECTIVE_FILES, where=None, exchange_host=None
) -> list[dict]:
    """Every row of ``files`` (those ``where(row)`` accepts, if given) with its prediction (module docstring);
    ``fused_s``: the host's time a call of the one-kernel all-reduce (:func:`fused_host_s`); ``exchange_host``:
    per collective, the host's time a call of the exchange kernel (None: :func:`exchange_host_s`)."""
    import captured_base as s6

    from dtrain.sim.peer_model import exchange_form, exchange_time

    exchange_host = {**(exchange_host_s() if exchange_host is None else exchange_host), "all_reduce": fused_s}
    out = []
    for name in files:
        for r in load(name):
            if where is not None and not where(r):
                continue
            coll, n, world = r["collective"], r["nbytes"], r["world_size"]
            resolved = r["resolved_algorithm"]
            row = {"record": "row", "source": name, "world_size": world, "collective": coll,
                   "algorithm": r["algorithm"], "resolved": resolved, "nbytes": n, "fresh": r["fresh"],
                   "measured_us": r["time_us"], "host_measured_us": r.get("host_us"),
                   "cost_model_us": r.get("predicted_us")}  # fmt: skip
            form = exchange_form(coll, resolved, rank_bytes(coll, n, world))
            if resolved in ("native", "native_wide"):  # NCCL's kernels (the wide communicator priced as the default)
                device, total, protocol = nccl_row_times(coll, n, world, params, host[coll])
                row |= {"model": "nccl", "pricing": "simulate_nccl", "protocol": protocol, "host_us": host[coll] * 1e6}
            elif form is not None:  # one call of the exchange kernel
                t = exchange_time(form, world, rank_bytes(coll, n, world), peer, host_s=exchange_host[coll])
                device, total = t.gpu_s, t.time_s
                row |= {"model": "peer", "pricing": "exchange_time", "form": form, "programs": t.programs,
                        "protocol": None, "host_us": t.host_s * 1e6}  # fmt: skip
            else:
                priced = s6._peer_row({**r, "run": name}, peer, graph=False)
                device, total = priced["gpu_us"] * 1e-6, priced["predicted_us"] * 1e-6
                host_s = None
                if coll == "all_reduce" and resolved in FUSED:  # one kernel: its own host path, not a replay's
                    host_s = fused_s
                    total = max(fused_s, device)
                row |= {"model": "peer", "pricing": "peer_time", "protocol": None,
                        "host_us": None if host_s is None else host_s * 1e6}  # fmt: skip
            row |= {"device_us": device * 1e6, "predicted_us": total * 1e6,
                    "device_error": _error(device * 1e6, r["time_us"]),
                    "error": _error(total * 1e6, r["time_us"])}  # fmt: skip
            out.append(row)
    return out


def _collectives(args: argparse.Namespace) -> list[dict]:
    params = nccl_figures_from(args.nccl_figures) if args.nccl_figures else fit_nccl_figures()
    host, fused, exchange = nccl_host_s(), fused_host_s(), exchange_host_s()
    rows = collective_rows(params, host, peer_figures(), fused, exchange_host=exchange)
    print(f"NCCL figures (4 x H200 graph captures): {params}")
    print("host time a call (us), " + ", ".join(f"{c} {s * 1e6:.1f}" for c, s in sorted(host.items()))
          + f" (median of {' and '.join(HOST_FILES)}); dtrain's one-kernel all-reduce {fused * 1e6:.1f} us "
          f"({FUSED_PROBE}); the exchange kernel, "
          + ", ".join(f"{c} {v * 1e6:.1f}" for c, v in sorted(exchange.items())) + f" ({ONE_PASS_PROBE})")  # fmt: skip
    print(f"{'file':42s} {'collective':15s} {'alg':9s} {'resolved':9s} {'bytes':>10s} {'measured':>9s} "
          f"{'device':>8s} {'+host':>8s} {'error':>7s}  pricing")  # fmt: skip
    for r in rows:
        print(f"{r['source']:42s} {r['collective']:15s} {r['algorithm']:9s} {r['resolved']:9s} {r['nbytes']:>10d} "
              f"{r['measured_us']:9.1f} {r['device_us']:8.1f} {r['predicted_us']:8.1f} {r['error']:+7.1%}  "
              f"{r['pricing']}")  # fmt: skip
    for label, key in (("device only", "device_error"), ("with host", "error")):
        for world in (4, 2):
            for model in ("nccl", "peer"):
                group = [r[key] for r in rows if r["world_size"] == world and r["model"] == model]
                if group:
                    print(f"{label}, {world} GPUs, {model}: median |error| {_median(group):.1%}, worst "
                          f"{max(map(abs, group)):.1%} over {len(group)}")  # fmt: skip
            for pricing in ("exchange_time", "peer_time"):
                group = [r[key] for r in rows if r["world_size"] == world and r["pricing"] == pricing]
                if group:
                    print(f"{label}, {world} GPUs, peer by {pricing}: median |error| {_median(group):.1%}, worst "
                          f"{max(map(abs, group)):.1%} over {len(group)}")  # fmt: skip
    figures = {"record": "figures", "nccl": dataclasses.asdict(params), "host_s": host,
               "host_source": list(HOST_FILES), "peer_source": PEER_FIGURES, "fused_host_s": fused,
               "fused_source": FUSED_PROBE, "exchange_host_s": exchange, "exchange_source": ONE_PASS_PROBE}  # fmt: skip
    return [figures, *rows]


# --- pipeline --------------------------------------------------------------------------------------------------


def fp32_device():
    """dtrain.sim.compute's H100 SXM model at the device catalogue's float32 peak, without the bfloat16 curves."""
    from dtrain.cluster.devices import DEVICES
    from dtrain.sim.compute import DEVICE_COMPUTE

    return dataclasses.replace(DEVICE_COMPUTE["h100-sxm"], peak_flops=DEVICES["h100-sxm"].flops("fp32"))


def stage_costs(
    rows_per_microbatch: int, layers_per_stage: int, width: int, device
) -> tuple[float, float, float, float]:
    """(forward, input gradient, weight gradient, last stage's loss) seconds of one micro-batch on one stage of
    ``layers_per_stage`` x (Linear(width, width) + GELU) in float32: per layer the product ``(T, w, w)``, its input
    gradient ``(T, w, w)`` and weight gradient ``(w, w, T)``; GELU 8 bytes an element forward, 12 backward; the
    bias gradient's pass over the output gradient (4 bytes an element) and the weight gradient added into ``.grad``
    (8 bytes a weight, as dtrain.sim.compute's ``grad-accumulate``). The MSE loss: 8 bytes an element forward,
    12 backward."""
    t, w = rows_per_microbatch, width
    forward = layers_per_stage * (device.matmul_s(t, w, w, itemsize=4) + device.memory_s(8 * t * w))
    backward = layers_per_stage * (device.matmul_s(t, w, w, itemsize=4) + device.memory_s(12 * t * w))
    weight = layers_per_stage * (
        device.matmul_s(w, w, t, itemsize=4) + device.memory_s(4 * t * w) + device.memory_s(8 * w * w)
    )
    loss = device.memory_s(8 * t * w) + device.memory_s(12 * t * w)
    return forward, backward, weight, loss


def message_s(nbytes: float) -> float:
    """One activation between neighbouring GPUs of the ``h100-node`` preset: a flow over NVLink."""
    from dtrain.cluster.presets import preset
    from dtrain.sim.flows import FlowSpec, simulate_flows

    topo = preset("h100-node")
    gpus = [d.name for d in topo.devices()]
    finish, _ = simulate_flows(topo, [FlowSpec(src=gpus[0], dst=gpus[1], nbytes=nbytes)])
    return finish[0]


def host_per_action_s(name: str) -> float:
    """The median host time to issue one action over every stage and eager row of ``name`` over the process
    groups (the peer channels' rows are not predicted: :func:`pipeline_rows`)."""
    eager = [r for r in load(name) if not r.get("graphs") and r.get("transport", "group") == "group"]
    return statistics.median(us for r in eager for us in r["host_issue_us_per_action_per_stage"]) * 1e-6


def pipeline_prediction(row: dict, host_s: float) -> dict:
    """The step (ms) and bubble of one bench_pipeline row, device only and with the host issuing a stage's actions
    ``host_s`` apart (:func:`dtrain.sim.pipeline.pipeline_makespan`'s ``host_s``)."""
    from dtrain.parallel.pipeline_schedules import SPLIT_BACKWARD, chunks_per_stage
    from dtrain.sim.pipeline import pipeline_makespan

    p, m, schedule = row["stages"], row["microbatches"], row["schedule"]
    rows = row["batch"] // m
    f, b, w, loss = stage_costs(rows, row["layers"] // p, row["width"], fp32_device())
    forward = [f] * p
    backward = [b] * p
    weight = [w] * p
    forward[-1] += loss / 2
    backward[-1] += loss / 2
    split = schedule in SPLIT_BACKWARD
    if not split:
        backward = [x + y for x, y in zip(backward, weight, strict=True)]
    v = chunks_per_stage(schedule)
    p2p = message_s(rows * row["width"] * 4)
    work = m * sum(forward + backward + (weight if split else []))

    def run(host: float) -> float:  # the host issues a stage's actions host_s apart, ahead of the device
        # dtrain bench pipeline builds ZB-V's order for equal costs (PipelineParallel's default)
        return pipeline_makespan(forward, backward, p2p, m, schedule, weight_s=weight if split else None, host_s=host,
                                 order_costs=(1.0, 1.0, 1.0))  # fmt: skip

    device, total = run(0.0), run(host_s)
    return {"device_ms": device * 1e3, "predicted_ms": total * 1e3, "device_bubble": 1 - work / (p * device),
            "predicted_bubble": 1 - work / (p * total), "message_us": p2p * 1e6, "host_us_per_action": host_s * 1e6,
            "chunks": v}  # fmt: skip


def pipeline_rows(files=PIPELINE_FILES) -> list[dict]:
    out = []
    for name in files:
        other = next(f for f in files if f != name)
        host_s = host_per_action_s(other)
        for r in load(name):
            # the host figure is the eager runtime's; graphed steps are not predicted here. The peer channels' rows
            # get the same prediction: what they change is NCCL's kernels spinning beside the compute, which the
            # model never had (it prices a message as its flow)
            if r.get("graphs"):
                continue
            pred = pipeline_prediction(r, host_s)
            out.append({"record": "row", "source": name, "host_source": other, "schedule": r["schedule"],
                        "transport": r.get("transport", "group"),
                        "microbatches": r["microbatches"], "batch": r["batch"], "measured_ms": r["step_ms"],
                        "measured_bubble": r["bubble_measured"], "theory_bubble": r["bubble_theory"],
                        "torch_ms": r.get("torch_step_ms"), **pred,
                        "device_error": _error(pred["device_ms"], r["step_ms"]),
                        "error": _error(pred["predicted_ms"], r["step_ms"]),
                        "torch_error": None if r.get("torch_step_ms") is None or r.get("transport", "group") != "group"
                        or r.get("torch_schedule")
                        not in (None, TORCH_SAME.get(r["schedule"]))  # torch's 1F1B beside ZB-H1: another schedule
                        else _error(pred["predicted_ms"], r["torch_step_ms"])})  # fmt: skip
    return out


def _pipeline(args: argparse.Namespace) -> list[dict]:
    rows = pipeline_rows()
    print(f"{'schedule':17s} {'m':>3s} {'batch':>5s} {'measured':>9s} {'device':>8s} {'+host':>8s} {'error':>7s} "
          f"{'bubble':>7s} {'dev.':>6s} {'+host':>6s} {'torch':>7s}")  # fmt: skip
    for r in rows:
        torch_ms = f"{r['torch_ms']:7.1f}" if r["torch_ms"] is not None else "      -"
        print(f"{r['schedule']:17s} {r['microbatches']:3d} {r['batch']:5d} {r['measured_ms']:9.2f} "
              f"{r['device_ms']:8.2f} {r['predicted_ms']:8.2f} {r['error']:+7.1%} {r['measured_bubble']:7.3f} "
              f"{r['device_bubble']:6.3f} {r['predicted_bubble']:6.3f} {torch_ms}")  # fmt: skip
    for label, key in (("device only", "device_error"), ("with host", "error"), ("torch, with host", "torch_error")):
        for batch in (1024, 4096):
            for transport in ("group", "peer"):
                group = [r[key] for r in rows if (r["batch"], r["transport"]) == (batch, transport)]
                group = [e for e in group if e is not None]
                if group:
                    print(f"{label}, batch {batch}, {transport}: median |error| {_median(group):.1%}, "
                          f"worst {max(map(abs, group)):.1%}")  # fmt: skip
    for label, key in (("device only", "device_bubble"), ("with host", "predicted_bubble")):
        for batch in (1024, 4096):
            for transport in ("group", "peer"):
                same = [r for r in rows if (r["batch"], r["transport"]) == (batch, transport)]
                gaps = [r[key] - r["measured_bubble"] for r in same]
                print(f"bubble {label}, batch {batch}, {transport}: predicted - measured, median |gap| "
                      f"{_median(gaps):.3f}, worst {max(map(abs, gaps)):.3f}")  # fmt: skip
    return rows


# --- data parallel ---------------------------------------------------------------------------------------------


def dp_prediction(ranks: int, batch_per_rank: int, parameters: float):
    """One simulated step (a ``StepResult``) of the 136M GPT on ``ranks`` H100s of ``h100-node``."""
    from dtrain.cluster.presets import preset
    from dtrain.sim.model import Layout, ModelSpec
    from dtrain.sim.placement import place
    from dtrain.sim.step import simulate_step

    model = ModelSpec(name="gpt-136m", parameters=parameters, bytes_per_value=4, **GPT_136M)
    layout = Layout(dp=ranks, micro_batch=batch_per_rank, global_batch=ranks * batch_per_rank, attention="flash")
    topo = preset("h100-node")
    return simulate_step(model, layout, topo, place(topo, layout))


def dp_rows(files=DP_FILES) -> list[dict]:
    out = []
    for name in files:
        for r in load(name):
            # ``local``: every GPU trains its own copy, no communication: one GPU's step
            ranks = 1 if r["variant"].startswith("local") else r["ranks"]
            step = dp_prediction(ranks, r["batch_per_rank"], float(r["parameters"]))
            out.append({"record": "row", "source": name, "variant": r["variant"], "ranks": r["ranks"],
                        "batch_per_rank": r["batch_per_rank"], "measured_s": r["step_s"], "predicted_s": step.step_s,
                        "compute_s": step.compute_s, "all_reduce_s": step.dp_s,
                        "exposed_all_reduce_s": step.dp_exposed_s,
                        "optimizer_s": step.optimizer_s, "error": _error(step.step_s, r["step_s"])})  # fmt: skip
    return out


def _dp(args: argparse.Namespace) -> list[dict]:
    rows = dp_rows()
    for r in rows:
        print(f"{r['source']:28s} {r['variant']:12s} {r['ranks']} GPU, {r['batch_per_rank']:2d} a GPU: "
              f"measured {r['measured_s'] * 1e3:6.1f} ms, predicted {r['predicted_s'] * 1e3:6.1f} ms, "
              f"{r['error']:+.1%}")  # fmt: skip
    for ranks in (1, 4):
        for recorded in (False, True):
            group = [r["error"] for r in rows if r["ranks"] == ranks and ("-graph" in r["variant"]) == recorded]
            if group:
                what = "recorded" if recorded else "eager"
                print(f"{ranks} GPU(s), {what}: median |error| {_median(group):.1%}, worst {max(map(abs, group)):.1%}")
    return rows


# --- command line ----------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(abs(v) for v in values)


MODES = {"collectives": _collectives, "pipeline": _pipeline, "dp": _dp}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="beside_measured.py", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=list(MODES))
    ap.add_argument("--out", default=None, help="JSON lines, one per measured row")
    ap.add_argument("--nccl-figures", default=None, help="collectives: NCCL's figures from an earlier --out file")
    args = ap.parse_args(argv)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        print(f"beside_measured.py: --out {args.out}: its directory does not exist", file=sys.stderr)
        return 2
    if args.nccl_figures and not Path(args.nccl_figures).is_file():
        print(f"beside_measured.py: --nccl-figures {args.nccl_figures}: no such file", file=sys.stderr)
        return 2
    try:
        records = MODES[args.mode](args)
    except ValueError as err:
        print(f"beside_measured.py: {err}", file=sys.stderr)
        return 2
    if args.out:
        target = Path(args.out).resolve()
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(f.name, target)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
