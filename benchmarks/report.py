"""Usage: python benchmarks/report.py [--check] [--no-figures] [--out docs/results.md] [--figures docs/figures]

Writes docs/results.md, the results page, and its plots docs/figures/*.png from the raw measurements in
benchmarks/results/: every table and figure is computed here from those files, nothing is typed in by hand.
The page is deterministic (same files, same page); ``--check`` writes nothing and exits 1 if docs/results.md
differs from what this script would write (the plots are not compared: their bytes depend on matplotlib).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20
NCCL = "2.28.9"  # torch 2.11.0+cu130's NCCL, printed by ``benchmarks/gpu/run.sh OUT machine`` on every GPU host
SIZES = (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB)
SYMMETRIC = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
NAMES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "halving_doubling": "halving-doubling",
    "recursive_doubling": "recursive doubling",
}


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def median_abs(values: list[float]) -> float:
    return statistics.median(abs(v) for v in values)


def errors(values: list[float]) -> str:
    """Median and worst |error|, and the number of points."""
    if not values:
        return "-"
    return f"{median_abs(values):.1%} / {max(abs(v) for v in values):.0%} ({len(values)})"


def setting(machine: str, software: str, command: str, data: str) -> str:
    return f"Machine: {machine}. Software: {software}.\nCommand: `{command}`.\nData: {data}."


def gpu_software(records: list[dict]) -> str:
    torch_version = next((r["torch_version"] for r in records if r.get("torch_version")), "?")
    nccl = next((r["nccl"] for r in records if r.get("nccl")), NCCL)
    return f"torch {torch_version}, NCCL {nccl}, NVLink multicast off"


def card(records: list[dict]) -> str:
    name = next(r.get("device_name") or r.get("device") for r in records if r.get("device_name") or r.get("device"))
    return f"4 x {name}, NVLink through NVSwitch"


CPU = "this 2-core CPU machine (no GPU), Gloo, one thread a rank"


# ---------------------------------------------------------------------------------------------------- collectives


def _by(records: list[dict], *keys: str) -> dict:
    out: dict = {}
    for r in records:
        out[tuple(r[k] for k in keys)] = r
    return out


def captured_table(records: list[dict]) -> str:
    """NCCL's time over our fastest algorithm's, both captured; and NCCL's eager call over ``auto``'s."""
    by = _by(records, "collective", "algorithm", "nbytes")
    rows = []
    for coll in SYMMETRIC + ROOTED:
        cells = [NAMES.get(coll, coll)]
        for n in SIZES:
            native = by.get((coll, "native+graph", n))
            ours = [
                r
                for r in records
                if r["collective"] == coll
                and r["nbytes"] == n
                and r["algorithm"].endswith("+graph")
                and not r["algorithm"].startswith(("native", "auto"))
            ]
            if not native or not ours:
                cells.append("-")
                continue
            best = min(ours, key=lambda r: (r["time_us"], r["algorithm"]))
            cell = f"{native['time_us'] / best['time_us']:.2f}x ({best['algorithm'].removesuffix('+graph')})"
            auto, eager = by.get((coll, "auto", n)), by.get((coll, "native", n))
            if auto and eager:
                cell += f" / {eager['time_us'] / auto['time_us']:.2f}x"
            cells.append(cell)
        rows.append(cells)
    return table(["collective", *(size(n) for n in SIZES)], rows)


def busbw_table(records: list[dict], algorithms: list[str], collective: str = "all_reduce") -> str:
    """busbw GB/s per size and algorithm, each with its ratio to ``native`` of the same run."""
    by = _by([r for r in records if r["collective"] == collective], "algorithm", "nbytes")
    sizes = sorted({r["nbytes"] for r in records if r["collective"] == collective})
    rows = []
    for n in sizes:
        native = by.get(("native", n))
        cells = [size(n)]
        for a in algorithms:
            r = by.get((a, n))
            if r is None:
                cells.append("-")
            elif a == "native" or native is None:
                cells.append(f"{r['busbw_gbps']:.3g}")
            else:
                extra = f", {r['resolved_algorithm']}" if a == "auto" else ""
                cells.append(f"{r['busbw_gbps']:.3g} ({r['busbw_gbps'] / native['busbw_gbps']:.2f}x{extra})")
        rows.append(cells)
    return table(["size", *(NAMES.get(a, a) for a in algorithms)], rows)


def section_collectives() -> str:
    h100 = load("captured-symmetric-h100x4.jsonl") + load("captured-rooted-h100x4.jsonl")
    h200 = load("captured-symmetric-h200x4-run3.jsonl") + load("captured-rooted-h200x4-run3.jsonl")
    ar = load("all_reduce-h100x4.jsonl")
    cpu = load("all_reduce-cpu2.jsonl")
    cpu_small = load("all_reduce-small-cpu2.jsonl")
    parts = [
        "## Collectives",
        "Times are nccl-tests style: `iters` calls back to back between two synchronizations, the median of "
        "`trials` runs, the slowest rank. busbw = size / time x (2(n-1)/n for all-reduce, (n-1)/n for all-gather, "
        "reduce-scatter, all-to-all, gather and scatter, 1 for broadcast, reduce and scan); sizes are a rank's whole "
        "buffer. Ours and "
        "NCCL (or Gloo) run in the same command on the same machine.",
        "### Ours against NCCL, every collective (4 x H100 and 4 x H200)",
        "Each call captured whole as a CUDA graph and replayed (the devices' time, the API's Python out of the "
        "loop). A cell is NCCL's time over our fastest algorithm's (which one, in brackets), then NCCL's own call "
        "over `auto` on the default path (peer-memory transport, graph replays): above 1.00x ours is faster. These "
        "sweeps predate the one-pass kernels and `auto`'s present rules, which take `native` wherever nothing of ours "
        'measured faster; what the defaults give today is in "The defaults against NCCL" below.',
        "#### 4 x H100",
        setting(
            card(h100),
            gpu_software(h100),
            "benchmarks/gpu/run.sh OUT captured",
            "`captured-symmetric-h100x4.jsonl`, `captured-rooted-h100x4.jsonl`",
        ),
        captured_table(h100),
        "#### 4 x H200",
        setting(
            card(h200),
            gpu_software(h200),
            "benchmarks/gpu/run.sh OUT captured",
            "`captured-symmetric-h200x4-run3.jsonl`, `captured-rooted-h200x4-run3.jsonl` (runs 1, 2 and 4 are the "
            "simulator's other processes)",
        ),
        captured_table(h200),
        "![NCCL's time over ours, captured](figures/collectives-captured.png)",
        *_defaults_part(),
        *_defaults_beside_part("h100x4"),
        *_defaults_beside_part("h200x2"),
        *_defaults_beside_part("h200x4"),
        *_direct_broadcast_part(),
        *_reduce_one_pass_part(),
        *_gather_scatter_part(),
        *_rooted_one_pass_4_part(),
        *_direct_reduce_part(),
        *_wide_part(),
        *_one_pass_part(),
        "### All-reduce on the defaults (4 x H100)",
        "busbw GB/s, ratio to NCCL in brackets, for our schedules run a round at a time; the `auto` column ran a "
        "rules file naming the ring from 32 MiB and the cost model below it. The defaults `auto` follows now are in "
        "the table above.",
        setting(card(ar), gpu_software(ar), "benchmarks/gpu/run.sh OUT all-reduce", "`all_reduce-h100x4.jsonl`"),
        busbw_table(ar, ["native", "ring", "halving_doubling", "auto"]),
        "![all-reduce busbw, 4 x H100](figures/all_reduce-h100x4.png)",
        "### Ours against Gloo on the CPU",
        "4 Gloo ranks on 2 cores: every figure carries the scheduler's noise (10-30% between runs). busbw GB/s, "
        "ratio to Gloo (`native`) in brackets. A named algorithm runs over Gloo's point-to-point messages (the "
        "CPU's transport for our schedules); `auto` names the algorithm and the transport it took (`@peer`: the "
        "ranks' windows in /dev/shm).",
        setting(
            CPU,
            f"torch {cpu[0]['torch_version']}",
            "python -m dtrain bench comm --nproc 4 --collectives all_reduce --min-bytes 1M --max-bytes 64M "
            "--factor 2 --iters 3 --trials 3",
            "`all_reduce-cpu2.jsonl`",
        ),
        busbw_table(cpu, ["native", "auto", "ring", "halving_doubling", "recursive_doubling", "direct", "tree"]),
        "Below 1 MiB (`all_reduce-small-cpu2.jsonl`, same command with `--min-bytes 1K --max-bytes 256K --factor 4`):",
        busbw_table(cpu_small, ["native", "auto", "ring", "recursive_doubling", "direct", "tree"]),
        "![all-reduce busbw, CPU](figures/all_reduce-cpu2.png)",
        section_transports(),
        section_port(),
    ]
    return "\n\n".join(parts)


DEFAULT_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def _peer(got: dict) -> dict | None:
    """NCCL's record among one size's records by algorithm: torch.distributed's own call (``torch``) where the
    sweep timed it, else the same call through dtrain (``native``)."""
    return got.get("torch") or got.get("native")


def _ratio_cell(records: list[dict], coll: str, nbytes: int) -> str:
    got = {r["algorithm"]: r for r in records if r["collective"] == coll and r["nbytes"] == nbytes}
    if _peer(got) is None or "auto" not in got:
        return "-"
    auto = got["auto"]
    pick = auto.get("resolved_algorithm") or "?"
    cell = f"{_peer(got)['time_us'] / auto['time_us']:.2f}x"
    return cell if pick == "native" else f"{cell} ({pick})"


def _defaults_part() -> list[str]:
    """Every collective with the defaults (``auto``) beside NCCL's own call, same tensors and fresh ones."""
    parts = []
    for gpus in (4, 2):
        same, fresh = (
            load(f"collectives_defaults-h100x{gpus}.jsonl"),
            load(f"collectives_defaults_fresh-h100x{gpus}.jsonl"),
        )
        if not same:
            continue
        if not parts:
            noise = _same_call_spread(
                [load(f"collectives_defaults{k}-h100x{g}.jsonl") for g in (4, 2) for k in ("", "_fresh")]
            )
            parts += [
                "### The defaults against NCCL, every collective",
                "`comm.<collective>(x)` with no algorithm named (`auto`) beside torch.distributed's own NCCL call "
                "(`dist.all_reduce` etc., nothing of dtrain between: `--algorithms torch`), the two alternating in 5 "
                "rounds of 20 calls between two synchronizations, the slowest rank's time, the median round; "
                "float32. A cell is NCCL's time over ours (above 1.00x ours is faster), then, where `auto` ran one "
                "of ours, which. `fresh`: new input and output tensors every call, made before the timed loop. Where "
                "`auto` is `native` both columns make the same NCCL call (ours through the process group's binding, "
                f"`dtrain.comm.native.direct`), so their spread is the measurement's noise: {noise}. The 1 MiB to "
                "32 MiB tables below each predate the two-shot all-reduce and the scatter-allgather broadcast "
                "(`auto`'s all-reduce cells from 1 MiB and broadcast cells at 4 MiB there ran NCCL's own or torch's "
                "two-shot kernel); the two-shot table after each gives those with today's code. These sweeps also "
                "predate `native_wide`: from 16 MiB `auto` now runs the all-reduce, all-gather, reduce-scatter and "
                "all-to-all on NCCL's wide communicator, measured in \"NCCL's own call on its wide communicator\" "
                "below.",
            ]
        sizes = sorted({r["nbytes"] for r in same})
        header = ["size"] + [f"{c.replace('_', '-')} {kind}" for c in DEFAULT_COLLECTIVES for kind in ("", "fresh")]
        rows = [
            [size(n)] + [_ratio_cell(recs, c, n) for c in DEFAULT_COLLECTIVES for recs in (same, fresh)] for n in sizes
        ]
        name = f"collectives_defaults-h100x{gpus}.jsonl"
        parts += [
            f"#### {gpus} x H100" + (" (two GPUs of the 4-GPU host)" if gpus == 2 else ""),
            setting(
                card(same),
                gpu_software(same),
                ("NP=2 " if gpus == 2 else "") + "benchmarks/gpu/run.sh OUT defaults",
                f"`{name}`, `{name.replace('defaults', 'defaults_fresh')}`",
            ),
            table([h.strip() for h in header], rows),
        ]
        mid, mid_fresh = load(f"collectives_mid-h100x{gpus}.jsonl"), load(f"collectives_mid_fresh-h100x{gpus}.jsonl")
        if mid:
            mids = sorted({r["nbytes"] for r in mid})
            rows = [
                [size(n)] + [_ratio_cell(recs, c, n) for c in DEFAULT_COLLECTIVES for recs in (mid, mid_fresh)]
                for n in mids
            ]
            parts += [
                f"1 MiB to 32 MiB by factors of 2, with the exchange kernel's {256 // gpus} programs "
                f"(`kernels.exchange_programs`) and the bands they gave (`rules.built_in`):",
                setting(
                    card(mid),
                    gpu_software(mid),
                    ("NP=2 " if gpus == 2 else "")
                    + "DEFAULTS_MIN=1M DEFAULTS_MAX=32M DEFAULTS_FACTOR=2 benchmarks/gpu/run.sh OUT defaults",
                    f"`collectives_mid-h100x{gpus}.jsonl`, `collectives_mid_fresh-h100x{gpus}.jsonl`",
                ),
                table([h.strip() for h in header], rows),
            ]
        parts += _two_shot_part(gpus)
    return parts


def _defaults_beside_part(machine: str) -> list[str]:
    """The defaults sweep with fresh tensors timed in the same rounds as the same tensors (``--fresh-beside``), on
    ``machine`` (``h100x4``: 4 GPUs of a 4-GPU host; ``h200x2``: a 2-GPU host)."""
    records = load(f"collectives_defaults_beside-{machine}.jsonl")
    if not records:
        return []
    gpus = records[0]["world_size"]
    name = next(r.get("device_name") for r in records if r.get("device_name"))
    where = card(records) if gpus == 4 else f"{gpus} x {name} (one host)"
    title = f"{gpus} x {name.replace('NVIDIA ', '').split()[0]}"
    rows, apart, below, ours_below, cells = _beside_rows(records)
    other_path = f"collectives_defaults_beside-{machine}-run1.jsonl"
    other_launch = load(other_path) if (RESULTS / other_path).exists() else []
    other = ""
    if other_launch:
        was = {(r["collective"], r["nbytes"], r["algorithm"]): r for r in other_launch}
        drifts = {
            (c, n): was[c, n, "auto+fresh"]["time_us"] / was[c, n, "auto"]["time_us"]
            for n in sorted({r["nbytes"] for r in other_launch})
            for c in DEFAULT_COLLECTIVES
            if (c, n, "auto") in was and (c, n, "auto+fresh") in was
        }
        spread = [f"{c.replace('_', '-')} at {size(n)} ({d:.2f})" for (c, n), d in drifts.items() if abs(d - 1) > 0.10]
        low = min(
            was[c, n, "torch"]["time_us"] / was[c, n, "auto"]["time_us"]
            for (c, n, a) in was
            if a == "auto" and (c, n, "torch") in was
        )
        other = (
            f" Another launch of the same sweep on another lend of the same kind of machine "
            f"(`collectives_defaults_beside-{machine}-run1.jsonl`) had its lowest `auto` cell at "
            f"{low:.2f}x torch.distributed's call on the same tensors, and fresh apart from same by more than 10% at "
            + (", ".join(spread) if spread else "no size")
            + ": cells that agree in the launch above, so a spread of that launch's, not of the tensors."
        )
    return [
        f"#### Same and fresh tensors in one launch ({title})",
        "The sweeps above timed same and fresh tensors in separate launches. Here each name also runs on fresh "
        "tensors (`NAME+fresh`) in the same rounds as on the same ones, so the two differ by the tensors alone. "
        "A fresh run takes a set of tensors for each of its calls, within 1 GiB a rank (two sets at 256 MiB, one "
        "from 512 MiB), the same sets in its warm-up and in every round: only a set's first use is new to the "
        "process, and from 256 MiB every fresh call is on tensors the warm-up used. "
        "A cell is NCCL's time over ours, same tensors / fresh tensors, both against torch.distributed's own call on "
        f"the same kind of tensors. {below} of {cells} ratios are below 1.00x, "
        + (
            "all of them where `auto` makes NCCL's own call (its spread against torch.distributed's identical call)"
            if not ours_below
            else "among them where `auto` runs one of ours or NCCL's wide communicator: " + ", ".join(ours_below)
        )
        + ". Ours on fresh tensors is within 10% of ours on the same ones everywhere"
        + (" but " + ", ".join(apart) + " (fresh time over same)." if apart else ".")
        + other,
        setting(
            where,
            gpu_software(records),
            "benchmarks/gpu/run.sh OUT defaults-beside",
            f"`collectives_defaults_beside-{machine}.jsonl`",
        ),
        table(["size", *(c.replace("_", "-") for c in DEFAULT_COLLECTIVES)], rows),
        *_between_part(machine, records),
        *_small_all_reduce_part(machine),
    ]


def _beside_rows(records: list[dict]) -> tuple[list[list[str]], list[str], int, list[str], int]:
    """A fresh-beside sweep's table rows (NCCL's time over ours, same / fresh tensors, and what `auto` ran), the
    cells where fresh is apart from same by more than 10%, how many ratios are below 1.00x, those among them where
    `auto` ran one of ours, and the number of ratios."""
    by = {(r["collective"], r["nbytes"], r["algorithm"]): r for r in records}
    sizes = sorted({r["nbytes"] for r in records})
    rows, apart, below, ours_below = [], [], 0, []
    for n in sizes:
        row = [size(n)]
        for c in DEFAULT_COLLECTIVES:
            same, fresh = by[c, n, "auto"], by[c, n, "auto+fresh"]
            ratios = (
                by[c, n, "torch"]["time_us"] / same["time_us"],
                by[c, n, "torch+fresh"]["time_us"] / fresh["time_us"],
            )
            below += sum(x < 1.0 for x in ratios)
            if min(ratios) < 1.0 and (same.get("resolved_algorithm") or "?") != "native":
                ours_below.append(f"{c.replace('_', '-')} at {size(n)}")
            drift = fresh["time_us"] / same["time_us"]
            if abs(drift - 1) > 0.10:
                apart.append(f"{c.replace('_', '-')} at {size(n)} ({drift:.2f})")
            pick = same.get("resolved_algorithm") or "?"
            row.append(f"{ratios[0]:.2f}x / {ratios[1]:.2f}x" + ("" if pick == "native" else f" ({pick})"))
        rows.append(row)
    return rows, apart, below, ours_below, 2 * len(sizes) * len(DEFAULT_COLLECTIVES)


def _between_part(machine: str, grid: list[dict]) -> list[str]:
    """The same sweep at the sizes between the grid's (``collectives_defaults_beside_between-{machine}.jsonl``:
    every other power of two), so that every power of two from the grid's smallest size to its largest is timed."""
    path = f"collectives_defaults_beside_between-{machine}.jsonl"
    records = load(path) if (RESULTS / path).exists() else []
    if not records:
        return []
    rows, apart, below, ours_below, cells = _beside_rows(records)
    sizes = sorted({r["nbytes"] for r in records})
    low_ar = min(
        (r["vs_torch"], r["nbytes"])
        for r in records
        if r["collective"] == "all_reduce" and r["algorithm"] == "auto" and r["nbytes"] <= 256 * 1024
    )
    return [
        f"The sizes between, {size(sizes[0])} to {size(sizes[-1])} by factors of 4, in another launch "
        f"(`DEFAULTS_MIN={size(sizes[0]).replace(' KiB', 'K')} DEFAULTS_MAX={size(sizes[-1]).replace(' MiB', 'M')} "
        f"benchmarks/gpu/run.sh OUT defaults-beside`; `{path}`): {below} of {cells} ratios below 1.00x"
        + (
            f", {len(ours_below)} of them where `auto` runs one of ours or NCCL's wide communicator ("
            + ", ".join(ours_below)
            + ")"
            if ours_below
            else (", all where `auto` makes NCCL's own call" if below else "")
        )
        + "; fresh apart from same by more than 10% at "
        + (", ".join(apart) if apart else "no size")
        + f". The all-reduce's lowest cell up to 256 KiB is {low_ar[0]:.2f}x at {size(low_ar[1])}, on the same "
        f"tensors (torch.distributed's call {_time_us(records, 'torch', low_ar[1]):.0f} us, ours "
        f"{_time_us(records, 'auto', low_ar[1]):.0f} us).",
        table(["size", *(c.replace("_", "-") for c in DEFAULT_COLLECTIVES)], rows),
    ]


def _small_all_reduce_part(machine: str) -> list[str]:
    """The all-reduce from 8 to 256 KiB by factors of 2 in two more launches on another allocation of the machine
    (``all_reduce_small-run{1,2}-{machine}.jsonl``): the defaults against torch.distributed's call, same and fresh
    tensors."""
    names = [f"all_reduce_small-run{r}-{machine}.jsonl" for r in (1, 2)]
    runs = [load(name) for name in names if (RESULTS / name).exists()]
    if not runs:
        return []
    sizes = sorted({r["nbytes"] for r in runs[0]})
    rows = []
    for n in sizes:
        cells = []
        for records in runs:
            ratio = {r["algorithm"]: r["vs_torch"] for r in records if r["nbytes"] == n}
            cells.append(f"{ratio['auto']:.2f}x / {ratio['auto+fresh']:.2f}x")
        torch_us = [next(r["time_us"] for r in rec if (r["nbytes"], r["algorithm"]) == (n, "torch")) for rec in runs]
        rows.append([size(n), *cells, " / ".join(f"{t:.0f}" for t in torch_us)])
    low = min(r["vs_torch"] for rec in runs for r in rec if r["algorithm"] in ("auto", "auto+fresh"))
    return [
        f"The all-reduce from {size(sizes[0])} to {size(sizes[-1])} by factors of 2 on another allocation of the "
        "machine, two launches "
        f"(`dtrain bench comm --collectives all_reduce --algorithms torch,native,auto --min-bytes 8K --max-bytes "
        f"256K --factor 2 --iters 20 --trials 9 --warm-s 0.3 --fresh-beside`; `all_reduce_small-run{{1,2}}-"
        f"{machine}.jsonl`): ours over torch.distributed's call, same / fresh tensors, every cell at {low:.2f}x or "
        "more; the host was twice as slow in the second launch for both.",
        table(["size", "launch 1", "launch 2", "torch.distributed's call us, launch 1 / 2"], rows),
    ]


def _time_us(records: list[dict], algorithm: str, nbytes: int) -> float:
    """The all-reduce's time of ``algorithm`` at ``nbytes`` in a sweep's records."""
    return next(
        r["time_us"]
        for r in records
        if (r["collective"], r["nbytes"], r["algorithm"]) == ("all_reduce", nbytes, algorithm)
    )


def _probe_rows(path: str) -> dict[tuple[bool, int, str], tuple[float, float]]:
    """A direct-broadcast or direct-reduce probe's figures: (fresh, MiB, variant) -> (ratio to NCCL back to back,
    one call)."""
    text = (RESULTS / path).read_text() if (RESULTS / path).exists() else ""
    found, fresh = {}, False
    for line in text.splitlines():
        if line.startswith(("# direct-broadcast", "# direct-reduce")):
            fresh = "fresh True" in line
            continue
        m = re.match(
            r"\s*(\d+) MiB\s+(api ring|api auto|direct|bare copy\+add|bare piped|bare add|bare|nccl)\s.*?"
            r"([\d.]+)x nccl\s+one call\s+"
            r"[\d.]+ us\s+([\d.]+)x",
            line,
        )
        if m:
            found[fresh, int(m.group(1)), m.group(2)] = (float(m.group(3)), float(m.group(4)))
    return found


def _direct_broadcast_part() -> list[str]:
    """The ring broadcast as the direct chain (dtrain.comm.peer.direct) on 2 H200s: the probe's calls back to back
    and alone, and the sweep harness's few calls a run."""
    found = _probe_rows("probe-direct-broadcast-h200x2.txt")
    beside = load("broadcast_ring_beside-h200x2.jsonl")
    if not found or not beside:
        return []
    sizes = sorted({n for _, n, _ in found})
    rows = []
    for variant in ("api ring", "direct", "bare"):
        for fresh in (False, True):
            if not any((fresh, n, variant) in found for n in sizes):
                continue
            cells = [
                f"{found[fresh, n, variant][0]:.2f}x / {found[fresh, n, variant][1]:.2f}x"
                if (fresh, n, variant) in found
                else "-"
                for n in sizes
            ]
            rows.append([variant + (" fresh" if fresh else ""), *cells])
    by = {(r["nbytes"], r["algorithm"]): r for r in beside}
    harness = [
        f"{size(n)}: {by[n, 'ring']['vs_torch']:.2f}x / {by[n, 'ring+fresh']['vs_torch']:.2f}x fresh "
        f"({by[n, 'ring']['iters']} call{'s' if by[n, 'ring']['iters'] > 1 else ''} a run)"
        for n in sorted({r["nbytes"] for r in beside})
        if (n, "ring") in by and (n, "ring+fresh") in by
    ]
    return [
        "#### The ring broadcast as one copy between the callers' tensors (2 x H200)",
        '`comm.broadcast(x, root, algorithm="ring")` on the peer transport of CUDA tensors runs as the direct chain '
        "(`dtrain.comm.peer.direct`, docs/collectives.md): each rank copies the pieces straight out of its "
        "predecessor's tensor by a copy engine, the tensor's allocation named to it through a host mailbox and mapped "
        "once. A cell is NCCL's time over ours: calls back to back between two synchronizations / one call alone "
        "between two synchronizations; `api ring` through `comm.broadcast`, `direct` the chain without the API, "
        "`bare` one copy-engine copy into a tensor mapped once (no counters, no mailbox: the ceiling). Every result "
        "was checked from every root, and a recorded CUDA graph replayed on new data. Back to back the chain passes "
        "NCCL from 64 MiB; alone it starts later (the receiving rank waits on the host for its predecessor's post, "
        "then on the device for its counter), so it catches up only at the largest sizes, and how far depends on "
        "the host's speed at Python (these launches ran on one slower at it than the sweep's below). `auto` keeps "
        "NCCL's broadcast (docs/collectives.md says why); the chain runs where a caller names the ring.",
        setting(
            f"2 x {beside[0].get('device_name', 'NVIDIA H200')} (one host)",
            gpu_software(beside),
            "torchrun --nproc-per-node 2 benchmarks/collectives/probe.py direct-broadcast [--fresh]",
            "`probe-direct-broadcast-h200x2.txt`",
        ),
        table(["path", *(f"{n} MiB" for n in sizes)], rows),
        "In the sweep's harness (`dtrain bench comm --collectives broadcast --algorithms torch,native,ring "
        "--min-bytes 64M --max-bytes 1G --factor 4 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside`; "
        "`broadcast_ring_beside-h200x2.jsonl`), where fresh tensors beside the same ones cut a run to the calls "
        "whose tensors fit in 1 GiB, the ring against torch.distributed's call: " + "; ".join(harness) + ".",
        *_lone_part(),
        *_direct_broadcast_4_part(),
    ]


def _direct_broadcast_4_part() -> list[str]:
    """The same probe on 4 H200s, where the chain passes the buffer on three times."""
    found = _probe_rows("probe-direct-broadcast-h200x4.txt")
    if not found:
        return []
    sizes = sorted({n for _, n, _ in found})
    rows = [
        [
            variant + (" fresh" if fresh else ""),
            *(f"{found[fresh, n, variant][0]:.2f}x / {found[fresh, n, variant][1]:.2f}x" for n in sizes),
        ]
        for variant in ("api ring", "direct", "api auto")
        for fresh in (False, True)
        if all((fresh, n, variant) in found for n in sizes)
    ]
    ring = [found[f, n, "api ring"][0] for f in (False, True) for n in sizes if (f, n, "api ring") in found]
    return [
        "On 4 x H200 the chain passes the buffer on three times, each rank copying from its predecessor as the pieces "
        f"arrive, and NCCL's broadcast ran at 250-356 GB/s: back to back the chain reached {min(ring):.2f}-"
        f"{max(ring):.2f}x NCCL's speed from {sizes[0]} MiB to {sizes[-1]} MiB, so on 4 GPUs too `auto` keeps "
        "NCCL's broadcast (`api auto`).",
        setting(
            "4 x NVIDIA H200 (one host, NVLink through NVSwitch)",
            "torch 2.11.0+cu130, NCCL 2.28.9, NVLink multicast off",
            "torchrun --nproc-per-node 4 benchmarks/collectives/probe.py direct-broadcast [--fresh]",
            "`probe-direct-broadcast-h200x4.txt`",
        ),
        table(["path", *(f"{n} MiB" for n in sizes)], rows),
    ]


def _reduce_one_pass_part() -> list[str]:
    """The reduce in one pass (the exchange kernel's rooted form) and the reduce's defaults on 2 H200s."""
    one = load("reduce_one_pass-h200x2.jsonl")
    defaults = load("reduce_defaults-h200x2.jsonl")
    if not one or not defaults:
        return []

    def cells(rows, names):
        by = {(r["nbytes"], r["algorithm"]): r for r in rows}
        return [
            [size(n), *(f"{by[n, a]['vs_torch']:.2f}x" if (n, a) in by else "-" for a in names)]
            for n in sorted({r["nbytes"] for r in rows})
        ]

    return [
        "#### The reduce in one pass, and the reduce's defaults (2 x H200)",
        '`comm.reduce(x, root, algorithm="star")` on the peer transport of CUDA tensors, up to 8 MiB, runs as one '
        "kernel (`dtrain.comm.peer.kernels.exchange`, its rooted form): every rank copies its tensor into its "
        "window, the ranks pass one barrier on the signal pads, and the root sums the windows into its tensor "
        "(float32 accumulation); no other rank's tensor is written. Above 8 MiB the star runs a round at a time. "
        "A cell is torch.distributed's reduce over ours (`+fresh`: a new tensor every call); every result, a "
        "second call through the kept path and a CUDA graph replay were checked against torch.distributed's reduce "
        "on both ranks (sums, averages and maxima of float32 and bfloat16, every root), in a launch before each "
        "timed one. `auto` follows the built-in rule this table gave: the star to 8 MiB, NCCL's reduce above "
        "(the second table, another launch).",
        setting(
            f"2 x {one[0].get('device_name', 'NVIDIA H200')} (one host)",
            gpu_software(one),
            "torchrun --nproc-per-node 2 -m dtrain bench comm --collectives reduce --algorithms "
            "torch,native,star,auto --min-bytes 8K --max-bytes 32M --factor 2 --iters 20 --trials 5 --warm-s 0.3 "
            "--fresh-beside",
            "`reduce_one_pass-h200x2.jsonl`",
        ),
        table(["size", "star", "star+fresh"], cells(one, ("star", "star+fresh"))),
        "The defaults (`--algorithms torch,native,auto --min-bytes 8K --max-bytes 1G --factor 4`; "
        "`reduce_defaults-h200x2.jsonl`):",
        table(["size", "auto", "auto+fresh"], cells(defaults, ("auto", "auto+fresh"))),
    ]


def _gather_scatter_part() -> list[str]:
    """The gather and the scatter in one pass (the exchange kernel's rooted forms), and their defaults, on 2
    H200s."""
    one = load("gather_scatter_one_pass-h200x2.jsonl")
    defaults = load("gather_scatter_defaults-h200x2.jsonl")
    if not one or not defaults:
        return []

    def cells(rows, coll, names):
        by = {(r["nbytes"], r["algorithm"]): r for r in rows if r["collective"] == coll}
        return [
            [size(n), *(f"{by[n, a]['vs_native']:.2f}x" if (n, a) in by else "-" for a in names)]
            for n in sorted({n for n, _ in by})
        ]

    parts = [
        "#### The gather and the scatter in one pass (2 x H200)",
        "torch.distributed's gather and scatter on NCCL are point-to-point messages in a group, about 60-130 us a "
        'call whatever the size up to 32 MiB here. `comm.gather(out, x, root, algorithm="star")` runs up to 8 MiB a '
        "rank as one kernel: every rank copies its input into its window, one barrier, the root reads every window "
        'into its output; `comm.scatter(out, x, root, algorithm="star")` up to 8 MiB of the root\'s input: the root '
        "copies its input into its window, one barrier, every rank reads its block. A cell is `native` (NCCL's call "
        "through dtrain: torch.distributed's, then the gather's blocks copied into one output) over ours, sizes the "
        "gather's output and the scatter's input, same and fresh tensors. Every result, every root and dtype "
        "(float32, bfloat16, int64) and a second call through the kept path were checked against the expected "
        "blocks in a launch before the timed one. `auto` follows the rules these gave (the second table, another "
        "launch): the star to the one pass's 8 MiB a rank put in (the gather's output to 16 MiB, the scatter's "
        "input to 8 MiB; above, the star runs a round at a time: the first table's last rows), NCCL's above.",
        setting(
            f"2 x {one[0].get('device_name', 'NVIDIA H200')} (one host)",
            gpu_software(one),
            "torchrun --nproc-per-node 2 -m dtrain bench comm --collectives gather,scatter --algorithms native,star "
            "--min-bytes 8K --max-bytes 32M --factor 2 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside",
            "`gather_scatter_one_pass-h200x2.jsonl`",
        ),
    ]
    for coll in ("gather", "scatter"):
        parts += [
            f"{coll.capitalize()}:",
            table(["size", "star", "star+fresh"], cells(one, coll, ("star", "star+fresh"))),
        ]
    parts.append(
        "The defaults (`--algorithms native,auto --min-bytes 8K --max-bytes 1G --factor 4`; "
        "`gather_scatter_defaults-h200x2.jsonl`):"
    )
    for coll in ("gather", "scatter"):
        parts += [
            f"{coll.capitalize()}:",
            table(["size", "auto", "auto+fresh"], cells(defaults, coll, ("auto", "auto+fresh"))),
        ]
    return parts


def _rooted_one_pass_4_part() -> list[str]:
    """The reduce, the gather and the scatter in one pass on 4 H200s, beside NCCL's (the band `auto` takes)."""
    reduce = load("reduce_one_pass-h200x4.jsonl")
    rooted = load("gather_scatter_one_pass-h200x4.jsonl")
    if not reduce or not rooted:
        return []
    sizes = sorted({r["nbytes"] for r in reduce} | {r["nbytes"] for r in rooted})

    def cell(rows, coll, base, n):
        by = {(r["nbytes"], r["algorithm"]): r for r in rows if r["collective"] == coll}
        if (n, "star") not in by:
            return "-"
        same = by[n, base]["time_us"] / by[n, "star"]["time_us"]
        fresh = by[n, base + "+fresh"]["time_us"] / by[n, "star+fresh"]["time_us"]
        return f"{same:.2f}x / {fresh:.2f}x"

    rows = [
        [
            size(n),
            cell(reduce, "reduce", "torch", n),
            cell(rooted, "gather", "native", n),
            cell(rooted, "scatter", "native", n),
        ]
        for n in sizes
    ]
    return [
        "#### The reduce, the gather and the scatter in one pass (4 x H200)",
        "The rooted forms of the exchange kernel above on 4 GPUs. A cell is NCCL's time over the star's, same tensors "
        "/ fresh tensors: for the reduce torch.distributed's call, for the gather and the scatter `native` (NCCL's "
        "point-to-point messages through dtrain, as above); sizes the reduce's tensor, the gather's output and the "
        "scatter's input. The reduce's root reads three windows through its one NVLink port, which binds from 4 MiB; "
        "the built-in rules give `auto` the star where it led here (the reduce to 2 MiB, the gather to 32 MiB of "
        "output, the scatter to 8 MiB) and NCCL's call above. `dtrain bench verify` on the same machine checked "
        f"every form against NCCL's result (`verify-h200x4.txt`: {_verified('verify-h200x4.txt')}).",
        setting(
            "4 x NVIDIA H200 (one host, NVLink through NVSwitch)",
            gpu_software(reduce),
            "torchrun --nproc-per-node 4 -m dtrain bench comm --collectives reduce --algorithms torch,native,star,auto "
            "(and --collectives gather,scatter --algorithms native,star,auto) --min-bytes 8K --max-bytes 32M "
            "--factor 2 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside",
            "`reduce_one_pass-h200x4.jsonl`, `gather_scatter_one_pass-h200x4.jsonl`",
        ),
        table(["size", "reduce", "gather", "scatter"], rows),
    ]


def _verified(path: str) -> str:
    """How many of a `dtrain bench verify` output's checks passed: "N of M ok"."""
    lines = (RESULTS / path).read_text().splitlines() if (RESULTS / path).exists() else []
    checks = [line for line in lines if re.match(r"(ok|fail|mismatch)\b", line, re.IGNORECASE)]
    return f"{sum(line.startswith('ok') for line in checks)} of {len(checks)} ok"


def _direct_reduce_part() -> list[str]:
    """The ring reduce as the direct chain (dtrain.comm.peer.direct) on 2 H200s beside NCCL's reduce, and the
    defaults' reduce in the sweep's harness."""
    found = _probe_rows("probe-direct-reduce-h200x2.txt")
    beside = load("reduce_beside-h200x2.jsonl")
    if not found or not beside:
        return []
    sizes = sorted({n for _, n, _ in found})
    rows = []
    for variant in ("api ring", "direct", "api auto", "bare add", "bare copy+add", "bare piped"):
        for fresh in (False, True):
            if not any((fresh, n, variant) in found for n in sizes) or (fresh and variant.startswith("bare")):
                continue  # the bare paths' tensors are the same whatever --fresh says
            cells = [
                f"{found[fresh, n, variant][0]:.2f}x / {found[fresh, n, variant][1]:.2f}x"
                if (fresh, n, variant) in found
                else "-"
                for n in sizes
            ]
            rows.append([variant + (" fresh" if fresh else ""), *cells])
    by = {(r["nbytes"], r["algorithm"]): r for r in beside}
    names = ("ring", "ring+fresh")
    sweep = [
        [size(n), *(f"{by[n, a]['vs_torch']:.2f}x" if (n, a) in by else "-" for a in names)]
        for n in sorted({r["nbytes"] for r in beside})
    ]
    return [
        "#### The ring reduce between the callers' tensors (2 x H200)",
        '`comm.reduce(x, root, algorithm="ring")` on the peer transport of CUDA tensors runs as the direct chain '
        "the other way (docs/collectives.md): the root's one elementwise kernel reads the other rank's tensor "
        "through a CUDA IPC mapping and adds it into its own. A cell is NCCL's time over ours, bf16: calls back to "
        "back / one call alone between two synchronizations; `api ring` through `comm.reduce`, `direct` the chain "
        "without the API, `api auto` the defaults (NCCL's reduce on the caller's tensor), and the root's bare ways "
        "to combine a tensor mapped once, without counters: `bare add` (the kernel reading the peer), `bare "
        "copy+add` (a copy-engine copy into a local buffer, then the add) and `bare piped` (the same in 8 pieces, "
        "copies and adds overlapped on two streams). Every result was checked from every root, the other rank's "
        "tensor as it was, and a recorded CUDA graph replayed on new data. The chain trails the bare add by its "
        "counters (about 24 us a call from 64 MiB), so it stays under NCCL's reduce, and `auto` keeps NCCL's. "
        "With each post's offset and size checked against the mapping the driver reports, `dtrain bench verify` on "
        f"2 x H200 checked every form against NCCL's result (`verify-h200x2.txt`: {_verified('verify-h200x2.txt')}; "
        "float32 data within a relative 1e-5, int32, int8, uint8 and bool data exactly).",
        setting(
            f"2 x {beside[0].get('device_name', 'NVIDIA H200')} (one host)",
            gpu_software(beside),
            "torchrun --nproc-per-node 2 benchmarks/collectives/probe.py direct-reduce [--fresh]",
            "`probe-direct-reduce-h200x2.txt`",
        ),
        table(["path", *(f"{n} MiB" for n in sizes)], rows),
        "In the sweep's harness (`dtrain bench comm --collectives reduce --algorithms torch,native,auto,ring "
        "--min-bytes 8K --max-bytes 1G --factor 4 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside`; "
        "`reduce_beside-h200x2.jsonl`), torch.distributed's reduce over the ring's (`+fresh`: a new tensor every "
        "call); below 16 MiB the chain's host path (a post and a take on the host, every call) sets its pace:",
        table(["size", *names], sweep),
    ]


def _spread(found: dict, name: str, base: str) -> str:
    """The range over sizes of what ``name`` adds to ``base``'s lone call, in microseconds."""
    added = [found[name][n][0] - found[base][n][0] for n in found[name] if n in found[base]]
    return f"{min(added):.0f}-{max(added):.0f} us"


def _lone_part() -> list[str]:
    """Where one broadcast alone between two synchronizations spends its time (the probe's ``--lone``)."""
    path = RESULTS / "probe-direct-broadcast-lone-h200x2.txt"
    if not path.exists():
        return []
    found: dict[str, dict[int, tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(\d+) MiB\s+lone\s+(.+?)\s+([\d.]+) us\s+([\d.]+)x nccl", line)
        if m:
            found.setdefault(m.group(2), {})[int(m.group(1))] = (float(m.group(3)), float(m.group(4)))
    if not found:
        return []
    sizes = sorted({n for cells in found.values() for n in cells})
    rows = [
        [name, *(f"{cells[n][0]:.0f} us ({cells[n][1]:.2f}x)" if n in cells else "-" for n in sizes)]
        for name, cells in found.items()
    ]
    return [
        "Where a lone call's time goes (`--lone`, one call between two synchronizations, the median of 15, NCCL's "
        "time over each in brackets): the bare copy pushed or pulled; the pull behind the chain's device handshake "
        "alone (the root raises a counter the receiver's stream waits on, the receiver raises one the root's waits "
        "on; no mailbox); the chain with its host mailbox; and `comm.broadcast`. Added by each, from 16 MiB to 1 "
        f"GiB: the counters {_spread(found, 'pull + counters', 'bare pull')}, the host's post and take "
        f"{_spread(found, 'chain', 'pull + counters')}, the API's path {_spread(found, 'api ring', 'chain')}.",
        setting(
            "2 x NVIDIA H200 (one host)",
            gpu_software(load("broadcast_ring_beside-h200x2.jsonl")),
            "torchrun --nproc-per-node 2 benchmarks/collectives/probe.py direct-broadcast --lone "
            "--sizes 16,64,256,1024",
            "`probe-direct-broadcast-lone-h200x2.txt`",
        ),
        table(["path", *(f"{n} MiB" for n in sizes)], rows),
    ]


def _wide_part() -> list[str]:
    """The defaults from 4 MiB, same and fresh tensors, where ``auto`` runs NCCL's own collective on the group's
    wide communicator (``native_wide``), on 4 and 2 GPUs (``collectives_wide-h100x{4,2}.jsonl``)."""
    runs = {g: load(f"collectives_wide-h100x{g}.jsonl") for g in (4, 2)}
    if not all(runs.values()):
        return []
    rows, wide = [], []
    for g, records in runs.items():
        by = {(r["collective"], r["nbytes"], r["algorithm"]): r for r in records}
        for n in sorted({r["nbytes"] for r in records}):
            row = [f"{g} GPUs", size(n)]
            for c in DEFAULT_COLLECTIVES:
                same, fresh = by[c, n, "auto"], by[c, n, "auto+fresh"]
                ratios = (
                    by[c, n, "torch"]["time_us"] / same["time_us"],
                    by[c, n, "torch+fresh"]["time_us"] / fresh["time_us"],
                )
                pick = same.get("resolved_algorithm") or "?"
                if pick == "native_wide":
                    wide.extend(ratios)
                row.append(f"{ratios[0]:.2f}x / {ratios[1]:.2f}x" + ("" if pick == "native" else f" ({pick})"))
            rows.append(row)
    return [
        "#### NCCL's own call on its wide communicator (4 and 2 x H100)",
        "From 16 MiB `auto` runs the all-reduce, all-gather, reduce-scatter and all-to-all as NCCL's own collective "
        "on the group's wide communicator (`native_wide`: 64 CTAs, docs/collectives.md), the broadcast on the "
        "group's own. NCCL's time over ours, same tensors / fresh tensors, against torch.distributed's own call on "
        f"the default communicator, in one launch a GPU count: the `native_wide` cells at {min(wide):.2f}-"
        f"{max(wide):.2f}x. The wide communicator's NCCL buffers take 3.4 GiB a GPU on 4 GPUs and 1.9 GiB on 2 "
        "(`probe-nccl-wide-h100x{4,2}.txt`, which also checks the results against torch.distributed's).",
        setting(
            card(runs[4]),
            gpu_software(runs[4]),
            "NP=4|2 benchmarks/gpu/run.sh OUT large-beside",
            "`collectives_wide-h100x4.jsonl`, `collectives_wide-h100x2.jsonl`",
        ),
        table(["GPUs", "size", *(c.replace("_", "-") for c in DEFAULT_COLLECTIVES)], rows),
    ]


#: The two-shot sweep's columns: (collective, algorithm, fresh), NCCL's time over that algorithm's.
_TWO_SHOT_COLUMNS = (
    ("all_reduce", "one_shot", False),
    ("all_reduce", "direct", False),
    ("all_reduce", "auto", False),
    ("all_reduce", "auto", True),
    ("broadcast", "star", False),
    ("broadcast", "scatter_allgather", False),
    ("broadcast", "auto", False),
    ("broadcast", "auto", True),
)


def _two_shot_part(gpus: int) -> list[str]:
    """The all-reduce's one-shot and two-shot kernels and the broadcast's star and scatter-allgather, each named,
    beside ``auto`` and NCCL's own call, 512 KiB-32 MiB (``two_shot{,_fresh}-h100x{gpus}.jsonl``)."""
    same, fresh = load(f"two_shot-h100x{gpus}.jsonl"), load(f"two_shot_fresh-h100x{gpus}.jsonl")
    if not same:
        return []

    def cell(records: list[dict], coll: str, algorithm: str, nbytes: int) -> str:
        got = {r["algorithm"]: r for r in records if r["collective"] == coll and r["nbytes"] == nbytes}
        if _peer(got) is None or algorithm not in got:
            return "-"
        ours = got[algorithm]
        text = f"{_peer(got)['time_us'] / ours['time_us']:.2f}x"
        pick = ours.get("resolved_algorithm") or "?"
        return f"{text} ({pick})" if algorithm == "auto" and pick != "native" else text

    header = ["size"] + [
        f"{c.replace('_', '-')} {a.replace('_', '-')}" + (" fresh" if f else "") for c, a, f in _TWO_SHOT_COLUMNS
    ]
    rows = [
        [size(n)] + [cell(fresh if f else same, c, a, n) for c, a, f in _TWO_SHOT_COLUMNS]
        for n in sorted({r["nbytes"] for r in same})
    ]
    name = f"two_shot-h100x{gpus}.jsonl"
    return [
        "The all-reduce's exchange-kernel forms (`one_shot`; `direct`, the two-shot: a reduce-scatter, a second "
        "barrier, an all-gather, one kernel) and the broadcast's (`star`; `scatter_allgather`: the root's buffer "
        "scattered over the other ranks, a second barrier, a direct all-gather among them), each named, and `auto` "
        "with today's bands (`rules.built_in`), beside torch.distributed's own call in one launch, 512 KiB to 32 MiB "
        "by factors of 2 (this table's all-reduce and broadcast cells supersede the tables above where they "
        "overlap). The two-shot runs 256 programs; a launch with 64 on 4 GPUs and 128 on 2 is in "
        f"`two_shot_fewer_programs{{,_fresh}}-h100x{gpus}.jsonl`:",
        setting(
            card(same),
            gpu_software(same),
            f"ONE_PASS_NP={gpus} TWO_SHOT_MIN=512K TWO_SHOT_MAX=32M benchmarks/gpu/run.sh OUT two-shot",
            f"`{name}`, `{name.replace('two_shot', 'two_shot_fresh')}`",
        ),
        table(header, rows),
    ]


def _same_call_spread(runs: list[list[dict]]) -> str:
    """How far apart two timings of the same NCCL call come out: the cells of the defaults tables where ``auto``
    ran ``native``, as their range and the middle 80 %."""
    ratios = []
    for records in runs:
        got = {(r["collective"], r["nbytes"], r["algorithm"]): r for r in records}
        for (coll, n, algorithm), r in got.items():
            native = got.get((coll, n, "torch")) or got.get((coll, n, "native"))
            if algorithm == "auto" and r.get("resolved_algorithm") == "native" and native:
                ratios.append(native["time_us"] / r["time_us"])
    if not ratios:
        return "no such cells"
    ratios.sort()
    low, high = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10]
    return (
        f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x over {len(ratios)} cells, {low:.2f}-{high:.2f}x for the middle 80 %, "
        f"median {statistics.median(ratios):.2f}x"
    )


ONE_PASS_PATHS = (
    ("all_gather", "direct"),
    ("reduce_scatter", "direct"),
    ("all_to_all", "direct"),
    ("broadcast", "star"),
)


def _one_pass_part() -> list[str]:
    """The one-pass collectives, each one kernel, beside NCCL, same and fresh tensors, on 4 and 2 GPUs."""
    parts = []
    for gpus in (4, 2):
        same, fresh = load(f"one_pass-h200x{gpus}.jsonl"), load(f"one_pass_fresh-h200x{gpus}.jsonl")
        if not same:
            continue
        if not parts:
            parts += [
                "### One pass over symmetric memory against NCCL",
                "The one-round schedules (`direct` all-gather, reduce-scatter and all-to-all, `star` broadcast) run "
                "as one kernel, `dtrain.comm.peer.kernels.exchange`: each rank copies its input into its window, "
                "passes one barrier on the signal pads and reads what it needs from the peers' windows (the "
                "reduce-scatter sums its block in float32), launched straight from the compiled kernel; up to 8 MiB "
                "a rank, a round at a time above. Timed as the defaults above, beside torch.distributed's own call. "
                "A cell is NCCL's time over the one pass's, then `auto`'s in brackets where the built-in rules send "
                "it to the one pass. `dtrain bench verify` with these paths: `verify_one_pass-h200x4.txt`.",
            ]
        rows = []
        for n in sorted({r["nbytes"] for r in same}):
            cells = [size(n)]
            for coll, path in ONE_PASS_PATHS:
                for records in (same, fresh):
                    got = {r["algorithm"]: r for r in records if r["collective"] == coll and r["nbytes"] == n}
                    peer = _peer(got)
                    if peer is None or path not in got:
                        cells.append("-")
                        continue
                    cell = f"{peer['time_us'] / got[path]['time_us']:.2f}x"
                    auto = got.get("auto")
                    if auto and auto.get("resolved_algorithm") == path:
                        cell += f" ({peer['time_us'] / auto['time_us']:.2f}x)"
                    cells.append(cell)
            rows.append(cells)
        header = ["size"] + [
            f"{c.replace('_', '-')} {kind}".strip() for c, _ in ONE_PASS_PATHS for kind in ("", "fresh")
        ]
        parts += [
            f"#### {gpus} x H200" + (" (two GPUs of the 4-GPU host)" if gpus == 2 else ""),
            setting(
                card(same),
                gpu_software(same),
                'ONE_PASS_NP="4 2" ONE_PASS_MAX=16M benchmarks/gpu/run.sh OUT one-pass',
                f"`one_pass-h200x{gpus}.jsonl`, `one_pass_fresh-h200x{gpus}.jsonl`",
            ),
            table(header, rows),
        ]
    return parts + _one_pass_gather_part() + _one_shot_part()


def _one_pass_gather_part() -> list[str]:
    """The one-kernel all-gather and all-to-all on 4 H100s, beside NCCL."""
    same, fresh = load("one_pass_gather-h100x4.jsonl"), load("one_pass_gather_fresh-h100x4.jsonl")
    if not same:
        return []
    rows = []
    for n in sorted({r["nbytes"] for r in same}):
        cells = [size(n)]
        for coll in ("all_gather", "all_to_all"):
            for records in (same, fresh):
                got = {r["algorithm"]: r for r in records if r["collective"] == coll and r["nbytes"] == n}
                peer, ours = _peer(got), got.get("direct")
                cells.append(
                    f"{peer['time_us'] / ours['time_us']:.2f}x ({ours['time_us']:.0f} us)" if peer and ours else "-"
                )
        rows.append(cells)
    return [
        "#### All-gather and all-to-all on 4 x H100",
        "The same kernel for these two on H100s, in a launch of its own: NCCL's time over the one pass's, the "
        "one pass's time per call in brackets.",
        setting(
            card(same),
            gpu_software(same),
            "ONE_PASS_NP=4 benchmarks/gpu/run.sh OUT one-pass-gather",
            "`one_pass_gather-h100x4.jsonl`, `one_pass_gather_fresh-h100x4.jsonl`",
        ),
        table(["size", "all-gather", "all-gather fresh", "all-to-all", "all-to-all fresh"], rows),
    ]


def _one_shot_part() -> list[str]:
    """The all-reduce's one-shot forms beside NCCL: the exchange kernel's and torch's two-shot kernel."""
    runs = {g: (load(f"one_shot_ar-h100x{g}.jsonl"), load(f"one_shot_ar_fresh-h100x{g}.jsonl")) for g in (4, 2)}
    if not runs[4][0]:
        return []
    rows = []
    for n in sorted({r["nbytes"] for r in runs[4][0]}):
        cells = [size(n)]
        for g in (4, 2):
            for records in runs[g]:
                got = {r["algorithm"]: r for r in records if r["collective"] == "all_reduce" and r["nbytes"] == n}
                peer = _peer(got)
                for path in ("one_shot", "direct"):
                    cells.append(f"{peer['time_us'] / got[path]['time_us']:.2f}x" if peer and path in got else "-")
        rows.append(cells)
    header = ["size"] + [f"{g} GPUs{f} {p}" for g in (4, 2) for f in ("", " fresh") for p in ("one-shot", "two-shot")]
    return [
        "#### The all-reduce in one kernel (4 and 2 x H100)",
        "`one_shot`: up to 256 KiB the exchange kernel's all-reduce form (each rank copies in, one barrier, each "
        "sums every peer's window in float32), above it torch's one-shot kernel; `direct`: torch's two-shot "
        "kernel, measured before the exchange kernel's two-shot form (the two-shot tables above); beside "
        "torch.distributed's own call: NCCL's time over ours. `auto`'s bands are in the two-shot tables.",
        setting(
            card(runs[4][0]),
            gpu_software(runs[4][0]),
            'ONE_PASS_NP="4 2" benchmarks/gpu/run.sh OUT one-shot-ar',
            "`one_shot_ar{,_fresh}-h100x{4,2}.jsonl`",
        ),
        table(header, rows),
    ]


def section_transports() -> str:
    runs = {t: load(f"transport-{t}-h200x4.jsonl") for t in ("nvlink", "shm", "socket")}
    sizes = sorted({r["nbytes"] for r in runs["nvlink"]})
    rows = []
    for n in sizes:
        cells = [size(n)]
        for records in runs.values():
            by = _by(records, "algorithm", "nbytes")
            for a in ("native", "ring"):
                r = by.get((a, n))
                cells.append(f"{r['busbw_gbps']:.3g}" if r else "-")
        rows.append(cells)
    header = ["size"] + [f"{t} {a}" for t in runs for a in ("NCCL", "ring")]
    return "\n\n".join(
        [
            "### Transports: NVLink, host shared memory, sockets (4 x H200)",
            "All-reduce busbw GB/s, NCCL's own and our ring on the point-to-point transport, over NVLink, with "
            "`NCCL_P2P_DISABLE=1` (host shared memory) and with `NCCL_SHM_DISABLE=1` as well (sockets).",
            setting(
                card(runs["nvlink"]),
                gpu_software(runs["nvlink"]),
                "benchmarks/gpu/run.sh OUT transports",
                "`transport-{nvlink,shm,socket}-h200x4.jsonl`",
            ),
            table(header, rows),
        ]
    )


def section_port() -> str:
    records = load("port-h100x4-run1.jsonl") + load("port-h100x4-run2.jsonl")
    chain = load("port-chain-h100x4.jsonl")
    flows = sorted({r["flow_bytes"] for r in records})
    patterns = list(dict.fromkeys(r["pattern"] for r in records))
    rows = []
    for p in patterns:
        cells = [p]
        for n in flows:
            v = sorted(r["port_gbps"] for r in records if r["pattern"] == p and r["flow_bytes"] == n)
            cells.append("-" if not v else f"{v[0]:.0f}" if v[0] == v[-1] else f"{v[0]:.0f}-{v[-1]:.0f}")
        rows.append(cells)
    chain_flows = sorted({r["flow_bytes"] for r in chain})
    chain_rows = [
        [p]
        + [
            next((f"{r['port_gbps']:.0f}" for r in chain if r["pattern"] == p and r["flow_bytes"] == n), "-")
            for n in chain_flows
        ]
        for p in dict.fromkeys(r["pattern"] for r in chain)
    ]
    return "\n\n".join(
        [
            "### How transfers share one GPU's NVLink port (4 x H100)",
            "One round: a device barrier, then each taking part rank's pass through peer memory. GB/s through the "
            "busiest port, the barrier alone subtracted; the range over two runs of one launch. These are the "
            "simulator's port and fan-in figures.",
            setting(
                card(records),
                gpu_software(load("captured-symmetric-h100x4.jsonl")),
                "benchmarks/gpu/run.sh OUT probe-port",
                "`port-h100x4-run1.jsonl`, `port-h100x4-run2.jsonl`",
            ),
            table(["pattern", *(f"{size(n)} flow" for n in flows)], rows),
            "The chain broadcast's rounds (`benchmarks/gpu/run.sh OUT probe-port-chain`, `port-chain-h100x4.jsonl`):",
            table(["pattern", *(f"{size(n)} flow" for n in chain_flows)], chain_rows),
        ]
    )


# ------------------------------------------------------------------------------------------------------- training


def _dp_ceiling() -> str:
    """What ``local`` (no communication) reached over every 4 x H100 launch on file, the host's enqueue time of one
    GPU's step from the profile, and the launches with NCCL's CTAs capped."""
    launches = ["dp_vs_ddp-h100x4-b16.jsonl", "dp_vs_ddp-h100x4-b32.jsonl", "dp_profile-h100x4.jsonl"]
    launches += [f"dp_vs_ddp-nccl_max_ctas{c}-h100x4-b{b}.jsonl" for c in (4, 16) for b in (16, 32)]
    launches += [f"dp_vs_ddp-graphs-h100x4-b{b}.jsonl" for b in (16, 32)]
    local: dict[int, list[float]] = {16: [], 32: []}
    for name in launches:
        rows = load(name)
        one = {r["batch_per_rank"]: r["step_s"] for r in rows if r["variant"] == "single"}
        for r in rows:
            if r["variant"] == "local" and r["batch_per_rank"] in one:
                local[r["batch_per_rank"]].append(one[r["batch_per_rank"]] / r["step_s"])
    profile = (RESULTS / "dp_profile-h100x4.txt").read_text()
    found = re.search(r"single-1ranks-b16: .*enqueues a step in ([\d.]+) ms of its ([\d.]+) ms", profile)
    enqueue = f"{found.group(1)} ms to enqueue a step that runs {found.group(2)} ms" if found else "(no profile)"
    capped = []
    for c in (4, 16):
        rows = load(f"dp_vs_ddp-nccl_max_ctas{c}-h100x4-b32.jsonl")
        eff = {r["variant"]: r.get("scaling_efficiency") for r in rows}
        capped.append(f"{c} CTAs: ours {eff['ours-auto']:.1%}, DDP {eff['ddp']:.1%}")

    def span(values: list[float]) -> str:
        low, high = f"{min(values):.1%}", f"{max(values):.1%}"
        return low if low == high else f"{low[:-1]}-{high}"

    return (
        "`local` is what four processes on this host reach with no data parallelism at all, the ceiling for any: "
        f"{span(local[32])} with 32 sequences a GPU and {span(local[16])} with 16, over {len(local[16])} launches. "
        f"With 16 the step is bound by the host: unprofiled, one GPU's process takes {enqueue}, so whatever a "
        "process adds on the host (the gradient hooks and launches of DDP and of ours) lengthens the step, and four "
        "processes drift out of phase at each reduction (`benchmarks/gpu/run.sh OUT dp-profile`: host enqueue "
        "time, device busy, compute, NCCL and its exposed part, per variant: `dp_profile-h100x4.txt`). NCCL's CTAs "
        "capped (`NCCL_MAX_CTAS`, every variant; `dp_vs_ddp-nccl_max_ctas{4,16}-h100x4-b{16,32}.jsonl`) gave no "
        f"better scaling with 32 sequences: {'; '.join(capped)}."
    )


def _dp_recorded() -> str:
    """What the recorded step's launches add: the optimizer recorded too, NCCL's CTAs capped, and the profile."""

    def times(name: str) -> dict[str, float]:
        return {r["variant"]: r["step_s"] * 1e3 for r in load(name)}

    whole = {b: times(f"dp_vs_ddp-graph_whole-h100x4-b{b}.jsonl") for b in (16, 32)}
    rows = [
        [
            f"{b}",
            *(f"{whole[b][v]:.2f}" for v in ("single-graph", "ours-graph", "single-graph-whole", "ours-graph-whole")),
        ]
        for b in (16, 32)
    ]
    ctas = []
    for c in ("default", "16", "8", "4", "2"):
        t = times(f"dp_vs_ddp-graphs-nccl_max_ctas_{c}-h100x4-b16.jsonl")
        ctas.append(
            [c, f"{t['ours-graph']:.2f}", f"{t['single-graph']:.2f}", f"{t['single-graph'] / t['ours-graph']:.1%}"]
        )
    profile = (RESULTS / "dp_profile-graphs-h100x4.txt").read_text()
    spans = {
        name: re.search(
            rf"^{name}-\d+ranks-b16: span ([\d.]+) ms, busy [\d.]+, compute ([\d.]+), comm [\d.]+ "
            rf"\(exposed ([\d.]+)\)",
            profile,
            re.M,
        )
        for name in ("local-graph", "ours-graph")
    }
    if all(spans.values()):
        local, ours = spans["local-graph"], spans["ours-graph"]
        where = (
            f"Under the profiler (`dp_profile-graphs-h100x4.txt`, 16 sequences a GPU) a recorded step of ours spans "
            f"{ours.group(1)} ms against {local.group(1)} ms with no communication: compute takes {ours.group(2)} ms "
            f"against {local.group(2)} (the gradient all-reduce runs beside it and slows it), and {ours.group(3)} ms "
            "of the all-reduce is left exposed after backward."
        )
    else:
        where = "(no profile)"
    return "\n\n".join(
        [
            "### A step recorded whole",
            "`-graph` variants record forward, loss and backward (with ours, the bucket all-reduces that run inside "
            "backward) as one CUDA graph at the third step (`dtrain.parallel.step_graph.GraphedStep`; "
            "`[parallel] step_graph` in `dtrain train`) and replay it; AdamW steps eagerly after each replay. Their "
            "scaling is taken against one GPU run the same way (`single-graph`), and beside it against the eager "
            "one. The host then enqueues a step in about 4 ms of its 27-29 ms, and four processes with no "
            "communication (`local-graph`) reach 99.5-99.8% of one GPU.",
            where,
            "With the optimizer recorded too (a capturable AdamW; ours steps it inside backward, every bucket's "
            "parameters but the last's while the last bucket is reduced) the step is slower on one GPU and the gap "
            "does not close (`dp_vs_ddp-graph_whole-h100x4-b{16,32}.jsonl`, step ms):",
            table(["sequences a GPU", "single-graph", "ours-graph", "single-graph-whole", "ours-graph-whole"], rows),
            "NCCL's CTAs capped (`NCCL_MAX_CTAS`, every variant; `dp_vs_ddp-graphs-nccl_max_ctas_*-h100x4-b16.jsonl`): "
            "fewer CTAs leave more of the reduction exposed, and no cap gains:",
            table(["NCCL_MAX_CTAS", "ours-graph ms", "single-graph ms", "scaling"], ctas),
            "NCCL's protocol forced (`NCCL_PROTO`, every variant, another launch; "
            "`dp_vs_ddp-graphs-nccl_proto_*-h100x4-b16.jsonl`): ours-graph "
            + ", ".join(
                f"{t['ours-graph']:.2f} ms ({name})"
                for name, t in (
                    (name, times(f"dp_vs_ddp-graphs-nccl_proto_{key}-h100x4-b16.jsonl"))
                    for name, key in (("NCCL's choice", "default"), ("Simple", "simple"), ("LL128", "ll128"))
                )
            )
            + ": the protocol is not what slows the products.",
            _train_recorded(),
            *_dp_copy_engine(),
            *_dp_overlap_whole(),
        ]
    )


def _dp_copy_engine() -> list[str]:
    """`DataParallel(exchange="copy-engine")` beside NCCL's all-reduce, recorded and eager, and its profile."""
    files = {b: load(f"dp_copy_engine-h100x4-b{b}.jsonl") for b in (16, 32)}
    if not all(files.values()):
        return []
    streams = {b: load(f"dp_copy_engine_peer_streams-h100x4-b{b}.jsonl") for b in (16, 32)}
    rows = []
    for b in (16, 32):
        t = {r["variant"]: r for r in files[b]}
        one = t["single-graph"]["step_s"]
        per_peer = {r["variant"]: r["step_s"] for r in streams[b]}
        rows.append(
            [
                str(b),
                f"{t['single-graph']['step_s'] * 1e3:.2f}",
                f"{t['local-graph']['step_s'] * 1e3:.2f}",
                *(
                    f"{t[v]['step_s'] * 1e3:.2f} ({one / t[v]['step_s']:.1%})"
                    for v in ("ours-graph", "ours-copy-engine-graph")
                ),
                f"{per_peer['ours-copy-engine-graph'] * 1e3:.2f}" if "ours-copy-engine-graph" in per_peer else "-",
                f"{t['ours-auto']['step_s'] * 1e3:.2f}",
                f"{t['ours-copy-engine']['step_s'] * 1e3:.2f}",
                f"{max(t['ours-copy-engine-graph']['max_abs_param_diff_vs_ddp'], 0):.1e}",
            ]
        )
    profile = (RESULTS / "dp_copy_engine_profile-h100x4-b16.txt").read_text()
    pattern = (
        r"^{}-\d+ranks-b16: span ([\d.]+) ms, busy [\d.]+, compute ([\d.]+), comm ([\d.]+) "
        r"\(exposed ([\d.]+)\)"
    )
    found = {
        v: re.search(pattern.format(v), profile, re.M) for v in ("local-graph", "ours-graph", "ours-copy-engine-graph")
    }
    where = ""
    if all(found.values()):
        local, nccl, ce = (found[v] for v in ("local-graph", "ours-graph", "ours-copy-engine-graph"))
        where = (
            f"Under the profiler (`dp_copy_engine_profile-h100x4-b16.txt`, 16 sequences a GPU, AdamW's eager step "
            f"in the span) the model's kernels and the summing pass take {ce.group(2)} ms a step with the copy "
            f"engines, against {nccl.group(2)} ms beside NCCL's kernels and {local.group(2)} ms with no "
            f"communication; the peer copies run {ce.group(3)} ms, {ce.group(4)} ms of them while no kernel runs."
        )
    return [
        "#### Buckets moved by copy engines",
        '`DataParallel(exchange="copy-engine")` (`[parallel] dp_exchange`): from the second step the buckets live '
        "in each rank's peer window; each is scattered in pieces by copy engines, summed by one pass where its piece "
        "lives, and the averaged pieces pushed straight into the peers' buckets, all on one stream a rank "
        "(`dtrain.comm.peer.bucket_reduce`). Step ms (scaling against `single-graph`), the same launch; `per-peer "
        "streams` is the same exchange with each peer's copies on a stream of their own, another launch "
        "(`dp_copy_engine_peer_streams-h100x4-b{16,32}.jsonl`); the last column is the largest parameter "
        "difference from DDP after the run (bf16 autocast).",
        setting(
            "4 x NVIDIA H100 80GB HBM3, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}, NVLink multicast off",
            "torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections dp --sizes 4 1 --batch-per-rank "
            "16|32 --graphs --variants ours-graph ours-copy-engine-graph ours-copy-engine ours-auto local-graph "
            "single-graph",
            "`dp_copy_engine-h100x4-b16.jsonl`, `dp_copy_engine-h100x4-b32.jsonl`",
        ),
        table(
            [
                "sequences a GPU",
                "single-graph",
                "local-graph",
                "ours-graph (NCCL)",
                "ours-copy-engine-graph",
                "per-peer streams",
                "ours-auto (eager)",
                "ours-copy-engine (eager)",
                "param diff vs DDP",
            ],
            rows,
        ),
        where,
    ]


def _dp_overlap_whole() -> list[str]:
    """The recorded step with AdamW inside it, stepped by `overlap_optimizer` while the last bucket moves, beside
    the recorded step alone, for both of AdamW's implementations; scaling against the faster one-GPU recording."""
    runs = [(o, b, load(f"dp_overlap_whole-{o}-h100x4-b{b}.jsonl")) for o in ("foreach", "fused") for b in (16, 32)]
    again = load("dp_overlap_whole-fused-h100x4-b16-run2.jsonl")
    if not all(r for _, _, r in runs):
        return []
    rows = []
    for optimizer, b, records in [*runs, ("fused (again)", 16, again)] if again else runs:
        t = {r["variant"]: r["step_s"] for r in records}
        one = min(t["single-graph"], t["single-graph-whole"])
        diff = max(r["max_abs_param_diff_vs_ddp"] or 0 for r in records)
        rows.append(
            [
                optimizer,
                str(b),
                f"{t['single-graph'] * 1e3:.2f}",
                f"{t['single-graph-whole'] * 1e3:.2f}",
                *(
                    f"{t[v] * 1e3:.2f} ({one / t[v]:.1%})"
                    for v in ("ours-graph", "ours-copy-engine-graph", "ours-copy-engine-graph-whole")
                ),
                f"{t['ddp'] * 1e3:.2f}",
                f"{t['ddp'] / t['ours-copy-engine-graph-whole']:.2f}x",
                f"{diff:.1e}",
            ]
        )
    return [
        "#### The optimizer inside the recorded step, beside the last bucket",
        "`ours-copy-engine-graph-whole`: the copy-engine exchange, with a capturable AdamW stepped inside the "
        "recorded step by `DataParallel.overlap_optimizer` (every bucket's parameters but the last's while the last "
        "bucket, the 100 MB embedding gradient, is still moving, then the last's). `single-graph-whole` is one GPU "
        "with its AdamW recorded too. Step ms; the percentages are scaling against the faster one-GPU recording of "
        "the same optimizer; DDP runs eagerly, with the same optimizer. `foreach` is torch's multi-tensor AdamW "
        "(its default), `fused` its one-kernel AdamW (what `dtrain train` uses on GPUs); each row is one launch.",
        setting(
            "4 x NVIDIA H100 80GB HBM3, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}, NVLink multicast off",
            "torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections dp --sizes 4 1 --batch-per-rank "
            "16|32 --graphs --optimizer foreach|fused --variants single-graph single-graph-whole ours-graph "
            "ours-copy-engine-graph ours-copy-engine-graph-whole local-graph-whole",
            "`dp_overlap_whole-{foreach,fused}-h100x4-b{16,32}.jsonl`, `dp_overlap_whole-fused-h100x4-b16-run2.jsonl`",
        ),
        table(
            [
                "AdamW",
                "sequences a GPU",
                "single-graph",
                "single-graph-whole",
                "ours-graph (NCCL)",
                "ours-copy-engine-graph",
                "ours-copy-engine-graph-whole",
                "DDP (eager)",
                "whole vs DDP",
                "param diff vs DDP",
            ],
            rows,
        ),
    ]


def _train_recorded() -> str:
    """`dtrain train` with and without ``step_graph`` (dp 4, one GPU, dp 2 x pp 2), and tp 2 x pp 2 over both
    pipeline transports: losses and step times."""

    def steps(name: str) -> list[dict]:
        return [r for r in load(name) if "loss" in r and "step" in r]

    def worst(a: list[dict], b: list[dict]) -> float:
        return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))

    def last_ms(runs: list[dict]) -> float:
        return statistics.median(r["step_s"] for r in runs[-10:]) * 1e3

    rows = []
    for layout, name in (("dp4", "dp 4"), ("dp1", "1 GPU"), ("dp2pp2", "dp 2 x pp 2")):
        eager, recorded = (steps(f"train_step_graph-{layout}-{v}-h100x4.jsonl") for v in ("eager", "graph"))
        diff = worst(eager, recorded)
        memory = [f"{runs[-1]['peak_memory_gib']:.3f}" for runs in (eager, recorded)]
        rows.append(
            [name, str(len(recorded)), f"{diff:g}", f"{last_ms(eager):.2f}", f"{last_ms(recorded):.2f}", *memory]
        )
    peer, group = (steps(f"train_tp2pp2-{v}-h100x4.jsonl") for v in ("peer", "group"))
    return "\n\n".join(
        [
            "`dtrain train`, the tiny Llama of `configs/tiny-cpu.toml` in bf16, 30 steps, with and without "
            "`--step-graph` (`python -m dtrain train --nproc N --config configs/tiny-cpu.toml --dp N --pp 1 --steps "
            "30 --precision bf16 --no-tensorboard --no-export [--step-graph]`; at dp 2 x pp 2 `--dp 2 --pp 2 "
            "--microbatches 4 --pipeline-transport peer`; `train_step_graph-{dp4,dp1,dp2pp2}-{eager,graph}-h100x4"
            ".jsonl`): the same loss at every step.",
            table(
                [
                    "layout",
                    "steps",
                    "largest loss difference",
                    "step ms eager (last 10)",
                    "step ms recorded",
                    "peak GiB eager",
                    "peak GiB recorded",
                ],
                rows,
            ),  # fmt: skip
            "The recording holds its activations and gradients in a memory pool of its own from the third step on, "
            "so a step's peak allocated memory (the last step's, rank 0) grows by what the step's tensors take.",
            "Tensor parallel inside pipeline stages (tp 2 x pp 2: `--dp 1 --tp 2 --pp 2 --microbatches 4`, which "
            "`step_graph` refuses), the stages' messages over peer channels and over the process group "
            f"(`train_tp2pp2-{{peer,group}}-h100x4.jsonl`): the same loss at every step (largest difference "
            f"{worst(peer, group):g}), {last_ms(peer):.1f} ms against {last_ms(group):.1f} ms a step (median of the "
            "last 10), both bound by the host's launches of this tiny model's tensor-parallel collectives.",
            *_train_overlap_optimizer(),
        ]
    )


def _train_overlap_optimizer() -> list[str]:
    """`dtrain train` with the step recorded: one GPU, and 4 with NCCL's all-reduce, copy-engine buckets, and
    copy-engine buckets with the optimizer stepped inside backward (`dp_overlap_optimizer`)."""
    names = ("one", "dp4-nccl", "dp4-ce", "dp4-ce-overlap")
    runs = {n: [r for r in load(f"train_overlap_optimizer-{n}-h100x4.jsonl") if "step_s" in r] for n in names}
    if not all(runs.values()):
        return []
    ms = {n: statistics.median(r["step_s"] for r in runs[n][10:]) * 1e3 for n in names}
    label = {
        "one": "1 GPU, 16 sequences",
        "dp4-nccl": "dp 4, NCCL's all-reduce",
        "dp4-ce": "dp 4, `--dp-exchange copy-engine`",
        "dp4-ce-overlap": "dp 4, `--dp-exchange copy-engine --dp-overlap-optimizer`",
    }
    rows = [[label[n], f"{ms[n]:.2f}", "" if n == "one" else f"{ms['one'] / ms[n]:.1%}"] for n in names]

    def apart(x: str, y: str) -> float:
        return max(abs(p["loss"] - q["loss"]) for p, q in zip(runs[x], runs[y], strict=True))

    return [
        "GPT-2 124M (`configs/gpt2-125m-gpu.toml`, 1024 tokens a sequence, bf16, fused AdamW), 60 steps with "
        "`--step-graph --grad-clip 0 --set lr_schedule.warmup_steps=10`, 16 sequences a GPU, one launch after "
        "another on 4 H100s (`train_overlap_optimizer-{one,dp4-nccl,dp4-ce,dp4-ce-overlap}-h100x4.jsonl`): the "
        "median step of steps 11-60 (each step waits for its loss) and its scaling from one GPU. With "
        "`--dp-overlap-optimizer` the AdamW step is recorded in the step (capturable, its learning rate a tensor "
        "the schedule fills) and runs beside the last bucket's exchange; its losses follow the run without it "
        f"as closely as runs that differ in their reduction alone do (largest loss difference "
        f"{apart('dp4-ce', 'dp4-ce-overlap'):.3f}, against {apart('dp4-ce', 'dp4-nccl'):.3f} between the copy-engine "
        "and the NCCL runs: the first step's losses are equal, and bf16 runs drift apart from there as their "
        "backward kernels' atomic additions come in another order).",
        table(["run", "step ms", "scaling"], rows),
    ]


def _dp_cells(r: dict) -> list[str]:
    """A data-parallel row's variant, GPUs, step, throughput, ratio to DDP and scaling efficiency."""
    return [
        r["variant"],
        str(r["ranks"]),
        f"{r['step_s'] * 1e3:.1f}",
        f"{r['tokens_per_s'] / 1e3:.0f} k",
        f"{r['ratio_vs_ddp']:.3f}x" if r.get("ratio_vs_ddp") else "-",
        f"{r['scaling_efficiency']:.1%}" if r.get("scaling_efficiency") is not None else "-",
    ]


def _dp_four_h200() -> list[str]:
    """The comparison on 4 H200s: every variant eager with torch's multi-tensor AdamW, then a launch with the
    one-kernel AdamW and the recorded steps."""
    parts = []
    for b in (32, 16):
        for name, extra, title in (
            (f"dp_vs_ddp-h200x4-b{b}.jsonl", "", "eager, multi-tensor AdamW"),
            (f"dp_vs_ddp-graphs-fused-h200x4-b{b}.jsonl", " --graphs --optimizer fused", "fused AdamW, steps recorded"),
        ):
            records = load(name)
            if not records:
                continue
            rows = [
                [*_dp_cells(r), f"{r['scaling_vs_eager_single']:.1%}" if "-graph" in r["variant"] else "-"]
                for r in sorted(records, key=lambda r: (r["ranks"], r["variant"]))
            ]
            local = next((r for r in records if r["variant"] == "local"), None)
            parts += [
                f"### 4 x H200, {b} sequences a GPU, {title}",
                setting(
                    f"4 x {records[0]['device']} (one host, NVLink)",
                    gpu_software(records),
                    f"torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections dp --sizes 4 1 "
                    f"--batch-per-rank {b} --stall-s 110{extra} (DP_EXTRA='{extra.strip()}' benchmarks/gpu/run.sh "
                    "OUT dp)",
                    f"`{name}`",
                ),
                table(
                    ["variant", "GPUs", "step ms", "tokens/s", "throughput / DDP", "scaling eff.", "vs one GPU eager"],
                    rows,
                ),
            ]
            if local is not None and local.get("scaling_efficiency") is not None and local["scaling_efficiency"] < 0.9:
                parts.append(
                    f"`local` (no communication at all) reaches {local['scaling_efficiency']:.1%} of one GPU here: "
                    "four processes launching this step's kernels at once slow each other on this host whatever the "
                    "communication, so the eager scaling column measures the host; the recorded steps, which the "
                    "host launches once, show the wrapper's own."
                )
    return parts


def _dp_two_h200() -> list[str]:
    """The same comparison on 2 H200s, eager (no recorded steps)."""
    parts = []
    for b in (32, 16):
        records = load(f"dp_vs_ddp-h200x2-b{b}.jsonl")
        if not records:
            continue
        rows = [_dp_cells(r) for r in sorted(records, key=lambda r: (r["ranks"], r["variant"]))]
        local = next((r for r in records if r["variant"] == "local"), None)
        parts += [
            f"### 2 x H200, {b} sequences a GPU, eager",
            setting(
                f"2 x {records[0]['device']} (one host)",
                gpu_software(records),
                f"torchrun --nproc-per-node 2 benchmarks/training/dp_zero.py --sections dp --sizes 2 1 "
                f"--batch-per-rank {b} --stall-s 100",
                f"`dp_vs_ddp-h200x2-b{b}.jsonl`",
            ),
            table(["variant", "GPUs", "step ms", "tokens/s", "throughput / DDP", "scaling eff."], rows),
        ]
        if local is not None and local.get("scaling_efficiency") is not None and local["scaling_efficiency"] < 0.9:
            parts.append(
                f"`local` (no communication at all) reaches {local['scaling_efficiency']:.1%} of one GPU here: two "
                "processes stepping at once slow each other on this host whatever the communication, so the "
                "scaling column measures the host as much as the data-parallel wrapper."
            )
    parts += _dp_two_h200_recorded()
    parts += _dp_two_h200_eager()
    return parts


def _dp_two_h200_recorded() -> list[str]:
    """The recorded steps on 2 H200s: fused AdamW, the copy-engine exchange and the optimizer inside the step."""
    runs = [(b, load(f"dp_vs_ddp-graphs-fused-h200x2-b{b}.jsonl")) for b in (16, 32)]
    runs = [(b, records) for b, records in runs if records]
    if not runs:
        return []
    order = (
        "single",
        "single-graph",
        "single-graph-whole",
        "ddp",
        "local",
        "local-graph",
        "local-graph-whole",
        "ours-auto",
        "ours-graph",
        "ours-copy-engine-graph",
        "ours-copy-engine-graph-whole",
    )
    parts = [
        "### 2 x H200, steps recorded, fused AdamW",
        'The recorded variants of "A step recorded whole" below, with torch\'s one-kernel AdamW for every variant '
        "(eager ones too): `-graph` records forward, loss and backward; `ours-copy-engine-graph-whole` also moves "
        "the buckets by copy engines and steps AdamW inside the recording beside the last bucket. A recorded "
        "variant's scaling is against one GPU recorded the same way, the last column against one GPU eager; DDP "
        "runs eagerly. Each row's parameters end within bf16 autocast's rounding of DDP's (largest difference "
        + ", ".join(
            f"{max(r['max_abs_param_diff_vs_ddp'] or 0 for r in records):.1e} with {b} sequences" for b, records in runs
        )
        + ").",
    ]
    for b, records in runs:
        by = {r["variant"]: r for r in records}
        rows = [
            [*_dp_cells(by[v]), f"{by[v]['scaling_vs_eager_single']:.1%}" if "-graph" in v else "-"]
            for v in order
            if v in by
        ]
        parts += [
            f"#### {b} sequences a GPU",
            setting(
                f"2 x {records[0]['device']} (one host)",
                gpu_software(records),
                f"torchrun --nproc-per-node 2 benchmarks/training/dp_zero.py --sections dp --sizes 2 1 "
                f"--batch-per-rank {b} --graphs --optimizer fused --stall-s 240 --variants single-graph "
                "single-graph-whole ours-auto ours-graph ours-copy-engine-graph ours-copy-engine-graph-whole local "
                "local-graph local-graph-whole",
                f"`dp_vs_ddp-graphs-fused-h200x2-b{b}.jsonl`",
            ),
            table(
                ["variant", "GPUs", "step ms", "tokens/s", "throughput / DDP", "scaling eff.", "vs one GPU eager"],
                rows,
            ),
        ]
    return parts


def _dp_two_h200_eager() -> list[str]:
    """The eager variants on 2 H200s in one launch a batch: the defaults, the optimizer inside backward and the
    copy-engine exchange, beside DDP and two processes without communication."""
    runs = [(b, load(f"dp_eager-fused-h200x2-b{b}.jsonl")) for b in (16, 32)]
    runs = [(b, records) for b, records in runs if records]
    if not runs:
        return []
    order = ("single", "ddp", "local", "ours-auto", "ours-overlap", "ours-copy-engine")
    parts = [
        "### 2 x H200, eager, fused AdamW",
        "Every variant eager, in one launch a batch size on another lend of the machine: `ours-auto` "
        "(`DataParallel`'s defaults), `ours-overlap` (AdamW stepped inside backward beside the last bucket, "
        "`overlap_optimizer`) and `ours-copy-engine` (the buckets moved by copy engines). `local` is two processes "
        "training at once with no communication at all: where it falls short of one GPU, the host's two processes "
        "slow each other, whatever the wrapper does (with 16 sequences a GPU the step is bound by the host's "
        "launches). Parameters end within bf16 autocast's rounding of DDP's (largest difference "
        + ", ".join(
            f"{max(r['max_abs_param_diff_vs_ddp'] or 0 for r in records):.1e} with {b} sequences" for b, records in runs
        )
        + ").",
    ]
    for b, records in runs:
        by = {r["variant"]: r for r in records}
        parts += [
            f"#### {b} sequences a GPU, eager",
            setting(
                f"2 x {records[0]['device']} (one host)",
                gpu_software(records),
                f"torchrun --nproc-per-node 2 benchmarks/training/dp_zero.py --sections dp --sizes 2 1 "
                f"--batch-per-rank {b} --optimizer fused --variants ours-auto ours-overlap ours-copy-engine local",
                f"`dp_eager-fused-h200x2-b{b}.jsonl`",
            ),
            table(
                ["variant", "GPUs", "step ms", "tokens/s", "throughput / DDP", "scaling eff."],
                [_dp_cells(by[v]) for v in order if v in by],
            ),
        ]
    return parts


def section_dp() -> str:
    first = load("dp_vs_ddp-h100x4-b32.jsonl")[0]
    model = (
        f"A GPT of {first['parameters'] / 1e6:.1f} M parameters (12 layers, 768 wide, 12 heads, vocabulary "
        f"{first.get('vocab', 50257)}, {first.get('block', 256)}-token context"
        + (f", {first['autocast']} autocast" if first.get("autocast") else "")
        + ")"
    )
    parts = [
        "## Data parallel against DDP",
        f"{model}, AdamW, weak scaling; ours (`DataParallel` with `auto`, with NCCL's own collectives, and with "
        "AdamW stepped inside backward, `ours-overlap`: `DataParallel.overlap_optimizer`), DDP, DDP with "
        "`gradient_as_bucket_view=True` (`ddp-view`) and the plain module on every GPU with no communication at "
        "all (`local`: each GPU trains its own copy) in the same launch, timed in rotating turns (median "
        "over the trials of the slowest rank's time for a run of steps). Scaling efficiency: tokens/s per GPU over "
        "one GPU's tokens/s (the plain module) in the same launch. Every variant but `local` ends with DDP's "
        "parameters (checked: the largest difference is in the data, under autocast's rounding).",
        _dp_ceiling(),
    ]
    for b in (32, 16):
        records = load(f"dp_vs_ddp-graphs-h100x4-b{b}.jsonl")
        rows = [
            [*_dp_cells(r), f"{r['scaling_vs_eager_single']:.1%}" if "-graph" in r["variant"] else "-"]
            for r in sorted(records, key=lambda r: (r["ranks"], r["variant"]))
        ]
        parts += [
            f"### 4 x H100, {b} sequences a GPU",
            setting(
                card([{"device_name": records[0]["device"]}]),
                gpu_software(records),
                f"torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections dp --sizes 4 1 "
                f"--batch-per-rank {b} --stall-s 110 --graphs (LIMIT=200 DP_EXTRA=--graphs benchmarks/gpu/run.sh "
                "OUT dp)",
                f"`dp_vs_ddp-graphs-h100x4-b{b}.jsonl`",
            ),
            table(
                ["variant", "GPUs", "step ms", "tokens/s", "throughput / DDP", "scaling eff.", "vs one GPU eager"],
                rows,
            ),
        ]
    parts.append(_dp_recorded())
    parts += _dp_four_h200()
    parts += _dp_two_h200()
    cpu = load("dp_vs_ddp-cpu2.jsonl")
    rows = []
    for r in cpu:
        rows.append(
            [
                r["model"],
                str(r["world_size"]) + (" (again)" if r["variant"] == "single" and r["launch"] else ""),
                r["variant"],
                f"{r['samples_per_s']:.0f}",
                f"{r['ratio_vs_ddp']:.2f}x" if r.get("ratio_vs_ddp") else "-",
                f"{r['scaling_efficiency']:.0%}" if r.get("scaling_efficiency") is not None else "-",
            ]
        )
    parts += [
        "### CPU",
        "`gpt-debug`: a 2-block GPT of width 64 (2 heads, 64-token context, 103-character vocabulary; 0.12 M "
        "parameters) on the pydoc text, global batch 32 x 64 tokens; `mlp-512x4`: the MLP classifier (4 x 512, "
        "global batch 256); 9 windows of 4 steps after 3 warm-up steps. 4 ranks on 2 cores can reach at most 50% "
        "scaling; the 1-rank launch is repeated last to show the machine's drift. (The script trains the GPT-2 "
        "`tiny` preset on random tokens in the GPT's place, reported as `gpt2-tiny`.)",
        setting(
            CPU,
            f"torch {cpu[0]['torch_version']}, Python {cpu[0]['python_version']}",
            "python benchmarks/training/dp_vs_ddp.py --nproc 1 2 4 1",
            "`dp_vs_ddp-cpu2.jsonl`",
        ),
        table(["model", "ranks", "variant", "samples/s", "ours / DDP", "scaling eff."], rows),
    ]
    return "\n\n".join(parts)


def _peak_scope(records: list[dict], others: str) -> str:
    """What a table's peak memory counts: the variant alone, or, as recorded without ``peak_memory_scope``, every
    tensor alive on the device, ``others`` among them."""
    if all(r.get("peak_memory_scope") == "variant" for r in records if r.get("peak_memory_bytes")):
        return " Peak memory: the variant's weights and gradients and what its step allocates."
    return (
        f" Peak memory as recorded: every tensor on the device during the step, {others} included, so the column "
        "compares the variants only by their differences."
    )


def section_zero() -> str:
    gpu = load("zero-h100x4.jsonl")
    rows = [
        [
            r["variant"],
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['ratio_vs_ddp']:.3f}x",
            f"{r['peak_memory_bytes'] / (1 << 30):.2f}",
            f"{r['max_abs_param_diff_vs_ddp']:.1e}",
        ]
        for r in gpu
    ]
    parts = [
        "## ZeRO memory",
        "### 4 x H100",
        "The GPT of the data-parallel table, 16 sequences a GPU, on 4 GPUs: plain data parallel (ours, DDP), ZeRO "
        "stage 1 and 2 (`ZeroOptimizer`) and DDP with torch's `ZeroRedundancyOptimizer`. Peak GPU memory of a step"
        + (
            "."
            if all(r.get("peak_memory_scope") == "variant" for r in gpu)
            else " as recorded, which also counts the model every variant is copied from, held on the device while "
            "it ran (its 32-bit weights, the same in every row): the rows differ by what each variant holds."
        ),
        setting(
            card([{"device_name": gpu[0]["device"]}]),
            gpu_software(gpu),
            "torchrun --nproc-per-node 4 benchmarks/training/dp_zero.py --sections zero --stall-s 140 "
            "(benchmarks/gpu/run.sh OUT zero)",
            "`zero-h100x4.jsonl`",
        ),
        table(["variant", "step ms", "DDP's step time / this", "peak GiB", "max param diff vs DDP"], rows),
        "### CPU",
        "Peak resident set of a rank (`ru_maxrss`) and its growth once the model is built (gradients, optimizer "
        "moments, communication buffers, activations), GPT of 12.9 M parameters, AdamW, each variant in its own "
        "launch; the final parameters equal plain data parallel's.",
    ]
    for name, label, extra in (
        ("zero_memory-cpu2.jsonl", "2 ranks, 25 MiB buckets", "--nproc 2"),
        ("zero_memory-bucket4mb-cpu2.jsonl", "2 ranks, 4 MiB buckets", "--nproc 2 --bucket-mb 4"),
        ("zero_memory-4ranks-cpu2.jsonl", "4 ranks, 25 MiB buckets", "--nproc 4"),
    ):
        records = load(name)
        rows = [
            [r["variant"], f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_growth_mb']:.0f}", f"{r['step_s_median']:.2f}"]
            for r in records
        ]
        parts += [
            f"{label}: `python benchmarks/training/zero_memory.py {extra}`, torch {records[0]['torch_version']} "
            f"(`{name}`)",
            table(["variant", "peak RSS MB", "growth MB", "step s"], rows),
        ]
    return "\n\n".join(parts)


def section_tp_pp() -> str:
    parts = ["## Tensor and pipeline parallel on GPUs"]
    for name, extra in (
        ("tp-h100x4.jsonl", "--sections tp --sizes 4 1 --stall-s 110 (benchmarks/gpu/run.sh OUT tp)"),
        ("tp-h200x4.jsonl", "--sections tp --tp-dim 8192 --tp-tokens 16384"),
    ):
        records = load(name)
        rows = [
            [
                r["variant"],
                str(r["ranks"]),
                f"{r['step_s'] * 1e3:.2f}",
                f"{r['ratio_vs_torch']:.3f}x" if r.get("ratio_vs_torch") else "-",
                f"{r['parameter_nbytes_per_rank'] / (1 << 20):.0f}" if r.get("parameter_nbytes_per_rank") else "-",
                f"{r['peak_memory_bytes'] / (1 << 30):.2f}" if r.get("peak_memory_bytes") else "-",
            ]
            for r in records
        ]
        parts += [
            f"### Tensor parallel against DTensor (4 x {records[0]['device']})",
            "The Megatron MLP `GeLU(X A) B` as `ParallelMLP`, one training step a call, against torch's "
            "`parallelize_module` with `ColwiseParallel` / `RowwiseParallel` on the same weights."
            + _peak_scope(records, "the full reference MLP, its output, and the other variants' weights and gradients"),
            setting(
                card([{"device_name": records[0]["device"]}]),
                gpu_software(records),
                f"torchrun --nproc-per-node 4 benchmarks/training/tp_pp.py {extra}",
                f"`{name}`",
            ),
            table(["variant", "GPUs", "step ms", "torch's step time / this", "parameter MiB a rank", "peak GiB"], rows),
        ]
    pp = load("pp-h200x4.jsonl")
    rows = [
        [
            r["variant"],
            str(r["microbatches"]),
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['ratio_vs_torch']:.3f}x" if r.get("ratio_vs_torch") else "-",
            f"{r['peak_memory_bytes'] / (1 << 30):.2f}" if r.get("peak_memory_bytes") else "-",
        ]
        for r in pp
    ]
    parts += [
        "### Pipeline parallel against torch.distributed.pipelining (4 x H200)",
        "16 x (Linear(4096, 4096) + GeLU), one stage a GPU (two chunks a GPU interleaved), 8192 rows a step, SGD; "
        "ours (`PipelineParallel`) against `ScheduleGPipe`, `Schedule1F1B` and `ScheduleInterleaved1F1B` on the "
        "same cut of the same weights; gradients equal torch's."
        + _peak_scope(
            pp, "the whole 16-layer model the stages are copied from and the other variant's weights and gradients"
        ),
        setting(
            card([{"device_name": pp[0]["device"]}]),
            gpu_software(pp),
            "torchrun --nproc-per-node 4 benchmarks/training/tp_pp.py --sections pp --pp-width 4096 --pp-batch 8192 "
            "--microbatches 2 4 8 --pp-warmup 2 --pp-iters 3 --pp-trials 3 --pp-budget-s 3 --stall-s 45 "
            "(benchmarks/gpu/run.sh OUT pp)",
            "`pp-h200x4.jsonl`",
        ),
        table(["variant", "micro-batches", "step ms", "torch's step time / this", "peak GiB"], rows),
    ]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------------- real models


LAYOUTS = (
    ("dp4", "dp 4"),
    ("tp4", "tp 4"),
    ("pp4", "pp 4, 1F1B, 4 micro-batches"),
    ("dp2tp2", "dp 2 x tp 2"),
    ("tp2pp2", "tp 2 x pp 2, 1F1B, 4 micro-batches"),
    ("dp4zero3", "dp 4, ZeRO-3"),
    ("dp4zero3ac", "dp 4, ZeRO-3, full activation checkpointing"),
)


def section_llama() -> str:
    dp = load("llama_1b_dp-h100x4.jsonl")
    ddp = {r.get("compile", False): r for r in dp if r["variant"] == "ddp"}  # each ratio against DDP compiled alike
    rows = [
        [
            r["variant"],
            "yes" if r.get("compile") else "no",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / ddp[r.get('compile', False)]['tokens_per_s']:.3f}",
            f"{r['mfu']:.1%}",
            f"{r['peak_memory_gib']:.1f}",
        ]
        for r in dp
    ]
    first = dp[0]
    parts = [
        "## Llama 1B on GPUs",
        "The Llama 3.2 1B shape (`--preset 1b`: 16 blocks of 2048, 32 heads, 8 key-value heads, a tied 128,256-token "
        f"vocabulary, 1.24 B parameters), bf16 compute with float32 master weights, sequences of {first['seq_len']} "
        f"tokens, {first['batch_per_gpu']} a GPU, AdamW (fused) and clipping to norm 1.0, each variant in its own "
        "launch on the same weights and token batches. MFU is model FLOPs (PaLM's 6N + 12LHQT, "
        "`dtrain.models.train_flops_per_token`) over 989.4 TFLOP/s a GPU (the H100 SXM's dense bf16 peak). "
        "`dtrain` is `HybridParallel` as `dtrain train` runs it (gradient buckets averaged by NCCL's own all-reduce "
        "while backward runs), `dtrain-bf16-reduce` the same with the gradients averaged in bf16. Compiled: every "
        "block and the loss through `torch.compile` (each block on its own, before any wrapper; the compiled loss "
        "reads the bf16 logits without a float32 copy), the ratio taken against DDP compiled alike. The variants "
        "ran one after another, not in turns within one launch, and the same step differs from one launch to the "
        "next on these hosts by as much as `dtrain` differs from DDP here (docs/parallel.md, one GPU's step on 4 x "
        "H200); FSDP2's lead is larger than that spread.",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch {first['torch']}, NCCL {NCCL}, NVLink multicast off",
            "benchmarks/gpu/run.sh OUT llama (torchrun --nproc-per-node 4 benchmarks/training/llama.py --preset 1b "
            "--seq-len 2048 --batch-per-gpu 4 --steps 20 --warmup 5 --variants V [--compile])",
            "`llama_1b_dp-h100x4.jsonl`",
        ),
        table(["variant", "compiled", "step ms", "tokens/s", "/ DDP", "MFU", "peak GiB"], rows),
        *_llama_turns_part(),
        "### The same model trained by `dtrain train` in seven layouts",
        "100 steps on Python's help texts (a BPE of 8,192 tokens; the model keeps its 128,256-token vocabulary), "
        "global batch 16 x 2048 tokens, learning rate 3e-4 after 10 warmup steps, cosine decay, bf16; the same seed "
        "and data order in every layout. Losses agree to bf16 rounding early and drift apart slowly as rounding "
        "differences compound; MFU and tokens/s are medians over steps 21-100.",
    ]
    rows = []
    for name, shape in LAYOUTS:
        steps = load(f"llama_1b_train_{name}-h100x4.jsonl")
        tail = steps[20:]
        rows.append(
            [
                shape,
                *(f"{steps[i]['loss']:.3f}" for i in (0, 24, 49, 99)),
                f"{statistics.median(r['tokens_per_s'] for r in tail):,.0f}",
                f"{statistics.median(r['mfu'] for r in tail):.1%}",
                f"{max(r['peak_memory_gib'] for r in steps):.1f}",
            ]
        )
    parts += [
        setting(
            "4 x NVIDIA H100 80GB HBM3, NVLink through NVSwitch",
            f"torch {first['torch']}, NCCL {NCCL}",
            "benchmarks/gpu/run.sh OUT llama-layouts (torchrun --nproc-per-node 4 -m dtrain train --preset 1b "
            "LAYOUT [--zero 3] [--activation-checkpointing full] --seq-len 2048 --batch-size 16 --steps 100 "
            "--lr 3e-4 --warmup-steps 10 "
            "--set data.tokenizer_vocab=8192 --precision bf16 --no-export --no-tensorboard)",
            ", ".join(f"`llama_1b_train_{n}-h100x4.jsonl`" for n, _ in LAYOUTS),
        ),
        table(["layout", "loss 1", "loss 25", "loss 50", "loss 100", "tokens/s", "MFU", "peak GiB"], rows),
    ]
    parts += _zero_recompute_part(ddp)
    parts += _largest_part()
    parts += _plan_score_part()
    parts += _torchtitan_part()
    return "\n\n".join(parts)


def _llama_turns_part() -> list[str]:
    """dtrain, DDP and FSDP2 on 2 x H200 in turns within one command: each round launches the three one after
    another, twice, eager and compiled; each variant's ratio to DDP within its round."""
    names = ["llama_1b_turns-h200x2.jsonl", "llama_1b_turns_compiled-h200x2.jsonl"]
    if not all((RESULTS / n).exists() for n in names):
        return []
    rows, ratios, steps = [], {}, {}
    for name in names:
        records = load(name)
        rounds = [records[i : i + 3] for i in range(0, len(records), 3)]  # each round: dtrain, ddp, fsdp2
        for variant in ("dtrain", "ddp", "fsdp2"):
            runs = [next(r for r in rnd if r["variant"] == variant) for rnd in rounds]
            over = [
                next(r for r in rnd if r["variant"] == variant)["tokens_per_s"]
                / next(r for r in rnd if r["variant"] == "ddp")["tokens_per_s"]
                for rnd in rounds
            ]
            ratios[(variant, runs[0]["compile"])] = over
            steps[(variant, runs[0]["compile"])] = [r["step_s"] for r in runs]
            rows.append(
                [
                    variant,
                    "yes" if runs[0]["compile"] else "no",
                    " / ".join(f"{r['step_s'] * 1e3:.1f}" for r in runs),
                    " / ".join(f"{r['tokens_per_s']:,.0f}" for r in runs),
                    " / ".join(f"{x:.3f}" for x in over),
                    " / ".join(f"{r['mfu']:.1%}" for r in runs),
                    f"{max(r['peak_memory_gib'] for r in runs):.1f}",
                ]
            )
    first = load(names[0])[0]

    def span(values: list[float]) -> str:
        low, high = f"{min(values):.3f}", f"{max(values):.3f}"
        return low if low == high else f"{low}-{high}"

    eager, compiled = ratios[("dtrain", False)], ratios[("dtrain", True)]
    fsdp = [[f / d for f, d in zip(ratios[("fsdp2", c)], ratios[("dtrain", c)], strict=True)] for c in (False, True)]
    spread = max(max(s) / min(s) - 1 for s in steps.values())
    return [
        "### In turns, on 2 x H200",
        "The same benchmark, model, batch a GPU and variants on 2 GPUs, the three variants launched in turn within "
        "one command (dtrain, DDP, FSDP2, then again), eager and compiled: the rounds give each variant's spread "
        "beside the others' on the same allocation. MFU over the H200's dense bf16 peak (989.4 TFLOP/s, the same "
        f"chip as the H100). dtrain's tokens/s over DDP's in the same round: {span(eager)} eager, {span(compiled)} "
        f"compiled; FSDP2's over dtrain's: {span(fsdp[0])} and {span(fsdp[1])}. A variant's step differs between "
        f"its two rounds by {spread:.1%} at most.",
        setting(
            f"2 x {first['device']}, NVLink",
            f"torch {first['torch']}, NCCL {NCCL}, NVLink multicast off",
            "for round in 1 2; do for V in dtrain ddp fsdp2; do torchrun --nproc-per-node 2 "
            "benchmarks/training/llama.py --preset 1b --seq-len 2048 --batch-per-gpu 4 --steps 20 --warmup 5 "
            "--variants $V [--compile] --out FILE; done; done",
            "`llama_1b_turns-h200x2.jsonl`, `llama_1b_turns_compiled-h200x2.jsonl`",
        ),
        table(["variant", "compiled", "step ms, round 1 / 2", "tokens/s", "/ DDP", "MFU", "peak GiB"], rows),
    ]


def _zero_recompute_part(ddp: dict[bool, dict]) -> list[str]:
    """dtrain's ZeRO stages, and activation checkpointing, on the same model and batch as the table above."""
    rows = []
    for r in load("llama_1b_zero-h100x4.jsonl") + load("llama_1b_recompute-h100x4.jsonl"):
        rows.append(
            [
                r["variant"],
                "yes" if r.get("compile") else "no",
                r.get("activation_checkpointing", "none"),
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s'] / ddp[bool(r.get('compile'))]['tokens_per_s']:.3f}",
                f"{r['mfu']:.1%}",
                f"{r['peak_memory_gib']:.1f}",
            ]
        )
    return [
        "### ZeRO stages and activation checkpointing",
        "The same model, batch and launches, with dtrain's optimizer state (ZeRO-1), gradients (ZeRO-2) and "
        "parameters (ZeRO-3, `dtrain.parallel.fsdp`: each block a unit gathered in bf16 while it computes, the next "
        "one prefetched, gradients reduce-scattered as backward produces them) sharded over the 4 GPUs, and with "
        "every block's activations recomputed in backward (`full`) or all but its matrix products' outputs "
        "(`selective`; `dtrain.parallel.recompute`). `/ DDP` against DDP's tokens/s in the table above, compiled "
        "alike. ZeRO-1 and -2 reduce after backward rather than during it, which their step time shows.",
        setting(
            "4 x NVIDIA H100 80GB HBM3, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            "torchrun --nproc-per-node 4 benchmarks/training/llama.py --preset 1b --variants V [--compile] "
            "[--activation-checkpointing full|selective]",
            "`llama_1b_zero-h100x4.jsonl`, `llama_1b_recompute-h100x4.jsonl`",
        ),
        table(["variant", "compiled", "recompute", "step ms", "tokens/s", "/ DDP", "MFU", "peak GiB"], rows),
    ]


def _largest_part() -> list[str]:
    """The deepest Llama (8B width) each trainer fits on the 4 GPUs with ZeRO-3 and full activation checkpointing."""
    records = load("largest_zero3-h100x4.jsonl")
    if not records:
        return []
    rows, largest, failed = [], {}, {}
    for r in sorted(records, key=lambda r: (r["variant"], r["layers"])):
        if "failed" in r:
            failed[r["variant"]] = r
            rows.append([r["variant"], str(r["layers"]), "", "", "", "", r["failed"]])
            continue
        largest[r["variant"]] = r
        rows.append(
            [
                r["variant"],
                str(r["layers"]),
                f"{r['parameters'] / 1e9:.2f}",
                f"{r['step_s'] * 1e3:.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}",
                f"{r['peak_memory_gib']:.1f}",
            ]
        )
    summary = "; ".join(
        f"{v}: {r['parameters'] / 1e9:.2f} B parameters ({r['layers']} blocks)"
        + (f", {failed[v]['layers']} blocks out of memory" if v in failed else "")
        for v, r in largest.items()
    )
    first = next(iter(largest.values()))
    return [
        "### The largest model ZeRO-3 trains",
        "Llama 3 8B's width (4096, 14,336-wide SwiGLU, 32 heads, 8 key-value heads, an untied 128,256-token "
        "vocabulary) with more blocks, until a step runs out of memory on the 4 GPUs: dtrain's ZeRO-3 "
        "(`dtrain.parallel.fsdp`) against FSDP2, both with every block's activations recomputed, one sequence of "
        f"{first['seq_len']} tokens a GPU, float32 master weights and AdamW state sharded four ways, bf16 compute, "
        f"CUDA memory in expandable segments for both (as `dtrain train` sets it). Largest trained: {summary}. MFU "
        "counts model FLOPs only (not the recomputed forward).",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch {first['torch']}, NCCL {NCCL}",
            "benchmarks/gpu/run.sh OUT largest (torchrun --nproc-per-node 4 benchmarks/training/llama.py --preset 8b "
            "--layers L --seq-len 2048 --batch-per-gpu 1 --steps 2 --warmup 1 --activation-checkpointing full "
            "--variants V, L growing by 4)",
            "`largest_zero3-h100x4.jsonl`",
        ),
        table(["variant", "blocks", "B params", "step ms", "tokens/s", "MFU", "peak GiB"], rows),
    ]


def _plan_score_part() -> list[str]:
    """`dtrain plan --write` on the Llama 1B config, then `dtrain train` of what it wrote: predicted beside measured."""
    records = load("plan_score_llama_1b-h100x4.jsonl")
    if not records:
        return []
    r = records[0]
    now = r["current"]
    measured_s, measured_gib = r["plan_measured_step_s"], r["plan_measured_memory_gib"]
    rows = [
        ["step time", f"{now['step_s'] * 1e3:.1f} ms", f"{measured_s * 1e3:.1f} ms",
         f"{measured_s / now['step_s']:.3f}",
         f"{r['plan_step_s'] * 1e3:.1f} ms ({r['plan_step_ratio']:.3f})"],
        ["peak memory a GPU", f"{now['memory_gib']:.1f} GiB", f"{measured_gib:.1f} GiB",
         f"{measured_gib / now['memory_gib']:.2f}", f"{r['plan_memory_gib']:.1f} GiB ({r['plan_memory_ratio']:.2f})"],
    ]  # fmt: skip
    return [
        "### A planned run, scored",
        f"`dtrain plan` on `{r['config']}` (Llama 1B, global batch 64 x 2048 tokens, compiled) for {r['devices']} "
        f"GPUs of the `h100-node` topology chose `{now['layout']}` and wrote it as a run config; `dtrain train` of "
        f"that config measured the median of {r['plan_steps_timed']} steps after three of warm-up. The simulator "
        "prices each operation with the H100 efficiency curves of `dtrain bench compute` "
        "(`dtrain/sim/compute_curves.json`). `predicted` is its prediction for the layout now; the run itself "
        "recorded the prediction of the model it was planned with (last column, with its ratio), which chose the "
        "same layout. dtrain keeps float32 weights and, under ZeRO-2, whole float32 gradients until the step; the "
        "memory model's ZeRO-2 shards them, which the measured peak shows.",
        setting(
            f"{r['devices']} x {r['device']}, NVLink through NVSwitch",
            f"torch {r['torch']}, NCCL {NCCL}",
            "benchmarks/gpu/run.sh OUT plan-score (dtrain bench compute; dtrain plan --config "
            "configs/llama-1b-gpu.toml --topology h100-node --devices 4 --write PLAN; torchrun "
            "--nproc-per-node 4 -m dtrain train --config PLAN --steps 20)",
            "`plan_score_llama_1b-h100x4.jsonl`, `bench_compute-h100x1.jsonl`",
        ),
        table(["", "predicted", "measured", "measured / predicted", "predicted at the run"], rows),
    ]


def _torchtitan_part() -> list[str]:
    """torchtitan's Llama 3 trainer beside dtrain, DDP and FSDP2 on the untied 1B shape it trains."""
    ours = load("llama_1b_untied_dp-h100x4.jsonl")
    titan = load("torchtitan_1b-h100x4.jsonl")
    ref = {r["compile"]: r for r in ours if r["variant"] == "dtrain"}
    rows = []
    for r in [*ours, *titan]:
        compiled = r.get("compile", r["variant"].endswith("-compile"))
        loading = r.get("data_loading_s")
        rows.append(
            [
                r["variant"].removesuffix("-compile"),
                "yes" if compiled else "no",
                f"{r['step_s'] * 1e3:.1f}",
                f"{loading * 1e3:.1f}" if loading is not None else "-",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.1%}",
                f"{ref[compiled]['tokens_per_s'] / r['tokens_per_s']:.3f}",
                f"{r['peak_memory_gib']:.1f}",
            ]
        )
    first = titan[0]
    return [
        "### Beside torchtitan",
        f"torchtitan {first['torchtitan']} (the newest release that runs on torch {first['torch']}) trains its "
        "Llama 3 model in the same 1B shape, with an untied head as its Llama 3 has "
        f"({first['parameters'] / 1e9:.2f} B parameters): FSDP2 over the 4 GPUs with bf16 parameters and float32 "
        "gradient reduction, fused AdamW, clipping to norm 1.0, no activation checkpointing, 4 x 2048 tokens a "
        "GPU; compiled means its model and loss compiled. dtrain, DDP and FSDP2 ran the same untied shape through "
        "benchmarks/training/llama.py. torchtitan's step includes reading and tokenizing its batch in the training "
        "process (the `data ms` column, its own figure); the others train on batches already on the GPU. "
        "`dtrain /` is dtrain's tokens/s over the row's, compiled alike.",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch {first['torch']}, NCCL {NCCL}, torchtitan {first['torchtitan']}",
            "torchrun --nproc-per-node 4 benchmarks/training/torchtitan_llama.py --preset 1b --seq-len 2048 "
            "--batch-per-gpu 4 --steps 20 --warmup 5 [--compile]; torchrun --nproc-per-node 4 "
            "benchmarks/training/llama.py --preset 1b --untied --variants V [--compile]",
            "`torchtitan_1b-h100x4.jsonl`, `llama_1b_untied_dp-h100x4.jsonl`",
        ),
        table(["trainer", "compiled", "step ms", "data ms", "tokens/s", "MFU", "dtrain /", "peak GiB"], rows),
    ]


# ------------------------------------------------------------------------------------------------------- pipeline


def bubble_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    done = [r for r in records if "bubble_theory" in r]  # a configuration that stalled has no measurement
    for r in sorted(done, key=lambda r: (r["stages"], r["schedule"], r["microbatches"])):
        rows.append(
            [
                str(r["stages"]),
                r["schedule"] + (f" (v={r['virtual_stages']})" if r.get("virtual_stages", 1) > 1 else ""),
                str(r["microbatches"]),
                f"{r['bubble_theory']:.2f}",
                f"{r['bubble_measured']:.2f}",
                "-" if r.get("bubble_timeline") is None else f"{r['bubble_timeline']:.2f}",
                f"{r['step_s'] * 1e3:.1f}",
                ",".join(str(a) for a in r["peak_activations_per_stage"]),
                ",".join(str(a) for a in r.get("peak_expected_per_stage") or []) or "-",
            ]
        )
    return rows


def stalled_line(records: list[dict]) -> str:
    """The configurations of ``records`` that stalled (ended by ``--stall-s``, nothing measured), or ""."""
    stalled = [r for r in records if "stalled_after_s" in r and "bubble_theory" not in r]
    if not stalled:
        return ""
    order = sorted(stalled, key=lambda r: (r["stages"], r["schedule"], r["microbatches"]))
    named = "; ".join(
        f"p = {r['stages']} {r['schedule']} m = {r['microbatches']} (after {r['stalled_after_s']:.0f} s)" for r in order
    )
    return (
        "Stalled, ended by `--stall-s` with nothing measured (nor the configurations after it in that launch): "
        f"{named}."
    )


def section_dropout() -> str:
    """dtrain's layout-independent dropout beside torch's on one H200, and a GPU run resumed and recomputed."""
    records = load("dropout_cost-h200x1.jsonl")
    resumed = load("dropout_resume-h200x1.jsonl")
    if not records:
        return ""
    check = next(r for r in records if r["kind"] == "check")
    steps = [r for r in records if r["kind"] == "step"]
    rows = [
        [
            r["mode"],
            r["variant"],
            f"{r['step_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['over_torch']:.2f}",
            f"{r['peak_gib']:.1f}",
        ]
        for r in steps
    ]
    parts = [
        "## Dropout drawn alike on every layout",
        "`dtrain.models.dropout` keeps a value where a hash of the step, the dropout's site and the value's place in "
        "the global batch is above p, so every layout, a recomputed forward and a resumed run draw one process's "
        "masks (docs/parallel.md, Dropout). Its cost beside torch's own dropout: GPT-2 small (124 M, the `124m` "
        f"preset), {check['batch']} sequences of {check['seq_len']} tokens, bf16 autocast, fused AdamW, one optimizer "
        "step a call, variants timed in turns (median of 5 runs of 10 steps). `none`: no dropout; `torch`: 0.1 on "
        "the embedding, the attention probabilities and both residual branches by torch's generator (the fused "
        "attention kernel drops inside); `dtrain`: the same probabilities by the hash, the attention probabilities "
        "dropped inside dtrain's flash-attention kernel (`dtrain/models/attention_kernel.py`), as a model on a GPU "
        "runs; "
        "`dtrain-written-out`: the same masks with the attention written out (its probabilities materialised, "
        "(B, H, T, T)), the CPU's path and the kernel's reference; `dtrain-no-attention`: the hash on the embedding "
        "and residual branches, none on the attention probabilities, so torch's fused attention kernel runs. "
        "`/ torch`: the step's time over `torch`'s. Compiled: each block through `torch.compile`, as "
        "`dtrain train --compile` runs it. Peak memory counts every variant's model and optimizer state, all held "
        "at once.",
        setting(
            f"1 x {check['device']}",
            f"torch {check['torch_version']}",
            "python benchmarks/training/dropout_cost.py --out benchmarks/results/dropout_cost-h200x1.jsonl",
            "`dropout_cost-h200x1.jsonl`",
        ),
        table(["mode", "variant", "step ms", "tokens/s", "/ torch", "peak GiB"], rows),
        f"Checked in the same launch: the GPU kernel's masks equal the CPU's tensor form bit for bit "
        f"({'yes' if check['masks_equal_cpu'] else 'no'}; {check['kept']:.4f} of the values kept at p = 0.1); "
        f"the model on the whole batch and on four pieces, each under its rows, gives logits "
        f"{check['pieces_max_abs_diff']:.1g} apart; and in float32 the flash-attention kernel's logits are "
        f"{check['written_out_max_abs_diff']:.1g} from the written-out attention's (logits up to "
        f"{check['logits_max_abs']:.1f} in size).",
    ]
    if resumed:
        runs: dict[str, dict[int, float]] = {}
        for r in resumed:
            runs.setdefault(r["run"], {})[r["step"]] = r["loss"]
        straight = runs["straight"]
        gap = max(abs(runs["resumed"][s] - straight[s]) for s in runs["resumed"] if s > 4)
        recomputed = max(abs(runs["recomputed"][s] - straight[s]) for s in straight)
        recorded = max(abs(runs["recorded"][s] - straight[s]) for s in straight) if "recorded" in runs else None
        graph = "" if recorded is None else f"; recorded as one CUDA graph a step (`--step-graph`), by {recorded:.1g}"
        parts += [
            "`dtrain train` of a small GPT-2 (4 layers of 256, every dropout 0.1, bf16, 8 steps, a checkpoint every "
            f"4) on the same GPU: resumed from its checkpoint of step 4, steps 5-8 differ from the straight run's "
            f"by {gap:.1g} in loss; with full recomputation, every step by {recomputed:.1g}{graph}. No generator "
            "state is saved for it.",
            setting(
                f"1 x {resumed[0]['device']}",
                f"torch {resumed[0]['torch_version']}",
                "python benchmarks/training/dropout_resume.py --out benchmarks/results/dropout_resume-h200x1.jsonl",
                "`dropout_resume-h200x1.jsonl`",
            ),
        ]
    return "\n\n".join(parts)


def section_bubble() -> str:
    gpu = load("bubble-h200x4.jsonl")
    gpu4 = load("bubble-p4-h200x4.jsonl")
    cpu = load("bubble-cpu2.jsonl")
    header = ["p", "schedule", "m", "theory", "measured", "timeline", "step ms", "peak activations a stage",
              "expected"]  # fmt: skip
    return "\n\n".join(
        part
        for part in [
            "## Pipeline bubble against theory",
            "The measured bubble beside (p - 1) / (v m + p - 1) for GPipe, 1F1B and interleaved 1F1B, and the "
            "micro-batches each stage held at once beside the count the schedule should hold (GPipe m, 1F1B "
            "min(p - s, m), interleaved min(2 (p - 1 - s) + (v - 1) p + 1, v m)), both as the script records them. "
            "`measured`: 1 - (the stages' busy time) / (p x the step time), the idle share of the step; `timeline`: "
            "the same from the stages' recorded timelines (CPU runs).",
            "### 4 x H200",
            "32 x (Linear(4096, 4096) + GELU), batch 8192, fp32 with TF32, one stage a GPU; median of 5 steps.",
            setting(
                card([{"device_name": gpu[0]["device"]}]),
                gpu_software(gpu),
                "benchmarks/gpu/run.sh OUT bubble",
                "`bubble-h200x4.jsonl` (p = 2 and 4), `bubble-p4-h200x4.jsonl` (p = 4, 1F1B and interleaved)",
            ),
            table(header, bubble_rows(gpu)),
            stalled_line(gpu),
            "p = 4, 1F1B and interleaved 1F1B:",
            table(header, bubble_rows(gpu4)),
            stalled_line(gpu4),
            "### CPU",
            "8 x (Linear(512, 512) + GELU), batch 128, one Gloo rank a stage. p = 4 puts four stages on two cores, "
            "so its bubble shows the scheduler, not the pipeline.",
            setting(
                CPU,
                f"torch {cpu[0]['torch_version']}",
                "python benchmarks/pipeline/bubble.py --stages 2 4 --schedules gpipe 1f1b",
                "`bubble-cpu2.jsonl`",
            ),
            table(header, bubble_rows(cpu)),
            "![bubble against theory](figures/pipeline-bubble.png)",
            *_zero_bubble_part(),
        ]
        if part
    )


def _graphs_flag(records: list[dict]) -> str:
    """The ``--graphs`` flag that made ``records``' graphed rows."""
    kinds = [k for k, v in (("actions", True), ("step", "step")) if any(r.get("graphs") == v for r in records)]
    if not kinds:
        return ""
    return " --graphs" if kinds == ["actions"] else f" --graphs {','.join(kinds)}"


def _zero_bubble_part() -> list[str]:
    """`dtrain bench pipeline` on 4 H100s: every schedule, zero-bubble ones included, beside torch's."""
    parts = []
    names = (
        "bench_pipeline-h100x4.jsonl",
        "bench_pipeline-b4096-h100x4.jsonl",
        "bench_pipeline_step-b1024-h100x4.jsonl",
        "bench_pipeline_step-b4096-h100x4.jsonl",
    )
    for name in names:
        records = load(name)
        if not records:
            continue
        step_file = name.startswith("bench_pipeline_step")
        rows = [
            [
                _graphs_label(r) + _transport_label(r),
                *_bubble_cells(r),
                f"{r['torch_step_ms'] / r['step_ms']:.2f}x" if r.get("torch_step_ms") else "-",
            ]
            for r in records
        ]
        first = records[0]
        ms = ",".join(str(m) for m in dict.fromkeys(r["microbatches"] for r in records))
        eager_busy = [r for r in records if r.get("graphs") and r.get("busy_from") != "graphs"]
        if not parts:
            parts += [
                "### Every schedule on 4 x H100, beside torch.distributed.pipelining",
                f"{first['layers']} x (Linear({first['width']}, {first['width']}) + GELU) on 4 stages, float32, one "
                "stage a GPU. Theory: (p - 1) / (v m + p - 1) for GPipe and 1F1B (v = 1) and interleaved 1F1B "
                "(v = 2); for ZB-H1 (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W)) with "
                "equal pass times (Qi et al. 2024, section 3.1); for ZB-V the idle share of its own schedule "
                "simulated with free messages. torch: the same model and micro-batches through "
                "torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and "
                "ScheduleZBVZeroBubble, and beside ZB-H1, which it has not, its Schedule1F1B where a row names it "
                "(`torch_schedule`); `torch / ours`: its step time over ours. "
                "`(graphs)`: the same schedule with every forward and backward replayed as CUDA graphs "
                "(`PipelineParallel(graphs=True)`), the same loss and gradients; its bubble counts as compute the "
                "stage's graphed forwards and backwards run back to back. "
                '`(peer)`: the messages over peer channels (`PipelineParallel(transport="peer")`, what the '
                "default `auto` picks on one host): copies through peer memory signalled by stream memory "
                'operations; the rows without it go through NCCL\'s send and recv (`transport="group"`). '
                "`(step graph)`: a stage's whole step, messages included, one CUDA graph over the peer channels "
                '(`PipelineParallel(graphs="step")`); its bubble counts as compute the stage\'s forwards and '
                "backwards recorded as one graph and replayed.",
            ]
        if eager_busy:
            parts += [
                f"In `{name}` the graphed rows' bubble counts the eager forwards and backwards as compute, which "
                "with micro-batches of 64 rows include host time, so it reads low there: the graphed 1F1B at "
                "m = 16 is nearer 0.25 against the device time of a graphed micro-batch (docs/parallel.md)."
            ]
        parts += [
            f"#### Batch {first['batch']}" + (", the whole step one graph" if step_file else ""),
            setting(
                f"4 x {first['device']}, NVLink through NVSwitch",
                f"torch 2.11.0+cu130, NCCL {NCCL}",
                f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
                f"{first['width']} --batch {first['batch']} --microbatches {ms}"
                + _graphs_flag(records)
                + (
                    " --transport auto"
                    if step_file
                    else " --transport group,peer"
                    if any(r.get("transport") == "peer" for r in records)
                    else ""
                )
                + " (benchmarks/gpu/run.sh OUT "
                + (
                    f"bench-pipeline-step with BATCH={first['batch']}"
                    + ("" if any(r.get("graphs") is True for r in records) else " GRAPHS=step")
                    + ")"
                    if step_file
                    else "bench-pipeline-large)"
                    if "b4096" in name
                    else "bench-pipeline)"
                ),
                f"`{name}`",
            ),
            table(
                ["schedule", *_BUBBLE_HEADER, "torch / ours"],
                rows,
            ),
            *_zero_bubble_bound(records),
        ]
    return (
        parts
        + _h200_host_part("h200x4")
        + _h200_host_part("h200x2")
        + _groups_part()
        + _in_place_part()
        + _steady_part()
        + _slowest_part()
        + _fusion_part()
        + _in_place_ab_part()
        + _engines_part()
        + _device_profile_part()
        + _train_graphs_part()
        + _train_zero_bubble_part()
        + _train_balance_part()
        + _eager_decoder_part()
        + _attention_forms_part()
    )


def _slowest_part() -> list[str]:
    """1F1B and interleaved 1F1B with each stage's own compute: the bubble by the mean stage and by the slowest."""
    runs = [load(f"pipeline_slowest-b{b}-h100x4.jsonl") for b in (1024, 4096)]
    if not all(runs):
        return []
    groups = load("pipeline_slowest_groups-b1024-h100x4.jsonl")  # another launch: interleaved, g = 4 and 8
    rows = []
    for records in [*runs, groups]:
        for r in records:
            if r["graphs"] != "step":
                continue
            theory = r["bubble_theory"]
            label = r["schedule"]
            if records is groups:
                label += f", g = {r['microbatch_group']} (another launch)"
            rows.append(
                [
                    label,
                    str(r["microbatches"]),
                    str(r["batch"] // r["microbatches"]),
                    " / ".join(f"{b:.2f}" for b in r["busy_ms_per_stage"]),
                    f"{r['step_ms_steady']:.2f}",
                    f"{theory:.3f}",
                    f"{r['bubble_steady']:.3f} ({r['bubble_steady'] / theory:.2f}x)",
                    f"{r['bubble_slowest_steady']:.3f} ({r['bubble_slowest_steady'] / theory:.2f}x)",
                ]
            )
    first = runs[0][0]
    return [
        "#### The stages' own compute: the bubble of the slowest stage",
        "The theory's stages compute alike; these do not. The first stage computes no input gradient for its first "
        "layer, and the last computes the loss, so the first waits for the others whatever the schedule. Each "
        "stage's compute alone (`busy_ms_per_stage`, ms a step, stages 0-3), and the bubble by the mean stage "
        "(as above) and by the slowest one, `1 - max(busy) / step` (`bubble_slowest_steady`), which is what the "
        "schedule and its messages leave on the stage that sets the pace; steps back to back, each stage's step one "
        "graph.",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            "torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers 16 --width 4096 --batch 1024|4096 "
            "--microbatches 8,16 --schedules 1f1b,interleaved-1f1b --graphs step --transport auto --steps 8 "
            "--no-torch",
            "`pipeline_slowest-b1024-h100x4.jsonl`, `pipeline_slowest-b4096-h100x4.jsonl`; the last rows "
            "`pipeline_slowest_groups-b1024-h100x4.jsonl` (`--batch 1024 --microbatches 16 --schedules "
            "interleaved-1f1b --microbatch-group 0,8`)",
        ),
        table(
            [
                "schedule",
                "m",
                "rows a micro-batch",
                "compute ms a stage",
                "back to back ms",
                "theory",
                "bubble, mean stage",
                "bubble, slowest stage",
            ],
            rows,
        ),
    ]


def _fusion_part() -> list[str]:
    """Gradient-accumulation fusion: one layer's accumulation on one GPU, the pipeline benchmark with and without
    it, and `dtrain train` on GPT-2 124M and Llama 1B over 4 stages."""
    layer = [load(f"grad_accumulation-h100{tail}.jsonl") for tail in ("", "-run2")]
    pipes = [load(f"pipeline_fusion-b{b}-h100x4.jsonl") for b in (1024, 4096)]
    if not all(layer) or not all(pipes):
        return []
    layer_rows = [
        [
            f"{a['dtype']} into float32",
            str(a["rows"]),
            f"{a['autograd_us']:.1f} / {b['autograd_us']:.1f}",
            f"{a['fused_us']:.1f} / {b['fused_us']:.1f}",
            f"{a['speedup']:.2f}x / {b['speedup']:.2f}x",
            f"{a['autograd_max_error']:.1e} / {a['fused_max_error']:.1e}",
        ]
        for a, b in zip(*layer, strict=True)
    ]
    pipe_rows = []
    for records in pipes:
        plain = {
            (r["schedule"], r["graphs"], r["microbatches"]): r for r in records if not r["grad_accumulation_fusion"]
        }
        for r in records:
            key = (r["schedule"], r["graphs"], r["microbatches"])
            if r["grad_accumulation_fusion"] is not True or key not in plain:
                continue
            off = plain[key]
            pipe_rows.append(
                [
                    r["schedule"],
                    "step one graph" if r["graphs"] == "step" else "eager",
                    str(r["batch"]),
                    str(r["microbatches"]),
                    f"{off['step_ms_steady']:.2f}",
                    f"{r['step_ms_steady']:.2f}",
                    f"{off['step_ms_steady'] / r['step_ms_steady']:.2f}x",
                    f"{off['bubble_steady']:.3f} / {r['bubble_steady']:.3f} ({r['bubble_theory']:.3f})",
                    f"{r['torch_step_ms_steady']:.2f}",
                ]
            )
    runs = {}
    for model in ("gpt2", "llama1b"):
        for tail in ("off", "on", "auto", "graph-off", "graph-on"):
            records = [r for r in load(f"train_fusion-{model}-pp4-{tail}-h100x4.jsonl") if "step_s" in r]
            runs[model, tail] = statistics.median(r["step_s"] for r in records[10:]) * 1e3
    train_rows = [
        [
            label,
            " / ".join(f"{runs[model, t]:.1f}" for t in ("off", "on", "auto")),
            " / ".join(f"{runs[model, t]:.1f}" for t in ("graph-off", "graph-on")),
        ]
        for model, label in (
            ("llama1b", "Llama 1B, 8 micro-batches of 2 x 2048 tokens"),
            ("gpt2", "GPT-2 124M, 16 micro-batches of 1 x 1024 tokens"),
        )
    ]
    machine = "4 x NVIDIA H100 80GB HBM3, NVLink through NVSwitch"
    return [
        "#### Gradient-accumulation fusion",
        "Each micro-batch's weight gradient added into `.grad` by its GEMM (`grad_accumulation_fusion`, "
        "docs/parallel.md) against autograd's product and second pass. One layer of 4096 x 4096 on one GPU, one "
        "accumulation, microseconds, two launches (`autograd / fused`), and the largest difference from a float64 "
        "sum (autograd's / the fused one's, first launch):",
        setting(
            "1 x NVIDIA H100 80GB HBM3",
            "torch 2.11.0+cu130",
            "python benchmarks/training/grad_accumulation.py",
            "`grad_accumulation-h100.jsonl`, `grad_accumulation-h100-run2.jsonl`",
        ),
        table(["operands", "rows", "autograd us", "fused us", "speedup", "max error"], layer_rows),
        "The pipeline benchmark (16 x Linear(4096), float32) with it off and on, one launch a batch, steps back to "
        "back; the bubble by the mean stage (off / on, and the theory), and torch.distributed.pipelining's step in "
        "the same launch:",
        setting(
            machine,
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            "benchmarks/gpu/run.sh OUT pipeline-fusion (dtrain bench pipeline --layers 16 --width 4096 --batch "
            "1024|4096 --microbatches 8,16 --schedules 1f1b,interleaved-1f1b,zb-h1 --graphs step --transport auto "
            "--steps 8 --grad-fusion no,yes)",
            "`pipeline_fusion-b1024-h100x4.jsonl`, `pipeline_fusion-b4096-h100x4.jsonl`",
        ),
        table(
            ["schedule", "step", "batch", "m", "off ms", "on ms", "speedup", "bubble off / on (theory)", "torch ms"],
            pipe_rows,
        ),
        "`dtrain train`, 1F1B over 4 stages, bf16 autocast, each run its own launch one after another; the median "
        "step of steps 11-25 (Llama 1B) and 11-39 (GPT-2), ms (`auto`: every layer of a recorded step, eagerly the "
        "layers of 2^32 multiply-adds or more):",
        setting(
            machine,
            "torch 2.11.0+cu130",
            "python -m dtrain train --nproc 4 --config configs/llama-1b-gpu.toml --dp 1 --pp 4 --microbatches 8 "
            "--batch-size 16 --steps 25 --set training.compile=false [--step-graph] --grad-accumulation-fusion "
            "off|on|auto; configs/gpt2-125m-gpu.toml --pp 4 --microbatches 16 --steps 40",
            "`train_fusion-{llama1b,gpt2}-pp4[-graph]-{off,on,auto}-h100x4.jsonl`",
        ),
        table(["model", "eager off / on / auto", "step recorded off / on"], train_rows),
        *_fusion_repeats(),
        *_fusion_eager_auto(),
    ]


def _fusion_repeats() -> list[str]:
    """GPT-2 124M eagerly over 4 stages, five launches one after another with the settings alternating."""
    names = sorted(p.name for p in RESULTS.glob("train_fusion_repeat-gpt2-pp4-*-h100x4.jsonl"))
    if not names:
        return []
    runs = []
    for name in sorted(names, key=lambda n: int(n.split("-")[3])):
        records = [r for r in load(name) if "step_s" in r]
        runs.append(f"{name.split('-')[4]} {statistics.median(r['step_s'] for r in records[10:]) * 1e3:.1f} ms")
    return [
        "The eager GPT-2 step is paced by the host, and its launches differ more than its settings: five more "
        "launches one after another, 30 steps each, the median of steps 11-30 "
        "(`train_fusion_repeat-gpt2-pp4-{1..5}-{setting}-h100x4.jsonl`): " + ", ".join(runs) + "."
    ]


def _fusion_eager_auto() -> list[str]:
    """`--grad-fusion no,auto` eagerly at batch 4096, m = 16 (256 rows a micro-batch: 2^32 multiply-adds a layer)."""
    records = load("pipeline_fusion_eager-b4096-h100x4.jsonl")
    if not records:
        return []
    pairs = []
    for schedule in ("1f1b", "interleaved-1f1b"):
        by = {r["grad_accumulation_fusion"]: r for r in records if r["schedule"] == schedule}
        if False in by and "auto" in by:
            off, auto = by[False]["step_ms_steady"], by["auto"]["step_ms_steady"]
            pairs.append(f"{schedule} {off:.2f} ms off, {auto:.2f} ms with `auto` ({off / auto:.2f}x)")
    return [
        "Eagerly with `auto` at 256 rows a micro-batch, where every layer's product has 2^32 multiply-adds and fuses "
        "(`--batch 4096 --microbatches 16 --grad-fusion no,auto`, steps back to back, another launch, "
        "`pipeline_fusion_eager-b4096-h100x4.jsonl`): " + "; ".join(pairs) + "."
    ]


def _steady_part() -> list[str]:
    """`dtrain bench pipeline` with each step timed alone and in a run of steps back to back, every schedule."""
    parts = []
    for name in ("pipeline_steady-b1024-h100x4.jsonl", "pipeline_steady-b4096-h100x4.jsonl"):
        records = load(name)
        if not records:
            continue
        first = records[0]
        if not parts:
            parts += [
                "#### Every schedule, each step alone and steps back to back",
                "`step ms` times each step alone (a barrier and a synchronization before it, a synchronization "
                "after), `back to back` a run of 8 steps with one synchronization at each end, as a training loop "
                "runs them; the bubble by each against the same compute alone. torch.distributed.pipelining's step, "
                "timed both ways in the same launch, on the same model and micro-batches (ZB-H1 beside its 1F1B).",
            ]
        rows = []
        for r in records:
            torch_ms = r.get("torch_step_ms_steady")
            rows.append(
                [
                    _graphs_label(r),
                    str(r["microbatches"]),
                    str(r["batch"] // r["microbatches"]),
                    f"{r['bubble_theory']:.3f}",
                    f"{r['step_ms']:.2f}",
                    f"{r['bubble_measured']:.3f}",
                    f"{r['step_ms_steady']:.2f}",
                    f"{r['bubble_steady']:.3f}",
                    f"{r['bubble_steady'] / r['bubble_theory']:.2f}x",
                    f"{torch_ms:.2f}" if torch_ms else "-",
                    f"{torch_ms / r['step_ms_steady']:.2f}x" if torch_ms else "-",
                ]
            )
        parts += [
            setting(
                f"4 x {first['device']}, NVLink through NVSwitch",
                f"torch 2.11.0+cu130, NCCL {NCCL}",
                f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
                f"{first['width']} --batch {first['batch']} --microbatches 8,16 --graphs step --transport auto "
                f"--steps 8 (benchmarks/gpu/run.sh OUT pipeline-steady)",
                f"`{name}`",
            ),
            table(
                [
                    "schedule",
                    "m",
                    "rows a micro-batch",
                    "theory",
                    "step ms",
                    "bubble",
                    "back to back ms",
                    "bubble",
                    "bubble / theory",
                    "torch back to back ms",
                    "torch / ours",
                ],
                rows,
            ),
        ]
    return parts


def _in_place_ab_part() -> list[str]:
    """`dtrain bench pipeline --in-place yes,no,yes`: messages computed on in their slots or on copies, one launch."""
    name = "pipeline_in_place_ab-b1024-h100x4.jsonl"
    records = load(name)
    if not records:
        return []
    first = records[0]
    rows = [
        [_graphs_label(r), "in its slot" if r["in_place"] else "copied out", *_bubble_cells(r)[:6]] for r in records
    ]
    return [
        "#### In place or copied, one launch",
        "Each stage computing on its messages in their peer-channel slots against copying each out first, in one "
        "launch, the in-place variant timed before and after the copied one.",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
            f"{first['width']} --batch {first['batch']} --microbatches 16 --schedules 1f1b,interleaved-1f1b "
            "--graphs step --transport peer --no-torch --in-place yes,no,yes (benchmarks/gpu/run.sh OUT "
            "pipeline-engines)",
            f"`{name}`",
        ),
        table(["schedule", "message", *_BUBBLE_HEADER[:6]], rows),
    ]


def _engines_part() -> list[str]:
    """`dtrain bench pipeline --send-engine`: where a message's copy into the next stage's slot runs, one launch."""
    name = "pipeline_engines-b1024-h100x4.jsonl"
    records = load(name)
    if not records:
        return []
    first = records[0]
    order, steps = [], {}
    for r in records:
        key = (_graphs_label(r), r["microbatches"])
        if key not in steps:
            order.append(key)
        steps.setdefault(key, []).append((r["send_engine"], r["step_ms"]))
    engines = [e for e, _ in steps[order[0]]]
    rows = [[label, str(m), *(f"{ms:.2f}" for _, ms in steps[label, m])] for label, m in order]
    return [
        "#### Where a message is copied",
        "Step ms with each stage's messages copied into the next stage's slot by a copy engine on a stream of the "
        "channel's (`stream`, the default), by a copy engine on the compute stream (`inline`), or by an elementwise "
        "kernel on the compute stream storing over the peer mapping (`kernel`), in one launch, `stream` timed first "
        "and last (`dtrain bench pipeline --send-engine`). What one message costs in each way, kernel to kernel "
        "across two GPUs: `probe-channel-latency-h100x2.txt` (`benchmarks/collectives/probe.py channel-latency`).",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
            f"{first['width']} --batch {first['batch']} --microbatches 8,16 --schedules 1f1b,interleaved-1f1b "
            "--graphs step --transport peer --no-torch --send-engine stream,inline,kernel,stream "
            "(benchmarks/gpu/run.sh OUT pipeline-engines)",
            f"`{name}`",
        ),
        table(["schedule", "m", *engines], rows),
    ]


def _in_place_part() -> list[str]:
    """`dtrain bench pipeline` after stages compute on their messages in the peer channels' slots."""
    name = "pipeline_in_place-b1024-h100x4.jsonl"
    records = load(name)
    if not records:
        return []
    first = records[0]
    return [
        "#### Messages computed on in their slots",
        "The same model with each stage computing on its messages where they landed in the peer channels' slots "
        "(`PipelineParallel(in_place=True)`, the default since this launch; every row), eager and the step one "
        "graph, beside torch's; the launches that took the figures above copied each message out of its slot first.",
        setting(
            f"4 x {first['device']}, NVLink through NVSwitch",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
            f"{first['width']} --batch {first['batch']} --microbatches 16 --schedules 1f1b,interleaved-1f1b,zb-h1 "
            "--graphs step --transport auto",
            f"`{name}`",
        ),
        table(["schedule", *_BUBBLE_HEADER], [[_graphs_label(r), *_bubble_cells(r)] for r in records]),
    ]


def _device_profile_part() -> list[str]:
    """`benchmarks/pipeline/device_profile.py`: per GPU, the step's kernels, the same compute alone, and idle."""
    parts = []
    for name in (
        "pipeline_device_profile-b1024-h100x4.jsonl",
        "pipeline_device_profile_fifths-b1024-h100x4.jsonl",
        "pipeline_device_profile_in_place-b1024-h100x4.jsonl",
    ):
        records = load(name)
        if not records:
            continue
        if not parts:
            parts += [
                "#### Where a step's time goes, per GPU",
                "Each stage's step recorded as one CUDA graph and replayed under torch.profiler (5 steps), batch "
                "1024, m = 16, float32. Per stage, ms a step: `kernels`: the step's kernels but NCCL's and the "
                "end-of-step loss broadcast's (whose spin is the stage waiting); `alone`: the same forwards and "
                "backwards back to back; `idle`: the step less the time any kernel or copy ran, the broadcast's "
                "spin included; `middle`: idle in the step's second, third and fourth fifths, where the theory has "
                "none. The in-place file is of the launch after stages computed on their messages in their slots. "
                "ZB-H1's `alone` runs each backward whole, not split in B and W.",
            ]
        rows = []
        for r in records:
            spins = [k["step"].get("exchange_kernel", [0.0, 0.0])[0] for k in r["kernels_per_rank"]]
            fifths = r.get("idle_by_fifth_ms") or [None] * len(spins)
            for rank, (x, spin, fifth) in enumerate(zip(r["per_rank"], spins, fifths, strict=True)):
                rows.append(
                    [
                        r["schedule"] + (f" g{r['microbatch_group']}" if r.get("microbatch_group") else ""),
                        f"{r['step_ms']:.2f}",
                        str(rank),
                        f"{x['compute_ms'] - spin:.2f}",
                        f"{x['alone_ms']:.2f}",
                        f"{x['idle_ms'] + spin:.2f}",
                        f"{r['bubble_theory'] * r['step_ms']:.2f}",
                        "-" if fifth is None else f"{sum(fifth[1:4]):.2f}",
                    ]
                )
        parts += [
            setting(
                f"4 x {records[0]['device']}, NVLink through NVSwitch",
                f"torch 2.11.0+cu130, NCCL {NCCL}",
                "torchrun --nproc-per-node 4 benchmarks/pipeline/device_profile.py --microbatches 16 --batch 1024",
                f"`{name}`",
            ),
            table(["schedule", "step ms", "stage", "kernels", "alone", "idle", "theory's idle", "middle"], rows),
        ]
    return parts


def _graphs_label(row: dict) -> str:
    """A bench_pipeline row's schedule and how its steps ran: eagerly, as per-action graphs or as one graph."""
    return row["schedule"] + {False: "", True: " (graphs)", "step": " (step graph)"}[row.get("graphs", False)]


#: the columns of :func:`_bubble_cells`
_BUBBLE_HEADER = ["m", "rows a micro-batch", "theory", "measured", "measured / theory", "step ms", "torch step ms"]


def _bubble_cells(row: dict) -> list[str]:
    """m, rows a micro-batch, the theory's and the measured bubble, their ratio, the step and torch's step."""
    return [
        str(row["microbatches"]),
        str(row["batch"] // row["microbatches"]),
        f"{row['bubble_theory']:.3f}",
        f"{row['bubble_measured']:.3f}",
        f"{row['bubble_measured'] / row['bubble_theory']:.2f}x",
        f"{row['step_ms']:.2f}",
        f"{row['torch_step_ms']:.2f}" if row.get("torch_step_ms") else "-",
    ]


def _groups_part() -> list[str]:
    """`dtrain bench pipeline --microbatch-group`: interleaved 1F1B with micro-batches in groups of p and 2p beside
    1F1B, eager and recorded, on 4 H100s."""
    parts = []
    for name in ("pipeline_groups-b1024-h100x4.jsonl", "pipeline_groups-b4096-h100x4.jsonl"):
        records = load(name)
        if not records:
            continue
        first = records[0]
        if not parts:
            parts.append(
                "#### Interleaved 1F1B in micro-batch groups\n\n"
                "Interleaved 1F1B with its micro-batches through the chunks in groups of `g` (`p` = 4 is "
                "Megatron-LM's; 8 leaves four forwards of slack before rank 0 needs the last rank's output) beside "
                "1F1B, over the peer channels, eager, per-action graphs and the step one graph. `held`: the "
                "(chunk, micro-batch) activations the first stage holds at its peak, by its schedule. The launch's "
                "time limit ended each sweep before `g` = 16."
            )
        ms = ",".join(str(m) for m in dict.fromkeys(r["microbatches"] for r in records))
        rows = [
            [_graphs_label(r), str(r["microbatch_group"] or "-"), *_bubble_cells(r), str(r["held_first_stage"])]
            for r in records
        ]
        parts += [
            f"Batch {first['batch']}:",
            setting(
                f"4 x {first['device']}, NVLink through NVSwitch",
                f"torch 2.11.0+cu130, NCCL {NCCL}",
                f"torchrun --nproc-per-node 4 -m dtrain bench pipeline --layers {first['layers']} --width "
                f"{first['width']} --batch {first['batch']} --microbatches {ms} --schedules 1f1b,interleaved-1f1b "
                "--microbatch-group 0,8,16 --graphs actions,step --transport auto (benchmarks/gpu/run.sh OUT "
                "pipeline-groups)",
                f"`{name}`",
            ),
            table(
                ["schedule", "g", *_BUBBLE_HEADER, "held"],
                rows,
            ),  # fmt: skip
        ]
    return parts


def _median_gap(rows: list[dict], batch: int, transport: str, worst: bool = False) -> float:
    """The median (or largest) |device-only predicted bubble - measured bubble| of ``rows`` at ``batch``."""
    gaps = [
        abs(r["device_bubble"] - r["measured_bubble"])
        for r in rows
        if (r["batch"], r.get("transport", "group")) == (batch, transport)
    ]
    return max(gaps) if worst else statistics.median(gaps)


def _transport_label(row: dict) -> str:
    return " (peer)" if row.get("transport") == "peer" else ""


def _h200_host_part(machine: str) -> list[str]:
    """`dtrain bench pipeline` on every GPU of one H200 host (``machine``: ``h200x2``, ``h200x4``): every schedule,
    eager and the step one graph, beside torch's."""
    parts = []
    for batch in (1024, 4096):
        name = f"bench_pipeline_step-b{batch}-{machine}.jsonl"
        records = load(name)
        if not records:
            continue
        first = records[0]
        p = first["stages"]
        if not parts:
            parts += [
                f"### Every schedule on {p} x {first['device'].removeprefix('NVIDIA ')}, beside "
                "torch.distributed.pipelining",
                f"The model above on {p} stages, one a GPU, every message over the peer channels "
                "(`--transport auto`), eager and the step one graph, in one launch a batch. `slowest stage` is the "
                "bubble by the stage that sets the pace, `1 - max(busy) / step` (steps back to back), beside the "
                "mean stage's."
                + (
                    " With two stages the theory's bubble is small (0.01-0.11) and the first stage's lighter compute "
                    "(no input gradient for its first layer) is a larger share of what is measured above it."
                    if p == 2
                    else ""
                ),
            ]
        ms = ",".join(str(m) for m in dict.fromkeys(r["microbatches"] for r in records))
        rows = [
            [
                _graphs_label(r) + _transport_label(r),
                *_bubble_cells(r),
                f"{r['torch_step_ms'] / r['step_ms']:.2f}x" if r.get("torch_step_ms") else "-",
                f"{r['bubble_slowest_steady']:.3f}" if r.get("bubble_slowest_steady") is not None else "-",
            ]
            for r in records
        ]
        parts += [
            f"#### {p} stages, batch {batch}",
            setting(
                f"{p} x {first['device']} (one host)",
                f"torch 2.11.0+cu130, NCCL {NCCL}",
                f"torchrun --nproc-per-node {p} -m dtrain bench pipeline --layers {first['layers']} --width "
                f"{first['width']} --batch {batch} --microbatches {ms}{_graphs_flag(records)} --transport auto",
                f"`{name}`",
            ),
            table(["schedule", *_BUBBLE_HEADER, "torch / ours", "slowest stage"], rows),
            *_zero_bubble_bound(records),
        ]
    return parts


def _zero_bubble_bound(records: list[dict]) -> list[str]:
    """How far ZB-H1 could go against torch's 1F1B on these rows: torch's step over ZB-H1's compute alone (no
    bubble at all) and over that compute with the theory's bubble."""
    torch_1f1b = {r["microbatches"]: r["torch_step_ms"] for r in records if r["schedule"] == "1f1b"}
    cells = []
    for r in records:
        theirs = r.get("torch_step_ms") or torch_1f1b.get(r["microbatches"])
        if r["schedule"] != "zb-h1" or not theirs:
            continue
        compute = (1 - r["bubble_measured"]) * r["step_ms"]  # the stages' compute, as this row ran it
        at_theory = compute / (1 - r["bubble_theory"])
        cells.append(
            f"m {r['microbatches']}{_graphs_label(r).removeprefix(r['schedule'])}{_transport_label(r)}: "
            f"{theirs / r['step_ms']:.2f}x "
            f"measured, {theirs / at_theory:.2f}x at the theory's bubble, {theirs / compute:.2f}x with none"
        )
    if not cells:
        return []
    return [
        "ZB-H1 against torch's Schedule1F1B, and what its compute allows (torch's step over ZB-H1's compute as "
        "measured, with the theory's bubble and with no bubble at all): " + "; ".join(cells) + "."
    ]


def _train_zero_bubble_part() -> list[str]:
    """`dtrain train` of Llama 1B on 4 stages under 1F1B, ZB-H1 and ZB-V, eager and each stage's step recorded."""
    rows = []
    for graph in ("", "graph-"):
        for schedule in ("1f1b", "zb-h1", "zb-v"):
            name = f"train_zero_bubble-llama1b-pp4-{graph}{schedule}-h200x4.jsonl"
            records = load(name)
            if not records:
                continue
            timed = [r for r in records if r["step"] > 10]
            rows.append(
                (
                    schedule + (" (step graph)" if graph else ""),
                    statistics.median(r["step_s"] for r in timed),
                    statistics.median(r["tokens_per_s"] for r in timed),
                    max(r["peak_memory_gib"] for r in records),
                    records[-1]["loss"],
                    name,
                )
            )
    if not rows:
        return []
    base = {graph: next(step for label, step, *_ in rows if label == "1f1b" + graph) for graph in ("", " (step graph)")}
    return [
        "### Zero-bubble schedules in `dtrain train`, Llama 1B on 4 x H200",
        setting(
            "4 x NVIDIA H200 (one host, NVLink)",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            "torchrun --nproc-per-node 4 -m dtrain train --preset 1b --pp 4 --microbatches 8 --schedule SCHEDULE "
            "[--step-graph] --seq-len 2048 --batch-size 16 --steps 30 --lr 3e-4 --warmup-steps 5 --set "
            "data.tokenizer_vocab=8192 --precision bf16 --no-export --no-tensorboard",
            "`train_zero_bubble-llama1b-pp4-[graph-]{1f1b,zb-h1,zb-v}-h200x4.jsonl`",
        ),
        "Each run its own launch, one after another; the median step of steps 11-30. ZB-V's order is built for the "
        "model's FLOPs of each pass (T_F : T_B : T_W about 1 : 1.1 : 0.9 at 2,048 tokens). The V puts both the "
        "embedding and the 128,256-word head on the first stage, which then computes more than any stage of "
        "1F1B or ZB-H1 (whose last stage holds the head alone), and holds more activations.",
        table(
            ["schedule", "step ms", "tokens/s", "1F1B's step / this", "peak GiB", "loss at step 30"],
            [
                [
                    label,
                    f"{step * 1e3:.1f}",
                    f"{tokens:,.0f}",
                    f"{base[' (step graph)' if 'graph' in label else ''] / step:.2f}x",
                    f"{peak:.1f}",
                    f"{loss:.4f}",
                ]
                for label, step, tokens, peak, loss, _ in rows
            ],
        ),  # fmt: skip
    ]


def _train_balance_part() -> list[str]:
    """`dtrain train` of Llama 1B on 4 stages, each schedule with stages of equal layer counts and of equal FLOPs,
    in two allocations of the machine (`lease1`, `lease2`); the second's metrics carry the bubble on the devices'
    clock."""
    schedules = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for schedule in schedules:
        for balance in ("layers", "flops"):
            for lease in (1, 2):
                name = f"train_balance-llama1b-pp4-{schedule}-{balance}-h200x4-lease{lease}.jsonl"
                if (RESULTS / name).exists():
                    runs[schedule, balance, lease] = load(name)
    if not runs:
        return []

    def step(key: tuple[str, str, int]) -> float | None:
        records = runs.get(key)
        return statistics.median(r["step_s"] for r in records if r["step"] > 10) if records else None

    rows = []
    for schedule in schedules:
        for balance in ("layers", "flops"):
            steps = [step((schedule, balance, lease)) for lease in (1, 2)]
            if not any(steps):
                continue
            last = runs.get((schedule, balance, 2), [{}])[-1]
            base = step(("1f1b", "layers", 2))
            layers = step((schedule, "layers", 2))
            rows.append(
                [
                    schedule,
                    balance,
                    " / ".join(f"{s * 1e3:.1f}" if s else "-" for s in steps),
                    f"{layers / steps[1]:.2f}x" if layers and steps[1] else "-",
                    f"{base / steps[1]:.2f}x" if base and steps[1] else "-",
                    f"{last['bubble_measured']:.3f} / {last['bubble_theory']:.3f}"
                    if last.get("bubble_clock") == "device"
                    else "-",
                    f"{max(r['peak_memory_gib'] for r in runs[schedule, balance, 2]):.1f}"
                    if (schedule, balance, 2) in runs
                    else "-",
                    f"{last['loss']:.4f}" if last else "-",
                ]
            )
    return [
        "### Pipeline stages cut by FLOPs in `dtrain train`, Llama 1B on 4 x H200",
        setting(
            "4 x NVIDIA H200 (one host, NVLink)",
            f"torch 2.11.0+cu130, NCCL {NCCL}",
            "torchrun --nproc-per-node 4 -m dtrain train --preset 1b --pp 4 --microbatches 8 --schedule SCHEDULE "
            "--balance {layers,flops} --seq-len 2048 --batch-size 16 --steps 30 --lr 3e-4 --warmup-steps 5 --set "
            "data.tokenizer_vocab=8192 --precision bf16 --no-export --no-tensorboard",
            "`train_balance-llama1b-pp4-{1f1b,interleaved-1f1b,zb-h1,zb-v}-{layers,flops}-h200x4-lease{1,2}.jsonl`"
            + "".join(
                f", but for {s} with equal {b} in allocation {n}"
                for s in schedules
                for b in ("layers", "flops")
                for n in (1, 2)
                if (s, b, n) not in runs
            ),  # fmt: skip
        ),
        "Each run its own launch, one after another, in two allocations of the machine (`-lease1`, `-lease2`); the "
        "median step of steps "
        "11-30. Llama 3.2 1B's head (128,256 x 2,048, tied to the embedding) costs 4.3 blocks' forward FLOPs. "
        "Equal layer counts (18 layers: embedding, 16 blocks, head) leave the head's stage 1.44x the mean stage's "
        "FLOPs; `--balance flops` cuts 6 / 5 / 5 / 2 layers (the head beside one block) and, under interleaving "
        "and the V, balances each rank's chunks together (1.05x the mean; `dtrain.parallel.pipeline_parallel."
        "partition_layers`). Ratios and the bubble are the second allocation's; the bubble is the last step's on the "
        "devices' clock (`bubble_clock` \"device\"), the stages' mean idle share, beside the theory for equal "
        "stages.",
        table(
            [
                "schedule",
                "balance",
                "step ms, allocation 1 / 2",
                "vs equal layers",
                "vs 1F1B, equal layers",
                "bubble / theory",
                "peak GiB",
                "loss at step 30",
            ],
            rows,
        ),
    ]


def _attention_forms_part() -> list[str]:
    """Three choices in dtrain.models' block, each form of one Llama 1B block side by side on one H200."""
    name = "attention_forms-llama1b-h200x1.jsonl"
    if not (RESULTS / name).exists():
        return []
    records = [r for r in load(name) if r["form"] != "model"]  # the explicit forms; "model" is the code of the run
    forms = list(dict.fromkeys(r["form"] for r in records))
    rounds = sorted({r["round"] for r in records})
    built = "each-call+grouped+shared"  # dtrain.models' form
    rows, forward, backward, saved = [], {}, {}, {}
    for b in sorted({r["micro_batch"] for r in records}):
        by = {(r["form"], r["round"]): r for r in records if r["micro_batch"] == b}
        for form in forms:
            mine = [by[form, k] for k in rounds]
            ratio = [m["graph_F_ms"] / by[built, k]["graph_F_ms"] for m, k in zip(mine, rounds, strict=True)]
            forward.setdefault(form, []).extend(ratio)
            backward.setdefault(form, []).extend(m["graph_B_ms"] / by[built, k]["graph_B_ms"]
                                                 for m, k in zip(mine, rounds, strict=True))  # fmt: skip
            saved.setdefault(form, []).append(mine[0]["saved_bytes"] / by[built, rounds[0]]["saved_bytes"])
            rows.append([b, form, " / ".join(f"{m['graph_F_ms']:.3f}" for m in mine),
                         " / ".join(f"{m['graph_B_ms']:.3f}" for m in mine),
                         " / ".join(f"{m['host_F_ms']:.2f}" for m in mine),
                         " / ".join(f"{x:.3f}x" for x in ratio), f"{mine[0]['saved_bytes'] / 2**20:.0f}",
                         f"{max(m.get('max_abs_diff_dx', 0.0) for m in mine):.1g}"])  # fmt: skip
    span = lambda v: f"{min(v):.2f}-{max(v):.2f}x"  # noqa: E731
    old = "each-call+repeated+each"
    return [
        "### Attention forms on one H200",
        setting(
            "1 x NVIDIA H200",
            f"torch {records[0]['torch']}",
            "python benchmarks/gpu/attention_forms.py --rounds 2",
            f"`{name}`",
        ),
        "One Llama 3.2 1B block (32 query heads, 8 key-value heads, sequence 2,048), forward and backward under "
        "bf16 autocast with 32-bit weights, in five forms run side by side in one process: the rotary cos and sin "
        "tables computed in every forward (`each-call`, seven kernels) or once and kept (`kept`); the key-value "
        "heads repeated to every query head before `scaled_dot_product_attention` (`repeated`) or read in place "
        "(`grouped`, `enable_gqa`); each product's 32-bit input cast by autocast apart (`each`: q, k, v, gate, "
        f"up) or attention's and the MLP's once (`shared`). dtrain.models runs `{built}`. Forward and backward "
        "replayed as CUDA graphs (the device alone; cuDNN's attention every time), the host's time to issue the "
        f"eager forward (round 1 / round 2), the forward against `{built}`'s, the bytes the forward leaves for "
        "backward, and the largest difference of the input's gradient from the block as built (the outputs agree "
        f"bit for bit; casting apart sums q's, k's and v's gradients in 32 bits, the shared cast in 16). `{old}`, "
        f"the block with neither change, runs the forward {span(forward[old])} and the backward "
        f"{span(backward[old])} as long on the device as `{built}`, and keeps {span(saved[old])} its bytes for "
        "backward; repeating the heads alone "
        f"(`each-call+repeated+shared`): {span(forward['each-call+repeated+shared'])} forward, "
        f"{span(saved['each-call+repeated+shared'])} bytes; casting apart alone (`each-call+grouped+each`): "
        f"{span(forward['each-call+grouped+each'])} forward, {span(backward['each-call+grouped+each'])} "
        f"backward, {span(saved['each-call+grouped+each'])} bytes. Keeping the tables: "
        f"{span(forward['kept+grouped+shared'])} forward; dtrain.models does not keep them, as a value made in one "
        "forward and kept for the next makes a selective checkpoint's recomputation run other operations than its "
        "forward did (torch's selective checkpointing replays operations by count).",
        table(
            [
                "micro-batch",
                "form",
                "graph forward ms",
                "graph backward ms",
                "host forward ms",
                f"forward vs {built}",
                "saved MiB",
                "input gradient, max diff",
            ],
            rows,
        ),  # fmt: skip
    ]


def _eager_decoder_part() -> list[str]:
    """dtrain.models' Llama 1B block and head, one micro-batch at a time on one H200, beside the simulator's prices
    with the fused layer and with `kernels="dtrain"`; then the 4-stage runs above, simulated both ways."""
    runs = [load(f"eager_ops-llama1b-h200x1-run{n}.jsonl") for n in (1, 2)]
    if not all(runs):
        return []
    from dtrain.cluster.presets import preset as topology_preset
    from dtrain.models.presets import preset as model_preset
    from dtrain.sim.compute import DEVICE_COMPUTE, device_compute, price, stage_ops
    from dtrain.sim.model import EagerForm, Layout
    from dtrain.sim.placement import place
    from dtrain.sim.step import StepConfig, simulate_step
    from dtrain.train.plan import model_spec

    RUNS_FORM = EagerForm(shared_inputs=False, repeat_kv=True)  # noqa: N806 (the runs' layer)
    spec = model_spec(model_preset("llama", "1b"), 2048, name="1b")
    topo = topology_preset("h200-4gpu")
    h200 = DEVICE_COMPUTE["h200-sxm"]
    device = device_compute(h200.peak_flops, h200.memory_bytes_per_s)  # with the H200's measured curves
    timing = [{r["micro_batch"]: r["timing"] for r in run if r["record"] == "timing"} for run in runs]

    def priced(b: int, kernels: str, part: str, backward: bool) -> float:
        ops = stage_ops(spec, Layout(micro_batch=b, global_batch=b, attention="flash"), 0, kernels)
        return 1e3 * sum(price(op, device) for op in ops["layer" if part == "block" else "last"]
                         if (op.phase != "F") == backward)  # fmt: skip

    rows = []
    for b in sorted(timing[1]):
        for part in ("block", "head"):
            for backward, name in ((False, "F"), (True, "B")):
                eager = " / ".join(f"{t[b][f'{part}-eager-{name}-ms']:.2f}" for t in timing if b in t)
                host = " / ".join(f"{t[b][f'{part}-host-{name}-ms']:.2f}" for t in timing if b in t)
                graph = timing[1][b].get(f"{part}-graph-{name}-ms")
                fused, eager_priced = priced(b, "fused", part, backward), priced(b, "dtrain", part, backward)
                rows.append([b, part, "forward" if name == "F" else "backward", eager, host,
                             f"{graph:.2f}" if graph else "not captured", f"{fused:.2f}", f"{eager_priced:.2f}",
                             f"{eager_priced / graph - 1:+.0%}" if graph else "-"])  # fmt: skip
    pipeline = []
    for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)):
        for balance in ("layers", "flops"):
            measured, peaks = [], []
            for lease in (1, 2):
                name = f"train_balance-llama1b-pp4-{schedule}-{balance}-h200x4-lease{lease}.jsonl"
                if (RESULTS / name).exists():
                    records = load(name)
                    measured.append(1e3 * statistics.median(r["step_s"] for r in records if r["step"] > 10))
                    peaks.append(max(r["peak_memory_gib"] for r in records))
            if not measured:
                continue
            layout = Layout(pp=4, micro_batch=2, global_batch=16, schedule=schedule, chunks=chunks,
                            attention="flash", balance=balance)  # fmt: skip
            # priced as the runs' attention ran: grouped-query keys and values repeated to every head
            sims = [simulate_step(spec, layout, topo, place(topo, layout), StepConfig(kernels=k, eager=RUNS_FORM))
                    for k in ("fused", "dtrain")]  # fmt: skip
            steps = [1e3 * r.step_s for r in sims]
            pipeline.append([schedule, balance, " / ".join(f"{m:.1f}" for m in measured),
                             f"{steps[0]:.1f}", " / ".join(f"{steps[0] / m - 1:+.0%}" for m in measured),
                             f"{steps[1]:.1f}", " / ".join(f"{steps[1] / m - 1:+.0%}" for m in measured),
                             f"{max(peaks):.1f}",
                             " / ".join(f"{r.memory.total / 2**30:.1f}" for r in sims)])  # fmt: skip
    errors = {k: [abs(float(e.strip("%+")) / 100) for row in pipeline for e in row[i].split(" / ")]
              for k, i in (("fused", 4), ("dtrain", 6))}  # fmt: skip
    return [
        "### dtrain's eager decoder, operation by operation, beside the simulator (Llama 1B, 1 x H200)",
        setting(
            "1 x NVIDIA H200 (two allocations of the machine)",
            f"torch {runs[1][0]['torch']}",
            "python benchmarks/gpu/eager_ops.py --repeat 20 --timed 1,2,4",
            "`eager_ops-llama1b-h200x1-run{1,2}.jsonl`; the 4-stage runs of the section above",
        ),
        "One Llama 3.2 1B block, and the final norm, output layer (128,256 x 2,048) and loss, forward and backward "
        "under bf16 autocast with 32-bit weights, as `dtrain train --precision bf16` runs them: CUDA-event times of "
        "each pass (median of 20, the backward including the gradients' accumulation), eager and replayed as a CUDA "
        "graph (the device alone), and the host's time to issue "
        "the eager pass (run 1 / run 2). Priced: the simulator's per-operation prices on the H200's curves "
        'with the fused layer (`kernels = "fused"`) and with dtrain.models\' own operations (`kernels = '
        '"dtrain"`: 32-bit residual stream and norms, the casts autocast makes, unfused RoPE and SwiGLU, the '
        "32-bit loss; `dtrain.sim.compute`), whose bytes a test holds to the aten operations recorded in the same "
        "file. The error is `dtrain` against the graph.",
        table(
            ["micro-batch", "part", "pass", "eager ms", "host ms", "graph ms", "fused ms", "dtrain ms", "error"],
            rows,
        ),
        "The 4-stage runs of the section above (median step, allocation 1 / 2; their layer cast each "
        "projection's input apart and repeated the grouped-query keys and values to every head, and is priced so: "
        "`EagerForm(shared_inputs=False, repeat_kv=True)`) against "
        "`simulate_step` on "
        "`h200-4gpu` with each kernel set (`dtrain plan --config` prices with `dtrain`), and the peak memory "
        "(`torch.cuda.max_memory_allocated`, as `dtrain train` records it) beside the memory model's with each "
        "set. Step time, median / worst |error|: "
        f"fused {statistics.median(errors['fused']):.0%} / {max(errors['fused']):.0%}, dtrain "
        f"{statistics.median(errors['dtrain']):.0%} / {max(errors['dtrain']):.0%}.",
        table(
            [
                "schedule",
                "balance",
                "measured ms",
                "fused ms",
                "error",
                "dtrain ms",
                "error",
                "peak GiB",
                "priced GiB, fused / dtrain",
            ],
            pipeline,
        ),  # fmt: skip
    ]


def _train_graphs_part() -> list[str]:
    """`dtrain train` with and without `[parallel] pipeline_graphs` (or `step_graph`, recorded under its earlier
    name `pipeline_step_graph`), the same run otherwise."""
    parts = []
    for name, key, title in (
        ("train_pipeline_graphs-h200x2.jsonl", "pipeline_graphs", "pipeline graphs"),
        ("train_pipeline_step_graph-h100x4.jsonl", "pipeline_step_graph", "the whole step one graph"),
    ):
        records = load(name)
        if not records:
            continue
        rows = [
            [
                "yes" if r[key] else "no",
                f"{r['final_loss']:.6f}",
                f"{r['last_step_s'] * 1e3:.1f}",
                f"{r['last_compute_s'] * 1e3:.1f}",
                f"{r['tokens_per_s'] / 1e3:.0f} k",
            ]
            for r in records
        ]
        first = records[0]
        parts += [
            f"### `dtrain train` with {title}",
            f"{first['what']}; the step and compute times are the last step's. The losses of every step are equal "
            f"(largest difference {records[-1]['max_loss_diff_over_steps']}).",
            setting(
                first["device"] + ", NVLink",
                f"torch {first['torch_version']}",
                first["command"].replace("--pipeline-step-graph", "--step-graph"),  # the flag's name today
                f"`{name}`",
            ),
            table(
                [
                    key.removeprefix("pipeline_") if key.endswith("step_graph") else key,
                    "final loss",
                    "step ms",
                    "compute ms",
                    "tokens/s",
                ],
                rows,
            ),
        ]
    return parts


# -------------------------------------------------------------------------------------------------- parameter server


def section_ps() -> str:
    thr = [r for r in load("ps_throughput-cpu2.jsonl") if r["bench"] == "throughput"]
    hmac = next(r for r in load("ps_throughput-cpu2.jsonl") if r["bench"] == "hmac")
    strag = load("ps_straggler-cpu2.jsonl")
    hot = load("ps_hot_keys-cpu2.jsonl")
    fail = load("ps_failover-cpu2.jsonl")
    return "\n\n".join(
        [
            "## Parameter server",
            setting(
                CPU + ", loopback, shared with other jobs",
                "Python 3.11, ZeroMQ",
                "python benchmarks/ps/bench.py",
                "`ps_throughput-cpu2.jsonl`, `ps_straggler-cpu2.jsonl`, `ps_hot_keys-cpu2.jsonl`, "
                "`ps_failover-cpu2.jsonl`",
            ),
            f"Push+pull throughput against a raw ZeroMQ transfer of the same bytes in the same pattern (the "
            f"ceiling); 4 MiB a server a pull. HMAC-SHA256 alone runs at {hmac['hmac_sha256_gb_s']:.2f} GB/s here.",
            table(
                ["workers", "servers", "PS GB/s", "raw ZeroMQ GB/s", "PS / raw"],
                [
                    [
                        str(r["workers"]),
                        str(r["servers"]),
                        f"{r['ps_gb_s']:.3f}",
                        f"{r['raw_zeromq_gb_s']:.3f}",
                        f"{r['ratio']:.2f}",
                    ]
                    for r in thr
                ],
            ),
            "![parameter-server throughput](figures/ps-throughput.png)",
            "One worker slowed 5x: iteration time of the fast workers.",
            table(
                ["case", "mode", "fast worker s", "vs no straggler", "dropped"],
                [
                    [
                        r["case"],
                        r["mode"],
                        f"{r['fast_worker_iteration_s']:.3f}",
                        f"{r['vs_no_straggler']:.2f}x",
                        str(r["dropped"]),
                    ]
                    for r in strag
                ],
            ),
            "Load imbalance on a Zipf workload (max / mean rows served per server), with and without hot-key copies.",
            table(
                ["zipf", "hot keys a server", "rows max / mean", "requests max / mean"],
                [
                    [
                        f"{r['zipf']:g}",
                        str(r["hot_keys_per_server"]),
                        f"{r['rows_max_over_mean']:.2f}",
                        f"{r['requests_max_over_mean']:.2f}",
                    ]
                    for r in hot
                ],
            ),
            "A server killed (`kill -9`): time until training goes on, and acknowledged updates lost.",
            table(
                ["replication", "recovery s", "lost acknowledged updates", "failovers"],
                [
                    [
                        r["replication"],
                        f"{r['recovery_s']:.2f}",
                        str(r["lost_acknowledged_updates"]),
                        str(r["failovers"]),
                    ]
                    for r in fail
                ],
            ),
        ]
    )


# ------------------------------------------------------------------------------------------------------ simulator


def section_sim() -> str:
    records = load("sim_validation-captured.jsonl")
    fit_process = "launch 1, process 1"
    mib = [r for r in records if r["nbytes"] >= MIB]

    def ours(r: dict) -> bool:
        return not r["algorithm"].startswith("native")

    groups = {
        "4 x H200, ours (3 held-out processes)": [
            r for r in mib if ours(r) and r["process"] not in (fit_process,) and not r["process"].startswith("H100")
        ],
        "4 x H200, NCCL (3 held-out processes)": [
            r for r in mib if not ours(r) and r["process"] != fit_process and not r["process"].startswith("H100")
        ],
        "4 x H100, ours (nothing fitted)": [r for r in mib if ours(r) and r["process"].startswith("H100")],
        "4 x H100, NCCL (nothing fitted)": [r for r in mib if not ours(r) and r["process"].startswith("H100")],
    }
    rows = []
    for coll in SYMMETRIC + ROOTED + ("all",):
        cells = [NAMES.get(coll, coll)]
        for sub in groups.values():
            errs = [r["error"] for r in sub if coll == "all" or r["collective"] == coll]
            cells.append(errors(errs))
        rows.append(cells)
    trans = load("sim_validation-transports-h200x4.jsonl")
    trows = []
    for part in ("nccl", "transport-nvlink", "transport-shm", "transport-socket"):
        for variant in ("fitted", "catalogue"):
            sub = [r for r in trans if r["part"] == part and r["variant"] == variant and r.get("held_out", True)]
            if sub:
                trows.append([part, variant, errors([r["relative_error"] for r in sub])])
    ps = [r for r in load("sim_validation-ps-emulated.jsonl") if r["bench"] == "ps_summary"]
    psrows = [
        [r["case"], f"{r['measured_step_s']:.3f}", f"{r['error']:+.1%}", f"{r['error_host']:+.1%}", r["bottleneck"]]
        for r in ps
    ]
    ps_other = []  # the same cases at another NIC rate or queue depth: median / worst |error| over the cases
    for name, setting in (
        ("sim_validation-ps-emulated.jsonl", "100 Mbit/s, the emulator's queue"),
        ("sim_validation-ps-emulated-400mbit.jsonl", "400 Mbit/s, the emulator's queue"),
        ("sim_validation-ps-emulated-queue100ms.jsonl", "100 Mbit/s, a 100 ms queue"),
    ):
        summary = [r for r in load(name) if r["bench"] == "ps_summary"]
        ps_other.append(
            [setting, f"`{name}`", errors([r["error"] for r in summary]), errors([r["error_host"] for r in summary])]
        )
    return "\n\n".join(
        [
            "## Simulator validation",
            "`predicted / measured - 1` for every measured point the simulator replays; cells give median / worst "
            "|error| (points). No GPU is needed to reproduce them: each suite reads the measurements in "
            "benchmarks/results/.",
            "### Every collective captured (4 x H200, 4 x H100)",
            "Calls captured whole as CUDA graphs (the devices' time), 1 MiB-1 GiB, every algorithm. The H200's GPU "
            "fixed times and NCCL's figures are fitted on one process (its calls of 256 KiB or less, its NCCL "
            "calls); the three other H200 processes are held out, and the H100 is priced with its own "
            "micro-benchmarks' rates and nothing fitted on it.",
            "Command: `python benchmarks/sim/validate.py captured --out benchmarks/results/sim_validation-captured"
            ".jsonl`. Measurements: `captured-*-h200x4-run{1..4}.jsonl`, `captured-*-h100x4.jsonl` "
            "(`benchmarks/gpu/run.sh OUT captured`, "
            + gpu_software(load("captured-symmetric-h100x4.jsonl"))
            + "); rates from `probe-*.txt` and `port-h100x4-run{1,2}.jsonl`.",
            table(["collective", *groups], rows),
            "![simulated against measured](figures/sim-validation.png)",
            "### NCCL's collectives and the three transports (4 x H200)",
            "The NCCL model fitted on one all-reduce and all-gather run and held out on every other native point; "
            "NVLink, host shared memory and sockets as topologies, `fitted` on every other size and tested on the "
            "rest, `catalogue` with data-sheet figures only. Held-out points only.",
            "Command: `python benchmarks/sim/validate.py transports`. Data: `sim_validation-transports-h200x4.jsonl`.",
            table(["part", "variant", "median / worst error (points)"], trows),
            "### The parameter server on an emulated rack",
            "One rack of six emulated machines at 100 Mbit/s, `dtrain.ps` pulling and pushing a 4 MiB dense model "
            "each step, against `dtrain.sim.ps` with the network alone and with each process's work per byte "
            "(fitted once on loopback); 3 runs a case.",
            "Command: `sudo python benchmarks/sim/ps_validate.py`. Data: `sim_validation-ps-emulated.jsonl`.",
            table(["case", "measured step s", "error, network", "error, network + host", "bottleneck"], psrows),
            "The same cases at four times the rate (`--mbit 400`) and with a deeper shaped queue (`--queue-ms 100`), "
            "each its own run of the command:",
            table(["setting", "data", "error, network (cases)", "error, network + host (cases)"], ps_other),
            *_training_sim_part(),
            *_ring_attention_part(),
        ]
    )


def _span(rows: list[dict], keep) -> str:
    """The range of |error| over the rows whose layout ``keep`` accepts, as "a-b%"."""
    picked = [abs(r["error"]) for r in rows if keep(r["layout"].split())]
    if not picked:
        return "-"
    low, high = min(picked), max(picked)
    return f"{low:.0%}" if round(low * 100) == round(high * 100) else f"{low * 100:.0f}-{high:.0%}"


def _span_shared(rows: list[dict]) -> str:
    """The range over the tensor-parallel rows of how much faster one input all-reduce a part prices than one a
    column-parallel projection, as "a-b%"."""
    picked = [1 - r["predicted_shared_s"] / r["predicted_s"] for r in rows if r["layout"].split()[1] != "tp1"]
    low, high = min(picked), max(picked)
    return f"{low * 100:.0f}-{high:.0%}"


def _ring_attention_part() -> list[str]:
    """A context-parallel rank's attention kernels on one H200 against the simulator's price (two runs)."""
    names = ["ring_attention-h200x1.jsonl", "ring_attention-h200x1-run2.jsonl"]
    if not all((RESULTS / n).exists() for n in names):
        return []
    runs = [load(n) for n in names]
    key = lambda r: (r["shape"], r["sequence"], r["cp"])  # noqa: E731
    second = {key(r): r for r in runs[1]}
    rows, ratios = [], {}
    for r in runs[0]:
        other = second[key(r)]
        pair = [r, other]
        for m in pair:
            ratios.setdefault(r["cp"], []).extend([m["first_over_priced"], m["last_over_priced"]])
        kernels = " / ".join(
            f"{m.get(k, 0.0) * 1e3:.3f}" for m in (r,) for k in ("own_s", "later_s", "earlier_s") if k in m
        )
        over = " / ".join(f"{m['first_over_priced']:.2f}, {m['last_over_priced']:.2f}" for m in pair)
        rows.append([r["shape"], f"{r['sequence']:,}", r["cp"], kernels,
                     " / ".join(f"{m['first_rank_s'] * 1e3:.2f}" for m in pair),
                     " / ".join(f"{m['last_rank_s'] * 1e3:.2f}" for m in pair), f"{r['priced_s'] * 1e3:.2f}",
                     over])  # fmt: skip
    spans = "; ".join(
        f"cp {cp} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for cp, v in sorted(ratios.items())
    )
    return [
        "### A context-parallel rank's attention kernels on one H200",
        setting(
            "1 x NVIDIA H200",
            f"torch {runs[0][0]['torch']}",
            "python benchmarks/training/ring_attention.py --out benchmarks/results/ring_attention-h200x1.jsonl",
            f"`{names[0]}`, `{names[1]}` (a second run in the same launch)",
        ),
        "The kernels one rank of a context-parallel ring runs for one layer and one sequence (Transformer Engine's "
        "ring attention: a rank holds a piece from each end of the sequence), forward and backward as one call "
        "each, every call issued while a sleep kernel holds the stream (the device's pace): its own causal kernel "
        "and, on another rank's keys, its second query piece over both key pieces (a later rank's, `later`) or "
        "all its queries over the first key piece (an earlier rank's, `earlier`), neither masked. A pass of the "
        "first rank is its own kernel and `cp - 1` of the `later` kind, of the last its own and `cp - 1` "
        "`earlier`. `priced` is the simulator's price of the pass (`dtrain.sim.compute.layer_ops` with "
        "`Layout.cp`: each kernel at its forward-and-backward call's efficiency, the causal one on the attention "
        "curve and the others on the unmasked one of `dtrain bench compute --kinds attention-full`, without the "
        f"sustained-clock factor). Measured / priced by cp, median (range): {spans}.",
        table(
            [
                "shape",
                "sequence",
                "cp",
                "kernels ms: own / later / earlier",
                "first rank ms, run 1 / 2",
                "last rank ms",
                "priced ms",
                "measured / priced, first, last",
            ],
            rows,
        ),  # fmt: skip
    ]


def _training_h200x2_part() -> list[str]:
    """``dtrain train`` of Llama 1B as dp 2 and tp 2 on 2 x H200 with dtrain.models as it is (each part's input
    cast once, its gradient all-reduced once in 16 bits), against ``simulate_step`` priced so."""
    names = {"dp2": "llama_1b_train_dp2-h200x2.jsonl", "tp2": "llama_1b_train_tp2-h200x2.jsonl"}
    if not all((RESULTS / n).exists() for n in names.values()):
        return []
    from dtrain.cluster.presets import preset as topology_preset
    from dtrain.models import preset as model_preset
    from dtrain.sim.model import EAGER, Layout
    from dtrain.sim.placement import place
    from dtrain.sim.step import StepConfig, simulate_step
    from dtrain.train.plan import model_spec

    topo = topology_preset("h200-4gpu")
    spec = model_spec(model_preset("llama", "1b"), 2048, name="llama-1b")
    rows, errs = [], []
    for name, fields in (("dp2", dict(dp=2, micro_batch=8)), ("tp2", dict(tp=2, micro_batch=16))):
        records = load(names[name])
        runs = [records[i : i + 40] for i in range(0, len(records), 40)]  # 40 steps a run, in the order they ran
        measured = [1e3 * statistics.median(r["step_s"] for r in run[20:]) for run in runs]
        peak = max(r["peak_memory_gib"] for r in records)
        layout = Layout(global_batch=16, attention="flash", **fields)
        sims = {k: simulate_step(spec, layout, topo, place(topo, layout), StepConfig(kernels=k, eager=EAGER))
                for k in ("dtrain", "fused")}  # fmt: skip
        step = 1e3 * sims["dtrain"].step_s
        errs += [step / m - 1 for m in measured]
        rows.append([name, layout.describe(), " / ".join(f"{m:.1f}" for m in measured), f"{step:.1f}",
                     " / ".join(f"{step / m - 1:+.1%}" for m in measured), f"{1e3 * sims['fused'].step_s:.1f}",
                     f"{peak:.1f}", f"{sims['dtrain'].memory.total / 2**30:.1f}"])  # fmt: skip
    return [
        "### Training steps on 2 x H200",
        "`dtrain train` of Llama 1B as it is now (dtrain.models: attention and the MLP cast their input once and "
        "all-reduce its gradient once a part in 16 bits under tensor parallelism, the grouped-query keys and values "
        "read in place), 40 steps of 16 x 2048 tokens, bf16, each layout twice in the order dp 2, tp 2, dp 2, tp 2 "
        "within one command; the median step of steps 21-40 against `simulate_step` on `h200-4gpu`'s first two "
        'GPUs with `kernels = "dtrain"` (`EAGER`; `dtrain plan --config` prices so) and the fused layer beside it. '
        f"Nothing is fitted: |error| {errors(errs)}.",
        setting(
            "2 x NVIDIA H200, NVLink",
            "torch 2.11.0+cu130, NCCL 2.28.9, NVLink multicast off",
            "torchrun --nproc-per-node 2 -m dtrain train --preset 1b --dp 2|--tp 2 --seq-len 2048 --batch-size 16 "
            "--steps 40 --lr 3e-4 --warmup-steps 10 --set data.tokenizer_vocab=8192 --precision bf16 --no-export "
            "--no-tensorboard --checkpoint-every 0 --eval-every 0",
            ", ".join(f"`{n}`" for n in names.values()),
        ),
        table(["run", "layout", "measured ms", "predicted ms", "error", "fused ms", "peak GiB", "priced GiB"], rows),
    ]


def _training_sim_part() -> list[str]:
    """The step simulator against dtrain's own training runs on 4 x H100, and against published A100 runs."""
    parts = []
    mine = load("sim_vs_measured-h100x4.jsonl")
    if mine:
        rows = [
            [
                r["run"],
                r["layout"],
                f"{r['measured_s'] * 1e3:.1f}",
                f"{r['predicted_s'] * 1e3:.1f}",
                f"{r['error']:+.1%}",
                f"{r['measured_memory_gib']:.1f}" if r.get("measured_memory_gib") else "-",
                f"{r['fused_memory_gib']:.1f} / {r['predicted_memory_gib']:.1f}",
            ]
            for r in mine
        ]
        held = [r for r in mine if r.get("measured_memory_gib")]
        parts += [
            "### Training steps on 4 x H100",
            "dtrain's own runs (the Llama 1B benchmark, `dtrain train` in seven layouts, the largest ZeRO-3 model), "
            "each simulated as dtrain runs it: flash attention, no sequence parallelism, compute priced per "
            "operation on the H100 curves of `dtrain bench compute`, the element-wise work as dtrain.models runs "
            'it eagerly (`kernels = "dtrain"`: the casts autocast makes of 32-bit weights and activations, the '
            "32-bit residual stream, norms and loss, unfused RoPE and SwiGLU; 16-bit under ZeRO-3; the weight "
            'gradients added inside the products in a pipeline, as `grad_accumulation_fusion = "auto"` does; '
            "under tensor parallelism one 32-bit all-reduce of its input's gradient per column-parallel "
            "projection, q, k, v, gate and up, each casting its own input, and the grouped-query keys and values "
            "repeated to every head, as the code these runs measured did: `EagerForm(shared_inputs=False, "
            "repeat_kv=True)`; dtrain.models' attention and MLP cast their input once and reduce its gradient "
            f"once a part in 16 bits, which the model prices {_span_shared(mine)} faster on the tensor-parallel "
            "rows; that form is measured on 2 x H200 below). "
            f"Nothing is fitted to these runs: median / worst |error| {errors([r['error'] for r in mine])}. "
            f"ZeRO-3 comes within {_span(mine, lambda w: 'zero3' in w)}, plain data parallelism within "
            f"{_span(mine, lambda w: w[1:3] == ['tp1', 'pp1'] and 'zero3' not in w)}; tensor parallelism runs "
            f"{_span(mine, lambda w: w[1] != 'tp1')} slower than predicted, what dtrain's tensor-parallel code "
            "spends beyond the operations and collectives the model prices. Priced with the fused layer "
            '(`kernels = "fused"`) the same runs come out at median / worst |error| '
            f"{errors([r['predicted_fused_s'] / r['measured_s'] - 1 for r in mine])}.",
            "Command: `python benchmarks/sim/validate.py training-h100 --out "
            "benchmarks/results/sim_vs_measured-h100x4.jsonl`. Data: the files named per row.",
            "Peak memory (`torch.cuda.max_memory_allocated`) beside the memory model's with the fused layer "
            "and with dtrain's own: median / worst |error| "
            f"{errors([r['fused_memory_gib'] / r['measured_memory_gib'] - 1 for r in held])} fused, "
            f"{errors([r['predicted_memory_gib'] / r['measured_memory_gib'] - 1 for r in held])} dtrain.",
            table(
                ["run", "layout", "measured ms", "predicted ms", "error", "peak GiB", "priced GiB, fused / dtrain"],
                rows,
            ),  # fmt: skip
        ]
    parts += _training_h200x2_part()
    published = load("sim_validation-cpu2.jsonl")
    if published:
        rows = [
            [
                r.get("name", r.get("run", "?")),
                f"{r['published_s']:.2f}",
                f"{r['predicted_s']:.2f}",
                f"{r['error']:+.1%}",
            ]
            for r in published
            if "published_s" in r
        ]
        if rows:
            parts += [
                "### Published large-scale runs (A100 and H100 clusters, 8 to 11,616 GPUs)",
                "See [simulator-validation.md](simulator-validation.md) for the rows, their sources and the "
                "median and worst error of each set.",
                table(["run", "published s", "predicted s", "error"], rows),
            ]
    return parts


def section_emulation() -> str:
    records = load("sim_validation-emulation.jsonl")
    cases = list(dict.fromkeys(r["case"] for r in records))
    rows = []
    for case in cases:
        ar = [r for r in records if r["case"] == case and r["kind"] == "all_reduce"]
        train = [r for r in records if r["case"] == case and r["kind"] == "train"]
        rows.append(
            [
                case,
                errors([r["error_network"] for r in ar]),
                errors([r["error"] for r in ar]),
                errors([r["error"] for r in train]),
            ]
        )
    ar = [r for r in records if r["kind"] == "all_reduce"]
    rows.append(
        [
            "all",
            errors([r["error_network"] for r in ar]),
            errors([r["error"] for r in ar]),
            errors([r["error"] for r in records if r["kind"] == "train"]),
        ]
    )
    return "\n\n".join(
        [
            "## Emulated cluster against the simulator",
            "2 racks x 2 servers of the `4-rack` preset, one 100 Gb/s NIC a server, 2 spines, emulated with Linux "
            "namespaces at 1/1000 of the real rates, at 1:1 and 1:4 oversubscription and two placements. All-reduce "
            "(ring, tree, recursive doubling, hierarchical, Gloo's own) from 256 KiB, and a training step (dp = 4) of "
            "a 2-block GPT of width 64 (0.12 M parameters, 469,504 bytes of gradients). `network`: wire time only; "
            "`fitted`: plus software costs fitted on the 4 KiB points of the 1:1 packed case. A step is predicted as "
            "the same training on loopback plus the simulated all-reduces.",
            setting(
                CPU + " (emulation as root)",
                "torch 2.13.0+cpu, Gloo, Linux tc/netns",
                "sudo python benchmarks/emulation/measure.py; python benchmarks/emulation/validate.py",
                "`emulation-{collectives,train,checks}.jsonl`, `sim_validation-emulation.jsonl`",
            ),
            table(["case", "all-reduce, network", "all-reduce, fitted", "training step"], rows),
            "![emulated cluster against the simulator](figures/emulation-validation.png)",
        ]
    )


# --------------------------------------------------------------------------------------------------------- figures


def _added(rows: list[dict], batch: int, recorded: bool) -> str:
    """The range of milliseconds the 4-GPU data-parallel rows of ``batch`` sequences a GPU measured above the 1-GPU
    row run the same way (``recorded``: the ``-graph`` rows against ``single-graph``; ``local``, which does not
    communicate, aside)."""
    same = [r for r in rows if r["batch_per_rank"] == batch and ("-graph" in r["variant"]) == recorded]
    one = next(r["measured_s"] for r in same if r["ranks"] == 1)
    more = [(r["measured_s"] - one) * 1e3 for r in same if r["ranks"] > 1 and not r["variant"].startswith("local")]
    low, high = f"{min(more):.1f}", f"{max(more):.1f}"
    return f"{low} ms" if low == high else f"{low}-{high} ms"


def section_sim_beside_measured() -> str:
    """The simulator's prediction beside each 4 x H100 measurement of collectives, pipeline schedules and data
    parallel (benchmarks/sim/beside_measured.py)."""
    parts = [
        "## Simulator beside the measurements",
        "The simulator's prediction for each measured row of the collectives, pipeline and data-parallel "
        "benchmarks on H100s; `predicted / measured - 1`, cells give median / worst |error| (points). Nothing is "
        "fitted to these rows: every figure comes from the simulator's defaults, the shipped H100 compute curves, "
        "or another results file. Command: `python benchmarks/sim/beside_measured.py MODE --out "
        "benchmarks/results/sim_beside_MODE-h100x4.jsonl` (MODE: collectives, pipeline, dp).",
    ]
    coll = [r for r in load("sim_beside_collectives-h100x4.jsonl") if r["record"] == "row"]
    figures = next(r for r in load("sim_beside_collectives-h100x4.jsonl") if r["record"] == "figures")
    if coll:
        rows = []
        for world in (4, 2):
            for fresh in (False, True):
                for name in SYMMETRIC + ("broadcast",):
                    sub = [r for r in coll if r["world_size"] == world and r["fresh"] == fresh
                           and r["collective"] == name]  # fmt: skip
                    nccl = [r for r in sub if r["model"] == "nccl"]
                    ours = [r for r in sub if r["model"] == "peer"]
                    if not sub:
                        continue
                    rows.append([f"{world} x H100{', fresh' if fresh else ''}", NAMES.get(name, name),
                                 errors([r["device_error"] for r in nccl]), errors([r["error"] for r in nccl]),
                                 errors([r["error"] for r in ours]),
                                 errors([r["cost_model_us"] / r["measured_us"] - 1 for r in ours])])  # fmt: skip
        host = ", ".join(f"{NAMES.get(c, c)} {s * 1e6:.0f} us" for c, s in sorted(figures["host_s"].items()))
        sizes = sorted({r["nbytes"] for r in coll})
        per_size = []
        four = [r for r in coll if r["world_size"] == 4 and not r["fresh"] and r["algorithm"] == "native"]
        for n in sizes:
            cells = [size(n)]
            for name in SYMMETRIC + ("broadcast",):
                r = next((r for r in four if r["nbytes"] == n and r["collective"] == name), None)
                cells.append("-" if r is None else f"{r['measured_us']:.0f} / {r['predicted_us']:.0f} "
                             f"({r['error']:+.0%})")  # fmt: skip
            per_size.append(cells)
        parts += [
            "### Collectives with the defaults (4 and 2 x H100)",
            "`dtrain bench comm` with the defaults (`collectives_defaults[_fresh]-h100x{4,2}.jsonl`), "
            f"{size(min(r['nbytes'] for r in coll))}-{size(max(r['nbytes'] for r in coll))}. "
            "NCCL's calls (`native`, and `auto` where it resolved to NCCL) are priced by the NCCL model (a ring "
            "in the protocol NCCL's tuning log gives, Simple below 1 MiB; all-to-all as grouped point-to-point) "
            "with its figures fitted on 4 x H200 graph captures; dtrain's own that run as the exchange kernel "
            "(the one-pass all-gather, reduce-scatter and all-to-all `direct`, broadcast `star`, the one-shot "
            "all-reduce up to 256 KiB) by `dtrain.sim.peer_model.exchange_time` (launch, copy in, one barrier, "
            "the reads at the NVLink rates), the others (torch's one-shot kernel above 256 KiB and two-shot "
            "kernel) by the peer-memory model as their pull plans, both with the H100 figures of "
            "`sim_validation-peer-h100x4.jsonl`. `device` is the "
            "kernel alone; `with host` adds the host's time a call (a call costs the larger of the two): for "
            f"NCCL the median of its eager calls of at most 1 MiB in {' and '.join(figures['host_source'])} "
            f"({host}); for the exchange kernel its call's host time on 4 H200s in "
            f"{figures.get('exchange_source', 'the one-pass probe')}; for torch's one-kernel all-reduces "
            f"{figures['fused_host_s'] * 1e6:.1f} us, the median of `auto` back to back at 8 KiB-1 MiB in "
            f"{figures['fused_source']}. Below 32 MiB every NCCL call is the host's, and the host time of this "
            "sweep's processes need not be the other launch's, which no figure carried from another launch can "
            "follow. Above that the kernel decides: NCCL's calls of 128 MiB and more come within "
            f"{errors([r['error'] for r in coll if r['model'] == 'nccl' and r['nbytes'] >= 128 * MIB])}. "
            "The last column is the cost model `auto` chose by, as the sweep recorded it.",
            table(
                [
                    "GPUs",
                    "collective",
                    "NCCL, device",
                    "NCCL, with host",
                    "ours (one-shot, direct, star)",
                    "ours, auto's cost model",
                ],
                rows,
            ),  # fmt: skip
            "NCCL on 4 x H100, defaults: measured / predicted us (error), with host.",
            table(["size", *(NAMES.get(c, c) for c in SYMMETRIC + ("broadcast",))], per_size),
        ]
    pipe = load("sim_beside_pipeline-h100x4.jsonl")
    if pipe:
        rows = [
            [r["schedule"] + _transport_label(r), r["microbatches"], r["batch"], f"{r['measured_ms']:.1f}",
             f"{r['device_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{r['error']:+.0%}", f"{r['measured_bubble']:.3f}",
             f"{r['device_bubble']:.3f}", f"{r['predicted_bubble']:.3f}",
             "-" if r["torch_ms"] is None else f"{r['torch_ms']:.1f}"]
            for r in pipe
        ]  # fmt: skip
        kinds = [(b, t) for b in sorted({r["batch"] for r in pipe}) for t in ("group", "peer")]
        by_batch = "; ".join(
            f"batch {b}{' (peer)' if t == 'peer' else ''}: "
            f"{errors([r['error'] for r in pipe if (r['batch'], r.get('transport', 'group')) == (b, t)])}"
            for b, t in kinds
            if any((r["batch"], r.get("transport", "group")) == (b, t) for r in pipe)
        )
        gaps = "; ".join(
            f"batch {b}{' (peer)' if t == 'peer' else ''}: median {_median_gap(pipe, b, t):.3f}, worst "
            f"{_median_gap(pipe, b, t, worst=True):.3f}"
            for b, t in kinds
            if any((r["batch"], r.get("transport", "group")) == (b, t) for r in pipe)
        )
        parts += [
            "### Pipeline schedules (4 x H100)",
            "`dtrain bench pipeline` (`bench_pipeline[-b4096]-h100x4.jsonl`: 16 x (Linear(4096, 4096) + GELU) in "
            "float32 on 4 stages). Each stage priced by the compute model at the H100's float32 peak (the shipped "
            "curves are bfloat16's, so the built-in matmul efficiency and wave quantisation price it), the "
            "activation a flow over NVLink, the step and bubble from the schedule's action order; `with host`: "
            "the host issues a stage's actions one after another at its measured time an action (the median of "
            "the other batch's file) and the device runs none before it is issued (`pipeline_makespan`'s "
            "`host_s`). "
            f"Step time, median / worst |error|: {by_batch}. The bubble, predicted on the device alone against "
            f"measured, |difference|: {gaps}. Over the peer channels (`(peer)`), which hold no SM while they wait, "
            "the schedules at batch 4096 run at the bubble the model gives them; over NCCL they run above it, by "
            "what its spinning kernels take from the products beside them. The model misses small float32 "
            "products: its "
            "wave quantisation (128 x 128 output tiles, one a multiprocessor) prices a 64- or 128-row product "
            "at a tenth to a fifth of the float32 peak, where the measured busy time (the rows' bubble) shows "
            "cuBLAS running them faster; with 8 and 16 micro-batches of 1024 rows a forward then lasts less than "
            "the host's time to issue an action, the host sets the pace, and the measured bubble grows past "
            "theory. With 256 and 512 rows a micro-batch (4096 rows) the model errs both ways.",
            table(
                [
                    "schedule",
                    "m",
                    "batch",
                    "measured ms",
                    "device ms",
                    "with host ms",
                    "error",
                    "bubble",
                    "predicted bubble, device",
                    "with host",
                    "torch ms",
                ],
                rows,
            ),  # fmt: skip
        ]
    dp = load("sim_beside_dp-h100x4.jsonl")
    if dp:
        rows = [
            [r["variant"], r["ranks"], r["batch_per_rank"], f"{r['measured_s'] * 1e3:.1f}",
             f"{r['predicted_s'] * 1e3:.1f}", f"{r['error']:+.0%}"]
            for r in dp
        ]  # fmt: skip

        def group(ranks: int, recorded: bool) -> str:
            return errors([r["error"] for r in dp if r["ranks"] == ranks and ("-graph" in r["variant"]) == recorded])

        parts += [
            "### Data parallel against DDP (4 x H100)",
            "`dp_vs_ddp-graphs-h100x4-b{16,32}.jsonl`: the 136M GPT (12 layers, width 768, 32768-token vocabulary, "
            "512 tokens) under bf16 autocast with AdamW, simulated as `validate.py training-h100` describes a model "
            "(flash attention, compute per operation on the H100 curves, bucketed ring all-reduce under backward). "
            "The `-graph` rows record the step as one CUDA graph, so they run at the devices' pace, which is what "
            f"the simulator prices. Recorded: 1 GPU {group(1, True)}, 4 GPUs {group(4, True)}; eager: 1 GPU "
            f"{group(1, False)}, 4 GPUs {group(4, False)}. One GPU runs slower than the operations the model prices "
            "even recorded. Part of that is work the model's fused kernels do not have: the benchmark computes the "
            "loss in float32 over the whole (B, T, V) logits (a float32 copy, log-softmax and its backward, about 32 "
            "bytes a logit against the 16 the model counts for a fused cross-entropy, some 2 ms at 16 sequences) "
            "and autocast casts every weight to bf16 at each forward. On 4 GPUs the model prices the ring all-reduce "
            "of the float32 gradients at "
            f"{statistics.median(r['all_reduce_s'] for r in dp if r['ranks'] == 4) * 1e3:.1f} ms and leaves all "
            "but the last bucket under backward, so it adds almost nothing to one GPU's step; recorded, the "
            f"measurement adds {_added(dp, 32, True)} with 32 sequences a GPU and {_added(dp, 16, True)} with 16 "
            "(eager, DDP and ours alike: "
            f"{_added(dp, 32, False)} and {_added(dp, 16, False)}), which is the products slowed beside the "
            "all-reduce and its last bucket after backward (`dp_profile-graphs-h100x4.txt`); the model has no term "
            "for that.",
            table(["variant", "GPUs", "sequences a GPU", "measured ms", "predicted ms", "error"], rows),
        ]
    return "\n\n".join(parts)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "svg.hashsalt": "dtrain"})
    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})


def fig_captured(path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (label, names) in zip(
        axes,
        (
            ("4 x H100", ("captured-symmetric-h100x4.jsonl", "captured-rooted-h100x4.jsonl")),
            ("4 x H200", ("captured-symmetric-h200x4-run3.jsonl", "captured-rooted-h200x4-run3.jsonl")),
        ),
        strict=True,
    ):
        records = [r for n in names for r in load(n)]
        for coll in SYMMETRIC + ROOTED:
            xs, ys = [], []
            for n in SIZES:
                native = [r for r in records if r["collective"] == coll and r["nbytes"] == n
                          and r["algorithm"] == "native+graph"]  # fmt: skip
                ours = [r["time_us"] for r in records if r["collective"] == coll and r["nbytes"] == n
                        and r["algorithm"].endswith("+graph")
                        and not r["algorithm"].startswith(("native", "auto"))]  # fmt: skip
                if native and ours:
                    xs.append(n)
                    ys.append(native[0]["time_us"] / min(ours))
            ax.plot(xs, ys, "o-", label=NAMES.get(coll, coll))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="bytes a rank", title=label)
    axes[0].set_ylabel("NCCL time / our best time (captured)")
    axes[1].legend(fontsize=7)
    _save(fig, path)


def fig_busbw(name: str, algorithms: list[str], title: str, path: Path) -> None:
    plt = _plt()
    records = [r for r in load(name) if r["collective"] == "all_reduce"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for a in algorithms:
        pts = sorted((r["nbytes"], r["busbw_gbps"]) for r in records if r["algorithm"] == a)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=NAMES.get(a, a))
    ax.set(xscale="log", xlabel="bytes a rank", ylabel="busbw GB/s", title=title)
    ax.legend(fontsize=7)
    _save(fig, path)


def fig_bubble(path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (label, records) in zip(
        axes,
        (("4 x H200", load("bubble-h200x4.jsonl")), ("CPU, Gloo", load("bubble-cpu2.jsonl"))),
        strict=True,
    ):
        records = [r for r in records if "bubble_theory" in r]
        for (p, sched), marker in zip(
            sorted({(r["stages"], r["schedule"]) for r in records}), "osd^v<>ph", strict=False
        ):
            sub = sorted((r for r in records if r["stages"] == p and r["schedule"] == sched),
                         key=lambda r: r["microbatches"])  # fmt: skip
            ax.plot([r["microbatches"] for r in sub], [r["bubble_measured"] for r in sub], marker + "-",
                    label=f"p={p} {sched}")  # fmt: skip
            ax.plot([r["microbatches"] for r in sub], [r["bubble_theory"] for r in sub], "k:", lw=0.8)
        ax.set(xscale="log", xlabel="micro-batches m", title=label + " (dotted: theory)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("bubble fraction")
    _save(fig, path)


def fig_ps(path: Path) -> None:
    plt = _plt()
    thr = [r for r in load("ps_throughput-cpu2.jsonl") if r["bench"] == "throughput"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"{r['workers']}w x {r['servers']}s" for r in thr]
    xs = range(len(thr))
    ax.bar([x - 0.2 for x in xs], [r["ps_gb_s"] for r in thr], 0.4, label="parameter server")
    ax.bar([x + 0.2 for x in xs], [r["raw_zeromq_gb_s"] for r in thr], 0.4, label="raw ZeroMQ")
    ax.set_xticks(list(xs), labels)
    ax.set(ylabel="GB/s", title="push+pull throughput, loopback, 2-core CPU")
    ax.legend(fontsize=7)
    _save(fig, path)


def fig_sim(path: Path) -> None:
    plt = _plt()
    records = [r for r in load("sim_validation-captured.jsonl") if r["nbytes"] >= MIB]
    fig, ax = plt.subplots(figsize=(6, 5))
    for label, pick, marker in (
        ("H200, ours", lambda r: not r["process"].startswith("H100") and not r["algorithm"].startswith("native"), "o"),
        ("H200, NCCL", lambda r: not r["process"].startswith("H100") and r["algorithm"].startswith("native"), "s"),
        ("H100, ours", lambda r: r["process"].startswith("H100") and not r["algorithm"].startswith("native"), "^"),
        ("H100, NCCL", lambda r: r["process"].startswith("H100") and r["algorithm"].startswith("native"), "v"),
    ):
        sub = [r for r in records if pick(r)]
        ax.plot([r["measured_us"] for r in sub], [r["predicted_us"] for r in sub], marker, ms=3, alpha=0.6,
                label=label)  # fmt: skip
    lo, hi = 10, 2e4
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured us", ylabel="simulated us",
           title="captured calls, 1 MiB-1 GiB")  # fmt: skip
    ax.legend(fontsize=7)
    _save(fig, path)


def fig_emulation(path: Path) -> None:
    plt = _plt()
    records = [r for r in load("sim_validation-emulation.jsonl") if r["kind"] == "all_reduce"]
    fig, ax = plt.subplots(figsize=(6, 5))
    for case, marker in zip(dict.fromkeys(r["case"] for r in records), "os^", strict=False):
        sub = [r for r in records if r["case"] == case]
        ax.plot([r["measured_s"] for r in sub], [r["predicted_s"] for r in sub], marker, label=case)
    xs = [r["measured_s"] for r in records]
    ax.plot([min(xs), max(xs)], [min(xs), max(xs)], "k-", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured s", ylabel="simulated s (fitted)",
           title="all-reduce on the emulated leaf-spine")  # fmt: skip
    ax.legend(fontsize=7)
    _save(fig, path)


FIGURES: dict[str, Callable[[Path], None]] = {
    "collectives-captured.png": fig_captured,
    "all_reduce-h100x4.png": lambda p: fig_busbw(
        "all_reduce-h100x4.jsonl", ["native", "ring", "halving_doubling", "auto"], "all-reduce, 4 x H100", p
    ),
    "all_reduce-cpu2.png": lambda p: fig_busbw(
        "all_reduce-cpu2.jsonl", ["native", "auto", "ring", "halving_doubling", "direct"], "all-reduce, 4 Gloo ranks", p
    ),
    "pipeline-bubble.png": fig_bubble,
    "ps-throughput.png": fig_ps,
    "sim-validation.png": fig_sim,
    "emulation-validation.png": fig_emulation,
}


# ------------------------------------------------------------------------------------------------------------ page

HEAD = """# Results

The current measured figures of dtrain, each table with its machine, software and the command that produced
its data. Every table and plot on this page is generated by `python benchmarks/report.py` from the raw
measurements in `benchmarks/results/` (JSON lines, one record a measured point); edit the script, not this page.
GPU runs use NVLink multicast off (`NCCL_NVLS_ENABLE=0`) and dtrain's defaults unless a table says otherwise.

- [Collectives](#collectives)
- [Data parallel against DDP](#data-parallel-against-ddp)
- [ZeRO memory](#zero-memory)
- [Tensor and pipeline parallel on GPUs](#tensor-and-pipeline-parallel-on-gpus)
- [Llama 1B on GPUs](#llama-1b-on-gpus)
- [Pipeline bubble against theory](#pipeline-bubble-against-theory)
- [Parameter server](#parameter-server)
- [Simulator validation](#simulator-validation)
- [Emulated cluster against the simulator](#emulated-cluster-against-the-simulator)
- [Simulator beside the measurements](#simulator-beside-the-measurements)
- [Compute beside communication](#compute-beside-communication)"""


def section_overlap() -> str:
    """A transformer layer's matrix products beside an NCCL collective on the same GPU, and each alone
    (``dtrain bench overlap``): the slowdowns the simulator prices overlapped communication with."""
    rows = []
    for path in ("nvlink", "network"):
        first = {(r["product"], r["collective"]): r for r in load(f"bench_overlap-{path}-h200x2-run2.jsonl")}
        for r in load(f"bench_overlap-{path}-h200x2.jsonl"):
            again = first.get((r["product"], r["collective"]))
            repeat = "-" if again is None else f"{again['product_slowdown']:.3f} / {again['collective_slowdown']:.3f}"
            rows.append([path, r["product"], NAMES.get(r["collective"].replace("-", "_"), r["collective"]),
                         f"{r['product_tflops']:.0f}", f"{r['collective_gbps']:.1f}", f"{r['product_slowdown']:.3f}",
                         f"{r['collective_slowdown']:.3f}", repeat])  # fmt: skip
    if not rows:
        return ""
    return "\n\n".join(
        [
            "## Compute beside communication",
            "`dtrain bench overlap` on 2 x NVIDIA H200 (torch 2.11.0+cu130, NCCL 2.28.9 as the repeat records): the "
            "products of one layer of a "
            "hidden-12288 transformer on 4 tensor-parallel ranks, 2,048 tokens (forward, input and weight gradients), "
            "in a loop beside a loop of 128 MiB collectives on another stream, and each alone; the median of 3 rounds, "
            "the slower rank. `collective alone`: bytes of the buffer over the time of one call (algorithm "
            "bandwidth, not nccl-tests' bus bandwidth). `product x`: the products' time beside the collectives over "
            "alone; `collective x`: the "
            "collectives' time beside the products over alone. `network`: `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`, so "
            "NCCL goes through its proxy and network transport (sockets here) as between servers. The simulator "
            "prices overlapped communication from the medians by path and precision (`dtrain/sim/compute_curves.json`, "
            "`StepConfig.contention`). Commands: `dtrain bench overlap --out "
            "benchmarks/results/bench_overlap-nvlink-h200x2.jsonl --write-curves dtrain/sim/compute_curves.json`, and "
            "the same under the two variables into `bench_overlap-network-h200x2.jsonl`. The last column is the same "
            "two commands on another allocation of 2 x H200 (`bench_overlap-{nvlink,network}-h200x2-run2.jsonl`), not "
            "used by the simulator.",
            table(
                [
                    "path",
                    "product",
                    "collective",
                    "products alone (TFLOP/s)",
                    "collective alone (algorithm GB/s)",
                    "product x",
                    "collective x",
                    "repeat: product x / collective x",
                ],
                rows,
            ),  # fmt: skip
        ]
    )


SECTIONS = (
    section_collectives,
    section_dp,
    section_zero,
    section_tp_pp,
    section_llama,
    section_dropout,
    section_bubble,
    section_ps,
    section_sim,
    section_emulation,
    section_sim_beside_measured,
    section_overlap,
)


def render() -> str:
    return "\n\n".join([HEAD, *(s() for s in SECTIONS)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[1].split()))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    ap.add_argument("--no-figures", action="store_true", help="write the page only")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != page:
            print(f"report.py: {args.out} is out of date; run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    if not args.no_figures:
        args.figures.mkdir(parents=True, exist_ok=True)
        for name, draw in FIGURES.items():
            draw(args.figures / name)
    print(f"wrote {args.out} and {0 if args.no_figures else len(FIGURES)} figures in {args.figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
