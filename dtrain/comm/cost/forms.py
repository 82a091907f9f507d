"""Closed-form costs of the registered collective algorithms, in the alpha-beta-gamma model.

Notation of Thakur, Rabenseifner and Gropp (2005): ``p`` ranks, ``n`` bytes of work buffer (see
:mod:`dtrain.comm.cost.model` for what that is per collective), ``lg = ceil(log2 p)``; ``p'`` the largest power of
two ``<= p``. A term ``k (alpha + m beta + r gamma)`` is k rounds, each sending ``m`` and reducing ``r``
bytes. A round in which the busiest rank talks to ``q > 1`` peers starts in ``alpha + (q-1) alpha_peer``
(all its messages posted at once; see :mod:`dtrain.comm.cost.model`), which is the paper's ``q alpha`` when
``alpha_peer = alpha``. Every form assumes ``p >= 2`` (one rank costs nothing).

Bandwidth follows the multi-port model with per-link and injection limits (LogGP family; Bruck et al.'s
k-port model): a round's wire time is ``max(beta * m, beta_peer * m_pair)``, ``m`` the busiest rank's bytes
to or from all its peers and ``m_pair`` the busiest pair's. Where each rank talks to one peer (ring, tree,
doubling and halving rounds) that is ``max(beta, beta_peer) m``, written ``beta`` in the formulas below; the
direct and star rounds, of ``q`` messages of ``m/q`` bytes, cost ``max(beta m, beta_peer m/q)``.

Where an algorithm runs on a power of two only, the others are folded (MPICH's recursive doubling and
Rabenseifner's reduce-scatter / all-gather): the first ``2(p - p')`` ranks pair up, one of each pair hands its
buffer to the other (``alpha + n beta + n gamma``), ``p'`` ranks run the algorithm, and the result goes back
(``alpha + n beta``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtrain.comm.cost.params import CostParams, LinkCost
from dtrain.comm.ir.schedule import Collective

__all__ = ["Form", "CLOSED_FORMS"]

C = Collective
Seconds = Callable[[float, int, CostParams, int, int], float]


@dataclass(frozen=True)
class Form:
    """``seconds(n, p, params, local_size, pipeline)``; ``pipelined``: it cuts the message into ``pipeline``
    pieces; ``needs_local_size``: it uses the node structure."""

    seconds: Seconds
    pipelined: bool = False
    needs_local_size: bool = False


def _r(
    link: LinkCost, rounds: float, sent: float, reduced: float = 0.0, peers: int = 1, pair: float | None = None
) -> float:
    """``rounds`` rounds, each sending ``sent`` and reducing ``reduced`` bytes on the busiest rank, which talks
    to ``peers`` peers, at most ``pair`` bytes to one of them (default: all of ``sent``, one peer)."""
    wire = link.wire_s(sent, sent if pair is None else pair)
    return rounds * (link.round_start_s(peers) + wire + reduced * link.gamma_s_per_byte)


def _lg(p: int) -> int:
    return (p - 1).bit_length()


def _pof2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _folded(n: float, p: int, link: LinkCost, core: Callable[[int], float]) -> float:
    """``core(p')``, plus the fold in and the copy out when p is not a power of two."""
    q = _pof2(p)
    if q == p:
        return core(p)
    return _r(link, 1, n, n) + core(q) + _r(link, 1, n)


# ------------------------------------------------------------------------------------------------ ring


def ring_all_reduce(n, p, P, L, k):
    """``2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma`` (Patarasuk and Yuan 2009)."""
    return _r(P.intra, p - 1, n / p, n / p) + _r(P.intra, p - 1, n / p)


def ring_reduce_scatter(n, p, P, L, k):
    """``(p-1) alpha + (p-1)/p n (beta + gamma)``."""
    return _r(P.intra, p - 1, n / p, n / p)


def ring_all_gather(n, p, P, L, k):
    """``(p-1) alpha + (p-1)/p n beta`` (Thakur et al. 2005, section 3)."""
    return _r(P.intra, p - 1, n / p)


def chain_broadcast(n, p, P, L, k):
    """Pipelined chain of ``k`` pieces: ``(p + k - 2)(alpha + n/k beta)``."""
    return _r(P.intra, p + k - 2, n / k)


def chain_reduce(n, p, P, L, k):
    """``(p + k - 2)(alpha + n/k (beta + gamma))``."""
    return _r(P.intra, p + k - 2, n / k, n / k)


# ------------------------------------------------------------------------------------------------ tree


def tree_broadcast(n, p, P, L, k):
    """Binomial tree: ``lg (alpha + n beta)`` (Thakur et al. 2005, section 4.1)."""
    return _r(P.intra, _lg(p), n)


def tree_reduce(n, p, P, L, k):
    """``lg (alpha + n beta + n gamma)`` (section 4.4)."""
    return _r(P.intra, _lg(p), n, n)


def tree_all_reduce(n, p, P, L, k):
    """Binomial reduce then binomial broadcast: ``2 lg (alpha + n beta) + lg n gamma``."""
    return tree_reduce(n, p, P, L, k) + tree_broadcast(n, p, P, L, k)


def tree_gather(n, p, P, L, k):
    """Subtrees forwarded whole: ``lg alpha + (p-1)/p n beta`` (section 4.6); scatter mirrors it."""
    return _lg(p) * P.intra.alpha_s + (p - 1) / p * n * P.intra.one_peer_s_per_byte


# -------------------------------------------------------------------- recursive doubling / halving


def rd_all_reduce(n, p, P, L, k):
    """``log p' (alpha + n beta + n gamma)`` after the fold (section 4.5)."""
    return _folded(n, p, P.intra, lambda q: _r(P.intra, _lg(q), n, n))


def _extra_blocks(q: int, r: int) -> int:
    """Blocks of extra ranks the busiest active rank forwards over the doubling (or halving) steps: at
    distance d its aligned group of d active ranks holds at most min(d, r) extras' blocks."""
    return sum(min(1 << i, r) for i in range(_lg(q)))


def rd_all_gather(n, p, P, L, k):
    """``lg alpha + (p-1)/p n beta`` for a power of two (section 3). Otherwise the ``r = p - p'`` extras hand
    in their block, the doubling carries up to ``min(d, r)`` extra blocks at distance ``d``, and each extra
    is sent the ``p - 1`` blocks it lacks: ``(log p' + 2) alpha + (1 + p' - 1 + sum_d min(d, r) + p - 1) n/p
    beta``."""
    q, link = _pof2(p), P.intra
    if q == p:
        return _lg(p) * link.alpha_s + (p - 1) / p * n * link.one_peer_s_per_byte
    blocks = 1 + (q - 1) + _extra_blocks(q, p - q) + (p - 1)
    return (_lg(q) + 2) * link.alpha_s + blocks * n / p * link.one_peer_s_per_byte


def hd_all_reduce(n, p, P, L, k):
    """Rabenseifner: ``2 log p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma`` after the fold
    (section 4.5)."""

    link = P.intra

    def core(q: int) -> float:
        return 2 * _lg(q) * link.alpha_s + (q - 1) / q * n * (2 * link.one_peer_s_per_byte + link.gamma_s_per_byte)

    return _folded(n, p, link, core)


def hd_reduce_scatter(n, p, P, L, k):
    """Recursive halving: ``lg alpha + (p-1)/p n (beta + gamma)`` for a power of two (section 4.3). Otherwise
    the extras fold in their whole buffer (``alpha + n (beta + gamma)``), the halving carries up to
    ``min(d, r)`` extra blocks at distance ``d``, and each extra is sent its block (``alpha + n/p beta``)."""
    q, link = _pof2(p), P.intra
    halving = (q - 1 + _extra_blocks(q, p - q)) * n / p
    seconds = _lg(q) * link.alpha_s + halving * (link.one_peer_s_per_byte + link.gamma_s_per_byte)
    if q == p:
        return seconds
    return _r(link, 1, n, n) + seconds + _r(link, 1, n / p)


# ------------------------------------------------------------------------------------- direct, star


def direct_exchange(n, p, P, L, k):
    """One round, every rank sending a block to each of the others (star gather and scatter: the root
    receiving from or sending to each): ``alpha + (p-2) alpha_peer + max((p-1)/p n beta, n/p beta_peer)``.
    Section 4.7's pairwise exchange, ``(p-1) alpha + (p-1)/p n beta``, when ``alpha_peer = alpha`` and
    ``beta_peer`` is None."""
    return _r(P.intra, 1, (p - 1) / p * n, peers=p - 1, pair=n / p)


def direct_reduce_scatter(n, p, P, L, k):
    """``alpha + (p-2) alpha_peer + max((p-1)/p n beta, n/p beta_peer) + (p-1)/p n gamma``."""
    return _r(P.intra, 1, (p - 1) / p * n, (p - 1) / p * n, peers=p - 1, pair=n / p)


def direct_all_reduce(n, p, P, L, k):
    """Direct reduce-scatter then direct all-gather: ``2 (alpha + (p-2) alpha_peer) + 2 max((p-1)/p n beta,
    n/p beta_peer) + (p-1)/p n gamma``."""
    return direct_reduce_scatter(n, p, P, L, k) + direct_exchange(n, p, P, L, k)


def star_broadcast(n, p, P, L, k):
    """The root sends the whole buffer to each rank in one round: ``alpha + (p-2) alpha_peer + max((p-1) n
    beta, n beta_peer)``."""
    return _r(P.intra, 1, (p - 1) * n, peers=p - 1, pair=n)


def star_reduce(n, p, P, L, k):
    """The root takes and reduces every rank's buffer in one round: ``alpha + (p-2) alpha_peer + max((p-1) n
    beta, n beta_peer) + (p-1) n gamma``."""
    return _r(P.intra, 1, (p - 1) * n, (p - 1) * n, peers=p - 1, pair=n)


def star_all_gather(n, p, P, L, k):
    """Gather to the hub, then the hub sends each rank the ``p - 1`` blocks it lacks:
    ``2 (alpha + (p-2) alpha_peer) + max((p-1)/p n beta, n/p beta_peer) + max((p-1)^2/p n beta, (p-1)/p n
    beta_peer)``."""
    second = _r(P.intra, 1, (p - 1) ** 2 / p * n, peers=p - 1, pair=(p - 1) / p * n)
    return direct_exchange(n, p, P, L, k) + second


def star_reduce_scatter(n, p, P, L, k):
    """Every rank reduces its whole buffer into the hub, which hands each rank its block: star reduce then
    direct exchange."""
    return star_reduce(n, p, P, L, k) + direct_exchange(n, p, P, L, k)


def star_all_reduce(n, p, P, L, k):
    """Star reduce then star broadcast."""
    return star_reduce(n, p, P, L, k) + star_broadcast(n, p, P, L, k)


# ------------------------------------------------------------------------------- scan, barrier, nodes


def rd_scan(n, p, P, L, k):
    """Hillis-Steele doubling: ``lg (alpha + n beta + n gamma)``."""
    return _r(P.intra, _lg(p), n, n)


def linear_scan(n, p, P, L, k):
    """A pipelined chain of ``k`` pieces: ``(p + k - 2)(alpha + n/k (beta + gamma))``."""
    return _r(P.intra, p + k - 2, n / k, n / k)


def dissemination_barrier(n, p, P, L, k):
    """Hensgen, Finkel and Manber (1988): ``lg alpha``."""
    return _lg(p) * P.intra.alpha_s


def hierarchical_all_reduce(n, p, P, L, k):
    """Ring reduce-scatter in each node of ``L`` ranks, ``L`` concurrent ring all-reduces of ``n/L`` across
    the ``N = p/L`` nodes on the inter link, ring all-gather in each node."""
    return hierarchical_reduce_scatter(n, p, P, L, k) + hierarchical_all_gather(n, p, P, L, k)


def hierarchical_reduce_scatter(n, p, P, L, k):
    """``(L-1)(alpha + n/L (beta + gamma))`` inside nodes, then ``(N-1)(alpha' + n/p (beta' + gamma'))``
    across them (primed: the inter link)."""
    return _r(P.intra, L - 1, n / L, n / L) + _r(P.inter_link, p // L - 1, n / p, n / p)


def hierarchical_all_gather(n, p, P, L, k):
    """``(N-1)(alpha' + n/p beta')`` across nodes, then ``(L-1)(alpha + n/L beta)`` inside them."""
    return _r(P.inter_link, p // L - 1, n / p) + _r(P.intra, L - 1, n / L)


def hierarchical_broadcast(n, p, P, L, k):
    """Binomial trees over the node leaders, then in every node: ``lg N (alpha' + n beta') + lg L (alpha +
    n beta)``."""
    return _r(P.inter_link, _lg(p // L), n) + _r(P.intra, _lg(L), n)


def hierarchical_reduce(n, p, P, L, k):
    """``lg L (alpha + n beta + n gamma) + lg N (alpha' + n beta' + n gamma')``."""
    return _r(P.intra, _lg(L), n, n) + _r(P.inter_link, _lg(p // L), n, n)


CLOSED_FORMS: dict[tuple[Collective, str], Form] = {
    (C.ALL_REDUCE, "ring"): Form(ring_all_reduce),
    (C.REDUCE_SCATTER, "ring"): Form(ring_reduce_scatter),
    (C.ALL_GATHER, "ring"): Form(ring_all_gather),
    (C.BROADCAST, "ring"): Form(chain_broadcast, pipelined=True),
    (C.REDUCE, "ring"): Form(chain_reduce, pipelined=True),
    (C.BROADCAST, "tree"): Form(tree_broadcast),
    (C.REDUCE, "tree"): Form(tree_reduce),
    (C.ALL_REDUCE, "tree"): Form(tree_all_reduce),
    (C.GATHER, "tree"): Form(tree_gather),
    (C.SCATTER, "tree"): Form(tree_gather),
    (C.ALL_REDUCE, "recursive_doubling"): Form(rd_all_reduce),
    (C.ALL_GATHER, "recursive_doubling"): Form(rd_all_gather),
    (C.ALL_REDUCE, "halving_doubling"): Form(hd_all_reduce),
    (C.REDUCE_SCATTER, "halving_doubling"): Form(hd_reduce_scatter),
    (C.ALL_TO_ALL, "direct"): Form(direct_exchange),
    (C.ALL_GATHER, "direct"): Form(direct_exchange),
    (C.REDUCE_SCATTER, "direct"): Form(direct_reduce_scatter),
    (C.ALL_REDUCE, "direct"): Form(direct_all_reduce),
    (C.BROADCAST, "star"): Form(star_broadcast),
    (C.REDUCE, "star"): Form(star_reduce),
    (C.GATHER, "star"): Form(direct_exchange),
    (C.SCATTER, "star"): Form(direct_exchange),
    (C.ALL_REDUCE, "star"): Form(star_all_reduce),
    (C.ALL_GATHER, "star"): Form(star_all_gather),
    (C.REDUCE_SCATTER, "star"): Form(star_reduce_scatter),
    (C.SCAN, "recursive_doubling"): Form(rd_scan),
    (C.SCAN, "linear"): Form(linear_scan, pipelined=True),
    (C.BARRIER, "dissemination"): Form(dissemination_barrier),
    (C.ALL_REDUCE, "hierarchical"): Form(hierarchical_all_reduce, needs_local_size=True),
    (C.REDUCE_SCATTER, "hierarchical"): Form(hierarchical_reduce_scatter, needs_local_size=True),
    (C.ALL_GATHER, "hierarchical"): Form(hierarchical_all_gather, needs_local_size=True),
    (C.BROADCAST, "hierarchical"): Form(hierarchical_broadcast, needs_local_size=True),
    (C.REDUCE, "hierarchical"): Form(hierarchical_reduce, needs_local_size=True),
}
