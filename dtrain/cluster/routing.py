"""Equal-cost paths found tier by tier: inside a server, then across the switch fabric, then inside the other server.

A cluster graph is servers (GPUs, CPUs, PCIe switches, NICs, NVSwitches: nodes that carry a ``server``) hung
under a fabric of switches (nodes without one). A path between two servers leaves the first through one of its
ports (a node with a link to the fabric), crosses the fabric and enters the second through one of its ports. So
the fewest-hop paths are combinations of three cached pieces: a server's shortest paths from a node to its ports
(one breadth-first search of a few dozen nodes), the fabric's shortest paths between two switches (one
breadth-first search of the switches per source switch, shared by every server under it) and the other server's
from its ports to the node. That is the hierarchical decomposition routing on a Clos network rests on (Al-Fares
et al., SIGCOMM 2008, section 3.3: two-level tables, a prefix for the pod and a suffix for the host).

Servers built alike are searched once. A server whose nodes are all named ``<server>/<part>`` is reduced to its
parts and their links (its template); servers of one template share their inner searches and path pieces,
named by part and prefixed with the server's name when a path is returned, so a cluster of ten thousand
identical servers costs the searches of one.

It is exact, not a heuristic, when no fewest-hop path can pass through a third server; :class:`TierRouter`
checks that once (no link joins two servers, and between any two switches a server's ports attach to, the fabric
is strictly shorter than the way through the server) and says so with :attr:`TierRouter.exact`; where it is not,
and for pairs the decomposition does not cover (a switch as an end, two nodes of one server that could be joined
faster through the fabric), :meth:`Topology.equal_cost_paths` falls back to a search of the whole graph.

Rail-optimised NIC affinity (``nic_affinity="rail"``): GPU ``k`` of a server with as many NICs as GPUs leaves
and enters the server through NIC ``k`` only, as NCCL picks the NIC nearest each GPU and a rail-optimised fabric
cables NIC ``k`` of every server to rail ``k`` (NVIDIA DGX SuperPOD reference architecture).

Fabric routing (:data:`ROUTINGS`): ``"ecmp"``, a switch hashes each flow onto one of the equal-cost paths (an
Ethernet/RoCE fabric; :meth:`Topology.route`); ``"d-mod-k"``, the switches forward by destination alone, as an
InfiniBand subnet manager programs their linear forwarding tables. OpenSM's fat-tree engine ("ftree",
doc/current-routing.txt: routes "optimized for congestion-free shift communication pattern") spreads the
destinations under each leaf over the leaf's up-ports in port order, so the ``j``-th host port of a leaf is
reached through up-port ``j mod k``, and one tier up through ``(j / k) mod k'`` (destination-mod-k routing, Gómez
et al., "Deterministic versus Adaptive Routing in Fat-Trees", IPDPS workshops 2007; Zahavi et al., "Optimized
InfiniBand fat-tree routing for shift all-to-all communication patterns", CCPE 2010). Every flow to one
destination port then takes one path whatever its source and connection, and two destinations of one leaf share a
downlink only when their port indices agree modulo the uplinks (:func:`destination_routed`). Which NIC a GPU sends
from and which NIC of the peer it addresses stay the hosts' choice (``nic_affinity``).

No torch here.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import deque
from typing import Any

__all__ = ["TierRouter", "NIC_AFFINITIES", "ROUTINGS", "natural_key", "destination_routed", "destination_pick"]

#: How a GPU picks the NIC its traffic leaves by: any on a fewest-hop path (hashed per flow), or its own rail's.
NIC_AFFINITIES = ("ecmp", "rail")
#: How the fabric's switches pick among equal-cost paths: a hash per flow, or by destination (module docstring).
ROUTINGS = ("ecmp", "d-mod-k")


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
        inner: dict[str, dict[str, list[tuple]]] = {}  # server -> successors inside it, with rates and latencies
        self._fabric: dict[str, list[str]] = {}  # switch -> successor switches
        self.exits: dict[str, list[tuple[str, str]]] = {}  # server -> (port, switch) links leaving it
        self.entries: dict[str, list[tuple[str, str]]] = {}  # server -> (switch, port) links entering it
        self.exact = True
        server, exits, entries, fabric = self.server, self.exits, self.entries, self._fabric
        for u, nbrs in graph.adjacency():
            su = server[u]
            for v, data in nbrs.items():
                sv = server[v]
                if su is not None and sv is not None:
                    if su != sv:
                        self.exact = False  # a cable between two servers: paths may cross a third
                    link = data.get("link")
                    rate = None if link is None else (link.bytes_per_s, link.latency_s)
                    inner.setdefault(su, {}).setdefault(u, []).append((v, rate))
                elif su is not None:
                    exits.setdefault(su, []).append((u, v))
                elif sv is not None:
                    entries.setdefault(sv, []).append((u, v))
                else:
                    fabric.setdefault(u, []).append(v)
        self._templates(inner, kinds)
        self._fabric_search: dict[str, tuple[dict[str, int], dict[str, list[str]]]] = {}
        self._middles: dict[tuple[str, str], list[list[str]]] = {}
        self._succ_sets: dict[str, tuple[set[str], list[str]]] = {}
        self._preds_of: dict[str, set[str]] = {}
        self._pieces: dict[tuple, Any] = {}  # (template, part, ...) -> path pieces named by part
        self._ways: dict[tuple[str, int], tuple | None] = {}  # (node, 0 out / 1 in) -> its one way (one_way)
        self._hops: dict[tuple[str, str], int | None] = {}  # switch pair -> distance, as one_way asks
        self.affinity: dict[str, str] = {}  # gpu -> its NIC
        if nic_affinity == "rail":
            self._rail_affinity(graph, kinds)
        if self.exact:
            self.exact = self._no_transit()

    def _templates(self, inner: dict[str, dict[str, list[tuple]]], kinds: dict[str, str]) -> None:
        """Each server's template (servers of equal parts, inner links of equal rates and latencies and equal
        ports share one) and name prefix."""
        members: dict[str, list[str]] = {}
        for node, server in self.server.items():
            if server is not None:
                members.setdefault(server, []).append(node)
        self._prefix: dict[str, str] = {}  # server -> what its node names start with
        self._template: dict[str, int] = {}  # server -> template id
        self._inner: list[dict[str, list[str]]] = []  # template -> successors inside, by part
        shapes: dict[tuple, int] = {}
        for server, nodes in members.items():
            prefix = f"{server}/"
            if not all(n.startswith(prefix) for n in nodes):
                prefix = ""  # names of its own: a template of its own
            cut = len(prefix)
            links = inner.get(server, {})
            # in insertion order: servers built alike list their parts alike (others only lose the sharing)
            shape = (
                tuple((n[cut:], kinds.get(n)) for n in nodes),
                tuple((u[cut:], tuple((v[cut:], rate) for v, rate in vs)) for u, vs in links.items()),
                tuple(u[cut:] for u, _ in self.exits.get(server, [])),
                tuple(v[cut:] for _, v in self.entries.get(server, [])),
            )
            key = shape if prefix else (server, shape)
            if key not in shapes:
                shapes[key] = len(self._inner)
                self._inner.append({u[cut:]: [v[cut:] for v, _ in vs] for u, vs in links.items()})
            self._prefix[server] = prefix
            self._template[server] = shapes[key]
        self._inner_search: dict[tuple[int, str], tuple[dict[str, int], dict[str, list[str]]]] = {}

    def template(self, server: str) -> tuple[int, str]:
        """The template id of ``server`` and the prefix of its node names (``""``: a template of its own). Two
        servers of one template with a prefix are copies: a node of one is the other's node of the same part."""
        return self._template[server], self._prefix[server]

    def _rail_affinity(self, graph: Any, kinds: dict[str, str]) -> None:
        by_server: dict[str, dict[str, list[str]]] = {}
        for name, kind in kinds.items():
            server = self.server[name]
            if server is not None and kind in ("gpu", "nic"):
                by_server.setdefault(server, {"gpu": [], "nic": []})[kind].append(name)
        by_template: dict[int, list[tuple[str, str]]] = {}  # copies of a template pair the same parts
        for server, parts in by_server.items():
            template, prefix = self.template(server)
            pairs = by_template.get(template) if prefix else None
            if pairs is None:
                cut = len(prefix)
                gpus, nics = sorted(parts["gpu"], key=natural_key), sorted(parts["nic"], key=natural_key)
                pairs = [(g[cut:], n[cut:]) for g, n in zip(gpus, nics, strict=True)] if len(gpus) == len(nics) else []
                if prefix:
                    by_template[template] = pairs
            self.affinity.update((prefix + g, prefix + n) for g, n in pairs)

    # -- searches, cached -------------------------------------------------------------------------------------

    def _part(self, node: str) -> tuple[str, int, str, str]:
        """(server, template, prefix, part name) of a server's node."""
        server = self.server[node]
        prefix = self._prefix[server]
        return server, self._template[server], prefix, node[len(prefix) :]

    def _search(self, template: int, part: str) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Fewest-hop search from ``part`` inside a server of ``template``, by part names."""
        found = self._inner_search.get((template, part))
        if found is None:
            found = self._inner_search[(template, part)] = _bfs(self._inner[template], part)
        return found

    def inner(self, node: str) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Fewest-hop search from ``node`` inside its server, by full node names."""
        _, template, prefix, part = self._part(node)
        dist, preds = self._search(template, part)
        return (
            {prefix + n: d for n, d in dist.items()},
            {prefix + n: [prefix + p for p in ps] for n, ps in preds.items()},
        )

    def distance(self, a: str, b: str) -> int | None:
        """Fewest hops from switch ``a`` to switch ``b`` over switches only (None: no way). A Clos fabric's
        common case, two switches one or two hops apart (leaf, spine, leaf), is read off their neighbours
        without a search of the whole fabric."""
        if a == b:
            return 0
        if a not in self._fabric_search:
            near = self._near(a)
            if b in near[0]:
                return 1
            if self._via(a, b):
                return 2
        return self.fabric(a)[0].get(b)

    def _near(self, a: str) -> tuple[set[str], list[str]]:
        found = self._succ_sets.get(a)
        if found is None:
            succ = self._fabric.get(a, [])
            found = self._succ_sets[a] = (set(succ), succ)
        return found

    def _via(self, a: str, b: str) -> list[str]:
        """The switches one hop from ``a`` with a link to ``b``, in ``a``'s order (as a search would list them)."""
        if not self._preds_of:
            for u, vs in self._fabric.items():
                for v in vs:
                    self._preds_of.setdefault(v, set()).add(u)
        preds = self._preds_of.get(b, set())
        return [m for m in self._near(a)[1] if m in preds and m != b]

    def fabric(self, switch: str) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Fewest-hop search from ``switch`` over switches only."""
        found = self._fabric_search.get(switch)
        if found is None:
            found = self._fabric_search[switch] = _bfs(self._fabric, switch)
        return found

    def _no_transit(self) -> bool:
        """True when no fewest-hop path between two switches can cross a server: for each server, every switch
        entering it and every switch it leaves to are joined over the fabric in fewer hops than through it."""
        checked = set()
        for server, entries in self.entries.items():
            exits = self.exits.get(server, [])
            template, cut = self._template[server], len(self._prefix[server])
            key = (template, tuple(a for a, _ in entries), tuple(b for _, b in exits)) if cut else None
            if key is not None:
                if key in checked:
                    continue  # a copy of a server already checked, under the same switches
                checked.add(key)
            for a, p in entries:
                inner = None
                for q, b in exits:
                    if a == b:
                        continue
                    fabric_hops = self.distance(a, b)
                    if fabric_hops is not None and fabric_hops <= 1:
                        continue  # any way through the server is >= 2 hops
                    if inner is None:
                        inner = self._search(template, p[cut:])[0]
                    through = inner.get(q[cut:])
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
        _, template, prefix, s_part = self._part(src)
        d_part = dst[len(prefix) :]
        key = ("same", template, s_part, d_part)
        found = self._pieces.get(key, False)
        if found is False:
            found = self._pieces[key] = self._same_template(server, template, len(prefix), s_part, d_part)
        if found is None:
            return None
        return [[prefix + n for n in path] for path in found]

    def _same_template(self, server: str, template: int, cut: int, src: str, dst: str) -> list[list[str]] | None:
        dist, preds = self._search(template, src)
        hops = dist.get(dst)
        if hops is None:
            return None
        # leaving and coming back costs at least: src to a port, out, in, a port to dst
        out = min((dist[u[cut:]] + 1 for u, _ in self.exits.get(server, []) if u[cut:] in dist), default=None)
        back = [self._search(template, v[cut:])[0].get(dst) for _, v in self.entries.get(server, [])]
        back = [h + 1 for h in back if h is not None]
        if out is not None and back and hops >= out + min(back):
            return None
        return _paths_to(preds, dst)

    def _heads(self, server: str, node: str) -> list[tuple[str, str, int, list[list[str]]]]:
        """(port, switch, hops, paths from ``node`` to the port by part names) for each way out of ``node``'s
        server its affinity allows."""
        _, template, prefix, part = self._part(node)
        nic = self.affinity.get(node)
        key = ("out", template, part, None if nic is None else nic[len(prefix) :])
        pieces = self._pieces.get(key)
        if pieces is None:
            dist, preds = self._search(template, part)
            cut = len(prefix)
            pieces = {}
            for u, _ in self.exits.get(server, []):
                local = u[cut:]
                if local in dist and (nic is None or u == nic) and local not in pieces:
                    pieces[local] = (dist[local], _paths_to(preds, local))
            self._pieces[key] = pieces
        return [(u, a, *pieces[u[len(prefix) :]]) for u, a in self.exits.get(server, []) if u[len(prefix) :] in pieces]

    def _tails(self, server: str, node: str) -> list[tuple[str, str, int, list[list[str]]]]:
        """(switch, port, hops, paths from the port to ``node`` by part names) for each way into its server."""
        _, template, prefix, part = self._part(node)
        nic = self.affinity.get(node)
        key = ("in", template, part, None if nic is None else nic[len(prefix) :])
        pieces = self._pieces.get(key)
        if pieces is None:
            cut = len(prefix)
            pieces = {}
            for _, v in self.entries.get(server, []):
                local = v[cut:]
                if (nic is not None and v != nic) or local in pieces:
                    continue
                dist, preds = self._search(template, local)
                if part in dist:
                    pieces[local] = (dist[part], _paths_to(preds, part))
            self._pieces[key] = pieces
        return [
            (b, v, *pieces[v[len(prefix) :]]) for b, v in self.entries.get(server, []) if v[len(prefix) :] in pieces
        ]

    def one_way(self, src: str, dst: str) -> tuple[list[str], str, str, list[str]] | None:
        """``(head, a, b, tail)`` where every fewest-hop path from ``src`` to ``dst`` (two nodes of two servers)
        is ``head`` (the one fewest-hop path from ``src`` to the one port it may leave by), a fewest-hop path of
        the fabric from switch ``a`` to switch ``b``, and ``tail`` (the one path from the one port it may enter
        by to ``dst``), in the order :meth:`paths` lists them: a GPU of rail affinity; else None."""
        if not self.exact:
            return None
        s_server, d_server = self.server.get(src), self.server.get(dst)
        if s_server is None or d_server is None or s_server == d_server:
            return None
        out = self._ways.get((src, 0), False)
        if out is False:
            exits = self._heads(s_server, src)
            ok = len(exits) == 1 and len(exits[0][3]) == 1
            out = self._ways[(src, 0)] = (self._prefixed(s_server, exits[0][3][0]), exits[0][1]) if ok else None
        into = self._ways.get((dst, 1), False)
        if into is False:
            entries = self._tails(d_server, dst)
            ok = len(entries) == 1 and len(entries[0][3]) == 1
            into = self._ways[(dst, 1)] = (entries[0][0], self._prefixed(d_server, entries[0][3][0])) if ok else None
        if out is None or into is None:
            return None
        hops = self._hops.get((out[1], into[0]), -1)
        if hops == -1:
            hops = self._hops[(out[1], into[0])] = self.distance(out[1], into[0])
        if hops is None:
            return None
        return out[0], out[1], into[0], into[1]

    def _prefixed(self, server: str, parts: list[str]) -> list[str]:
        prefix = self._prefix[server]
        return [prefix + n for n in parts]

    def _between(self, src: str, dst: str, s_server: str, d_server: str) -> list[list[str]] | None:
        exits = self._heads(s_server, src)
        entries = self._tails(d_server, dst)
        best, combos = None, []
        for _u, a, out_hops, heads in exits:
            for b, _v, in_hops, tails in entries:
                middle = self.distance(a, b)
                if middle is None:
                    continue
                total = out_hops + 1 + middle + 1 + in_hops
                if best is None or total < best:
                    best, combos = total, [(heads, a, b, tails)]
                elif total == best:
                    combos.append((heads, a, b, tails))
        if best is None:
            return None
        s_prefix, d_prefix = self._prefix[s_server], self._prefix[d_server]
        out: list[list[str]] = []
        for heads, a, b, tails in combos:
            middles = self._middle(a, b)
            full_heads = [[s_prefix + n for n in head] for head in heads]
            full_tails = [[d_prefix + n for n in tail] for tail in tails]
            for head, middle, tail in itertools.product(full_heads, middles, full_tails):
                out.append(head + middle + tail)
        return out

    def middle(self, a: str, b: str) -> list[list[str]]:
        """Every fewest-hop path of the fabric from switch ``a`` to switch ``b`` (cached)."""
        return self._middle(a, b)

    def _middle(self, a: str, b: str) -> list[list[str]]:
        found = self._middles.get((a, b))
        if found is None:
            hops = self.distance(a, b)
            if hops == 0:
                found = [[a]]
            elif hops == 1:
                found = [[a, b]]
            elif hops == 2 and a not in self._fabric_search:
                found = [[a, m, b] for m in self._via(a, b)]
            else:
                found = _paths_to(self.fabric(a)[1], b)
            self._middles[(a, b)] = found
        return found


def destination_routed(paths: list[list[str]], server: dict[str, str | None], port_index: Any) -> list[list[str]]:
    """The paths of ``paths`` (every fewest-hop path from one node to another, in a stable order) that
    destination-mod-k forwarding leaves (module docstring): one per way in and out of the servers (the hosts'
    choice), its switch hops picked by the destination port alone. ``server``: node -> its server (None for a
    fabric switch); ``port_index(switch, node)``: the position of host port ``node`` among ``switch``'s host
    ports. At the ``i``-th switch hop with a choice of ``n_i`` next switches (in natural order) the path takes
    ``(j / (n_1 ... n_{i-1})) mod n_i``, ``j`` the destination port's index at its leaf."""
    groups: dict[tuple, list[tuple[int, int, list[str]]]] = {}
    for path in paths:
        fabric = [i for i, node in enumerate(path) if server.get(node) is None]
        if not fabric:
            groups.setdefault((tuple(path),), []).append((0, 0, path))
            continue
        first, last = fabric[0], fabric[-1]
        groups.setdefault((tuple(path[:first]), tuple(path[last + 1 :])), []).append((first, last, path))
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.append(members[0][2])
            continue
        first, last, path = members[0]
        j = port_index(path[last], path[last + 1]) if last + 1 < len(path) else 0
        out.append(destination_pick([m[2] for m in members], first, j))
    return out


def destination_pick(paths: list[list[str]], first: int, j: int) -> list[str]:
    """The path of ``paths`` (equal up to position ``first``, the first switch, and from their last switch on)
    that destination-mod-k forwarding takes to the destination port of index ``j`` (:func:`destination_routed`)."""
    remaining, stride, i = paths, 1, first
    while len(remaining) > 1:
        i += 1
        choices = sorted({p[i] for p in remaining}, key=natural_key)
        if len(choices) > 1:
            pick = choices[(j // stride) % len(choices)]
            stride *= len(choices)
            remaining = [p for p in remaining if p[i] == pick]
    return remaining[0]
