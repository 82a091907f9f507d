"""Equal-cost paths found tier by tier: inside a server, then across the switch fabric, then inside the other server.

A cluster graph is servers (GPUs, CPUs, PCIe switches, NICs, NVSwitches: nodes that carry a ``server``) hung
under a fabric of switches (nodes without one). A path between two servers leaves the first through one of its
ports (a node with a link to the fabric), crosses the fabric and enters the second through one of its ports. So
the fewest-hop paths are combinations of three cached pieces: a server's shortest paths from a node to its ports
(one breadth-first search of a few dozen nodes), the fabric's shortest paths between two switches (one
breadth-first search of the switches per source switch, shared by every server under it) and the other server's
from its ports to the node. That is the hierarchical decomposition routing on a Clos network rests on (Al-Fares
et al., SIGCOMM 2008, section 3.3: two-level tables, a prefix for the pod and a suffix for the host).

It is exact, not a heuristic, when no fewest-hop path can pass through a third server; :class:`TierRouter`
checks that once (no link joins two servers, and between any two switches a server's ports attach to, the fabric
is strictly shorter than the way through the server) and says so with :attr:`TierRouter.exact`; where it is not,
and for pairs the decomposition does not cover (a switch as an end, two nodes of one server that could be joined
faster through the fabric), :meth:`Topology.equal_cost_paths` falls back to a search of the whole graph.

Rail-optimised NIC affinity (``nic_affinity="rail"``): GPU ``k`` of a server with as many NICs as GPUs leaves
and enters the server through NIC ``k`` only, as NCCL picks the NIC nearest each GPU and a rail-optimised fabric
cables NIC ``k`` of every server to rail ``k`` (NVIDIA DGX SuperPOD reference architecture).

No torch here.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import deque
from typing import Any

__all__ = ["TierRouter", "NIC_AFFINITIES", "natural_key"]

#: How a GPU picks the NIC its traffic leaves by: any on a fewest-hop path (hashed per flow), or its own rail's.
NIC_AFFINITIES = ("ecmp", "rail")


def _bfs(succ: dict[str, list[str]], src: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Hop distances from ``src`` and each node's predecessors on fewest-hop paths."""
    dist, preds = {src: 0}, {src: []}
    queue = deque([src])
    while queue:
        u = queue.popleft()
        du = dist[u] + 1
        for v in succ.get(u, ()):
            dv = dist.get(v)
            if dv is None:
                dist[v] = du
                preds[v] = [u]
                queue.append(v)
            elif dv == du:
                preds[v].append(u)
    return dist, preds


def _paths_to(preds: dict[str, list[str]], dst: str) -> list[list[str]]:
    """Every fewest-hop path from the search's source to ``dst``, from the predecessor lists."""
    if not preds[dst]:
        return [[dst]]
    return [path + [dst] for p in preds[dst] for path in _paths_to(preds, p)]


@functools.lru_cache(maxsize=1 << 18)
def natural_key(name: str) -> tuple[Any, ...]:
    """Sort ``gpu2`` before ``gpu10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


class TierRouter:
    """Fewest-hop paths of a topology's graph, computed per tier and cached (see the module docstring)."""

    def __init__(self, graph: Any, nic_affinity: str = "ecmp") -> None:
        if nic_affinity not in NIC_AFFINITIES:
            raise ValueError(f"nic_affinity {nic_affinity!r} is not one of {NIC_AFFINITIES}")
        self.server: dict[str, str | None] = dict(graph.nodes(data="server"))
        kinds = dict(graph.nodes(data="kind"))
        self._inner: dict[str, dict[str, list[str]]] = {}  # server -> successors inside it
        self._fabric: dict[str, list[str]] = {}  # switch -> successor switches
        self.exits: dict[str, list[tuple[str, str]]] = {}  # server -> (port, switch) links leaving it
        self.entries: dict[str, list[tuple[str, str]]] = {}  # server -> (switch, port) links entering it
        self.exact = True
        for u, v in graph.edges():
            su, sv = self.server[u], self.server[v]
            if su is not None and sv is not None:
                if su != sv:
                    self.exact = False  # a cable between two servers: paths may cross a third
                self._inner.setdefault(su, {}).setdefault(u, []).append(v)
            elif su is not None:
                self.exits.setdefault(su, []).append((u, v))
            elif sv is not None:
                self.entries.setdefault(sv, []).append((u, v))
            else:
                self._fabric.setdefault(u, []).append(v)
        self._inner_search: dict[str, tuple[dict[str, int], dict[str, list[str]]]] = {}
        self._inner_reverse: dict[str, dict[str, list[str]]] = {}
        self._fabric_search: dict[str, tuple[dict[str, int], dict[str, list[str]]]] = {}
        self.affinity: dict[str, str] = {}  # gpu -> its NIC
        if nic_affinity == "rail":
            self._rail_affinity(graph, kinds)
        if self.exact:
            self.exact = self._no_transit()

    def _rail_affinity(self, graph: Any, kinds: dict[str, str]) -> None:
        by_server: dict[str, dict[str, list[str]]] = {}
        for name, kind in kinds.items():
            server = self.server[name]
            if server is not None and kind in ("gpu", "nic"):
                by_server.setdefault(server, {"gpu": [], "nic": []})[kind].append(name)
        for parts in by_server.values():
            gpus, nics = sorted(parts["gpu"], key=natural_key), sorted(parts["nic"], key=natural_key)
            if len(gpus) == len(nics):
                self.affinity.update(zip(gpus, nics, strict=True))

    # -- searches, cached -------------------------------------------------------------------------------------

    def inner(self, node: str) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Fewest-hop search from ``node`` inside its server."""
        found = self._inner_search.get(node)
        if found is None:
            found = self._inner_search[node] = _bfs(self._inner.get(self.server[node], {}), node)
        return found

    def fabric(self, switch: str) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Fewest-hop search from ``switch`` over switches only."""
        found = self._fabric_search.get(switch)
        if found is None:
            found = self._fabric_search[switch] = _bfs(self._fabric, switch)
        return found

    def _no_transit(self) -> bool:
        """True when no fewest-hop path between two switches can cross a server: for each server, every switch
        entering it and every switch it leaves to are joined over the fabric in fewer hops than through it."""
        for server, entries in self.entries.items():
            exits = self.exits.get(server, [])
            for a, p in entries:
                dist_a = self.fabric(a)[0]
                inner = None
                for q, b in exits:
                    if a == b:
                        continue
                    fabric_hops = dist_a.get(b)
                    if fabric_hops is not None and fabric_hops <= 1:
                        continue  # any way through the server is >= 2 hops
                    if inner is None:
                        inner = self.inner(p)[0]
                    through = inner.get(q)
                    if through is None:
                        continue
                    if fabric_hops is None or fabric_hops >= through + 2:
                        return False
        return True

    # -- paths ------------------------------------------------------------------------------------------------

    def paths(self, src: str, dst: str) -> list[list[str]] | None:
        """Every fewest-hop node path from ``src`` to ``dst`` (rail affinity applied), or None where the tiers
        do not decide it (the caller searches the whole graph)."""
        if not self.exact:
            return None
        s_server, d_server = self.server.get(src), self.server.get(dst)
        if s_server is None or d_server is None:
            return None
        if s_server == d_server:
            return self._same_server(src, dst, s_server)
        return self._between(src, dst, s_server, d_server)

    def _same_server(self, src: str, dst: str, server: str) -> list[list[str]] | None:
        dist, preds = self.inner(src)
        hops = dist.get(dst)
        if hops is None:
            return None
        # leaving and coming back costs at least: src to a port, out, in, a port to dst
        out = min((dist[u] + 1 for u, _ in self.exits.get(server, []) if u in dist), default=None)
        back = [self.inner(v)[0].get(dst) for _, v in self.entries.get(server, [])]
        back = [h + 1 for h in back if h is not None]
        if out is not None and back and hops >= out + min(back):
            return None
        return _paths_to(preds, dst)

    def _between(self, src: str, dst: str, s_server: str, d_server: str) -> list[list[str]] | None:
        s_dist, s_preds = self.inner(src)
        s_nic, d_nic = self.affinity.get(src), self.affinity.get(dst)
        exits = [(u, a) for u, a in self.exits.get(s_server, []) if u in s_dist and (s_nic is None or u == s_nic)]
        entries = []
        for b, v in self.entries.get(d_server, []):
            if d_nic is not None and v != d_nic:
                continue
            hops = self.inner(v)[0].get(dst)
            if hops is not None:
                entries.append((b, v, hops))
        best, combos = None, []
        for u, a in exits:
            a_dist = self.fabric(a)[0]
            for b, v, in_hops in entries:
                middle = a_dist.get(b)
                if middle is None:
                    continue
                total = s_dist[u] + 1 + middle + 1 + in_hops
                if best is None or total < best:
                    best, combos = total, [(u, a, b, v)]
                elif total == best:
                    combos.append((u, a, b, v))
        if best is None:
            return None
        out: list[list[str]] = []
        for u, a, b, v in combos:
            heads = _paths_to(s_preds, u)
            middles = _paths_to(self.fabric(a)[1], b)
            tails = self._reverse_paths(v, dst)
            for head, middle, tail in itertools.product(heads, middles, tails):
                out.append(head + middle + tail)
        return out

    def _reverse_paths(self, port: str, dst: str) -> list[list[str]]:
        return _paths_to(self.inner(port)[1], dst)
