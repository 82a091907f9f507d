"""dtrain.sim.ps: a parameter-server step on a uniform star equals its hand-worked closed form."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.sim.ps import PSStep, ps_traffic, simulate_ps
from tests.sim.test_sim_topologies import GB, star

RATE = 1 * GB
W, S = 6, 3
WORKERS = [f"g{i}" for i in range(W)]
SERVERS = [f"g{W + i}" for i in range(S)]
P = 3e6  # dense bytes: 1 MB a shard
APPLY = 1e-10  # the servers' optimizer, seconds per byte
ZIPF = dict(rows_per_worker=2000, key_space=100_000, row_bytes=256, zipf=1.2, seed=3)


def step(**kw) -> PSStep:
    return PSStep(workers=WORKERS, servers=SERVERS, **kw)


def sync_closed_form(replicas: int, latency_s: float = 0.0) -> float:
    """Every worker sends P/S to every server at once: a server's downlink carries W P/S, a worker's uplink P;
    flows are equal, so all move at the tighter share and end together. Pulls mirror pushes. Each head applies
    its shard; each further replica receives the shard's entry (one flow a link) and applies it. Pushes,
    forwards, acks, pull requests and replies each cross two links (their latency)."""
    phase = max(W * P / S, P) / RATE
    chain = (replicas - 1) * (P / S / RATE + 2 * latency_s)
    return 2 * phase + replicas * APPLY * P / S + chain + 4 * 2 * latency_s


@pytest.mark.parametrize("latency_s", [0.0, 5e-6])
def test_a_sync_dense_step_on_a_uniform_star_equals_the_closed_form(latency_s: float) -> None:
    topo = star(W + S, bytes_per_s=RATE, latency_s=latency_s)
    result = simulate_ps(topo, step(dense_bytes=P, apply_s_per_byte=APPLY))
    assert result.time_s == pytest.approx(sync_closed_form(1, latency_s), rel=1e-6)
    assert result.worker_s == pytest.approx([result.time_s] * W)
    # a server's links carry W P/S each way (pushes in, pulls out): they are the bottleneck
    assert {result.bottleneck.link.src, result.bottleneck.link.dst} & set(SERVERS)
    assert result.bottleneck.nbytes == pytest.approx(W * P / S)


def test_dense_load_is_even_and_counts_one_push_and_one_pull_per_worker() -> None:
    result = simulate_ps(star(W + S, bytes_per_s=RATE), step(dense_bytes=P))
    for load in result.servers:
        assert (load.push_bytes, load.pull_bytes, load.requests) == (W * P / S, W * P / S, 2 * W)
    assert result.byte_imbalance == pytest.approx(1.0) and result.request_imbalance == pytest.approx(1.0)


@pytest.mark.parametrize("replicas", [2, 3])
def test_chain_replication_adds_one_forward_and_one_apply_per_extra_replica(replicas: int) -> None:
    topo = star(W + S, bytes_per_s=RATE)
    one = simulate_ps(topo, step(dense_bytes=P, apply_s_per_byte=APPLY))
    chained = simulate_ps(topo, step(dense_bytes=P, apply_s_per_byte=APPLY, replicas=replicas))
    assert chained.time_s - one.time_s == pytest.approx((replicas - 1) * (P / S / RATE + APPLY * P / S), rel=1e-6)
    # each server sends its shard's entry on and receives its predecessor's, once a hop
    for load in chained.servers:
        assert load.replication_bytes == pytest.approx(2 * (replicas - 1) * P / S)
    # the forwarding flows are on the wire: a server's uplink carries its hops' entries
    uplink = {u.link.src: u.nbytes for u in chained.links if u.link.dst == "sw"}
    assert uplink["g6"] == pytest.approx(W * P / S + (replicas - 1) * P / S)


def test_async_workers_finish_on_their_own_and_no_later_than_sync() -> None:
    topo = star(W + S, bytes_per_s=RATE)
    sync = simulate_ps(topo, step(dense_bytes=P, **ZIPF))
    async_ = simulate_ps(topo, step(dense_bytes=P, mode="async", **ZIPF))
    assert len(async_.worker_s) == W and all(0 < t <= sync.time_s * (1 + 1e-9) for t in async_.worker_s)
    assert len(set(async_.worker_s)) > 1  # no barrier: workers with fewer rows finish first


def test_hot_copies_lower_the_max_over_mean_load_of_a_zipf_workload() -> None:
    topo = star(W + S, bytes_per_s=RATE)
    plain = simulate_ps(topo, step(**ZIPF))
    hot = simulate_ps(topo, step(hot_keys=1024, hot_replicas=2, **ZIPF))
    assert plain.pull_imbalance > 2.0  # Zipf ids put the popular rows in server 0's key range
    assert hot.pull_imbalance < 0.7 * plain.pull_imbalance
    assert hot.byte_imbalance < plain.byte_imbalance
    # the rows moved, not created: every pulled byte is still pulled once, and pushes stay at the owners
    assert sum(s.pull_bytes for s in hot.servers) == sum(s.pull_bytes for s in plain.servers)
    assert [s.push_bytes for s in hot.servers] == [s.push_bytes for s in plain.servers]
    # the owners refresh their copies: N rows to each of the hot_replicas next servers
    assert ps_traffic(step(hot_keys=256, hot_replicas=2, **ZIPF)).hot[0, 1] == 256 * ZIPF["row_bytes"]
    assert sum(s.replication_bytes for s in hot.servers) > 0 == sum(s.replication_bytes for s in plain.servers)


@pytest.mark.parametrize("extra", [dict(hot_keys=0, hot_replicas=2), dict(hot_keys=256, hot_replicas=0)])
def test_without_hot_copies_the_load_is_unchanged(extra: dict) -> None:
    topo = star(W + S, bytes_per_s=RATE)
    plain = simulate_ps(topo, step(**ZIPF))
    none = simulate_ps(topo, step(**ZIPF, **extra))
    assert none.servers == plain.servers and none.time_s == pytest.approx(plain.time_s)


@pytest.mark.parametrize("workers", [1, 3])
def test_host_work_is_paid_by_sender_and_receiver_one_message_at_a_time(workers: int) -> None:
    """One server, ``W`` workers, host cost ``h`` a byte. Pushes: each worker works ``hP``, the ``W`` flows share
    the server's downlink (``W P / B``) and end together; the server then checks them one by one (``W hP``).
    Pulls: the server prepares the replies one by one, each ``hP`` after the last; the first starts at once and
    the link is never idle after it (``hP < P/B``), so the last lands ``hP + W P / B`` after the ack; that worker
    then works ``hP``. In all, ``2 W P / B + (W + 3) hP``."""
    host = 1e-10  # 10 GB/s a process: hP = 0.1 P/B on this 1 GB/s network
    topo = star(workers + 1, bytes_per_s=RATE)
    names = dict(workers=[f"g{i}" for i in range(workers)], servers=[f"g{workers}"])
    plain = simulate_ps(topo, PSStep(**names, dense_bytes=P))
    costly = simulate_ps(topo, PSStep(**names, dense_bytes=P, host_s_per_byte=host))
    assert plain.time_s == pytest.approx(2 * workers * P / RATE, rel=1e-9)
    assert costly.time_s == pytest.approx(2 * workers * P / RATE + (workers + 3) * host * P, rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(workers=WORKERS, servers=[]), "servers"),
        (dict(workers=[], servers=SERVERS), "workers"),
        (dict(workers=WORKERS, servers=["g6", "g6"]), "servers"),
        (dict(workers=WORKERS, servers=SERVERS, dense_bytes=-1), "dense_bytes"),
        (dict(workers=WORKERS, servers=SERVERS, row_bytes=-4), "row_bytes"),
        (dict(workers=WORKERS, servers=SERVERS, rows_per_worker=10), "key_space"),
        (dict(workers=WORKERS, servers=SERVERS, mode="bsp"), "mode"),
        (dict(workers=WORKERS, servers=SERVERS, replicas=4), "replicas"),
        (dict(workers=WORKERS, servers=SERVERS, hot_replicas=3), "hot_replicas"),
        (dict(workers=WORKERS, servers=SERVERS, host_s_per_byte=-1e-9), "host_s_per_byte"),
    ],
)
def test_bad_steps_are_refused_naming_the_field(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PSStep(**kwargs)


def test_a_node_outside_the_topology_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'gx' is not a node"):
        simulate_ps(star(W + S), PSStep(workers=[*WORKERS[:-1], "gx"], servers=SERVERS))


@settings(max_examples=40, deadline=None)
@given(
    workers=st.integers(1, 5),
    servers=st.integers(1, 4),
    hot_keys=st.integers(0, 50),
    hot_replicas=st.integers(0, 3),
    zipf=st.floats(0.0, 2.0),
    seed=st.integers(0, 10),
)
def test_hot_copies_only_move_pulls_between_servers(workers, servers, hot_keys, hot_replicas, zipf, seed) -> None:
    hot_replicas = min(hot_replicas, servers - 1)
    names = dict(workers=[f"w{i}" for i in range(workers)], servers=[f"s{i}" for i in range(servers)])
    rows = dict(rows_per_worker=200, key_space=1000, row_bytes=8, zipf=zipf, seed=seed, dense_bytes=80.0)
    plain = ps_traffic(PSStep(**names, **rows))
    hot = ps_traffic(PSStep(**names, **rows, hot_keys=hot_keys, hot_replicas=hot_replicas))
    assert hot.push == plain.push and hot.entry == plain.entry
    # each worker pulls back exactly what it pushed (its distinct rows and the dense shards), wherever from
    for w in range(workers):
        pushed = sum(b for (v, _), b in plain.push.items() if v == w)
        assert sum(b for (v, _), b in hot.pull.items() if v == w) == pytest.approx(pushed)
    # a copy holds at most hot_keys rows of each owner, and only the next hot_replicas servers are copies
    for (owner, copy), nbytes in hot.hot.items():
        assert nbytes <= hot_keys * 8 and 0 < (copy - owner) % servers <= hot_replicas
