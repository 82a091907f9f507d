"""The training-step simulator against published iteration times of large GPT runs (benchmarks/sim/published.toml).

Each row is simulated with the techniques it used (recomputation, sequence parallelism, schedule, FP8) on a
cluster like its own (``cluster_of``): the A100 rows on a DGX A100 SuperPOD like the papers' Selene (scalable units
of 20 DGX A100 servers, 8 A100 80 GB on NVSwitch, 8 HDR NICs, rail-optimised; NVIDIA DGX SuperPOD reference
architecture), the H100 rows on a DGX H100 SuperPOD; compute priced per operation from device specs, published
microbenchmarks and dtrain bench compute's H100 curves (dtrain.sim.compute). Every row's ranks are placed in
Megatron-LM's and DeepSpeed's order, tensor parallelism innermost, then data, then pipeline (``PLACEMENT``, the
``megatron`` placement of dtrain.sim.placement), as the codes of all these runs number them. Nothing is fitted to
these rows.

    python benchmarks/sim/validate.py published [--out benchmarks/results/sim_validation-cpu2.jsonl] [--plan]

``--plan``: also run ``dtrain plan``'s search on each row's cluster and batch, and report where the published
layout ranks and whether the best plan is at least as fast (``--jobs N``: N rows' searches at once).
``--placement aware`` places every row in ``dtrain train``'s default order instead, to see what the order moves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

from dtrain.cluster.presets import preset
from dtrain.sim.classes import DEFAULT_FLOW_LIMIT
from dtrain.sim.compute import MEGATRON_FP16_OPTIMIZER_BYTES
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.placement import PLACEMENTS, place
from dtrain.sim.step import StepConfig, simulate_step

DATA = Path(__file__).resolve().parents[1] / "published.toml"
SERVERS_PER_UNIT = 20  # DGX SuperPOD (A100) scalable unit
PRESETS = {"a100-sxm": "dgx-a100", "h100-sxm": "h100-node"}
MEDIAN_TARGET, WORST_TARGET = 0.10, 0.20
#: The rank order of every row: Megatron-LM's ``initialize_model_parallel`` and DeepSpeed's
#: ``PipeModelDataParallelTopology`` (axes pipe, data, model) both put pipeline stages outermost.
PLACEMENT = "megatron"
SETS = ("validation", "held-out")
MEASURES = {"time": "iteration_s", "tflops": "tflops_per_gpu"}
_FIELDS = ("name", "source", "set", "device", "layers", "hidden", "heads", "sequence", "vocab", "dp", "tp", "pp",
           "micro_batch", "global_batch", "recompute", "sequence_parallel", "measure")  # fmt: skip


#: How a row that publishes throughput counted an iteration's FLOPs (row field ``flops``, default ``narayanan21``).
FLOP_COUNTS = ("narayanan21", "megatron-core")


def iteration_flops(row: dict) -> float:
    """FLOPs of one iteration as the row's source counted them (``flops``): ``narayanan21``, with full
    recomputation, Narayanan et al. 2021, equation 3, ``F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``;
    ``megatron-core``, the model's FLOPs without recomputation, Megatron-LM ``num_floating_point_operations``
    (``megatron/training/training.py``, commit f2e5db4, 2024-07-15): ``F = 12 B s l h^2 ((1 + g / a + s / h) +
    f / h x m + V / (2 l h))``, ``g / a`` the key/value heads over the heads, ``f`` the MLP's width and ``m`` 3/2
    for a gated MLP (1 otherwise), the attention counted over the whole ``s x s`` square; for a GPT of 4h MLP and
    as many key/value heads as heads ``F = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))``."""
    b, s, layers, h, v = row["global_batch"], row["sequence"], row["layers"], row["hidden"], row["vocab"]
    if row.get("flops", "narayanan21") == "megatron-core":
        heads = row["heads"]
        groups = row.get("kv_heads", 0) or heads
        ffn = row.get("ffn_hidden", 0) or 4 * h
        gated = 1.5 if row.get("gated_mlp", False) else 1.0
        return 12 * b * s * layers * h * h * ((1 + groups / heads + s / h) + ffn / h * gated + v / (2 * layers * h))
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def load(path: Path = DATA) -> list[dict]:
    """The published runs, each checked for its fields; ``iteration_s`` derived from ``tflops_per_gpu`` where a
    row publishes throughput (:func:`iteration_flops` over ``GPUs x TFLOP/s``)."""
    rows = tomllib.loads(path.read_text())["run"]
    for row in rows:
        missing = [f for f in _FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: run {row.get('name', '?')!r} lacks {', '.join(missing)}")
        if row["device"] not in PRESETS:
            raise ValueError(f"{path}: run {row['name']!r}: device {row['device']!r}; accepted: {', '.join(PRESETS)}")
        if _cluster_name(row) not in CLUSTERS[row["device"]]:
            raise ValueError(f"{path}: run {row['name']!r}: cluster {row['cluster']!r}; accepted on {row['device']}: "
                             f"{', '.join(CLUSTERS[row['device']])}")  # fmt: skip
        if row.get("flops", "narayanan21") not in FLOP_COUNTS:
            raise ValueError(f"{path}: run {row['name']!r}: flops {row['flops']!r}; accepted: {', '.join(FLOP_COUNTS)}")
        if row["set"] not in SETS:
            raise ValueError(f"{path}: run {row['name']!r}: set {row['set']!r}; accepted: {', '.join(SETS)}")
        if row["measure"] not in MEASURES or MEASURES[row["measure"]] not in row:
            raise ValueError(f"{path}: run {row['name']!r}: measure {row['measure']!r} needs its value; accepted: "
                             + ", ".join(f"{m} (with {k})" for m, k in MEASURES.items()))  # fmt: skip
        if row["measure"] == "tflops":
            gpus = row["dp"] * row.get("cp", 1) * row["tp"] * row["pp"]
            row["iteration_s"] = iteration_flops(row) / (gpus * row["tflops_per_gpu"] * 1e12)
    return rows


def model_of(row: dict) -> ModelSpec:
    """The model of a row. A GPT: ``12 L h^2 (1 + 13 / 12 h) + V h`` parameters (Narayanan et al. 2021, appendix),
    one more ``V h`` where the output layer has its own matrix (``tied_embeddings = false``); a Llama (``gated_mlp``,
    its ``ffn_hidden`` and ``kv_heads``): the matrices its shape holds (``ModelSpec.shape_parameters``)."""
    h, layers, vocab = row["hidden"], row["layers"], row["vocab"]
    tied = row.get("tied_embeddings", True)
    params = 12 * layers * h * h * (1 + 13 / (12 * h)) + vocab * h * (1 if tied else 2)
    model = ModelSpec(name=row["name"], parameters=params, layers=layers, hidden=h, heads=row["heads"],
                      sequence=row["sequence"], vocab=vocab, ffn_hidden=row.get("ffn_hidden", 0),
                      kv_heads=row.get("kv_heads", 0), gated_mlp=row.get("gated_mlp", False),
                      tied_embeddings=tied)  # fmt: skip
    if row.get("gated_mlp", False):
        return dataclasses.replace(model, parameters=model.shape_parameters)
    return model


def layout_of(row: dict) -> Layout:
    return Layout(dp=row["dp"], cp=row.get("cp", 1), tp=row["tp"], pp=row["pp"], micro_batch=row["micro_batch"],
                  global_batch=row["global_batch"], zero_stage=row.get("zero_stage", 0),
                  schedule=row.get("schedule", "1f1b"), chunks=row.get("chunks", 1), recompute=row["recompute"],
                  sequence_parallel=row["sequence_parallel"], attention=row.get("attention", "unfused"),
                  embedding_layers=row.get("embedding_layers", 0), fp8=row.get("fp8", False),
                  fp8_params=row.get("fp8_params", False))  # fmt: skip


#: Clusters a row may name (``cluster``), by device, the first the default. A100: Selene's DGX SuperPOD (above), or
#: Jean Zay's A100 partition (BLOOM-176B: 8 A100 80 GB a server, 4 Omni-Path 100 Gb/s links a server; BigScience
#: tr11-176B-ml README; the fabric's shape is not published there and is taken as a non-blocking fat tree), built as
#: DGX A100 servers with 4 NICs of 100 Gb/s (the catalogue's EDR InfiniBand, the same rate) under leaves of 12
#: servers, 1:1. H100: a DGX SuperPOD of DGX H100 servers (NVIDIA DGX SuperPOD reference architecture, DGX H100:
#: scalable units of 32 servers, 8 NDR 400 Gb/s NICs a server, rail-optimised), the ``h100-rail`` preset's fabric.
#: Both SuperPODs are InfiniBand fabrics under a subnet manager's fat-tree routing (``routing="d-mod-k"``, by
#: destination port: :mod:`dtrain.cluster.routing`); Jean Zay's Omni-Path fabric, its routing not published with
#: the run, hashes flows over its equal-cost paths.
CLUSTERS = {"a100-sxm": ("selene", "jean-zay"), "h100-sxm": ("dgx-h100-superpod",)}
SERVERS_PER_H100_UNIT = 32


def _cluster_name(row: dict) -> str:
    return row.get("cluster", CLUSTERS[row["device"]][0])


def cluster_of(row: dict):
    gpus = row["dp"] * row.get("cp", 1) * row["tp"] * row["pp"]
    servers = math.ceil(gpus / 8)
    if servers > 1 and _cluster_name(row) == "dgx-h100-superpod":
        units = math.ceil(servers / SERVERS_PER_H100_UNIT)
        return preset(PRESETS[row["device"]], racks=units, servers_per_rack=min(servers, SERVERS_PER_H100_UNIT),
                      fabric="rail", nic_affinity="rail", spines=16, routing="d-mod-k")  # fmt: skip
    if _cluster_name(row) == "jean-zay":
        racks = math.ceil(servers / 12)
        return preset(PRESETS[row["device"]], nics=4, nic="ib-edr", racks=racks, servers_per_rack=min(servers, 12),
                      spines=4, nic_affinity="ecmp")  # fmt: skip
    if servers == 1:
        return preset(PRESETS[row["device"]])
    units = math.ceil(servers / SERVERS_PER_UNIT)
    return preset(PRESETS[row["device"]], racks=units, servers_per_rack=min(servers, SERVERS_PER_UNIT),
                  fabric="rail", nic_affinity="rail", spines=8, routing="d-mod-k")  # fmt: skip


def config_of(row: dict, flow_limit: int | None = DEFAULT_FLOW_LIMIT) -> StepConfig:
    """How a row's software ran: Megatron-LM's scatter-gather pipeline sends (on by default from 2021-02,
    Megatron-LM commit 72e4230), each exchange synchronous (``_communicate``: ``batch_isend_irecv``, wait,
    ``torch.cuda.synchronize()``, then the gather), interleaved 1F1B's one exchange per forward-backward pair
    (``send_forward_backward_recv_forward_backward`` after the backward), the tied word embedding's gradient
    all-reduce between the first and last stage (``allreduce_word_embedding_grads``), Megatron-LM's
    mixed-precision optimizer step (:data:`dtrain.sim.compute.MEGATRON_FP16_OPTIMIZER_BYTES`), and the backward's
    tensor-parallel collective under the weight gradient only where the row's code had it
    (``async_tp_allreduce``: Megatron-LM's asynchronous all-reduce, first in commit 16c9044 of 2021-09-02), and
    the bytes of a gradient in the data-parallel reduction (``gradient_bytes``, default 2: the 16-bit gradients of
    Megatron-LM's ``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``, as ``examples/sc21/CONFIG.sh``
    runs it; 4 for DeepSpeed's ``BF16_Optimizer`` and for Megatron-LM's ``--bf16``, which turns on
    ``--accumulate-allreduce-grads-in-fp32``), and whether the data-parallel reduction starts under each stage's
    last backward and the weights' all-gather runs under the next forward (``overlap_dp``: Megatron-Core's
    ``--overlap-grad-reduce --overlap-param-gather``, ``StepConfig.overlap_grad_reduce`` and
    ``overlap_param_gather``; the A100 rows' Megatron-LM and DeepSpeed reduce after the pipeline's last
    backward), and whether
    ZeRO-1 reduce-scatters the gradients (``distributed_optimizer``: Megatron-Core's distributed optimizer) or
    all-reduces them (DeepSpeed's ``BF16_Optimizer``), and whether the tensor-parallel all-gathers and
    reduce-scatters of sequence parallelism run in chunks under the products beside them (``tp_comm_overlap``:
    Megatron-Core's ``--tp-comm-overlap``, ``StepConfig.tp_comm_overlap``), and whether an interleaved schedule's
    pipeline exchanges run under compute (``overlap_p2p_comm``: Megatron-Core's default, which its argument checks
    keep only with an interleaved schedule; ``StepConfig.overlap_p2p_comm``), and the kernels of the layer
    (``kernels``, default ``"fused"``; ``"megatron-lm"`` for Megatron-LM's layer of 2021-2022, whose QKV bias,
    causal softmax, copies and 32-bit cross-entropy :func:`dtrain.sim.compute.layer_ops` prices as it runs them),
    and whether the weight-gradient products add into the 32-bit gradients themselves
    (``grad_accumulation_fusion``: Megatron-LM's ``--gradient-accumulation-fusion``, on by default, which its
    argument checks keep only where gradients accumulate in 32 bits; ``StepConfig.grad_accumulation_fusion``),
    and which userbuffers overlaps run their product on fewer multiprocessors (``ub_sm_margin``, the run's
    ``tp_overlap`` file; ``StepConfig.ub_sm_margin``), and whether Transformer Engine's FP8 amax reduction waits
    on the compute stream after each chunk's forward and backward (``amax_reduction``,
    ``StepConfig.amax_reduction``), and which family of fused attention kernel ran (``attention_kernel``,
    ``StepConfig.attention_kernel``; None: the one the device's curves measured).
    ``flow_limit``: replay collectives of more messages than that in lock-step rounds
    (:func:`dtrain.sim.classes.replay_jobs`)."""
    return StepConfig(split_pipeline=True, overlap_tp_backward=row.get("async_tp_allreduce", True),
                      synchronous_p2p=True, paired_exchanges=True,
                      tied_embedding_allreduce=row.get("tied_embeddings", True),
                      optimizer_bytes=MEGATRON_FP16_OPTIMIZER_BYTES, flow_limit=flow_limit,
                      gradient_bytes=row.get("gradient_bytes", 2),
                      overlap_grad_reduce=row.get("overlap_dp", False),
                      overlap_param_gather=row.get("overlap_dp", False),
                      distributed_optimizer=row.get("distributed_optimizer", False),
                      tp_comm_overlap=row.get("tp_comm_overlap", False),
                      overlap_p2p_comm=row.get("overlap_p2p_comm", False),
                      kernels=row.get("kernels", "fused"),
                      grad_accumulation_fusion=row.get("grad_accumulation_fusion", False),
                      ub_sm_margin=tuple(sorted(row.get("ub_sm_margin", {}).items())),
                      amax_reduction=row.get("amax_reduction", "none"),
                      attention_kernel=row.get("attention_kernel"))  # fmt: skip


def simulate(row: dict, config: StepConfig | None = None, placement: str = PLACEMENT) -> dict:
    """Predicted against published seconds of one row, its ranks placed by ``placement``."""
    model, layout, topo = model_of(row), layout_of(row), cluster_of(row)
    result = simulate_step(model, layout, topo, place(topo, layout, placement), config or config_of(row))
    error = result.step_s / row["iteration_s"] - 1
    return {
        "name": row["name"], "source": row["source"], "set": row["set"], "layout": layout.describe(),
        "gpus": layout.world_size, "placement": placement,
        "published_s": row["iteration_s"], "measure": row["measure"], "predicted_s": result.step_s,
        "error": error, "compute_s": result.compute_s, "tp_s": result.tp_s, "pp_s": result.pp_s,
        "dp_exposed_s": result.dp_exposed_s, "contention_s": result.contention_s, "optimizer_s": result.optimizer_s,
        "amax_s": result.amax_s, "cp_ring_s": result.cp_s,
        "bubble_theory": result.bubble_theory,
        "memory_gb": result.memory.total / 1e9, "fits": result.fits,
    }  # fmt: skip


def compute_factor(result: dict) -> float:
    """How much slower each micro-batch's compute would have to be for the prediction to meet the published time,
    the rest of the step (collectives, bubble, optimizer) held: ``(published - (predicted - compute)) / compute``.
    The bubble and every collective that waits on compute grow with it too, so this is an upper bound."""
    rest = result["predicted_s"] - result["compute_s"]
    return (result["published_s"] - rest) / result["compute_s"]


def summary(rows: list[dict]) -> dict:
    """Median and worst |error| of ``rows``, and of each set among them."""
    errors = [abs(r["error"]) for r in rows]
    out = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors), "rows": len(rows)}
    for name in SETS:
        part = [abs(r["error"]) for r in rows if r.get("set") == name]
        if part:
            out[name] = {"median_abs_error": statistics.median(part), "worst_abs_error": max(part), "rows": len(part)}
    return out


def plan_check(row: dict, flow_limit: int | None = DEFAULT_FLOW_LIMIT, placement: str = PLACEMENT) -> dict:
    """Where ``dtrain plan``'s search puts the published layout on the row's cluster and batch: every layout of
    the row's GPUs (tp up to 8, the row's micro-batch, no ZeRO and the row's ZeRO stage, 1F1B and interleaved
    1F1B of 2 chunks and of the row's chunks; context parallelism of 1 up to twice the row's degree, in powers of
    two, where the row runs it), ranked by simulated step time, searched twice: with every technique
    (recomputation only where memory needs it, sequence parallelism with tp) and with the row's own (its
    recomputation, sequence parallelism as it used it), every layout with the row's attention core and the row's
    FP8 linear layers and weights, every layout's ranks placed by ``placement``. A rank is 1 +
    the plans faster than the published layout, as simulated."""
    from dtrain.sim.planner import plan

    model, layout, topo = model_of(row), layout_of(row), cluster_of(row)
    config = config_of(row, flow_limit)
    schedules = sorted({("1f1b", 1), ("interleaved-1f1b", 2), (layout.schedule, layout.chunks)})
    degrees = tuple(2**i for i in range(layout.cp.bit_length() + 1)) if layout.cp > 1 else (1,)
    published = simulate_step(model, layout, topo, place(topo, layout, placement), config).step_s
    out = {"name": row["name"], "published_layout": layout.describe(), "published_layout_s": published,
           "flow_limit": flow_limit, "placement": placement}  # fmt: skip
    for suffix, techniques in (
        ("", {}),
        ("_same_techniques", {"recompute": (layout.recompute,), "sequence_parallel": layout.sequence_parallel}),
    ):
        plans, _ = plan(model, topo, global_batch=row["global_batch"], devices=layout.world_size,
                        placements=(placement,), micro_batches=(row["micro_batch"],),
                        zero_stages=tuple(sorted({0, layout.zero_stage})), max_tp=8,
                        config=config, schedules=schedules, attention=layout.attention, fp8=layout.fp8,
                        fp8_params=layout.fp8_params, context_parallel=degrees, **techniques)  # fmt: skip
        best = plans[0] if plans else None
        out |= {
            f"best{suffix}": best.layout.describe() if best else None,
            f"best{suffix}_s": best.result.step_s if best else None,
            f"at_least_as_fast{suffix}": bool(best and best.result.step_s <= published * (1 + 1e-9)),
            f"published_rank{suffix}": 1 + sum(p.result.step_s < published * (1 - 1e-9) for p in plans),
            f"plans{suffix}": len(plans),
        }
    return out


class _Late(Exception):
    pass


def _timed_plan_check(row: dict, limit_s: int, flow_limit: int | None, placement: str = PLACEMENT) -> dict:
    """:func:`plan_check`, or a record that it ran past ``limit_s`` seconds."""

    def late(signum, frame):
        raise _Late

    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(limit_s)
    start = time.perf_counter()
    try:
        out = plan_check(row, flow_limit, placement)
    except _Late:
        out = {"name": row["name"], "skipped": f"planner search over {limit_s} s", "flow_limit": flow_limit,
               "placement": placement}  # fmt: skip
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out["search_s"] = time.perf_counter() - start
    return out


def _plan_checks(rows: list[dict], limit_s: int, flow_limit: int | None, placement: str, jobs: int):
    """:func:`_timed_plan_check` of each row, in the rows' order, ``jobs`` of them at once in worker processes."""
    if jobs == 1:
        for row in rows:
            yield _timed_plan_check(row, limit_s, flow_limit, placement)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_timed_plan_check, row, limit_s, flow_limit, placement) for row in rows]
        for future in futures:
            yield future.result()


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _verdict(part: dict) -> str:
    median_ok = part["median_abs_error"] <= MEDIAN_TARGET
    worst_ok = part["worst_abs_error"] <= WORST_TARGET
    if median_ok and worst_ok:
        return "met"
    if not median_ok and not worst_ok:
        return "both missed"
    return "median missed, worst met" if worst_ok else "median met, worst missed"


def tables(results_path: str, plan_path: str | None = None) -> str:
    """The markdown tables of docs/simulator-validation.md from the JSON lines ``--out`` (and ``--plan-out``)
    wrote: each row, the summary by set, and the planner's ranks."""
    results = [r for r in _read(results_path) if "name" in r]
    rows = load()
    by_name = {r["name"]: r for r in rows}
    out = ["| run | set | layout | published (s) | predicted (s) | error |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for r in results:
        star = " *" if r["measure"] == "tflops" else ""
        out.append(f"| {r['name']} | {r['set']} | {r['layout']} | {r['published_s']:.2f}{star} | "
                   f"{r['predicted_s']:.2f} | {r['error']:+.1%} |")  # fmt: skip
    out += [
        "",
        "| set | rows | median \\|error\\| | worst \\|error\\| | targets |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    s = summary(results)
    for name in SETS:
        if name in s:
            part = s[name]
            out.append(f"| {name} | {part['rows']} | {part['median_abs_error']:.1%} | {part['worst_abs_error']:.1%} | "
                       f"{_verdict(part)} |")  # fmt: skip
    out.append(f"| all | {s['rows']} | {s['median_abs_error']:.1%} | {s['worst_abs_error']:.1%} | {_verdict(s)} |")
    for label, prefix, where in (("Korthikanti et al. 2022 alone", "korthikanti22-", "validation"),
                                 ("Narayanan et al. 2021, table 1", "narayanan21-", "validation"),
                                 ("MLPerf Training v3.0-v4.1, H100", "mlperf", "validation"),
                                 ("Megatron-Core r0.8.0, H100", "mcore24-", "held-out"),
                                 ("NeMo 24.03 long sequences, H100", "nemo24-", "held-out")):  # fmt: skip
        part = [r for r in results if r["name"].startswith(prefix) and r["set"] == where]
        if part:
            p = summary(part)
            out.append(f"| {label} | {p['rows']} | {p['median_abs_error']:.1%} | {p['worst_abs_error']:.1%} | "
                       f"{_verdict(p)} |")  # fmt: skip
    out += ["", "| run | compute (s) | tp, every call (s) | dp exposed (s) | compute lost to dp (s) | FP8 amax (s) "
            "| optimizer (s) | bubble, theory | step beyond compute (s) | compute x to match |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in results:
        out.append(f"| {r['name']} | {r['compute_s']:.2f} | {r['tp_s']:.2f} | {r['dp_exposed_s']:.2f} | "
                   f"{r.get('contention_s', 0.0):.3f} | {r.get('amax_s', 0.0):.3f} | "
                   f"{r['optimizer_s']:.3f} | {r['bubble_theory']:.1%} | {r['predicted_s'] - r['compute_s']:.2f} | "
                   f"{compute_factor(r):.2f} |")  # fmt: skip
    out += ["", *per_action(results, by_name)]
    if plan_path:
        checks = [c for c in _read(plan_path) if "best" in c]
        out += ["", "| run | published layout (s) | best plan, any technique (s) | rank | best plan, the run's "
                "techniques (s) | rank | search (s) |", "| --- | ---: | --- | ---: | --- | ---: | ---: |"]  # fmt: skip

        def best(c: dict, suffix: str) -> str:
            layout = c[f"best{suffix}"]
            return "none fits" if layout is None else f"{layout} {c[f'best{suffix}_s']:.2f}"

        for c in checks:
            out.append(f"| {c['name']} | {c['published_layout_s']:.2f} | {best(c, '')} | {c['published_rank']} | "
                       f"{best(c, '_same_techniques')} | {c['published_rank_same_techniques']} | "
                       f"{c['search_s']:.0f} |")  # fmt: skip
        fast = sum(c["at_least_as_fast"] for c in checks)
        top = sum(c["published_rank"] <= 5 for c in checks)
        top_same = sum(c["published_rank_same_techniques"] <= 5 for c in checks)
        out += ["", f"Searched {len(checks)} of {len(rows)} rows; the best plan is at least as fast as the published "
                f"layout on {fast}; the published layout ranks in the top 5 on {top} with every technique and on "
                f"{top_same} with the run's own."]  # fmt: skip
        missing = sorted(set(by_name) - {c["name"] for c in checks})
        if missing:
            out.append(f"Not searched: {', '.join(missing)}.")
    return "\n".join(out)


def per_action(results: list[dict], by_name: dict) -> list[str]:
    """What each pipelined H100 row's prediction misses, per action of a stage: a (chunk, micro-batch) forward or
    backward, ``2 m v`` of them a step (``m`` micro-batches, ``v`` chunks a stage), beside the compute the model
    gives an action and the layers in a chunk. A table, no model: the residual laid out by how finely the
    schedule cuts the work."""
    out = ["| run | stages | chunks | layers a chunk | micro-batch | micro-batches | compute an action (ms) | "
           "missing an action (ms) | missing / compute |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in results:
        row = by_name.get(r["name"])
        if row is None or row.get("device") != "h100-sxm" or row["pp"] == 1:
            continue
        layout = layout_of(row)
        actions = 2 * layout.microbatches * layout.chunks
        compute = r["compute_s"] / actions
        missing = (r["published_s"] - r["predicted_s"]) / actions
        out.append(f"| {r['name']} | {layout.pp} | {layout.chunks} | {row['layers'] / (layout.pp * layout.chunks):g} | "
                   f"{layout.micro_batch} | {layout.microbatches} | {compute * 1e3:.2f} | {missing * 1e3:+.2f} | "
                   f"{missing / compute:+.0%} |")  # fmt: skip
    return out


def _blocks(lines: list[str]) -> list[tuple[int, int]]:
    """The ``[start, end)`` line ranges of the markdown tables in ``lines``."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            found.append((i, j))
            i = j
        else:
            i += 1
    return found


def _key(header: str) -> str:
    """A table's name: its first two header cells."""
    return "|".join(cell.strip() for cell in header.split("|")[1:3])


def sync_doc(printed: str, doc: str | os.PathLike, *, check: bool = False) -> list[str]:
    """Put :func:`tables`' output into ``doc``: each table in place of the doc's table of the same first two
    header cells, the planner's summary line in place of the doc's line that begins as it does. What differed (or,
    with ``check``, differs and is left alone), by table name; a table or line the doc lacks raises
    ``ValueError``."""
    new, path = printed.splitlines(), Path(doc)
    lines = path.read_text().splitlines()
    have = {_key(lines[i]): (i, j) for i, j in _blocks(lines)}
    changes: list[tuple[int, int, list[str], str]] = []
    for i, j in _blocks(new):
        name = _key(new[i])
        if name not in have:
            raise ValueError(f"{doc}: no table headed {new[i]}")
        start, end = have[name]
        changes.append((start, end, new[i:j], name))
    for line in new:
        if line.startswith("Searched "):
            where = [n for n, old in enumerate(lines) if old.startswith("Searched ")]
            if len(where) != 1:
                raise ValueError(f"{doc}: needs one line beginning 'Searched ' for the planner's summary")
            changes.append((where[0], where[0] + 1, [line], "the planner's summary"))
    stale = [name for start, end, block, name in changes if lines[start:end] != block]
    if not check:
        for start, end, block, _ in sorted(changes, reverse=True):
            lines[start:end] = block
        path.write_text("\n".join(lines) + "\n")
    return stale


def _write(path: str, lines: list[dict]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(f.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON lines: one per row, then the summary")
    parser.add_argument("--plan", action="store_true", help="also check dtrain plan's search on each row")
    parser.add_argument("--plan-out", default=None, help="JSON lines of the --plan checks, one per row")
    parser.add_argument("--plan-limit", type=int, default=300, help="seconds a row's search may take (default 300)")
    parser.add_argument("--tables", action="store_true",
                        help="print the markdown tables of --out (and --plan-out) without simulating")  # fmt: skip
    parser.add_argument("--doc", default=None,
                        help="with --tables: write them into this page over its own tables")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help="with --doc: change nothing; exit 1 naming each stale table")  # fmt: skip
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: every row)")
    parser.add_argument("--placement", default=PLACEMENT, choices=PLACEMENTS,
                        help=f"the rank order of every row (default {PLACEMENT}, the runs' own)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="rows' --plan searches run at once (default 1)")
    parser.add_argument(
        "--flow-limit",
        type=int,
        default=DEFAULT_FLOW_LIMIT,
        help=f"replay collectives of more messages in lock-step rounds (default {DEFAULT_FLOW_LIMIT})",
    )
    args = parser.parse_args()
    if args.jobs < 1:
        raise SystemExit(f"validate.py published: --jobs must be at least 1, got {args.jobs}")
    if args.tables:
        if not args.out:
            raise SystemExit("validate.py published: --tables reads the file --out names; give --out")
        printed = tables(args.out, args.plan_out)
        if not args.doc:
            print(printed)
            return
        stale = sync_doc(printed, args.doc, check=args.check)
        if args.check and stale:
            raise SystemExit(f"validate.py published: {args.doc} differs from the data in: {'; '.join(stale)}")
        print(f"validate.py published: {args.doc}: {len(stale)} table(s) {'stale' if args.check else 'rewritten'}")
        return
    rows = load()
    if args.rows:
        names = args.rows.split(",")
        unknown = sorted(set(names) - {r["name"] for r in rows})
        if unknown:
            raise SystemExit(f"validate.py published: --rows names unknown rows {', '.join(unknown)}")
        rows = [r for r in rows if r["name"] in names]
    start = time.perf_counter()
    results = [simulate(row, config_of(row, args.flow_limit), args.placement) for row in rows]
    print(f"{'run':34} {'set':10} {'layout':50} {'published':>10} {'predicted':>10} {'error':>7}")
    for r in results:
        print(f"{r['name']:34} {r['set']:10} {r['layout']:50} {r['published_s']:10.2f} {r['predicted_s']:10.2f} "
              f"{r['error']:+7.1%}")  # fmt: skip
    s = summary(results)
    for name, part in [("all", s)] + [(n, s[n]) for n in SETS if n in s]:
        print(f"{name}: {part['rows']} rows, median |error| {part['median_abs_error']:.1%} (target "
              f"{MEDIAN_TARGET:.0%}), worst {part['worst_abs_error']:.1%} (target {WORST_TARGET:.0%})")  # fmt: skip
    print(f"{time.perf_counter() - start:.1f} s")
    if args.out:
        _write(args.out, [*results, {"summary": s}])
    checks = []
    if args.plan:
        for c in _plan_checks(rows, args.plan_limit, args.flow_limit, args.placement, args.jobs):
            checks.append(c)
            if "skipped" in c:
                print(f"plan {c['name']:34} skipped: {c['skipped']}", flush=True)
            elif c["best"] is None or c["best_same_techniques"] is None:
                print(f"plan {c['name']:34} published layout {c['published_layout_s']:.2f} s; no layout of the "
                      f"search fits ({c['plans']} plans, {c['plans_same_techniques']} with the run's techniques)",
                      flush=True)  # fmt: skip
            else:
                print(f"plan {c['name']:34} published layout {c['published_layout_s']:.2f} s; best {c['best']} "
                      f"{c['best_s']:.2f} s, rank {c['published_rank']} of {c['plans']}; same techniques: best "
                      f"{c['best_same_techniques']} {c['best_same_techniques_s']:.2f} s, rank "
                      f"{c['published_rank_same_techniques']} of {c['plans_same_techniques']} ({c['search_s']:.0f} s)",
                      flush=True)  # fmt: skip
            if args.plan_out:
                _write(args.plan_out, checks)


if __name__ == "__main__":
    main()
