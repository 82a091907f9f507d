"""The alpha-beta-gamma model: closed forms agree with round-by-round pricing, choices follow the model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm.cost import model as cost
from dtrain.comm.cost.forms import CLOSED_FORMS
from dtrain.comm.cost.model import CostParams, LinkCost, choose, predict, predict_schedule
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective

# Distinct, not round, values so that a term counted with the wrong coefficient cannot cancel out.
PARAMS = CostParams(
    intra=LinkCost(alpha_s=1.0, beta_s_per_byte=1e-3, gamma_s_per_byte=3e-4),
    inter=LinkCost(alpha_s=7.0, beta_s_per_byte=5e-3, gamma_s_per_byte=2e-4),
)
# The same links with a round's further peers starting cheaper than its first (messages posted together).
MULTI_PORT = CostParams(
    intra=LinkCost(alpha_s=1.0, beta_s_per_byte=1e-3, gamma_s_per_byte=3e-4, alpha_peer_s=0.37),
    inter=LinkCost(alpha_s=7.0, beta_s_per_byte=5e-3, gamma_s_per_byte=2e-4, alpha_peer_s=2.9),
)
BOTH_PORT_MODELS = pytest.mark.parametrize("params", [PARAMS, MULTI_PORT], ids=["single_port", "multi_port"])


def _with_beta_peer(params: CostParams, intra: float | None, inter: float | None) -> CostParams:
    return CostParams(
        intra=dataclasses.replace(params.intra, beta_peer_s_per_byte=intra),
        inter=dataclasses.replace(params.inter, beta_peer_s_per_byte=inter),
    )


# One pair slower than a rank's total (4.3x: direct rounds are pair-bound up to 5 ranks, rank-bound above).
PAIR_SLOW = _with_beta_peer(MULTI_PORT, 4.3e-3, 1.3e-2)
# One pair faster than the rank's total: the per-pair limit never binds.
PAIR_FAST = _with_beta_peer(MULTI_PORT, 0.6e-3, 2.1e-3)
ALL_MODELS = pytest.mark.parametrize(
    "params",
    [PARAMS, MULTI_PORT, PAIR_SLOW, PAIR_FAST],
    ids=["single_port", "multi_port", "pair_slower", "pair_faster"],
)
CPU = cost.default_params("cpu")

REGISTERED = [(c, a) for c in Collective for a in registry.names(c)]
WITH_FORMS = [(c, a) for c, a in REGISTERED if (c, a) in CLOSED_FORMS]


def _local_sizes(algorithm: str, world: int) -> list[int | None]:
    if not registry.needs_local_size(algorithm):
        return [None]
    return [d for d in range(1, world + 1) if world % d == 0]


def _schedule(collective: Collective, algorithm: str, world: int, pipeline: int, local_size: int | None):
    root = 0 if collective in ROOTED_COLLECTIVES else None
    return registry.build(collective, algorithm, world, root=root, pipeline=pipeline, local_size=local_size)


def test_every_registered_algorithm_has_a_closed_form_or_a_schedule_price():
    for collective, algorithm in REGISTERED:
        assert predict(collective, algorithm, 1 << 16, 4, PARAMS, local_size=2) > 0


@pytest.mark.parametrize(("collective", "algorithm"), WITH_FORMS, ids=lambda x: getattr(x, "value", x))
@pytest.mark.parametrize("world", range(1, 10))
@ALL_MODELS
def test_closed_form_equals_round_by_round_price(collective, algorithm, world, params):
    """Exact where the chunk sizes divide evenly: both follow the same model."""
    for local_size in _local_sizes(algorithm, world):
        for pipeline in (1, 3):
            schedule = _schedule(collective, algorithm, world, pipeline, local_size)
            nbytes = 0 if collective == Collective.BARRIER else 4 * schedule.nchunks * 5 * 64
            by_rounds = predict_schedule(schedule, nbytes, params, local_size=local_size)
            closed = predict(collective, algorithm, nbytes, world, params, local_size=local_size, pipeline=pipeline)
            assert closed == pytest.approx(by_rounds, rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from([(c, a) for c, a in WITH_FORMS if c != Collective.BARRIER]),
    world=st.integers(2, 12),
    nbytes=st.integers(0, 1 << 22),
    params=st.sampled_from([PARAMS, MULTI_PORT, PAIR_SLOW, PAIR_FAST]),
)
def test_closed_form_is_within_uneven_chunk_rounding_of_the_schedule(case, world, nbytes, params):
    """With uneven chunks (every chunk non-empty) the two differ by at most a byte a chunk a round."""
    collective, algorithm = case
    local_size = 2 if registry.needs_local_size(algorithm) and world % 2 == 0 else None
    if registry.needs_local_size(algorithm) and local_size is None:
        local_size = world
    schedule = _schedule(collective, algorithm, world, 1, local_size)
    nbytes = max(nbytes, schedule.nchunks)
    nbytes -= nbytes % schedule.nblocks
    by_rounds = predict_schedule(schedule, nbytes, params, local_size=local_size, itemsize=1)
    closed = predict(collective, algorithm, nbytes, world, params, local_size=local_size)
    links = (params.intra, params.inter_link)
    per_byte = max(link.one_peer_s_per_byte for link in links) + max(link.gamma_s_per_byte for link in links)
    slack = schedule.num_rounds * schedule.nchunks * per_byte + 1e-9
    assert abs(by_rounds - closed) <= slack


@pytest.mark.parametrize("local_size", [2, 4])
def test_flat_ring_across_nodes_is_priced_at_the_inter_link(local_size):
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 8)
    by_rounds = predict_schedule(schedule, 4 * 8 * 64, PARAMS, local_size=local_size)
    assert predict("all_reduce", "ring", 4 * 8 * 64, 8, PARAMS, local_size=local_size) == pytest.approx(by_rounds)


@ALL_MODELS
def test_flat_algorithms_across_nodes_cost_at_most_their_closed_form(params):
    for collective, algorithm in WITH_FORMS:
        if registry.needs_local_size(algorithm):
            continue
        schedule = _schedule(collective, algorithm, 8, 2, None)
        nbytes = 0 if collective == Collective.BARRIER else 4 * schedule.nchunks * 64
        closed = predict(collective, algorithm, nbytes, 8, params, local_size=4, pipeline=2)
        assert predict_schedule(schedule, nbytes, params, local_size=4) <= closed + 1e-9


def test_one_rank_costs_nothing():
    for collective, algorithm in WITH_FORMS:
        assert predict(collective, algorithm, 1 << 20, 1, PARAMS, local_size=1) == 0.0


def test_ring_all_reduce_is_the_textbook_formula():
    a, b, g = 1.0, 1e-3, 3e-4
    p, n = 8, 8 * 1024
    want = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert predict("all_reduce", "ring", n, p, PARAMS) == pytest.approx(want)


def test_hierarchical_prices_the_cross_node_steps_on_the_inter_link():
    same = CostParams(intra=PARAMS.intra)
    slow_between = predict("all_reduce", "hierarchical", 1 << 20, 8, PARAMS, local_size=4)
    assert slow_between > predict("all_reduce", "hierarchical", 1 << 20, 8, same, local_size=4)


def test_choose_picks_ring_for_large_messages_on_cpu_defaults():
    candidates = ["tree", "recursive_doubling", "halving_doubling", "ring"]
    assert choose("all_reduce", 64 << 20, 6, CPU, candidates=candidates) == "ring"


@pytest.mark.parametrize("world", [4, 6, 8])
def test_choose_picks_a_log_round_algorithm_for_small_messages_on_cpu_defaults(world):
    candidates = ["ring", "tree", "recursive_doubling", "halving_doubling"]
    assert choose("all_reduce", 1024, world, CPU, candidates=candidates) == "recursive_doubling"


def test_choose_skips_auto_native_and_hierarchical_without_nodes():
    picked = choose("all_reduce", 1 << 20, 8, CPU, candidates=["auto", "native", "hierarchical", "ring"])
    assert picked == "ring"
    with pytest.raises(ValueError, match="no candidate"):
        choose("all_reduce", 1 << 20, 8, CPU, candidates=["hierarchical"], local_size=8)


# Measured on 4 H200s over NCCL: a round with one peer starts in ~55 us, with all three ~95 us.
def _h200(alpha_peer_s: float | None) -> CostParams:
    link = LinkCost(alpha_s=55e-6, beta_s_per_byte=1 / 150e9, gamma_s_per_byte=1 / 1e12, alpha_peer_s=alpha_peer_s)
    return CostParams(intra=link)


@pytest.mark.parametrize("collective", [Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
@pytest.mark.parametrize("nbytes", [64 << 20, 256 << 20])
def test_choose_picks_direct_for_large_messages_at_four_ranks_when_further_peers_start_cheaply(collective, nbytes):
    candidates = registry.names(collective)
    assert {"ring", "direct"} < set(candidates)
    assert choose(collective, nbytes, 4, _h200(20e-6), candidates=candidates) == "direct"


@pytest.mark.parametrize(
    ("collective", "picked"),
    [
        (Collective.ALL_REDUCE, "halving_doubling"),
        (Collective.ALL_GATHER, "recursive_doubling"),
        (Collective.REDUCE_SCATTER, "halving_doubling"),
    ],
)
def test_choose_keeps_the_single_port_choices_when_alpha_peer_equals_alpha(collective, picked):
    candidates = registry.names(collective)
    assert choose(collective, 64 << 20, 4, _h200(55e-6), candidates=candidates) == picked
    assert choose(collective, 64 << 20, 4, _h200(None), candidates=candidates) == picked


# Measured on 4 H200s over NCCL point to point: one pair moves 16-64 MiB at ~150-190 GB/s, a rank sending to
# its three peers at once ~305-330 GB/s in total; at 64 MiB all-reduce busbw is direct 197, halving_doubling
# 144, ring 99 GB/s.
H200_PAIRS = CostParams(
    intra=LinkCost(
        alpha_s=47e-6,
        alpha_peer_s=31e-6,
        beta_s_per_byte=1 / 330e9,
        beta_peer_s_per_byte=1 / 190e9,
        gamma_s_per_byte=1 / 1.4e12,
    )
)


def _pairs_half_as_fast(alpha_peer_s: float) -> CostParams:
    link = LinkCost(
        alpha_s=47e-6,
        alpha_peer_s=alpha_peer_s,
        beta_s_per_byte=1 / 330e9,
        beta_peer_s_per_byte=2 / 330e9,
        gamma_s_per_byte=1 / 1.4e12,
    )
    return CostParams(intra=link)


@pytest.mark.parametrize("params", [_pairs_half_as_fast(5e-6), H200_PAIRS], ids=["half_rate_pairs", "h200"])
def test_choose_picks_direct_for_64_mib_all_reduce_when_pairs_are_slower_than_the_rank(params):
    candidates = registry.names(Collective.ALL_REDUCE)
    assert {"direct", "halving_doubling", "ring"} <= set(candidates)
    assert choose("all_reduce", 64 << 20, 4, params, candidates=candidates) == "direct"


def test_choose_picks_recursive_doubling_for_8_kib_all_reduce_when_further_peers_start_dearly():
    candidates = registry.names(Collective.ALL_REDUCE)
    assert choose("all_reduce", 8 << 10, 4, H200_PAIRS, candidates=candidates) == "recursive_doubling"


def test_the_model_orders_64_mib_all_reduce_at_four_ranks_as_measured_on_h200():
    times = {a: predict("all_reduce", a, 64 << 20, 4, H200_PAIRS) for a in ("direct", "halving_doubling", "ring")}
    assert times["direct"] < times["halving_doubling"] < times["ring"]


def test_choose_takes_hierarchical_when_the_inter_link_is_slow():
    params = CostParams(intra=CPU.intra, inter=LinkCost(alpha_s=1e-4, beta_s_per_byte=1e-8, gamma_s_per_byte=0))
    picked = choose("all_reduce", 64 << 20, 8, params, candidates=["ring", "hierarchical"], local_size=4)
    assert picked == "hierarchical"


def test_optimal_pipeline_minimises_the_chain_broadcast():
    n, p = 64 << 20, 8
    k = cost.optimal_pipeline(n, p, CPU.intra)
    times = {j: predict("broadcast", "ring", n, p, CPU, pipeline=j) for j in range(1, 65)}
    assert times[k] == pytest.approx(min(times.values()), rel=1e-3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: predict("all_reduce", "ring", -1, 4, PARAMS), "nbytes"),
        (lambda: predict("all_reduce", "ring", 1024, 0, PARAMS), "world_size"),
        (lambda: predict("all_reduce", "bogus", 1024, 4, PARAMS), "bogus"),
        (lambda: predict("all_reduce", "ring", 1024, 4, PARAMS, pipeline=0), "pipeline"),
        (lambda: predict("all_reduce", "hierarchical", 1024, 4, PARAMS), "local_size"),
        (lambda: predict("all_reduce", "hierarchical", 1024, 6, PARAMS, local_size=4), "local_size"),
        (lambda: predict("no_such_collective", "ring", 1024, 4, PARAMS), "no_such_collective"),
        (lambda: LinkCost(alpha_s=-1.0, beta_s_per_byte=0, gamma_s_per_byte=0), "alpha_s"),
        (lambda: LinkCost(alpha_s=math.nan, beta_s_per_byte=0, gamma_s_per_byte=0), "alpha_s"),
        (lambda: LinkCost(alpha_s=1.0, beta_s_per_byte=0, gamma_s_per_byte=0, alpha_peer_s=-1e-6), "alpha_peer_s"),
        (lambda: LinkCost(alpha_s=1.0, beta_s_per_byte=0, gamma_s_per_byte=0, alpha_peer_s=math.inf), "alpha_peer"),
        (lambda: dataclasses.replace(PARAMS.intra, beta_peer_s_per_byte=-1e-9), "beta_peer_s_per_byte"),
        (lambda: dataclasses.replace(PARAMS.intra, beta_peer_s_per_byte=math.nan), "beta_peer_s_per_byte"),
        (lambda: dataclasses.replace(PARAMS.intra, beta_peer_s_per_byte="1"), "beta_peer_s_per_byte"),
        (lambda: cost.default_params("tpu"), "tpu"),
        (lambda: CostParams.from_dict({"intra": {"alpha": 1}}), "CostParams"),
        (lambda: predict_schedule(registry.build(Collective.ALL_GATHER, "ring", 4), 6, PARAMS), "element"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@ALL_MODELS
def test_params_round_trip_through_json(tmp_path, params):
    path = cost.save_params(params, tmp_path / "cal.json", {"host": "test"})
    assert cost.load_params(path) == params
    assert CostParams.from_dict(params.to_dict()) == params


def test_a_calibration_file_without_alpha_peer_reads_as_single_port():
    data = {"intra": {"alpha_s": 1.0, "beta_s_per_byte": 1e-3, "gamma_s_per_byte": 3e-4}, "inter": None}
    link = CostParams.from_dict(data).intra
    assert link.alpha_peer_s is None
    assert link.per_peer_s == link.alpha_s == 1.0


def test_a_calibration_file_without_beta_peer_reads_as_no_per_pair_limit():
    data = {"intra": {"alpha_s": 1.0, "beta_s_per_byte": 1e-3, "gamma_s_per_byte": 3e-4, "alpha_peer_s": 0.5}}
    link = CostParams.from_dict(data).intra
    assert link.beta_peer_s_per_byte is None
    assert link.pair_s_per_byte == link.one_peer_s_per_byte == link.beta_s_per_byte == 1e-3


def test_beta_peer_is_saved_in_the_json_file(tmp_path):
    path = cost.save_params(PAIR_SLOW, tmp_path / "cal.json")
    data = json.loads(path.read_text())
    assert data["intra"]["beta_peer_s_per_byte"] == 4.3e-3 and data["inter"]["beta_peer_s_per_byte"] == 1.3e-2


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_no_per_pair_limit_prices_every_algorithm_on_the_rank_total_alone(world):
    """None, 0 (pairs infinitely fast) and beta itself (a pair as fast as the rank) all price alike: one
    pair's bytes never exceed its rank's, so only the rank's total counts, as before beta_peer existed."""
    no_limit, as_fast_as_the_rank = _with_beta_peer(MULTI_PORT, 0.0, 0.0), _with_beta_peer(MULTI_PORT, 1e-3, 5e-3)
    for collective, algorithm in REGISTERED:
        local_size = (2 if world % 2 == 0 else world) if registry.needs_local_size(algorithm) else None
        want = predict(collective, algorithm, 3 << 14, world, MULTI_PORT, local_size=local_size)
        for params in (no_limit, as_fast_as_the_rank):
            assert predict(collective, algorithm, 3 << 14, world, params, local_size=local_size) == want, algorithm


def test_alpha_peer_equal_to_alpha_prices_like_the_single_port_default():
    explicit = CostParams(
        intra=LinkCost(alpha_s=1.0, beta_s_per_byte=1e-3, gamma_s_per_byte=3e-4, alpha_peer_s=1.0),
        inter=LinkCost(alpha_s=7.0, beta_s_per_byte=5e-3, gamma_s_per_byte=2e-4, alpha_peer_s=7.0),
    )
    for collective, algorithm in REGISTERED:
        for world in (2, 6, 8):
            local_size = 2 if registry.needs_local_size(algorithm) else None
            single = predict(collective, algorithm, 1 << 16, world, PARAMS, local_size=local_size)
            same = predict(collective, algorithm, 1 << 16, world, explicit, local_size=local_size)
            assert same == pytest.approx(single, rel=1e-12)


def test_a_pair_slower_than_its_rank_slows_single_peer_rounds_to_the_pair_rate():
    a, b_pair, g = 1.0, 4.3e-3, 3e-4
    p, n = 8, 8 * 1024
    want = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b_pair + (p - 1) / p * n * g
    assert predict("all_reduce", "ring", n, p, PAIR_SLOW) == pytest.approx(want)


@pytest.mark.parametrize(("world", "bound"), [(3, "pair"), (4, "pair"), (5, "pair"), (6, "rank"), (8, "rank")])
def test_direct_all_to_all_pays_the_slower_of_the_rank_total_and_one_pair(world, bound):
    """Each of ``p - 1`` messages is ``n/p``: the pair moves ``n/p`` at 4.3e-3, the rank ``(p-1)/p n`` at 1e-3."""
    n = world * 1024
    wire = n / world * 4.3e-3 if bound == "pair" else (world - 1) / world * n * 1e-3
    want = 1.0 + (world - 2) * 0.37 + wire
    assert predict("all_to_all", "direct", n, world, PAIR_SLOW) == pytest.approx(want)


@pytest.mark.parametrize("world", [3, 4, 8])
def test_direct_all_to_all_pays_one_start_up_and_alpha_peer_per_further_peer(world):
    n = world * 1024
    want = 1.0 + (world - 2) * 0.37 + (world - 1) / world * n * 1e-3
    assert predict("all_to_all", "direct", n, world, MULTI_PORT) == pytest.approx(want)
    assert predict_schedule(registry.build(Collective.ALL_TO_ALL, "direct", world), n, MULTI_PORT) == pytest.approx(
        want
    )


def test_load_params_falls_back_to_defaults_without_a_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "missing.json"))
    assert cost.load_params(device="cuda") == cost.default_params("cuda")
    with pytest.raises(FileNotFoundError):
        cost.load_params(tmp_path / "missing.json")


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-8))
def test_fit_line_recovers_alpha_and_beta_from_exact_timings(alpha, beta):
    from dtrain.comm.cost.calibrate import DEFAULT_SIZES, fit_line

    fitted = fit_line(DEFAULT_SIZES, [alpha + beta * n for n in DEFAULT_SIZES])
    assert fitted == pytest.approx((alpha, beta), rel=1e-6, abs=1e-15)


def test_the_runtime_pipelines_exactly_the_forms_the_model_prices_as_pipelined():
    """A form priced in pieces must run in pieces (and with the same piece count), or the model's choice among
    algorithms compares a pipelined price with an unpipelined run."""
    from dtrain.comm import api
    from dtrain.comm.cost.forms import CLOSED_FORMS

    for (coll, algorithm), form in CLOSED_FORMS.items():
        assert api._pipelines(coll, algorithm) is form.pipelined, (coll, algorithm)
        assert api._pipelines(coll, algorithm + "@peer") is form.pipelined, (coll, algorithm)
