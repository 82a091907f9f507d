"""The emulator on this host: it builds a small topology from namespaces, bridges and shaped veths, the links
hold their rates, and everything is gone afterwards, also after a failure. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.cli.main import main
from dtrain.cluster.presets import preset
from dtrain.emulate import links, netns
from dtrain.emulate.build import Emulation, build, teardown_leftovers
from dtrain.emulate.plan import plan_emulation
from dtrain.emulate.probe import ping, throughput_bit_per_s
from dtrain.emulate.run import JobConfig, run_job
from dtrain.emulate.verify import verify
from tests.emulate.test_emulate_plan import _tree

pytestmark = [
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, bridges and tc qdiscs"),
]

ROOT = Path(__file__).resolve().parents[2]
# NIC 80 Mb/s, ToR uplink 40 Mb/s (scale 1e-3 of 80 / 40 Gb/s): the path between the racks is the uplink.
UPLINK_BIT_PER_S = 40e6


def _plan(tag: str):
    return plan_emulation(_tree(server_gbit=80, uplink_gbit=40), scale=1e-3, tag=tag)


def _tag(word: str) -> str:
    return f"{word}{os.getpid() % 10000}"


def _bridges(fabric: str) -> set[str]:
    out = netns.ip("-o", "link", "show", "type", "bridge", namespace=fabric)
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture(scope="module")
def built():
    plan = _plan(_tag("up"))
    with Emulation(plan):
        yield plan
    assert not netns.list_namespaces(f"dte-{plan.tag}-")


def test_every_server_and_the_fabric_are_namespaces(built):
    assert set(netns.list_namespaces(f"dte-{built.tag}-")) == set(built.namespaces)


def test_every_switch_is_a_bridge_in_the_fabric(built):
    assert _bridges(built.fabric) == set(built.bridges)


def test_servers_in_different_racks_reach_each_other(built):
    a, b = built.servers
    assert len(ping(a.namespace, b.namespace, b.ip)) == 3


def test_a_rate_limited_path_holds_its_rate_within_15_percent(built):
    a, b = built.servers
    measured = throughput_bit_per_s(a.namespace, b.namespace, b.ip, attempts=3, at_least=0.85 * UPLINK_BIT_PER_S)
    assert measured == pytest.approx(UPLINK_BIT_PER_S, rel=0.15)


def test_leaving_removes_every_namespace_and_bridge():
    plan = _plan(_tag("rm"))
    with Emulation(plan):
        assert set(netns.list_namespaces(f"dte-{plan.tag}-")) == set(plan.namespaces)
    assert netns.list_namespaces(f"dte-{plan.tag}-") == []


def test_an_error_inside_still_tears_down():
    plan = _plan(_tag("er"))
    with pytest.raises(RuntimeError, match="boom"), Emulation(plan):
        raise RuntimeError("boom")
    assert netns.list_namespaces(f"dte-{plan.tag}-") == []


def test_down_removes_leftovers_by_prefix():
    plan = _plan(_tag("lo"))
    build(plan)  # as a killed process would leave it
    removed = teardown_leftovers(f"dte-{plan.tag}-")
    assert sorted(removed) == sorted(plan.namespaces)
    assert netns.list_namespaces(f"dte-{plan.tag}-") == []


def test_down_refuses_a_prefix_that_is_not_the_emulators():
    with pytest.raises(ValueError, match="must start with 'dte-'"):
        teardown_leftovers("eth")


def test_a_dtrain_command_runs_across_the_servers(built, tmp_path):
    out = tmp_path / "bench.jsonl"
    command = ["bench", "comm", "--collectives", "all_reduce", "--algorithms", "native", "--min-bytes", "4K",
               "--max-bytes", "4K", "--warmup", "0", "--iters", "1", "--trials", "1", "--out", str(out)]  # fmt: skip
    assert run_job(built, JobConfig(command=command, log_dir=tmp_path, timeout_s=120, port=29561)) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (record["world_size"], record["backend"]) == (2, "gloo")


def test_a_failing_node_stops_the_job_with_its_status(built, tmp_path, capsys):
    missing = str(tmp_path / "no-such-script.py")  # every worker fails at once, before importing anything
    job = JobConfig(command=[], script=missing, log_dir=tmp_path, timeout_s=120, port=29562)
    assert run_job(built, job) != 0
    assert "dtrain emulate: node" in capsys.readouterr().err
    assert all(netns.ip("netns", "pids", s.namespace).split() == [] for s in built.servers)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_tears_down_before_the_process_exits(signum):
    tag = _tag("sg")
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a test's shell ignores it)\n"
        "from dtrain.emulate.build import Emulation\n"
        "from dtrain.emulate.plan import plan_emulation\n"
        "from tests.emulate.test_emulate_plan import _tree\n"
        f"with Emulation(plan_emulation(_tree(), scale=1e-3, tag={tag!r})):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "up"
        assert len(netns.list_namespaces(f"dte-{tag}-")) == 3
        child.send_signal(signum)
        child.wait(timeout=30)
        left = netns.list_namespaces(f"dte-{tag}-")  # before the safety net below removes anything
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        teardown_leftovers(f"dte-{tag}-")
    assert child.returncode != 0
    assert left == []


def test_the_check_reports_every_servers_rtt_and_the_cross_rack_rate(built):
    report = verify(built, tolerance=0.15)
    assert set(report["median_rtt_s"]) == {"s1"}
    assert report["configured_bit_per_s"] == pytest.approx(UPLINK_BIT_PER_S)


def test_a_second_emulation_with_the_same_tag_is_refused_and_leaves_the_first_alone(built):
    with pytest.raises(netns.EmulationError, match="exist already"), Emulation(built):
        pass
    assert set(netns.list_namespaces(f"dte-{built.tag}-")) == set(built.namespaces)


# The routed leaf-spine: 2 racks x 1 server, 100 Gb/s NICs, 2 spines, 1:1, at 1e-3: each ToR-spine link is
# 50 Mb/s, so one flow between the racks (one spine) gets 50 Mb/s, not the ToR's summed 100 Mb/s.
SPINE_LINK_BIT_PER_S = 50e6


def _routed_plan(tag: str):
    topology = preset("4-rack", racks=2, servers_per_rack=1, gpus=1, nics=1, nic="ethernet100", oversubscription=1)
    return plan_emulation(topology, scale=1e-3, tag=tag, fabric="routed")


@pytest.fixture(scope="module")
def routed():
    plan = _routed_plan(_tag("ro"))
    with Emulation(plan):
        yield plan
    assert not netns.list_namespaces(f"dte-{plan.tag}-")


def _sysctl(namespace: str, key: str) -> str:
    return netns.run_tool(netns.in_ns(namespace, ["sysctl", "-n", key])).strip()


def test_a_routed_fabric_is_a_namespace_per_router_and_server(routed):
    assert set(netns.list_namespaces(f"dte-{routed.tag}-")) == set(routed.namespaces)
    assert len(routed.namespaces) == 6  # 2 ToRs, 2 spines, 2 servers


def test_routers_forward_and_hash_on_the_l4_five_tuple(routed):
    for router in routed.routers:
        assert _sysctl(router.namespace, "net.ipv4.ip_forward") == "1"
        assert _sysctl(router.namespace, "net.ipv4.fib_multipath_hash_policy") == "1"


def test_a_tor_spreads_tcp_connections_over_every_spine(routed):
    # The kernel's forwarding decision for 16 TCP 5-tuples that differ only in source port (`ip route get`, the
    # L4 hash of a packet that carries none of its own): both spines get some (all 16 on one spine has
    # probability 2**-15 under a uniform hash).
    tor = routed.routers[0]
    a, b = routed.servers
    devices = set()
    for sport in range(40000, 40016):
        out = netns.ip("route", "get", b.ip, "from", a.ip, "iif", tor.bridge, "ipproto", "tcp", "sport", str(sport),
                       "dport", "5201", namespace=tor.namespace)  # fmt: skip
        devices.add(out.split(" dev ")[1].split()[0])
    assert devices == {"dte-u0", "dte-u1"}


def test_the_check_pings_every_pair_and_one_flow_gets_one_spine_links_rate(routed):
    report = verify(routed, tolerance=0.15)
    assert set(report["median_rtt_s"]) == {"s0->s1", "s1->s0"}
    assert report["configured_bit_per_s"] == pytest.approx(SPINE_LINK_BIT_PER_S)


def test_down_removes_a_routed_fabrics_routers_and_servers():
    plan = _routed_plan(_tag("rl"))
    build(plan)  # as a killed process would leave it
    removed = teardown_leftovers(f"dte-{plan.tag}-")
    assert sorted(removed) == sorted(plan.namespaces)
    assert netns.list_namespaces(f"dte-{plan.tag}-") == []


def test_a_failure_half_way_through_a_routed_build_removes_every_router_and_server(monkeypatch):
    plan = _routed_plan(_tag("rf"))
    real_ip = netns.ip

    def failing_routes(*args, **kwargs):
        if args[:2] == ("route", "add"):
            raise netns.EmulationError("ip route add failed (injected)")
        return real_ip(*args, **kwargs)

    monkeypatch.setattr(netns, "ip", failing_routes)
    with pytest.raises(netns.EmulationError, match="injected"), Emulation(plan):
        pass
    assert netns.list_namespaces(f"dte-{plan.tag}-") == []


def test_up_with_a_tag_in_use_is_refused_and_leaves_the_first_emulation_up(built, monkeypatch, capsys):
    monkeypatch.setattr("dtrain.cli.emulate._plan", lambda args: built)
    assert main(["emulate", "up", "--topology", "4-rack", "--tag", built.tag]) == 2
    assert "exist already" in capsys.readouterr().err
    assert set(netns.list_namespaces(f"dte-{built.tag}-")) == set(built.namespaces)


class _Signalled(BaseException):
    """SIGTERM that reached a handler the test set, not the emulator's (the test process must survive it)."""


@pytest.fixture
def sigterm_guard():
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(_Signalled()))
    yield
    signal.signal(signal.SIGTERM, previous)


def _sigterm_on_call(monkeypatch, module, name: str, call: int) -> None:
    """``module.name`` sends this process SIGTERM on its ``call``-th call, then does its work."""
    real, calls = getattr(module, name), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, signalled)


def test_sigterm_during_up_removes_what_was_built(sigterm_guard, monkeypatch, capsys):
    plan = _plan(_tag("us"))
    monkeypatch.setattr("dtrain.cli.emulate._plan", lambda args: plan)
    _sigterm_on_call(monkeypatch, links, "limit_rate", 2)
    try:
        status = main(["emulate", "up", "--topology", "4-rack", "--tag", plan.tag])
        left = netns.list_namespaces(f"dte-{plan.tag}-")
    finally:
        teardown_leftovers(f"dte-{plan.tag}-")
    assert (status, left) == (128 + signal.SIGTERM, [])
    assert "stopped by signal 15" in capsys.readouterr().err


def test_sigterm_during_the_teardown_does_not_cut_it_short(sigterm_guard, monkeypatch):
    plan = _plan(_tag("ts"))
    _sigterm_on_call(monkeypatch, netns, "delete", 1)
    try:
        with Emulation(plan):
            pass
        left = netns.list_namespaces(f"dte-{plan.tag}-")
    finally:
        teardown_leftovers(f"dte-{plan.tag}-")
    assert left == []
