"""Check an emulated network: reachability with round-trip times, and the throughput of one path.

No ping or iperf on these hosts, so both are a few lines of Python sockets run inside the namespaces
(``python -m dtrain.emulate.probe serve|ping|send``). The receiver measures throughput the way iperf does,
bytes over time at the receiving end, but leaves out the first ``warmup_s`` (TCP slow start and the token
bucket's initial burst), so what it reports is the steady rate the shaper holds.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

from dtrain.emulate.netns import EmulationError, in_ns

__all__ = ["ping", "throughput_bit_per_s", "main"]

_PING, _SINK = b"P", b"T"
_CHUNK = 64 * 1024
_PORT = 5201


def ping(src_ns: str, dst_ns: str, dst_ip: str, *, count: int = 3, timeout_s: float = 10.0) -> list[float]:
    """Round-trip times (seconds) of ``count`` 64-byte TCP echoes from ``src_ns`` to ``dst_ip`` in ``dst_ns``.
    Raises :class:`EmulationError` naming both ends if it does not get through within ``timeout_s``."""
    server = _start(dst_ns, ["serve", "--bind", dst_ip, "--timeout", str(timeout_s)])
    client = _run(src_ns, ["ping", "--to", dst_ip, "--count", str(count), "--timeout", str(timeout_s)], server)
    _finish(server, timeout_s)
    return client["rtt_s"]


def throughput_bit_per_s(
    src_ns: str,
    dst_ns: str,
    dst_ip: str,
    *,
    seconds: float = 1.5,
    warmup_s: float = 0.3,
    attempts: int = 1,
    at_least: float = 0.0,
) -> float:
    """The steady rate (bit/s) one TCP stream gets from ``src_ns`` to ``dst_ip`` (in ``dst_ns``): measured up to
    ``attempts`` times, until a measurement reaches ``at_least``, the highest kept. A busy host slows the Python
    sender or receiver, never the shaped path, so a low reading can be the host's where a high one is the path's."""
    timeout = seconds + 10.0
    best = 0.0
    for _ in range(attempts):
        server = _start(dst_ns, ["serve", "--bind", dst_ip, "--timeout", str(timeout), "--warmup", str(warmup_s)])
        _run(src_ns, ["send", "--to", dst_ip, "--seconds", str(seconds), "--timeout", str(timeout)], server)
        best = max(best, _finish(server, timeout)["bit_per_s"])
        if best >= at_least:
            break
    return best


def _argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "dtrain.emulate.probe", *args]


def _start(namespace: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(in_ns(namespace, _argv(args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(namespace: str, args: list[str], server: subprocess.Popen) -> dict:
    done = subprocess.run(in_ns(namespace, _argv(args)), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        server.kill()
        server.wait()
        raise EmulationError(f"probe {args[0]} from namespace {namespace} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def _finish(server: subprocess.Popen, timeout_s: float) -> dict:
    try:
        out, err = server.communicate(timeout=timeout_s + 5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        raise EmulationError("probe server did not finish in time") from None
    if server.returncode != 0:
        raise EmulationError(f"probe server failed: {err.strip()[-500:]}")
    return json.loads(out)


def _connect(host: str, timeout_s: float) -> socket.socket:
    """Connect, retrying while the server is still starting; a clear error naming the peer after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, _PORT), timeout=timeout_s)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise EmulationError(f"cannot reach {host}:{_PORT} within {timeout_s} s: {exc}") from exc
            time.sleep(0.05)


def _serve(bind: str, timeout_s: float, warmup_s: float) -> dict:
    with socket.create_server((bind, _PORT), reuse_port=False) as listener:
        listener.settimeout(timeout_s)
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(timeout_s)
        mode = conn.recv(1)
        if mode == _PING:
            while data := conn.recv(64):
                conn.sendall(data)
            return {"mode": "ping"}
        return _sink(conn, warmup_s)


def _sink(conn: socket.socket, warmup_s: float) -> dict:
    buffer = bytearray(_CHUNK)
    total, start, mark = 0, None, None
    while n := conn.recv_into(buffer):
        now = time.perf_counter()
        start = start if start is not None else now
        total += n
        if mark is None and now - start >= warmup_s:
            mark = (now, total)
    end = time.perf_counter()
    if mark is None or end <= mark[0]:
        raise EmulationError(f"transfer too short to measure: {total} bytes, shorter than the {warmup_s} s warm-up")
    return {"mode": "sink", "bytes": total, "bit_per_s": (total - mark[1]) * 8 / (end - mark[0])}


def _ping_client(host: str, count: int, timeout_s: float) -> dict:
    rtts = []
    with _connect(host, timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_PING)
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(b"x" * 64)
            got = 0
            while got < 64:
                try:
                    chunk = conn.recv(64 - got)
                except OSError as exc:
                    chunk, why = b"", f" ({exc})"
                else:
                    why = ""
                if not chunk:
                    raise EmulationError(f"{host} closed the connection during ping {len(rtts) + 1} of {count}{why}")
                got += len(chunk)
            rtts.append(time.perf_counter() - start)
    return {"rtt_s": rtts, "median_rtt_s": statistics.median(rtts)}


def _send_client(host: str, seconds: float, timeout_s: float) -> dict:
    payload = b"\0" * _CHUNK
    sent = 0
    with _connect(host, timeout_s) as conn:
        conn.sendall(_SINK)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sent += conn.send(payload)
    return {"bytes": sent}


def main(argv: list[str] | None = None) -> int:
    """``python -m dtrain.emulate.probe serve|ping|send ...``: one JSON line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m dtrain.emulate.probe")
    parser.add_argument("role", choices=["serve", "ping", "send"])
    parser.add_argument("--bind")
    parser.add_argument("--to")
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.role == "serve":
        result = _serve(args.bind, args.timeout, args.warmup)
    elif args.role == "ping":
        result = _ping_client(args.to, args.count, args.timeout)
    else:
        result = _send_client(args.to, args.seconds, args.timeout)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
