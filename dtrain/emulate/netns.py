"""Network namespaces through iproute2: create, run in, list by prefix, remove (with what still runs inside).

One namespace per emulated server (``ip netns``, see ip-netns(8)); the bridges live in one more, the "fabric",
so nothing the emulator creates touches the host's own interfaces, and deleting the namespaces removes every
veth and bridge with them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

__all__ = [
    "EmulationError", "require_root", "ip", "create", "delete", "exists", "list_namespaces", "in_ns", "set_sysctl",
]  # fmt: skip


class EmulationError(RuntimeError):
    """An ``ip`` / ``tc`` command failed, or the host cannot emulate (not root, no iproute2)."""


def require_root() -> None:
    """Raise :class:`PermissionError` unless this process is root and ``ip`` and ``tc`` are installed."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise PermissionError(f"dtrain emulate needs iproute2 ({', '.join(missing)} not found on PATH)")
    if os.geteuid() != 0:
        raise PermissionError(
            f"dtrain emulate needs root (it creates network namespaces, bridges and tc qdiscs); running as uid "
            f"{os.geteuid()}: try sudo"
        )


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n namespace] args...``; its stdout. A failure raises :class:`EmulationError` with stderr."""
    return run_tool(["ip", *(["-n", namespace] if namespace else []), *args], check=check)


def run_tool(argv: list[str], *, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise EmulationError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def in_ns(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` execs it, so the child's pid is the command's)."""
    return ["ip", "netns", "exec", namespace, *argv]


def create(namespace: str) -> None:
    """A fresh namespace with its loopback up."""
    ip("netns", "add", namespace)
    ip("link", "set", "lo", "up", namespace=namespace)


def set_sysctl(namespace: str, key: str, value: str) -> None:
    """``sysctl -w key=value`` inside ``namespace`` (for the per-namespace keys under ``net.``), read back to
    make sure the kernel took it: a kernel without the key fails here, not later as a silently wrong fabric."""
    if shutil.which("sysctl") is None:
        raise EmulationError(f"setting {key} in {namespace} needs the sysctl tool (procps), not found on PATH")
    run_tool(in_ns(namespace, ["sysctl", "-qw", f"{key}={value}"]))
    got = run_tool(in_ns(namespace, ["sysctl", "-n", key])).strip()
    if got != value:
        raise EmulationError(f"{key} in {namespace} reads {got!r} after setting it to {value!r}")


def exists(namespace: str) -> bool:
    return namespace in list_namespaces("")


def list_namespaces(prefix: str) -> list[str]:
    """Names of the namespaces that start with ``prefix``."""
    out = ip("netns", "list", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def delete(namespace: str, *, grace_s: float = 3.0) -> None:
    """Stop what still runs in ``namespace`` (SIGTERM, then SIGKILL after ``grace_s``) and remove it."""
    pids = _pids(namespace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _pids(namespace)
        if not pids:
            break
    ip("netns", "delete", namespace, check=False)


def _pids(namespace: str) -> list[int]:
    out = ip("netns", "pids", namespace, check=False)
    return [int(p) for p in out.split() if p.isdigit()]
