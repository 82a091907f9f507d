"""``dtrain simulate collective|train|ps`` and ``dtrain plan``: the simulator on a preset or a topology file.

Registered by :mod:`dtrain.cli.cluster` (``register(commands)``). Readable rich tables, or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dtrain.cli.cluster_common import link_rows, link_table
from dtrain.cli.units import check_finite, parse_bytes, parse_count, whole

__all__ = ["register"]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


DEFAULT_MODEL = "llama-7b"  # --model's default
#: the model flags (dest, flag) that change --model's preset
MODEL_FLAGS = (("model", "--model"), ("params", "--params"), ("layers", "--layers"), ("hidden", "--hidden"),
               ("heads", "--heads"), ("seq", "--seq"), ("vocab", "--vocab"))  # fmt: skip
RECOMPUTE = ("none", "selective", "full")  # dtrain.sim.model.RECOMPUTE, without importing the simulator here
PLACEMENTS = ("aware", "megatron", "oblivious")  # dtrain.sim.placement.PLACEMENTS, likewise
ATTENTION_KERNELS = ("cudnn", "fa2", "fa1")  # dtrain.sim.compute.ATTENTION_KERNELS, likewise


_whole = whole


def _print_json(data: dict) -> None:
    """``data`` as JSON on stdout; a ValueError naming the first infinite or NaN value instead (JSON holds none)."""
    check_finite(data)
    print(json.dumps(data, indent=2))


def _recompute_modes(text: str) -> list[str]:
    modes = _names(text)
    if not modes or any(m not in RECOMPUTE for m in modes):
        raise argparse.ArgumentTypeError(f"expected comma-separated modes of {', '.join(RECOMPUTE)}, got {text!r}")
    return modes


_PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v")  # dtrain.sim.model.SCHEDULES


def _schedules(text: str) -> list[tuple[str, int]]:
    """``plan --schedules``: comma-separated schedule names, as (schedule, chunks a stage) pairs."""
    names = _names(text)
    if not names or any(n not in _PIPELINE_SCHEDULES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated schedules of {', '.join(_PIPELINE_SCHEDULES)}, each once, got {text!r}"
        )
    return [(n, 2 if n in ("interleaved-1f1b", "zb-v") else 1) for n in names]


def _slow_rank(text: str) -> tuple[int, float]:
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slow-rank takes RANK:FACTOR, e.g. 3:1.5; got {text!r}") from None


#: The most micro-batches a replica runs in a step that ``simulate train`` simulates, and the largest global batch
#: ``plan`` searches: each micro-batch is an event of the pipeline's replay (about 5 s at pp 8 for this many).
MAX_MICROBATCHES = 1 << 16

#: plans ``dtrain plan`` shows without ``--top``
DEFAULT_TOP = 10

#: dtrain.sim.classes.DEFAULT_FLOW_LIMIT, without importing the simulator here
DEFAULT_FLOW_LIMIT = 50_000


def _flow_limit(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--flow-limit takes a whole number >= 1 or 'none', got {text!r}")
    return value


def register(commands) -> None:
    """Add ``simulate`` (``collective``, ``train``, ``ps``) and ``plan`` to ``dtrain``."""
    from dtrain.cli.sim_ps import add_ps_parser

    sim = commands.add_parser("simulate", help="simulate a collective, a training step or a parameter-server step")
    sub = sim.add_subparsers(dest="simulate_command", required=True)
    p = sub.add_parser("collective", help="replay a dtrain.comm schedule: time, link utilisation, bottleneck")
    _add_topology(p)
    p.add_argument("--collective", default="all_reduce", help="all_reduce, all_gather, broadcast, ...")
    p.add_argument("--algorithm", default="ring", help="a dtrain.comm algorithm, or 'all' to compare every one")
    p.add_argument("--bytes", type=parse_bytes, required=True, help="work buffer per rank, e.g. 1G (binary units)")
    p.add_argument("--ranks", type=int, help="ranks (default: every device of the topology)")
    p.add_argument("--placement", default="aware",
                   help="aware, megatron (the same as aware for one group), oblivious, or comma-separated device "
                   "names")  # fmt: skip
    p.add_argument("--local-size", type=_whole(1),
                   help="ranks a node for hierarchical algorithms (default: per server)")  # fmt: skip
    p.add_argument("--pipeline", type=_whole(1), default=1, help="pieces a chain algorithm cuts the buffer into")
    _add_software(p)
    p.add_argument("--links", type=_whole(0), default=8, help="busiest links to show")
    p.set_defaults(handler=_simulate_collective)

    p = sub.add_parser("train", help="one training step of a dp x tp x pp layout")
    _add_topology(p)
    _add_model(p)
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=_whole(1), default=1, help=f"{axis} degree")
    p.add_argument("--cp", type=_whole(1), default=1,
                   help="context-parallel degree: each sequence cut over cp ranks, its keys and values passed round a "
                   "ring (flash attention); the ranks number tp, cp, dp, pp (Megatron-Core's order)")  # fmt: skip
    p.add_argument("--micro-batch", type=_whole(1), default=1, help="sequences a micro-batch")
    p.add_argument("--global-batch", type=_whole(1), required=True, help="sequences a step")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v"], default="1f1b")
    p.add_argument(
        "--chunks",
        type=_whole(0),
        default=0,
        help="model chunks a stage: interleaved-1f1b's (default 2; zb-v has 2, the others 1)",
    )
    p.add_argument("--microbatch-group", type=_whole(0), default=0,
                   help="interleaved-1f1b: micro-batches through one chunk before the next, a multiple of pp "
                        "(default pp)")  # fmt: skip
    p.add_argument(
        "--recompute", choices=RECOMPUTE, default="none", help="activation recomputation: none, selective or full"
    )
    p.add_argument("--sequence-parallel", action="store_true", help="activations outside tp regions split over tp")
    p.add_argument(
        "--fp8", action="store_true", help="linear layers' products in 8-bit floating point (Transformer Engine's FP8)"
    )
    p.add_argument("--fp8-params", action="store_true",
                   help="with --fp8: the weights in 8 bits only (Transformer Engine's fp8_model_init)")  # fmt: skip
    p.add_argument("--embedding-layers", type=_whole(0), default=0,
                   help="the pipeline split counts each embedding as this many layers (DeepSpeed's "
                   "type:transformer|embedding: 1); the first and last stages hold that many fewer")  # fmt: skip
    p.add_argument("--balance", choices=["layers", "flops"], default=None,
                   help="the pipeline cut dtrain train makes (its --balance) of the embedding, blocks and head; "
                   "default: Megatron-LM's, L / pp blocks a stage")  # fmt: skip
    p.add_argument(
        "--placement",
        default="aware",
        choices=PLACEMENTS,
        help="aware (dtrain train's default rank order, tp-pp-dp), megatron (Megatron-LM's and DeepSpeed's, "
        "dtrain train's tp-dp-pp) or oblivious",
    )
    _add_step_config(p)
    p.add_argument("--synchronous-p2p", action="store_true",
                   help="each pipeline exchange holds both stages (Megatron-LM's synchronous sends)")  # fmt: skip
    p.add_argument(
        "--split-pipeline",
        action="store_true",
        help="each tp rank sends 1/tp of the activation to the next stage, which all-gathers it (Megatron-LM)",
    )
    p.add_argument(
        "--flow-limit",
        type=_flow_limit,
        default=DEFAULT_FLOW_LIMIT,
        help=f"messages a set of concurrent collectives may start before it is replayed in lock-step rounds "
        f"(faster, approximate); 'none': every message replayed (default {DEFAULT_FLOW_LIMIT})",
    )
    p.add_argument("--slow-rank", type=_slow_rank, action="append", default=[], help="RANK:FACTOR, a straggler")
    p.add_argument("--straggler-sigma", type=float, default=0.0, help="lognormal sigma of every rank's slowdown")
    p.add_argument("--links", type=_whole(0), default=8, help="busiest links to show")
    p.set_defaults(handler=_simulate_train)
    add_ps_parser(sub, parse_bytes)

    p = commands.add_parser("plan", help="rank dp/tp/pp/micro-batch layouts and placements by simulated step time")
    _add_topology(p)
    _add_model(p)
    p.add_argument(
        "--config",
        help="a `dtrain train` config: plan its model, sequence length and global batch (instead of --model and "
        "--global-batch)",
    )
    p.add_argument(
        "--write",
        metavar="TOML",
        help="with --config: write it with the fastest layout dtrain train runs, and the prediction in [plan]",
    )
    p.add_argument("--global-batch", type=_whole(1),
                   help="sequences a step (with --config: its [training] batch_size)")  # fmt: skip
    p.add_argument("--devices", type=int, help="devices to use (default: all; with --config: dp x tp x pp of it)")
    p.add_argument("--micro-batches", type=_ints, default=[1, 2, 4], help="micro-batch sizes to try, e.g. 1,2,4")
    p.add_argument("--zero", type=_ints, help="ZeRO stages to try, e.g. 0,1,2 (default 0,1; with --config 0,1,2,3)")
    p.add_argument(
        "--placements",
        type=_names,
        default=list(PLACEMENTS),
        help="rank orders to try among aware,megatron,oblivious (default all; with --config: aware and megatron, "
        "the two orders dtrain train's [parallel] rank_order places its ranks in)",
    )
    p.add_argument("--max-tp", type=int, help="largest tensor-parallel degree to try")
    p.add_argument("--cp", type=_ints, default=[1],
                   help="context-parallel degrees to try, e.g. 1,2,4 (default 1; with one above 1 every layout runs "
                   "flash attention; not with --config: dtrain train has no context parallelism)")  # fmt: skip
    p.add_argument(
        "--schedules",
        type=_schedules,
        default=None,
        help="pipeline schedules to try, e.g. 1f1b,zb-v (default 1f1b,interleaved-1f1b,zb-h1,zb-v; "
        "interleaved-1f1b and zb-v with 2 chunks a stage)",
    )
    p.add_argument(
        "--recompute",
        type=_recompute_modes,
        default=list(RECOMPUTE),
        help="activation recomputation modes to try, cheapest first: each layout takes the first that fits "
        "(default none,selective,full)",
    )
    _add_step_config(p)
    p.add_argument("--fp8", action="store_true",
                   help="every layout's linear layers in 8-bit floating point (Transformer Engine's FP8; Hopper and "
                        "later; not with --config: dtrain train has no FP8 layers)")  # fmt: skip
    p.add_argument("--fp8-params", action="store_true",
                   help="with --fp8: every layout's weights kept in 8 bits only")  # fmt: skip
    p.add_argument("--top", type=int, default=None, help=f"plans to show (default {DEFAULT_TOP}; not with --config, "
                   "which plans the fastest layout dtrain train runs)")  # fmt: skip
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="simulate every layout (default: skip those whose lower bound ranks them after the --top fastest, "
        "at least 5; the plans shown are the same; not with --config, which simulates every layout)",
    )
    p.set_defaults(handler=_plan)

    for parser in [*sub.choices.values(), p]:
        parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", required=True, help="a preset (dtrain topology show --help lists them) or a file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset parameter, e.g. racks=2")


def _add_model(p: argparse.ArgumentParser) -> None:
    # the presets are named where --model is read (dtrain.sim.model imports numpy and networkx: 0.4 s at every
    # start of `dtrain`, whatever its command, were they named here)
    p.add_argument(
        "--model",
        default=None,
        help=f"a preset of dtrain.sim.model (an unknown name lists them; default {DEFAULT_MODEL}), changed by the "
        "flags below",
    )
    p.add_argument("--params", type=parse_count, help="parameters, e.g. 7e9 or 7G")
    p.add_argument("--layers", type=_whole(1))
    p.add_argument("--hidden", type=_whole(1))
    p.add_argument("--heads", type=_whole(1))
    p.add_argument("--seq", type=_whole(1), help="sequence length in tokens")
    p.add_argument("--vocab", type=_whole(0),
                   help="vocabulary: the embedding, logits and loss are priced (default: none)")  # fmt: skip


def _add_software(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", help="a `dtrain bench calibrate` JSON file: its alpha, alpha_peer and gamma")
    p.add_argument("--alpha-us", type=float, default=0.0, help="host time to post a round (us)")
    p.add_argument("--alpha-peer-us", type=float, help="each further peer of a round (us; default: alpha)")
    p.add_argument("--flow-cap-gbyte-per-s", type=float, help="most one message reaches alone (GB/s)")


def _add_step_config(p: argparse.ArgumentParser) -> None:
    from dtrain.sim.compute import KERNELS
    from dtrain.sim.step import AMAX_REDUCTIONS

    p.add_argument(
        "--efficiency",
        type=float,
        help="price compute as FLOPs at this share of peak (default: each operation priced, dtrain.sim.compute)",
    )
    p.add_argument(
        "--curves",
        help="a `dtrain bench compute --write-curves` file of measured efficiency curves (default: the one shipped "
        "with dtrain)",
    )
    p.add_argument(
        "--tp-algorithm",
        default=None,
        help="the tensor-parallel all-reduce's algorithm (and, with --split-pipeline, the pipeline's all-gather's): "
        "ring (the default), nccl-ring or another dtrain.comm algorithm",
    )
    p.add_argument(
        "--dp-algorithm",
        default=None,
        help="nccl-ring (NCCL's rail-aligned rings, one a GPU of the group on each server; the default), or a "
        "dtrain.comm algorithm: ring, halving_doubling, hierarchical, ...",
    )
    p.add_argument("--no-overlap", action="store_true", help="never overlap the dp all-reduce with backward")
    p.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="sequence parallelism's all-gathers and reduce-scatters in pieces under the products beside them "
        "(Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers), on layouts with sequence parallelism",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="ZeRO stage 1 reduce-scatters the gradients (Megatron-Core's distributed optimizer)",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="the dp reduction (ZeRO 0 to 2's all-reduce or reduce-scatter) in buckets under the last backward, with "
        "a pipeline under each stage's last, per model chunk under interleaved 1F1B (Megatron-Core's "
        "--overlap-grad-reduce); ZeRO 3's collectives stay after backward",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="the distributed optimizer's weight all-gather under the next step's first forwards, per model chunk "
        "under interleaved 1F1B (Megatron-Core's --overlap-param-gather; needs --overlap-grad-reduce)",
    )
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="how a layer's element-wise work runs: fused (the default), megatron-lm (Megatron-LM's layer of "
        "2021-2022) or dtrain (dtrain.models' eager decoder under bf16 autocast: 32-bit residual stream and norms, "
        "casts, unfused RoPE and SwiGLU, 32-bit loss; the default of dtrain plan --config for a run not compiled)",
    )
    p.add_argument(
        "--attention-kernel",
        default=None,
        choices=ATTENTION_KERNELS,
        help="the fused attention kernel's family: cudnn (cuDNN's, Transformer Engine's choice on Hopper from v1.4, "
        "torch's own there), fa2 (FlashAttention-2) or fa1 (FlashAttention 1.x, priced from the FlashAttention-2 "
        "paper's figures); default: the family the device's curves measured",
    )
    p.add_argument(
        "--grad-accumulation-fusion",
        action="store_true",
        help="each weight-gradient product adds into the 32-bit gradient itself, no pass of its own (Megatron-LM's "
        "--gradient-accumulation-fusion)",
    )
    p.add_argument(
        "--ub-sm-margin",
        default="",
        metavar="NAME=SMS,...",
        help="with --tp-comm-overlap, userbuffers overlaps whose product leaves SMS multiprocessors to its "
        "communication kernel (a --tp-comm-overlap-cfg file's set_sm_margin: 1 entries, e.g. proj_fprop=24)",
    )
    p.add_argument(
        "--no-contention",
        action="store_true",
        help="overlapped communication costs the compute beside it nothing (default: priced from dtrain bench "
        "overlap's measurement where the device has one)",
    )
    p.add_argument(
        "--overlap-p2p-comm",
        action="store_true",
        help="interleaved 1F1B's pipeline sends and receives posted after each action and waited for before the "
        "next of its kind, under compute (Megatron-Core's overlap_p2p_comm); other schedules ignore it",
    )
    p.add_argument(
        "--amax-reduction",
        choices=AMAX_REDUCTIONS,
        default="none",
        help="with --fp8: synchronous prices Transformer Engine's amax all-reduce over each stage's tensor- and "
        "data-parallel ranks after every model chunk's forward and backward, on the compute stream (its default "
        "before NVTE_DP_AMAX_REDUCE_INTERVAL=0 NVTE_ASYNC_AMAX_REDUCTION=1); none (the default) leaves it out",
    )
    _add_software(p)


def _check_software(args: argparse.Namespace) -> None:
    """``--alpha-us``, ``--alpha-peer-us`` and ``--flow-cap-gbyte-per-s``, each named where it is out of range."""
    for flag, value in (("--alpha-us", args.alpha_us), ("--alpha-peer-us", args.alpha_peer_us)):
        if value is not None and not 0 <= value < math.inf:
            raise ValueError(f"{flag} {value}: host time in microseconds, a finite number >= 0")
    cap = args.flow_cap_gbyte_per_s
    if cap is not None and not 0 < cap < math.inf:
        raise ValueError(f"--flow-cap-gbyte-per-s {cap}: a rate in GB/s, a finite number above 0")
    beside = [flag for flag, value in (("--alpha-us", args.alpha_us), ("--alpha-peer-us", args.alpha_peer_us)) if value]
    if args.calibration and beside:
        raise ValueError(f"{', '.join(beside)}: not with --calibration, whose alpha and alpha_peer are taken")


def _software(args: argparse.Namespace):
    from dtrain.sim.collective import SoftwareCost

    _check_software(args)
    cap = args.flow_cap_gbyte_per_s
    if args.calibration:
        from dtrain.sim.api import software_cost_from_calibration

        cost = software_cost_from_calibration(args.calibration)
        return replace(cost, flow_cap_bytes_per_s=None if cap is None else cap * 1e9)
    return SoftwareCost(
        alpha_s=args.alpha_us * 1e-6,
        alpha_peer_s=None if args.alpha_peer_us is None else args.alpha_peer_us * 1e-6,
        flow_cap_bytes_per_s=None if cap is None else cap * 1e9,
    )


def _model(args: argparse.Namespace):
    from dtrain.sim.model import MODELS

    name = args.model or DEFAULT_MODEL
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or change one with --params ...)")
    changes = {"parameters": args.params, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
               "sequence": args.seq, "vocab": args.vocab}  # fmt: skip
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.params is not None and not args.params > 0:
        raise ValueError(f"--params {args.params:g}: a model holds more than 0 parameters")
    model = MODELS[name]
    if not changes:
        return model
    changed = replace(model, name=f"{model.name} (changed)", **changes)
    if args.params is None:  # a new shape holds what it holds: compute is priced from it, memory and MFU from P
        if changed.shape_parameters != model.shape_parameters:
            changed = replace(changed, parameters=model.parameters * changed.shape_parameters / model.shape_parameters)
        return changed
    ratio = args.params / changed.shape_parameters
    if not 2 / 3 <= ratio <= 3 / 2:
        raise ValueError(
            f"--params {args.params:.3g}: the shape (--layers {changed.layers}, --hidden {changed.hidden}, ffn "
            f"{changed.ffn}, vocabulary {changed.vocab}) holds {changed.shape_parameters:.3g}, and the simulator "
            "prices compute from the shape; give a shape that holds them (--layers, --hidden) or leave --params out"
        )
    return changed


def _topology(args: argparse.Namespace):
    from dtrain.cli.cluster_common import resolve_topology

    topo = resolve_topology(args.topology, args.set)
    topo.validate()
    return topo


def _simulate_collective(args: argparse.Namespace) -> int:
    from dtrain.comm.ir.schedule import Collective
    from dtrain.sim.api import algorithms_for, simulate_collective

    collectives = [c.value for c in Collective]
    if args.collective not in collectives:
        raise ValueError(f"--collective {args.collective}: unknown; accepted: {', '.join(collectives)}")
    if not args.bytes >= 1:
        raise ValueError(f"--bytes must be at least 1, got {args.bytes}")
    if args.ranks is not None and args.ranks < 2:
        raise ValueError(f"--ranks must be at least 2 (a collective of one rank moves nothing), got {args.ranks}")
    given = [
        flag
        for flag, value in (
            ("--alpha-us", args.alpha_us),
            ("--alpha-peer-us", args.alpha_peer_us),
            ("--flow-cap-gbyte-per-s", args.flow_cap_gbyte_per_s),
            ("--calibration", args.calibration),
        )
        if value
    ]
    if args.algorithm == "native" and given:
        raise ValueError(f"{', '.join(given)}: the software costs of our algorithms; native is NCCL's own collective, "
                         "priced by its own model (dtrain.sim.nccl)")  # fmt: skip
    _check_software(args)
    _check_schedule_flags(args)
    topo = _topology(args)
    placement = _collective_placement(args, topo, [d.name for d in topo.devices()])
    if len(placement) < 2:
        raise ValueError(
            f"--placement {args.placement}: a collective needs at least 2 ranks; it places {len(placement)}"
        )
    twice = sorted({d for d in placement if placement.count(d) > 1})
    if twice:
        raise ValueError(f"--placement names {', '.join(twice)} more than once: one rank a device")
    chosen = algorithms_for(args.collective) if args.algorithm == "all" else [args.algorithm]
    runs = []
    for algorithm in chosen:
        result = simulate_collective(
            topo, args.collective, algorithm, args.bytes, placement=placement, cost=_software(args),
            pipeline=args.pipeline, local_size=args.local_size,
        )  # fmt: skip
        runs.append({
            "algorithm": algorithm, "time_s": result.time_s, "algbw_gbyte_per_s": args.bytes / result.time_s / 1e9,
            "bottleneck": result.bottleneck.link.name if result.bottleneck else None,
            "links": link_rows(result.links, args.links),
        })  # fmt: skip
    runs.sort(key=lambda r: r["time_s"])
    head = {"topology": topo.name, "collective": args.collective, "ranks": len(placement), "bytes": args.bytes}
    check_finite(runs, "algorithms")  # a table shows no infinity either: the inputs are out of range
    if args.json:
        data = {**head, **runs[0]} if len(runs) == 1 else {**head, "algorithms": runs}
        _print_json(data)
        return 0
    from dtrain.cluster.report import print_table

    console = Console()
    if len(runs) > 1:
        table = Table(title=f"{args.collective} of {args.bytes:,} bytes on {len(placement)} ranks of {topo.name}")
        for column in ("algorithm", "time", "GB/s", "bottleneck"):
            table.add_column(column, justify="right" if column in ("time", "GB/s") else "left")
        for r in runs:
            table.add_row(r["algorithm"], _format("time_s", r["time_s"]), f"{r['algbw_gbyte_per_s']:.1f}",
                          r["bottleneck"] or "-")  # fmt: skip
        print_table(console, table)
        return 0
    r = runs[0]
    console.print(
        f"{args.collective}/{r['algorithm']} of {args.bytes:,} bytes on {len(placement)} ranks of {topo.name}: "
        f"[bold]{r['time_s'] * 1e3:.3f} ms[/bold] ({r['algbw_gbyte_per_s']:.1f} GB/s algorithm bandwidth); "
        f"bottleneck {r['bottleneck']}"
    )
    print_table(console, link_table(r["links"], "busiest links"))
    return 0


def _check_schedule_flags(args: argparse.Namespace) -> None:
    """``--local-size`` and ``--pipeline`` where the algorithm (one, not ``all``) would not use them: refused."""
    if args.algorithm == "all":
        return
    from dtrain.comm.ir.algorithms import build, needs_local_size

    if args.local_size is not None and (args.algorithm == "native" or not needs_local_size(args.algorithm)):
        raise ValueError(f"--local-size {args.local_size}: {args.algorithm} has no nodes to size (the hierarchical "
                         "algorithms take it)")  # fmt: skip
    if args.pipeline > 1:
        from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective

        collective, pipelined = Collective(args.collective), False
        if args.algorithm != "native":
            shape = {"root": 0 if collective in ROOTED_COLLECTIVES else None,
                     "local_size": 2 if needs_local_size(args.algorithm) else None}  # fmt: skip
            try:  # schedules of 4 ranks in nodes of 2, cut in 1 and in 2 pieces, say whether the algorithm cuts
                pipelined = build(collective, args.algorithm, 4, pipeline=2, **shape) != build(
                    collective, args.algorithm, 4, pipeline=1, **shape
                )
            except ValueError:
                return  # the algorithm itself is refused where the schedule is built, by name
        if not pipelined:
            raise ValueError(f"--pipeline {args.pipeline}: {args.collective}/{args.algorithm} does not cut its "
                             "buffer into pieces (ring broadcast and reduce, and linear scan, do)")  # fmt: skip


def _collective_placement(args: argparse.Namespace, topo, devices: list[str]) -> list[str]:
    ranks = args.ranks or len(devices)
    if ranks > len(devices) and args.placement in PLACEMENTS:
        raise ValueError(f"--ranks {ranks}: {topo.name} has {len(devices)} devices, one rank a device")
    if args.placement in PLACEMENTS:
        from dtrain.sim.model import Layout
        from dtrain.sim.placement import place

        return place(topo, Layout(dp=ranks, global_batch=ranks), args.placement)
    placement = _names(args.placement)
    unknown = [d for d in placement if d not in devices]
    if unknown:
        raise ValueError(
            f"--placement {args.placement}: {unknown[0]!r} is neither {', '.join(PLACEMENTS)} nor a device of "
            f"{topo.name} (such as {devices[0]})"
        )
    if args.ranks and len(placement) != args.ranks:
        raise ValueError(f"--placement names {len(placement)} devices but --ranks is {args.ranks}")
    return placement


TP_ALGORITHM = "ring"  # StepConfig.tp_algorithm's default
DP_ALGORITHM = "nccl-ring"  # StepConfig.dp_algorithm's default (dtrain.sim.traffic.NCCL_RING)


def _check_group_algorithms(args: argparse.Namespace) -> None:
    """``--tp-algorithm`` and ``--dp-algorithm``, each named where it is not an all-reduce algorithm."""
    from dtrain.sim.step import GROUP_ALGORITHMS

    for flag, algorithm in (("--tp-algorithm", args.tp_algorithm), ("--dp-algorithm", args.dp_algorithm)):
        if algorithm is not None and algorithm not in GROUP_ALGORITHMS:
            raise ValueError(f"{flag} {algorithm}: unknown; known: {', '.join(GROUP_ALGORITHMS)}")


def _check_runs(flag: str, algorithm: str | None, collectives, why: str) -> None:
    """``flag``'s ``algorithm`` (None: the default, which runs every collective) named where it has no schedule
    for one of ``collectives`` (:class:`dtrain.comm.ir.schedule.Collective` members) that ``why`` runs."""
    if algorithm is None or algorithm == DP_ALGORITHM:  # NCCL's rings run every collective
        return
    from dtrain.comm.ir.algorithms import names

    for collective in collectives:
        if algorithm not in names(collective):
            raise ValueError(f"{flag} {algorithm}: has no {collective.value}, which {why} runs; algorithms with one: "
                             f"{', '.join([DP_ALGORITHM, *names(collective)])}")  # fmt: skip


def _dp_collectives(zero: int, distributed_optimizer: bool):
    """The data-parallel collectives of ZeRO stage ``zero`` (:data:`dtrain.sim.traffic.ZERO_PHASES`)."""
    from dtrain.sim.traffic import ZERO_PHASES

    return ZERO_PHASES[2 if distributed_optimizer and zero == 1 else zero]


def _check_train_flags(args: argparse.Namespace) -> None:
    """The flags of ``simulate train`` that its layout would ignore, each refused by name before any simulation."""
    from dtrain.comm.ir.schedule import Collective

    if args.pp == 1:
        for flag, given in (("--split-pipeline", args.split_pipeline), ("--synchronous-p2p", args.synchronous_p2p),
                            ("--overlap-p2p-comm", args.overlap_p2p_comm), ("--balance", args.balance),
                            ("--embedding-layers", args.embedding_layers)):  # fmt: skip
            if given:
                raise ValueError(f"{flag}: needs a pipeline (--pp above 1); --pp 1 has no stages")
    if args.split_pipeline and args.tp == 1:
        raise ValueError("--split-pipeline: needs --tp above 1 (each tensor-parallel rank sends 1/tp of the "
                         "activation)")  # fmt: skip
    if args.synchronous_p2p and args.overlap_p2p_comm and args.schedule == "interleaved-1f1b":
        raise ValueError("--synchronous-p2p: not with --overlap-p2p-comm, whose overlapped exchanges take its place "
                         "under interleaved-1f1b")  # fmt: skip
    if args.tp_algorithm is not None and args.tp == 1:
        raise ValueError(f"--tp-algorithm {args.tp_algorithm}: no tensor-parallel group to run it (--tp 1)")
    if args.split_pipeline:
        _check_runs("--tp-algorithm", args.tp_algorithm, (Collective.ALL_GATHER,), "--split-pipeline")
    replicas = args.dp * args.cp  # the data-parallel group: dp x cp ranks (dtrain.sim.model.context_view)
    if replicas == 1:
        for flag, given in (("--dp-algorithm", args.dp_algorithm), ("--zero", args.zero),
                            ("--no-overlap", args.no_overlap), ("--overlap-grad-reduce", args.overlap_grad_reduce),
                            ("--distributed-optimizer", args.distributed_optimizer),
                            ("--overlap-param-gather", args.overlap_param_gather)):  # fmt: skip
            if given:
                raise ValueError(f"{flag}: no data-parallel group (--dp x --cp is 1) to reduce or shard over")
    else:
        optimizer = " with --distributed-optimizer" if args.distributed_optimizer else ""
        stages = f"ZeRO stage {args.zero}{optimizer}"
        _check_runs("--dp-algorithm", args.dp_algorithm, _dp_collectives(args.zero, args.distributed_optimizer),
                    stages)  # fmt: skip
    if args.no_overlap and (args.pp > 1 or args.zero or args.overlap_grad_reduce):
        raise ValueError("--no-overlap: the all-reduce overlaps backward only with --pp 1, --zero 0 and no "
                         "--overlap-grad-reduce; this layout does not overlap it")  # fmt: skip
    if args.attention_kernel is not None and not (args.kernels == "dtrain" or args.cp > 1):
        raise ValueError(f"--attention-kernel {args.attention_kernel}: the layout's attention is unfused "
                         "(Megatron-LM's); flash attention runs with --cp above 1 or --kernels dtrain")  # fmt: skip


def _step_config(args: argparse.Namespace, **extra):
    from dtrain.sim.step import StepConfig

    curves = None
    if args.curves:
        from dtrain.sim.compute import load_curves

        if not Path(args.curves).is_file():
            raise ValueError(f"--curves: {args.curves}: no such file")
        curves = load_curves(args.curves)
    margins = []
    for item in filter(None, (part.strip() for part in args.ub_sm_margin.split(","))):
        name, _, sms = item.partition("=")
        if not sms.isdigit():
            raise ValueError(f"--ub-sm-margin: {item!r} is not NAME=SMS (e.g. proj_fprop=24)")
        margins.append((name, int(sms)))
    if margins and not args.tp_comm_overlap:
        raise ValueError("--ub-sm-margin: needs --tp-comm-overlap (the margins are userbuffers overlaps')")
    if args.amax_reduction != "none" and not args.fp8:
        raise ValueError("--amax-reduction: needs --fp8 (the amaxes are FP8 layers')")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (Megatron-Core's requirement)")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency {args.efficiency}: a share of peak, above 0 and at most 1")
    _check_group_algorithms(args)
    return StepConfig(efficiency=args.efficiency, tp_algorithm=args.tp_algorithm or TP_ALGORITHM,
                      dp_algorithm=args.dp_algorithm or DP_ALGORITHM,
                      overlap_dp=not args.no_overlap, cost=_software(args), curves=curves,
                      tp_comm_overlap=args.tp_comm_overlap, distributed_optimizer=args.distributed_optimizer,
                      overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
                      overlap_p2p_comm=args.overlap_p2p_comm,
                      grad_accumulation_fusion=args.grad_accumulation_fusion, contention=not args.no_contention,
                      ub_sm_margin=tuple(margins), kernels=args.kernels or "fused",
                      amax_reduction=args.amax_reduction, attention_kernel=args.attention_kernel,
                      **extra)  # fmt: skip


def _simulate_train(args: argparse.Namespace) -> int:
    from dtrain.sim.model import Layout
    from dtrain.sim.placement import place
    from dtrain.sim.step import OVERLAP_GRAD_REDUCE_STAGES, simulate_step

    if args.tp_comm_overlap and not (args.sequence_parallel and args.tp > 1):
        raise ValueError("--tp-comm-overlap needs --sequence-parallel and --tp above 1 (Megatron-Core's requirement)")
    if args.fp8_params and not args.fp8:
        raise ValueError("--fp8-params: needs --fp8 (the weights in 8 bits are for FP8 linear layers)")
    if args.distributed_optimizer and args.zero != 1:
        raise ValueError(f"--distributed-optimizer: ZeRO stage 1's way to reduce (--zero 1), got --zero {args.zero}")
    if args.overlap_param_gather and not args.zero:
        raise ValueError("--overlap-param-gather: needs sharded weights to gather (--zero 1 or 2)")
    if args.overlap_grad_reduce and args.zero not in OVERLAP_GRAD_REDUCE_STAGES:
        raise ValueError("--overlap-grad-reduce: not with --zero 3, whose reduce-scatter and weight all-gathers the "
                         "simulator prices after backward (use --zero 0, 1 or 2)")  # fmt: skip
    _check_group_algorithms(args)
    _check_train_flags(args)
    if not 0 <= args.straggler_sigma < math.inf:
        raise ValueError(f"--straggler-sigma {args.straggler_sigma}: must be a finite number >= 0")
    for rank, factor in args.slow_rank:
        if rank < 0 or not 1 <= factor < math.inf:
            raise ValueError(f"--slow-rank {rank}:{factor:g}: a rank >= 0 and a finite factor >= 1 (a slower rank)")
    topo, model = _topology(args), _model(args)
    chunks = args.chunks or {"interleaved-1f1b": 2, "zb-v": 2}.get(args.schedule, 1)
    if args.kernels == "dtrain" and (args.fp8 or args.sequence_parallel or args.cp > 1):
        raise ValueError("--kernels dtrain: dtrain.models runs neither FP8 (--fp8), sequence parallelism "
                         "(--sequence-parallel) nor context parallelism (--cp)")  # fmt: skip
    if args.cp > 1 and model.sequence % (2 * args.cp):
        raise ValueError(f"--cp {args.cp}: a sequence of {model.sequence} tokens does not cut into 2 x cp = "
                         f"{2 * args.cp} equal pieces (a context-parallel rank takes one from each end)")  # fmt: skip
    flash = args.kernels == "dtrain" or args.cp > 1
    layout = Layout(dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch,
                    global_batch=args.global_batch, zero_stage=args.zero, schedule=args.schedule, chunks=chunks,
                    recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                    embedding_layers=args.embedding_layers, microbatch_group=args.microbatch_group, fp8=args.fp8,
                    fp8_params=args.fp8_params, balance=args.balance,
                    attention="flash" if flash else "unfused")  # fmt: skip
    layout.check(model)
    if layout.microbatches > MAX_MICROBATCHES:
        raise ValueError(
            f"--global-batch {args.global_batch}: {layout.microbatches:,} micro-batches a replica (global batch / "
            f"(dp x micro-batch)); at most {MAX_MICROBATCHES:,} are simulated (raise --micro-batch or --dp)"
        )
    config = _step_config(args, slowdown=dict(args.slow_rank), straggler_sigma=args.straggler_sigma,
                          split_pipeline=args.split_pipeline, flow_limit=args.flow_limit,
                          synchronous_p2p=args.synchronous_p2p)  # fmt: skip
    outside = sorted(rank for rank, _ in args.slow_rank if rank >= layout.world_size)
    if outside:
        raise ValueError(f"--slow-rank: rank {outside[0]} outside the layout's {layout.world_size} ranks")
    result = simulate_step(model, layout, topo, place(topo, layout, args.placement), config)
    data = {"topology": topo.name, "model": asdict(model), "layout": asdict(layout), "placement": args.placement,
            "split_pipeline": args.split_pipeline, "flow_limit": args.flow_limit, **_step_data(result),
            "links": link_rows(result.links, args.links)}  # fmt: skip
    check_finite(data)  # a table shows no infinity either: the inputs are out of range
    if args.json:
        _print_json(data)
        return 0
    from dtrain.cluster.report import print_table

    console = Console()
    console.print(f"{model.name} on {topo.name}, {layout.describe()}, {args.placement} placement")
    table = Table(title="one training step")
    table.add_column("part")
    table.add_column("value", justify="right")
    for key, value in _step_data(result).items():
        table.add_row(key, _format(key, value))
    print_table(console, table)
    if not result.fits:
        console.print(
            f"[red]does not fit: {result.memory.total / 1e9:.1f} GB a device against {result.memory_limit / 1e9:.1f} "
            "GB usable[/red] (try ZeRO with --zero, --recompute, more tp or pp, or a smaller micro-batch)"
        )
    print_table(console, link_table(data["links"], "links over the step"))
    return 0


def _step_data(r) -> dict:
    return {
        "step_s": r.step_s, "step_p95_s": r.step_p95_s, "tokens_per_s": r.tokens_per_s, "compute_s": r.compute_s,
        "pipeline_s": r.pipeline_s,
        "tp_comm_s": r.tp_s, "pp_message_s": r.pp_s, "dp_comm_s": r.dp_s,
        "dp_exposed_s": r.dp_exposed_s, "contention_s": r.contention_s, "optimizer_s": r.optimizer_s,
        "amax_s": r.amax_s, "cp_ring_s": r.cp_s,
        "bubble": r.bubble, "bubble_theory": r.bubble_theory, "memory_gb": r.memory.total / 1e9,
        "memory_limit_gb": r.memory_limit / 1e9,
        "fits": r.fits, "bottleneck": r.bottleneck.link.name if r.bottleneck else None,
    }  # fmt: skip


def _format(key: str, value) -> str:
    if isinstance(value, float) and key.endswith("_s") and not key.endswith("per_s"):
        return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"
    if key in ("bubble", "bubble_theory"):
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def _check_plan_flags(args: argparse.Namespace) -> None:
    """The planner's search flags, each named where it cannot be searched (before any layout is simulated)."""
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices: must be >= 1 (leave it out for every device), got {args.devices}")
    if not args.micro_batches or min(args.micro_batches) < 1:
        raise ValueError(f"--micro-batches: sizes must be >= 1, got {args.micro_batches}")
    if args.max_tp is not None and args.max_tp < 1:
        raise ValueError(f"--max-tp: must be >= 1, got {args.max_tp}")
    unknown = [p for p in args.placements if p not in PLACEMENTS]
    if not args.placements or unknown:
        raise ValueError(f"--placements: among {','.join(PLACEMENTS)}, got {','.join(args.placements) or 'nothing'}")
    if args.zero is not None and (not args.zero or any(z not in (0, 1, 2, 3) for z in args.zero)):
        raise ValueError(f"--zero: stages among 0, 1, 2 and 3, got {args.zero}")
    if not args.cp or min(args.cp) < 1:
        raise ValueError(f"--cp: context-parallel degrees must be >= 1, got {args.cp}")


def _check_plan_ignored(args: argparse.Namespace) -> None:
    """The step flags of ``plan`` that no layout of its search would use, each refused by name."""
    _check_group_algorithms(args)
    flash = args.config or args.kernels == "dtrain" or max(args.cp) > 1  # a run config's layouts: flash attention
    if args.attention_kernel is not None and not flash:
        raise ValueError(f"--attention-kernel {args.attention_kernel}: the layouts' attention is unfused "
                         "(Megatron-LM's); flash attention runs with --cp above 1, --kernels dtrain or "
                         "--config")  # fmt: skip
    schedules = [name for name, _ in args.schedules or []]
    if args.overlap_p2p_comm and schedules and "interleaved-1f1b" not in schedules:
        raise ValueError(f"--overlap-p2p-comm: interleaved-1f1b's exchanges, and --schedules {','.join(schedules)} "
                         "leaves it out")  # fmt: skip
    if args.tp_algorithm is not None and (args.max_tp == 1 or args.devices == 1):
        raise ValueError(f"--tp-algorithm {args.tp_algorithm}: no layout has a tensor-parallel group to run it "
                         f"({'--max-tp' if args.max_tp == 1 else '--devices'} 1)")  # fmt: skip
    zero = args.zero or ([0, 1, 2, 3] if args.config else [0, 1])
    for stage in sorted(set(zero)):
        stages = f"ZeRO stage {stage}" + (" with --distributed-optimizer" if args.distributed_optimizer else "")
        _check_runs("--dp-algorithm", args.dp_algorithm, _dp_collectives(stage, args.distributed_optimizer),
                    f"{stages} (--zero)")  # fmt: skip


def _plan(args: argparse.Namespace) -> int:
    _check_plan_flags(args)
    if args.write and not args.config:
        raise ValueError("--write: needs --config, the run config to write the chosen layout into")
    if args.write:
        from dtrain.cli.paths import check_file_out

        check_file_out("--write", args.write)
    if args.fp8 and args.config:
        raise ValueError("--fp8: not with --config (dtrain train runs no FP8 layers)")
    if max(args.cp) > 1 and args.config:
        raise ValueError("--cp: not with --config (dtrain train runs no context parallelism)")
    if max(args.cp) > 1 and args.kernels == "dtrain":
        raise ValueError("--cp: not with --kernels dtrain (dtrain.models runs no context parallelism)")
    if args.config:  # Megatron-Core's techniques dtrain train does not run: a plan priced with them would not hold
        for flag, given in (
            ("--tp-comm-overlap", args.tp_comm_overlap),
            ("--ub-sm-margin", args.ub_sm_margin),
            ("--distributed-optimizer", args.distributed_optimizer),
            ("--overlap-param-gather", args.overlap_param_gather),
            ("--overlap-p2p-comm", args.overlap_p2p_comm),
        ):
            if given:
                raise ValueError(f"{flag}: not with --config (dtrain train does not run it; its plan would not hold)")
        given = [flag for dest, flag in (*MODEL_FLAGS, ("top", "--top"), ("exhaustive", "--exhaustive"))
                 if getattr(args, dest) not in (None, False)]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: not with --config, which plans its own model and the fastest "
                             "layout dtrain train runs, every layout simulated")  # fmt: skip
    if args.fp8_params and not args.fp8:
        raise ValueError("--fp8-params: needs --fp8 (the weights in 8 bits are for FP8 linear layers)")
    if args.kernels == "dtrain" and args.fp8:
        raise ValueError("--kernels dtrain: dtrain.models runs no FP8 (--fp8)")
    _check_plan_ignored(args)
    if args.config:
        return _plan_run(args)
    if args.global_batch is None:
        raise ValueError("--global-batch: required (or --config, a run config that has the batch)")
    if args.global_batch > MAX_MICROBATCHES:
        raise ValueError(f"--global-batch {args.global_batch}: at most {MAX_MICROBATCHES:,} sequences a step are "
                         "searched (a replica runs up to that many micro-batches)")  # fmt: skip
    if args.zero is None:
        args.zero = [0, 1]
    from rich.progress import Progress

    from dtrain.sim.planner import sweep

    if args.top is None:
        args.top = DEFAULT_TOP
    if args.top < 1:
        raise ValueError(f"--top: plans to show must be >= 1, got {args.top}")
    topo, model = _topology(args), _model(args)
    if args.devices is not None and args.devices > len(topo.devices()):
        raise ValueError(f"--devices: {args.devices} but {topo.name} has {len(topo.devices())}")
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("simulating layouts", total=None)
        found = sweep(
            model, topo, global_batch=args.global_batch, devices=args.devices, placements=args.placements,
            config=_step_config(args), micro_batches=args.micro_batches, zero_stages=args.zero, max_tp=args.max_tp,
            recompute=args.recompute, fp8=args.fp8, fp8_params=args.fp8_params,
            **({"schedules": args.schedules} if args.schedules else {}),
            **({"attention": "flash", "sequence_parallel": False} if args.kernels == "dtrain" else {}),
            **({"attention": "flash", "context_parallel": args.cp} if max(args.cp) > 1 else {}),
            top=None if args.exhaustive else max(args.top, 5),
            progress=lambda done, total: progress.update(task, completed=done, total=total),
        )  # fmt: skip
    plans, dropped = found.plans, found.too_big
    rows = [
        {"layout": p.layout.describe(), "placement": p.placement, "mfu": p.mfu, **_step_data(p.result),
         "bottleneck_utilisation": p.result.bottleneck.utilisation if p.result.bottleneck else None}
        for p in plans[: args.top]
    ]  # fmt: skip
    check_finite(rows, "plans")  # a table shows no infinity either: the inputs are out of range
    if args.json:
        data = {"topology": topo.name, "model": asdict(model), "plans": rows, "too_big": dropped,
                "simulated": found.simulated, "bounded": found.bounded}  # fmt: skip
        _print_json(data)
        return 0
    from dtrain.cluster.report import print_table

    console = Console(width=max(Console().width, 110))
    bounded = f", {found.bounded} bounded out" if found.bounded else ""
    title = f"{model.name} on {topo.name}: fastest of {len(plans)} plans simulated ({dropped} too big{bounded})"
    table = Table(title=title)
    for column in ("#", "layout", "placement", "step", "tokens/s", "MFU", "GB", "bottleneck", "busy"):
        right = column in ("#", "step", "tokens/s", "MFU", "GB", "busy")
        table.add_column(column, justify="right" if right else "left", no_wrap=column != "bottleneck")
    for i, r in enumerate(rows, 1):
        busy = "" if r["bottleneck_utilisation"] is None else f"{r['bottleneck_utilisation']:.0%}"
        table.add_row(str(i), r["layout"], r["placement"], _format("step_s", r["step_s"]), f"{r['tokens_per_s']:,.0f}",
                      f"{r['mfu']:.0%}", f"{r['memory_gb']:.1f}", r["bottleneck"] or "-", busy)  # fmt: skip
    print_table(console, table)
    if not plans:
        console.print(
            "no layout fits device memory: try more devices, ZeRO (--zero 0,1,2,3), --recompute full or a smaller model"
        )
    return 0


def _plan_run(args: argparse.Namespace) -> int:
    """``dtrain plan --config RUN.toml [--write OUT.toml]``: the fastest layout of the run that dtrain train runs."""
    from dtrain.train.config import load_config
    from dtrain.train.plan import RUN_PLACEMENTS, plan_run, run_kernels

    config = load_config(args.config)
    par = config.parallel
    devices = args.devices or par.dp * par.tp * par.pp
    if args.global_batch is not None and args.global_batch != config.training.batch_size:
        raise ValueError(
            f"--global-batch: {args.global_batch} differs from {args.config}'s batch_size "
            f"{config.training.batch_size}; change the config (or leave --global-batch out)"
        )
    topo = _topology(args)
    if devices > len(topo.devices()):
        raise ValueError(f"--devices: {devices} but {topo.name} has {len(topo.devices())}")
    step_config = _step_config(args)
    if args.kernels is None:  # the run's own layer: dtrain.models' eager decoder, or compiled
        step_config = replace(step_config, kernels=run_kernels(config))
    planned = plan_run(
        config, topo, devices=devices, step_config=step_config, micro_batches=args.micro_batches,
        zero_stages=args.zero or [0, 1, 2, 3], placements=list(RUN_PLACEMENTS), recompute=args.recompute,
        max_tp=args.max_tp, schedules=args.schedules,
    )  # fmt: skip
    p, predicted = planned.plan, planned.config.plan
    if args.write:
        from dtrain.cli.paths import write_atomic

        write_atomic(args.write, planned.config.to_toml())
    data = {
        "topology": topo.name, "devices": devices, "layout": p.layout.describe(), "placement": p.placement,
        "mfu": p.mfu, **_step_data(p.result), "skipped": planned.skipped, "written": args.write,
    }  # fmt: skip
    if args.json:
        _print_json(data)
        return 0
    where = f"; written to {args.write}" if args.write else ""
    skipped = f" ({planned.skipped} faster plans dtrain train cannot run)" if planned.skipped else ""
    print(
        f"dtrain plan: {predicted.layout} on {devices} device(s) of {topo.name}: {predicted.step_s * 1e3:.4g} ms a "
        f"step, {predicted.tokens_per_s:,.0f} tokens/s, {predicted.memory_gib:.1f} GiB a device{skipped}{where}"
    )
    return 0
