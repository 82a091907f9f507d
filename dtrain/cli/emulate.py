"""``dtrain emulate run|up|down``: a cluster topology emulated on this host (namespaces, bridges, tc).

``run`` builds the topology, optionally checks it, runs one dtrain command across it (one torchrun per
server namespace, c10d rendezvous, Gloo over the shaped veths), writes ``<out>/emulation.json`` (the plan with
its scale and the check's figures) and tears everything down, also on a failure or Ctrl-C. ``up`` builds and
checks and leaves it up; ``down`` removes every namespace named ``dte-...`` (or of one ``--tag``). All need
root: without it they say so and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
from pathlib import Path

__all__ = ["register", "parse_setting"]

_EPILOG = """examples (as root):
  dtrain emulate run --topology 4-rack --set racks=2 --set servers_per_rack=2 --set nic=ethernet100 \\
      --set nics=1 --set gpus=1 --scale 1e-3 -- bench comm --collectives all_reduce --max-bytes 4M
  dtrain emulate up --topology my-cluster.toml --scale 1e-3 --tag demo
  dtrain emulate up --topology 4-rack --set racks=2 --set servers_per_rack=2 --fabric routed --tag ecmp
  dtrain emulate down
Rates: emulated bit/s = topology bit/s x --scale (1e-3: 100 Gb/s -> 100 Mb/s). Latencies are not emulated."""


def parse_setting(text: str) -> tuple[str, int | float | str]:
    """``"racks=2"`` -> ``("racks", 2)``; numbers become int or float, the rest stays a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value (e.g. racks=2), got {text!r}")
    for kind in (int, float):
        try:
            return key.strip(), kind(value)
        except ValueError:
            pass
    return key.strip(), value.strip()


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", required=True, help="a preset name (see dtrain.cluster.presets) or a TOML file")
    p.add_argument("--set", dest="settings", type=parse_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset parameter, e.g. --set racks=2 --set oversubscription=4")  # fmt: skip
    p.add_argument("--scale", type=float, default=1e-3, help="emulated rate / topology rate (default 1e-3)")
    p.add_argument(
        "--placement",
        default="packed",
        help="packed (rack by rack), interleaved (racks dealt in turn) or s0,s2,... (node-rank order)",
    )
    p.add_argument("--tag", default=None, help="1-8 letters/digits naming the namespaces (default: random)")
    p.add_argument(
        "--fabric",
        choices=["bridged", "routed"],
        default="bridged",
        help="bridged: switches as bridges, a leaf-spine's spines merged into one (exact capacity, no ECMP "
        "collisions); routed: ToRs and spines as routers hashing each flow onto one spine (per-flow ECMP)",
    )


def register(commands) -> None:
    """Add ``dtrain emulate`` and its ``run``, ``up`` and ``down`` subcommands."""
    emulate = commands.add_parser("emulate", help="run dtrain on a cluster emulated on this host (needs root)",
                                  epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = emulate.add_subparsers(dest="emulate_command", required=True)
    run = sub.add_parser("run", help="build, run a dtrain command on every server, tear down",
                         epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _add_topology_args(run)
    run.add_argument("--gpus-per-server", type=int, default=1, help="ranks (processes) per server namespace")
    run.add_argument(
        "--hierarchy",
        choices=["server", "rack"],
        default="server",
        help="what 'node' means to hierarchical algorithms (rack: all ranks under one ToR)",
    )
    run.add_argument("--check", action="store_true", help="ping every server and measure one path first")
    run.add_argument("--port", type=int, default=29500, help="rendezvous port on node 0")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is stopped")
    run.add_argument("--out", default="runs/emulate", help="emulation.json and the other nodes' logs")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the dtrain command, e.g. -- bench comm")
    run.set_defaults(handler=_guarded(_run, on_sigterm=True))
    up = sub.add_parser("up", help="build and check the emulated cluster and leave it up (see: down)")
    _add_topology_args(up)
    up.set_defaults(handler=_guarded(_up, on_sigterm=True))
    down = sub.add_parser("down", help="remove every dte-* namespace (with its veths, bridges and processes)")
    down.add_argument("--tag", default=None, help="only this emulation's namespaces")
    down.set_defaults(handler=_guarded(_down))


def _guarded(handler, *, on_sigterm: bool = False):
    """Not root / no iproute2 / a failed ip or tc command: one clear line and exit status 2. Ctrl-C or SIGTERM
    (after the emulation has torn itself down): one line and the shell's 128 + signal. ``on_sigterm``: SIGTERM
    unwinds as Ctrl-C does from the start, while the plan is made too (the emulation takes it over while it
    is up)."""

    def guarded(args: argparse.Namespace) -> int:
        from dtrain.emulate.build import Terminated, _main_thread, _raise_terminated
        from dtrain.emulate.netns import EmulationError

        previous = None
        if on_sigterm and _main_thread():
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return handler(args)
        except (PermissionError, EmulationError) as exc:
            print(f"dtrain emulate: error: {exc}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, Terminated) as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            print(f"dtrain emulate: stopped by signal {signum}; namespaces, bridges and processes removed",
                  file=sys.stderr)  # fmt: skip
            return 128 + signum
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    return guarded


def _plan(args: argparse.Namespace):
    from dtrain.cluster.files import resolve
    from dtrain.emulate.placement import placement_order
    from dtrain.emulate.plan import plan_emulation

    topology = resolve(args.topology, **dict(args.settings))
    tag = args.tag or secrets.token_hex(3)
    return plan_emulation(topology, scale=args.scale, tag=tag, placement=placement_order(topology, args.placement),
                          fabric=args.fabric)  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from dtrain.emulate.build import Emulation
    from dtrain.emulate.netns import require_root
    from dtrain.emulate.placement import ranks_per_rack
    from dtrain.emulate.run import JobConfig, run_job
    from dtrain.emulate.verify import verify

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    plan = _plan(args)
    local_size = ranks_per_rack(plan, args.gpus_per_server) if args.hierarchy == "rack" else None
    out = Path(args.out)
    job = JobConfig(command=command, procs_per_server=args.gpus_per_server, local_size=local_size, port=args.port,
                    timeout_s=args.timeout, log_dir=out)  # fmt: skip
    _check_command(command)
    from dtrain.cli.paths import check_dir_out

    check_dir_out("--out", out)
    require_root()
    record = {**plan.describe(), "command": command, "gpus_per_server": args.gpus_per_server,
              "hierarchy": args.hierarchy, "local_size": local_size}  # fmt: skip
    with Emulation(plan):
        if args.check:
            record["check"] = verify(plan)
            print(f"dtrain emulate: check {json.dumps(record['check'])}")
        _write(out, record)
        record["exit_status"] = run_job(plan, job)
    _write(out, record)
    return record["exit_status"]


def _check_command(command: list[str]) -> None:
    """The words after ``--`` make a ``dtrain`` command line its parser takes (ValueError with the parser's one
    line if not): checked here, before any namespace is built, rather than on every emulated server."""
    import contextlib
    import io

    from dtrain.cli.main import build_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parsed = build_parser().parse_args(command)
    except SystemExit as exc:
        if exc.code not in (0, None):
            reason = said.getvalue().strip().splitlines()[-1:] or [f"exit status {exc.code}"]
            reason = reason[0].partition(": error: ")[2] or reason[0]
            raise ValueError(f"the command after -- ({' '.join(command)}): {reason}") from None
        return
    # Under torchrun a command's --nproc is ignored: every emulated server starts --gpus-per-server ranks.
    if hasattr(parsed, "nproc") and any(_is_nproc(word) for word in command):
        raise ValueError(
            f"the command after -- ({' '.join(command)}): --nproc is ignored on emulated servers; give "
            f"--gpus-per-server N before the -- for N ranks a server"
        )


def _is_nproc(word: str) -> bool:
    """``--nproc``, ``--nproc=4`` or an abbreviation argparse takes for it (``--npr``)."""
    flag = word.partition("=")[0]
    return len(flag) >= 4 and "--nproc".startswith(flag)


def _write(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "emulation.json").write_text(json.dumps(record, indent=1) + "\n")


def _up(args: argparse.Namespace) -> int:
    from dtrain.emulate.build import Emulation
    from dtrain.emulate.netns import require_root
    from dtrain.emulate.verify import verify

    plan = _plan(args)
    require_root()
    # Built as `run` builds (a tag in use refused before anything is touched; a failure, Ctrl-C or SIGTERM
    # removes what was built), and left up once the check has passed.
    emulation = Emulation(plan)
    with emulation:
        check = verify(plan)
        emulation.keep()
    print(json.dumps({**plan.describe(), "check": check}, indent=1))
    print(f"up: run commands with `ip netns exec {plan.servers[0].namespace} ...`; remove with "
          f"`dtrain emulate down --tag {plan.tag}`")  # fmt: skip
    return 0


def _down(args: argparse.Namespace) -> int:
    from dtrain.emulate.build import teardown_leftovers
    from dtrain.emulate.plan import PREFIX

    if args.tag is not None and not (args.tag.isalnum() and len(args.tag) <= 8):  # "" would mean every emulation
        raise ValueError(f"--tag must be 1-8 letters or digits (an emulation's tag), got {args.tag!r}")
    removed = teardown_leftovers(f"{PREFIX}{args.tag}-" if args.tag is not None else PREFIX)
    print(f"removed {len(removed)} namespaces{': ' + ', '.join(removed) if removed else ''}")
    return 0
