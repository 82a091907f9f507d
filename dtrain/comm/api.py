"""The public collectives: torch.distributed-like functions that run our own algorithms.

Every call checks its arguments on this rank before a byte is sent, lays the tensors out as the schedule's
flat work buffer (see :mod:`dtrain.comm.ir.schedule`), runs the schedule through the group's transport
(torch.distributed point-to-point or peer memory; MPI point-to-point for a :class:`dtrain.comm.mpi.MPIGroup`),
and copies the result back where it belongs. ``algorithm="native"`` hands the call to torch.distributed (to
MPI's own collective on an MPI group); ``algorithm="auto"`` follows what was measured fastest
(:mod:`dtrain.comm.cost.rules`), and is ``native`` where nothing was measured.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from functools import lru_cache

import torch
import torch.distributed as dist

from dtrain.comm import arguments, native
from dtrain.comm.arguments import (
    check_algorithm,
    check_op,
    check_overlap,
    check_pair,
    check_root,
    check_tensor,
    check_written,
    group_info,
    op_name,
    writable,
)
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.mpi.group import is_mpi_group
from dtrain.comm.p2p.runtime import CommTimeoutError, round_timeout, run_schedule
from dtrain.comm.p2p.transport import transport_for
from dtrain.comm.peer import chain as peer_chain
from dtrain.comm.peer import channels as peer_channels
from dtrain.comm.peer import direct as peer_direct
from dtrain.comm.peer import fused, watchdog
from dtrain.comm.peer import graphs as persistent
from dtrain.comm.peer import push as peer_push
from dtrain.comm.peer import window as peer
from dtrain.comm.state import FAST, GENERATION, changed, find_state, group_state
from dtrain.env import comm_env

__all__ = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "scan",
    "barrier",
    "algorithms",
    "set_local_size",
    "SUPPORTED_DTYPES",
    "OPS",
]

OPS = arguments.OPS
SUPPORTED_DTYPES = arguments.SUPPORTED_DTYPES
set_local_size = arguments.set_local_size


def algorithms(collective: str) -> list[str]:
    """Names ``algorithm=`` accepts for ``collective``: "auto", "native", then ours."""
    return registry.accepted(collective)


# ----------------------------------------------------------------------------------------------- running


def _resolve(coll: Collective, algorithm: str, world: int, nbytes: int, device: torch.device, local_size, group):
    if algorithm != "auto":
        if world > 1 and _pipelines(coll, algorithm):  # its pieces come from the cost parameters: alike on every rank
            key = dist.group.WORLD if group is None else group
            state = find_state(key)
            if state is None or device.type not in state.params_agreed:
                _agree_on_params(key, (device.type,), device, "algorithm=" + repr(algorithm))
                group_state(key).params_agreed.add(device.type)
        return algorithm
    usable = local_size if local_size and world % local_size == 0 and 1 < local_size < world else None
    kind = _kind(group, device)
    key = dist.group.WORLD if group is None else group
    state = find_state(key)
    if state is None or kind not in state.agreed:
        _agree_on_choices(key, kind, device, world)
        state = group_state(key)
    choice = (coll, nbytes, world, kind, usable)
    picked = state.choices.get(choice)
    if picked is None:
        if len(state.choices) >= 4096:
            state.choices.clear()
        picked = state.choices[choice] = _choose(coll, nbytes, world, kind, usable, state.rules.get(kind))
    return picked


@lru_cache(maxsize=4096)
def _auto(coll: Collective, nbytes: int, world: int, kind: str, local_size: int | None) -> str:
    """What ``auto`` chooses from this rank's own rules file (:func:`_rules`), kept; a group's calls follow its
    rank 0's rules instead (:func:`_agree_on_choices`)."""
    return _choose(coll, nbytes, world, kind, local_size, _rules(kind))


def _choose(coll: Collective, nbytes: int, world: int, kind: str, local_size: int | None, measured) -> str:
    """The choice for ``auto``: a measured rule (``measured``, the group's rules, else the built-in rules of
    :mod:`dtrain.comm.cost.rules`) where one covers the call, the cost model's least predicted time among ours
    where that rule says :data:`~dtrain.comm.cost.rules.MODEL`, else ``native``: the model does not price the
    backend's own collectives, so without a measurement it cannot show that ours win. A rule naming a transport
    (``"ring@peer"``) holds where the group may change transport per call (``DTRAIN_COMM_TRANSPORT=auto``, not an
    MPI group); elsewhere only one naming the group's own transport does. Pricing every candidate costs tens of
    microseconds of host time a call, as much as a small collective itself on a GPU (callers keep the choice)."""
    from dtrain.comm.cost import model as cost
    from dtrain.comm.cost import rules

    candidates = [a for a in registry.names(coll) if local_size or not registry.needs_local_size(a)]
    own = "mpi" if kind.endswith("-mpi") else "peer" if kind.endswith("-peer") else "p2p"
    switchable = own != "mpi" and _transport_setting() == "auto"
    for table in (measured, rules.built_in(kind, world, local_size)):  # the file first, then built in
        if table is not None and table.covers(kind, world, local_size):
            picked = table.pick(coll.value, nbytes)
            if picked is None:
                continue
            algorithm, via = rules.split(picked)
            if via is not None and via != own and not (switchable and via in rules.TRANSPORTS):
                return rules.NATIVE  # measured on a transport this group cannot use
            if algorithm in (rules.NATIVE, rules.NATIVE_WIDE) or algorithm in candidates:
                return algorithm if via is None or via == own else picked
            if algorithm == rules.MODEL:
                return cost.choose(coll, nbytes, world, _params(kind), candidates=candidates, local_size=local_size)
    return rules.NATIVE


@lru_cache(maxsize=4)
def _params(device_type: str):
    """The calibrated cost parameters for this device type, or the defaults (read once per process)."""
    from dtrain.comm.cost import model as cost

    return cost.load_params(device=device_type)


@lru_cache(maxsize=4)
def _rules(kind: str):
    """This rank's measured rules for this kind of group (``dtrain bench comm --rules-out``), or None (read once)."""
    from dtrain.comm.cost import rules

    return rules.load_rules(kind)


def _own_rules(kind: str, world: int):
    """This rank's rules for a group of ``kind`` and ``world`` ranks (:func:`dtrain.comm.cost.rules.lookup_paths`):
    the first file found; an unusable cache warns in one line and is skipped."""
    from dtrain.comm.cost import rules

    for path, cached in rules.lookup_paths(kind, world, _transport_setting(), torch.__version__):
        if not cached:
            found = rules.load_rules(kind, path)
        else:
            found, problem = rules.load_cached(path, kind=kind, world_size=world, torch_version=torch.__version__)
            if problem is not None:
                warnings.warn(f"dtrain.comm: algorithm='auto' ignores {problem}", stacklevel=2)
        if found is not None:
            return found
    return None


@lru_cache(maxsize=4)
def _choice_digest(kinds: tuple[str, ...]) -> int:
    """A digest of the cost parameters this rank chooses with for ``kinds`` (a kind of group and its device type:
    what ``auto`` and the pipelining read), as loaded (the rules come from rank 0)."""
    seen = tuple((kind, repr(_params(kind))) for kind in kinds)
    return int.from_bytes(hashlib.sha256(repr(seen).encode()).digest()[:8], "little", signed=True)


#: What a rank puts into the digests' all-gather when it cannot read its calibration file.
_UNREADABLE = -(1 << 63)


def _agree_on_params(group, kinds: tuple[str, ...], device: torch.device, what: str) -> None:
    """Check, with one all-gather, that every rank of ``group`` prices with the same cost parameters for ``kinds``
    (:func:`_choice_digest`); ranks that differ, or a rank that cannot read its calibration file, make every rank
    raise the same ``ValueError`` rather than choose apart."""
    from dtrain.comm.cost import model as cost

    try:
        digest, problem = _choice_digest(kinds), None
    except ValueError as err:
        digest, problem = _UNREADABLE, str(err).splitlines()[0]
    every = _all_gather_int64(group, digest, device)
    unreadable = sorted(r for r, t in enumerate(every) if t == _UNREADABLE)
    if unreadable:
        raise ValueError(
            f"{what}: "
            + (problem or f"group ranks {unreadable} cannot read their calibration file (DTRAIN_CALIBRATION)")
        )
    differ = sorted({r for r, t in enumerate(every) if t != every[0]})
    if differ:
        raise ValueError(
            f"{what}: the ranks of this group price with different calibration files (group ranks "
            f"{differ} differ from rank 0; this rank reads {cost.params_path(kinds[0])}); give every rank the same "
            "file (DTRAIN_CALIBRATION) or name the algorithm"
        )


def _kind(group, device: torch.device) -> str:
    """The kind of group whose measured rules and cost parameters ``auto`` reads: "cpu", "cuda", "cpu-peer",
    "cuda-peer" or "cpu-mpi"."""
    transport = transport_name(group, device)
    return device.type + (f"-{transport}" if transport in ("peer", "mpi") else "")


def _all_gather_int64(group, value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in group rank order (one all-gather on the group's own transport)."""
    if is_mpi_group(group):
        from dtrain.comm.mpi import native as mpi_native

        every = torch.empty(group.size, dtype=torch.int64)
        mpi_native.all_gather(every, torch.tensor([value], dtype=torch.int64), group)
        return every.tolist()
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


def _bounded(n: int) -> int:
    """A length announced by rank 0, refused before anything is allocated when out of range."""
    from dtrain.comm.values import MAX_BYTES

    if not 0 <= n <= MAX_BYTES:
        raise ValueError(f"rank 0 announced {n} bytes; what it sends takes 0 to {MAX_BYTES} bytes")
    return n


def _from_rank0(group, data: bytes, device: torch.device) -> bytes:
    """Rank 0's ``data`` on every rank of ``group`` (its length, then its bytes; nothing is unpickled)."""
    if is_mpi_group(group):
        from dtrain.comm.mpi import native as mpi_native

        size = torch.tensor([len(data)], dtype=torch.int64)
        mpi_native.broadcast(size, 0, group)
        _bounded(int(size))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == 0 else None
        payload = payload if payload is not None else torch.zeros(int(size), dtype=torch.uint8)
        if int(size):
            mpi_native.broadcast(payload, 0, group)
        return bytes(payload.tolist())
    root = dist.get_global_rank(group, 0)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, root, group=group)
    n = _bounded(int(size.item()))
    if dist.get_rank(group) == 0:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if n else None
    else:
        payload = torch.zeros(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(payload, root, group=group)
    return bytes(payload.cpu().tolist()) if n else b""


def _decision(data: bytes) -> dict:
    """What rank 0 sent :func:`_agree_on_choices`, checked: a JSON object, its ``error`` (rank 0 could not read its
    rules) text and its ``missing`` (no rules: measure them) true or false; rules themselves are checked as a
    rules file is (:meth:`dtrain.comm.cost.rules.Rules.from_dict`). ``ValueError`` naming rank 0 otherwise."""
    from dtrain.comm.values import _decode

    def check(value):
        if not isinstance(value, dict):
            raise ValueError(f"{type(value).__name__} where the rules agreement is a JSON object")
        if not isinstance(value.get("error", ""), str) or not isinstance(value.get("missing", False), bool):
            raise ValueError(f"a rules agreement whose error is not text or missing not true or false: {value!r:.200}")
        return value

    try:
        return _decode(data, 0, check)
    except ValueError as err:
        raise ValueError(f"algorithm='auto': {err}") from None


def _group_rank(group) -> int:
    return group.rank if is_mpi_group(group) else dist.get_rank(group)


def _agree_on_choices(group, kind: str, device: torch.device, world: int) -> None:
    """Once per group and kind: rank 0 decides what ``auto`` follows, and every rank checks it prices alike.

    Rank 0 reads its rules (:func:`_own_rules`; with ``DTRAIN_COMM_AUTOTUNE=1`` and none found, the group first
    measures them, :mod:`dtrain.comm.tune`) and sends them to every rank: every rank follows rank 0's rules.
    The cost parameters (for rules naming the model, and for the pipelining) are compared by digest (one
    all-gather), and ranks that differ raise the same ``ValueError`` on every rank rather than choose apart."""
    import json

    from dtrain.comm.cost import rules

    mine = None
    if _group_rank(group) == 0:
        try:
            mine = _own_rules(kind, world)
        except Exception as err:  # a named file that is not rules, or cannot be read: every rank hears of it
            mine = {"error": str(err).splitlines()[0] if str(err) else type(err).__name__}
    missing = mine is None and comm_env().autotune
    text = json.dumps(mine.to_dict() if isinstance(mine, rules.Rules) else mine or {"missing": missing})
    decided = _decision(_from_rank0(group, text.encode(), device))
    if "error" in decided:
        raise ValueError(f"algorithm='auto' (rank 0's rules): {decided['error']}")
    _agree_on_params(group, (kind, kind.removesuffix("-peer").removesuffix("-mpi")), device, "algorithm='auto'")
    state = group_state(group)
    if decided.get("missing"):
        import importlib

        # dtrain.comm.tune sits above this module (it times collectives through it): loaded by name, on request
        tune = importlib.import_module("dtrain.comm.tune")
        made = tune.autotune(group, device, kind)  # collective: rank 0 saves and returns the rules
        text = json.dumps(made.to_dict() if made is not None else {})
        decided = _decision(_from_rank0(group, text.encode(), device))
    try:
        state.rules[kind] = rules.Rules.from_dict(decided) if "kind" in decided else None
    except ValueError as err:
        raise ValueError(f"algorithm='auto': rank 0 sent {err}") from None
    state.choices.clear()
    state.agreed.add(kind)
    changed()


def _pipelines(coll: Collective, algorithm: str) -> bool:
    """Whether ``algorithm`` (a name as given, with or without its transport) runs ``coll`` in pieces whose count
    the cost parameters decide (:func:`_pipeline`)."""
    name = algorithm.partition("@")[0]
    return (name == "ring" and coll in (Collective.BROADCAST, Collective.REDUCE)) or (
        name == "linear" and coll is Collective.SCAN
    )


def _pipeline(coll: Collective, algorithm: str, world: int, nbytes: int, device: torch.device) -> int:
    """Pieces for a pipelined chain (ring broadcast and reduce, linear scan), from the cost model's optimum: the
    pieces the cost model prices it with (:data:`dtrain.comm.cost.forms.CLOSED_FORMS`' ``pipelined``)."""
    if not _pipelines(coll, algorithm):
        return 1
    from dtrain.comm.cost import model as cost

    return cost.optimal_pipeline(nbytes, world, _params(device.type).intra)


def _via(group, device: torch.device, algorithm: str) -> tuple[str, str]:
    """(algorithm, transport) of a chosen name: ``"ring@peer"`` runs on the peer transport where the group may
    change transport per call (``DTRAIN_COMM_TRANSPORT=auto``, and it did not fall back from peer memory);
    otherwise, and for a plain name, the group's own transport (:func:`transport_name`)."""
    from dtrain.comm.cost.rules import split

    name, via = split(algorithm)
    own = transport_name(group, device)
    if via is None or via == own or own == "mpi" or _transport_setting() != "auto":
        return name, own
    state = find_state(group)
    if via == "peer" and ((state is not None and state.fell_back) or not peer.peer_available(group, device)):
        return name, "p2p"  # peer_available: a collective question, asked by every rank at the same call
    return name, via


def _run(coll, algorithm, work, group, op="sum", root=None, local_size=None, out=None) -> tuple | None:
    """Run ``algorithm`` for ``coll`` on the flat ``work`` buffer, in place. Returns (form, schedule, window)
    where one kernel ran it (:mod:`dtrain.comm.peer.fused`), else None.

    ``algorithm`` may name its transport (``"ring@peer"``, see :func:`_via`). ``out`` (a reduce-scatter where
    :func:`_out_of_place` holds): ``work`` is the caller's input and stays as it was; this rank's block of the
    result goes into ``out``, with no copy of the input. Should the group's window be refused after all (and the
    group move to point-to-point), the input is copied into a work buffer."""
    named = algorithm
    algorithm, via = _via(group, work.device, algorithm)
    world = group.size if is_mpi_group(group) else dist.get_world_size(group)
    nbytes = work.numel() * work.element_size()
    chained = via == "peer" and coll is Collective.BROADCAST and algorithm == "ring" and out is None
    if chained and _run_direct(work, group, root, world, nbytes):
        return
    if chained and nbytes >= peer_chain.CHAIN_FROM_BYTES and _run_chain(work, group, root, world, nbytes):
        return
    pipeline = _pipeline(coll, algorithm, world, nbytes, work.device)
    schedule = registry.build(
        coll,
        algorithm,
        world,
        root=root,
        pipeline=pipeline,
        local_size=local_size if registry.needs_local_size(algorithm) else None,
    )
    if via == "peer":
        own = out is not None and peer_push.writes_own_block_only(schedule, work.numel())
        push = peer.push_mode(
            schedule, nbytes, work.device.type
        )  # push form: two banks of the buffer's size in every window
        form = fused.fused_form(schedule, work, op) if out is None and round_timeout() is None else None
        # the exchange kernel's all-reduces alternate two halves of the window, as a one-pass call does
        halves = form == "one" or (form == "two" and nbytes <= fused.TWO_SHOT_MAX_BYTES)
        size = 2 * (nbytes + fused.ALIGN) if halves else nbytes * (2 if push else 1)
        try:
            window = peer.window_for(group, work.device, size)
        except peer.PeerUnavailable as err:  # raised on every rank of the group alike
            if _transport_setting() != "auto":
                raise
            _fall_back(group, err)
        else:
            if form is not None:
                _run_fused(form, schedule, work, window)
                return (form, schedule, window)
            if out is None or (push and own):
                _run_peer(schedule, work, window, op, push, out)
                return
    if out is not None:  # the schedule reduces in place: a copy of the input to work in
        work = _scratch(group, work)
        _run(coll, named, work, group, op, root, local_size)
        rank, m = group_info(group, "reduce_scatter")[0], out.numel()
        out.copy_(work[rank * m : (rank + 1) * m])
        return
    run_schedule(schedule, work, _transport(group), op, lanes=_lanes(schedule, work))


def _run_direct(work: torch.Tensor, group, root: int, world: int, nbytes: int) -> bool:
    """The ring broadcast on the peer transport of CUDA tensors CUDA IPC can export, run as a chain of copies
    between the callers' own tensors (:mod:`dtrain.comm.peer.direct`); False where it cannot be (every rank of a
    host alike), or where the group was moved off the peer transport."""
    if nbytes == 0 or not peer_direct.exportable(work.device):
        return False
    return _run_chained(
        "direct",
        lambda: peer_direct.direct_for(group, work.device),
        lambda chain: chain.broadcast(work, root, round_timeout()),
        work,
        group,
        world,
    )


def _reduce_direct(tensor: torch.Tensor, dst: int, op: str, group, chosen: str, world: int) -> bool:
    """Run a ring reduce of a CUDA tensor on the peer transport as the direct chain
    (:meth:`dtrain.comm.peer.direct.DirectChain.reduce`: each rank combines its predecessor's partial into its own,
    the root into its tensor; no other rank's tensor written); False where it cannot run so (every rank of a host
    alike: nothing here depends on a rank's own tensor but its size), and the call goes the long way."""
    if chosen.partition("@")[0] != "ring" or not tensor.is_cuda:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or not peer_direct.exportable(tensor.device) or _via(group, tensor.device, chosen)[1] != "peer":
        return False
    return _run_direct_reduce(tensor, dst, op, group, world)


def _run_direct_reduce(tensor: torch.Tensor, dst: int, op: str, group, world: int) -> bool:
    """:func:`_reduce_direct` once its checks passed (a repeated call's were made by its first). A tensor that is
    not contiguous goes in as a contiguous copy (the root's result copied back), as every rank takes this path
    whatever its own tensor's layout."""
    work = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    ran = _run_chained(
        "direct",
        lambda: peer_direct.direct_for(group, work.device),
        lambda chain: chain.reduce(work, dst, op, round_timeout()),
        work,
        group,
        world,
        what="reduce",
    )
    if ran and work.data_ptr() != tensor.data_ptr() and group_info(group, "reduce")[0] == dst:
        tensor.copy_(work.view(tensor.shape))
    return ran


def _run_chained(kind: str, make, call, work: torch.Tensor, group, world: int, what: str = "broadcast") -> bool:
    """Make or find a group's chain of ``kind`` (``"direct"``, ``"chain"``: its key in the group's windows) with
    ``make()`` and run ``call(chain)``, a ``what`` (``"broadcast"``, ``"reduce"``); False where the group's peer
    windows were refused (and ``DTRAIN_COMM_TRANSPORT=auto`` moves it to point-to-point). A chain that stalls on
    the host is dropped, and the stall raised as a :class:`CommTimeoutError`; on CUDA the call is watched
    (:mod:`.peer.watchdog`)."""
    try:
        chain = make()
    except peer.PeerUnavailable as err:  # raised on every rank of the group alike
        if _transport_setting() != "auto":
            raise
        _fall_back(group, err)
        return False
    where = f"{what}/ring: rank {chain.rank} (global {chain.window.global_rank})"
    name = "direct" if kind == "direct" else "chain"
    try:
        call(chain)
    except peer_chain.ChainStalled as err:  # the host's waits: the ranks now stand at different points
        group_state(_group_key(group)).windows.pop((kind, work.device), None)
        raise CommTimeoutError(f"{where} timed out in the {name} {what}: {err}") from err
    except peer_direct.DirectRefused as err:
        raise RuntimeError(f"{where}: {err}") from err
    if work.is_cuda and not torch.cuda.is_current_stream_capturing():
        nbytes = work.numel() * work.element_size()
        call_of = (what, "ring", nbytes, str(work.dtype))
        place = (world, chain.rank, chain.window.global_rank, str(work.device))
        watchdog.watch(
            work.device, chain.window.stall_limit(round_timeout()), _label(call_of, place, chain.window.calls)
        )
    return True


def _broadcast_direct(tensor: torch.Tensor, src: int, group, algorithm: str, chosen: str, world: int) -> bool:
    """Run a ring broadcast of a contiguous CUDA tensor on the peer transport as the direct chain
    (:func:`_run_direct`), and keep that for the next call with the same arguments (:func:`_fast`); False where
    it cannot run so (the call then goes the long way)."""
    if chosen.partition("@")[0] != "ring" or not tensor.is_cuda or not tensor.is_contiguous():
        return False
    if _via(group, tensor.device, chosen)[1] != "peer":
        return False

    def run(t: torch.Tensor, _t: torch.Tensor) -> bool:
        return t.is_contiguous() and _run_direct(t.view(-1), group, src, world, t.numel() * t.element_size())

    if not run(tensor, tensor):
        return False
    _keep(Collective.BROADCAST, group, algorithm, src, tensor, tensor, run)
    return True


def _direct_declined(algorithm: str, chosen: str, tensor: torch.Tensor) -> bool:
    """Whether ``auto`` chose the ring broadcast (measured as the direct chain, :mod:`dtrain.comm.peer.direct`) for
    a CUDA tensor this process cannot export: NCCL's broadcast runs instead, faster than the slot chain. Every rank
    of a host answers alike."""
    return (
        algorithm == "auto"
        and tensor.is_cuda
        and chosen.partition("@")[0] == "ring"
        and not peer_direct.exportable(tensor.device)
    )


def _run_chain(work: torch.Tensor, group, root: int, world: int, nbytes: int) -> bool:
    """The ring broadcast on the peer transport (from :data:`~dtrain.comm.peer.chain.CHAIN_FROM_BYTES`), run as a
    pipelined chain through copy engines and counters (:mod:`dtrain.comm.peer.chain`) where it can be (a CUDA
    driver with stream memory operations, or CPU windows on x86-64); False where it cannot (every rank of a host
    alike), or where the group was moved off the peer transport, and the schedule then runs a round at a time."""
    if nbytes == 0:
        return False
    if work.is_cuda and peer_channels._driver() is None:
        return False
    if not work.is_cuda and not peer.SHARED_COUNTER_BARRIER:
        return False
    piece = peer_chain.pieces(nbytes, world)
    return _run_chained(
        "chain",
        lambda: peer_chain.chain_for(group, work.device, piece),
        lambda chain: chain(work, root, piece, round_timeout()),
        work,
        group,
        world,
    )


def _transport(group):
    """The point-to-point transport of ``group``: MPI messages for an MPI group, else torch.distributed's."""
    if is_mpi_group(group):
        from dtrain.comm.mpi.transport import transport_for as mpi_transport_for

        return mpi_transport_for(group)
    return transport_for(group)


#: ``auto``'s choices that run the backend's own collective: on the group, or on its wide communicator.
NATIVE_CHOICES = ("native", "native_wide")


def _backend_group(group, chosen: str):
    """The group a backend call of ``chosen`` (one of :data:`NATIVE_CHOICES`) runs on: for ``native_wide`` the
    group's wide communicator (:func:`dtrain.comm.native.wide_group`) unless ``DTRAIN_COMM_WIDE=0`` or none can be
    made, else the group itself."""
    if chosen == "native_wide" and comm_env().wide and not is_mpi_group(group):
        wide = native.wide_group(group)
        if wide is not None:
            return wide
    return group


def _native(group):
    """Where ``algorithm="native"`` goes: MPI's collectives for an MPI group, else torch.distributed's."""
    if is_mpi_group(group):
        from dtrain.comm.mpi import native as mpi_native

        return mpi_native
    return native


def _run_peer(schedule, work: torch.Tensor, window, op: str, push: bool, out: torch.Tensor | None) -> None:
    fused.settle(window)  # before any graph is recorded: a one-pass call's half may still be read
    run = peer.run_push if push else peer.run_pull
    extra = {} if out is None else {"out": out}
    timeout = round_timeout()
    if not work.is_cuda:
        run(schedule, work, window, op, timeout=timeout, **extra)
        return
    window.calls += 1
    if timeout is not None:
        run(schedule, work, window, op, timeout=timeout, **extra)
    else:
        key = (schedule, push, work.data_ptr(), work.numel(), work.dtype, op, window.generation)
        owner = work
        if out is not None:  # the graph writes into out too: it belongs to both storages
            key, owner = (*key, out.data_ptr(), out.numel()), (work, out)
        persistent.run(window.group, key, lambda: run(schedule, work, window, op, **extra), work.device, owner=owner)
    _watch(schedule, work, window, timeout)


def _run_fused(form: str, schedule, work: torch.Tensor, window) -> None:
    """One kernel with its barriers inside (:mod:`dtrain.comm.peer.fused`), watched as every peer call is."""
    window.calls += 1
    fused.run_fused(form, work, window)
    _watch(schedule, work, window, None)


def _keep_fused(group, algorithm: str, op: str, tensor: torch.Tensor, ran: tuple, world: int) -> None:
    """Keep what a one-kernel all-reduce needs to run again (:data:`dtrain.comm.state.FAST`), for a call with the
    same group, algorithm, reduction, size, dtype and device while nothing changes (:func:`_fast_all_reduce`)."""
    form, schedule, window = ran
    if comm_env().check:  # every call goes through its signature check
        return
    if len(FAST) >= 1024:
        FAST.clear()
    what = (schedule.collective.value, schedule.algorithm, tensor.numel() * tensor.element_size(), str(tensor.dtype))
    place = (window.world_size, window.rank, window.global_rank, str(tensor.device))
    device, limit, average = tensor.device, window.stall_limit(None), op == "avg"
    launch = fused.reducer(window, tensor.view(-1), form)  # kept: one lookup, not one a call

    def again(t: torch.Tensor) -> None:
        work = t if t.dim() == 1 else t.view(-1)
        window.calls += 1
        fused.run_fused(form, work, window, launch)
        if average:
            native.divide(work, world)
        if not torch.cuda.is_current_stream_capturing():
            watchdog.watch(device, limit, _label(what, place, window.calls))

    key = (_group_key(group), algorithm, op, tensor.numel(), tensor.dtype, device)
    FAST[key] = (comm_env(), GENERATION[0], again)


def _fast_all_reduce(tensor, op: str, group, algorithm: str) -> bool:
    """Run an all-reduce the group already ran as one kernel with the same arguments, skipping the checks and
    choices that call made (nothing that decides them changed: the environment, :data:`~dtrain.comm.state.
    GENERATION`); False where there is none. A small all-reduce then costs little more host time than the
    kernel's launch."""
    if type(tensor) is not torch.Tensor:
        return False
    known = FAST.get((_group_key(group), algorithm, op, tensor.numel(), tensor.dtype, tensor.device))
    if known is None or known[0] is not comm_env() or known[1] != GENERATION[0] or not tensor.is_contiguous():
        return False
    return known[2](tensor) is not False  # False: it could not run these (nothing was sent)


# ------------------------------------------------------------------------------------- one-pass calls


def _fast(coll: Collective, group, algorithm: str, extra, output: torch.Tensor, input: torch.Tensor):
    """What runs a call the group already made with the same arguments (:data:`dtrain.comm.state.FAST`: the
    collective, algorithm, reduction or root, sizes, dtypes and device), while nothing that decided it changed
    (the environment, :data:`~dtrain.comm.state.GENERATION`): a function ``(output, input) -> bool`` (False: it
    cannot take these tensors, and the call goes the long way), or None. The checks and choices that call made
    are not made again: a small collective then costs little more host time than its launches."""
    if type(output) is not torch.Tensor or type(input) is not torch.Tensor:
        return None
    key = (_group_key(group), coll, algorithm, extra, output.numel(), input.numel(), input.dtype, output.dtype)
    known = FAST.get((*key, input.device))
    if known is None or known[0] is not comm_env() or known[1] != GENERATION[0]:
        return None
    return known[2]


def _keep(coll: Collective, group, algorithm: str, extra, output: torch.Tensor, input: torch.Tensor, run) -> None:
    """Keep ``run`` for the next call with these arguments (:func:`_fast`)."""
    if type(output) is not torch.Tensor or type(input) is not torch.Tensor or comm_env().check:
        return
    if len(FAST) >= 1024:
        FAST.clear()
    key = (_group_key(group), coll, algorithm, extra, output.numel(), input.numel(), input.dtype, output.dtype)
    FAST[(*key, input.device)] = (comm_env(), GENERATION[0], run)


def _keep_native(
    coll: Collective, group, algorithm: str, extra, output, input, run, root: int = 0, op: str = "sum", on=None
):
    """Keep the backend's own call for the next call with these arguments (:func:`_keep`): straight through the
    process group's binding (:func:`dtrain.comm.native.direct`; of ``on``, the group the call runs on, where that
    is not ``group``) where the tensors are contiguous and not complex and the group is torch.distributed's, else
    ``run`` (torch.distributed's function)."""
    if not is_mpi_group(group) and output.is_contiguous() and input.is_contiguous() and not output.is_complex():
        direct = native.direct(coll.value, group if on is None else on, op=op, root=root)
        if direct is not None and coll is Collective.ALL_TO_ALL:

            def again(o: torch.Tensor, i: torch.Tensor) -> bool:
                # in place, the backend's own would read blocks it has already written: the long way copies
                return o.is_contiguous() and i.is_contiguous() and o.data_ptr() != i.data_ptr() and direct(o, i)

            run = again
        elif direct is not None and coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):

            def again(o: torch.Tensor, i: torch.Tensor) -> bool:
                # Gloo's own writes o through autograd's guards: the long way writes where they let it (writable)
                guarded = o.requires_grad or o.is_inference()
                return o.is_contiguous() and i.is_contiguous() and not guarded and direct(o, i)

            run = again
        elif direct is not None:

            def again(o: torch.Tensor, i: torch.Tensor) -> bool:
                return o.is_contiguous() and i.is_contiguous() and direct(o, i)

            run = again
    _keep(coll, group, algorithm, extra, output, input, run)


def _keep_native_all_reduce(group, algorithm: str, op: str, tensor: torch.Tensor, on=None) -> None:
    """Keep the backend's own all-reduce, straight through the process group's binding (of ``on``, the group the
    call runs on, where that is not ``group``), for the next call with the same group, algorithm, reduction, size,
    dtype and device (:func:`_fast_all_reduce`)."""
    if is_mpi_group(group) or type(tensor) is not torch.Tensor or tensor.is_complex() or not tensor.is_contiguous():
        return
    direct = native.direct("all_reduce", group if on is None else on, op=op)
    if direct is None or comm_env().check:
        return
    if len(FAST) >= 1024:
        FAST.clear()
    key = (_group_key(group), algorithm, op, tensor.numel(), tensor.dtype, tensor.device)
    FAST[key] = (comm_env(), GENERATION[0], lambda t: direct(t, t))


def _one_pass_or_native(
    coll: Collective, algorithm: str, chosen: str, dtype: torch.dtype, op: str, device, nbytes: int
) -> str:
    """``auto``'s choice, or ``native`` where it chose a one-pass schedule (:data:`dtrain.comm.peer.fused.ONE_PASS`)
    at a size the one pass takes (``nbytes`` a rank puts in, at most :data:`~dtrain.comm.peer.fused.
    ONE_PASS_MAX_BYTES`) that this call cannot run in one pass (its dtype or reduction, ``DTRAIN_COMM_FUSED=0``,
    ``DTRAIN_COMM_ONE_PASS=0``, no kernels): the rules measured the one pass, and NCCL's is faster than the same
    schedule run a round at a time."""
    if algorithm != "auto" or device.type != "cuda" or nbytes > fused.ONE_PASS_MAX_BYTES:
        return chosen
    name = chosen.partition("@")[0]
    if (coll, name) in fused.ONE_PASS and fused.one_pass_form(coll, name, dtype, op, device, nbytes) is None:
        return "native"
    return chosen


def _declined(coll: Collective, algorithm: str, chosen: str, input: torch.Tensor, nbytes: int | None = None) -> bool:
    """Whether ``auto`` chose a one-pass schedule that :func:`_one_pass` then could not run (``DTRAIN_COMM_TIMEOUT``
    set, the group off the peer transport): NCCL's collective runs instead, as
    in :func:`_one_pass_or_native`. Every rank of the group answers alike for the same call. ``nbytes``: what each
    rank puts in, default ``input``'s bytes."""
    nbytes = input.numel() * input.element_size() if nbytes is None else nbytes
    name = chosen.partition("@")[0]
    return (
        algorithm == "auto"
        and input.is_cuda
        and (coll, name) in fused.ONE_PASS
        and 0 < nbytes <= fused.ONE_PASS_MAX_BYTES
    )


def _one_pass_first(
    coll, algorithm, chosen, group, output, input, op: str = "sum", root: int = 0, numel: int | None = None
) -> str | None:
    """Run the call in one pass where ``auto``'s choice or the named algorithm is a one-pass schedule the call can
    run (:func:`_one_pass`): None when it ran; else the algorithm that runs it, ``native`` where ``auto`` chose a
    one pass that cannot run (:func:`_one_pass_or_native`, :func:`_declined`). ``numel``: the elements each rank
    puts in (the scatter's root puts in them all), default ``input``'s."""
    if chosen in NATIVE_CHOICES:
        return chosen
    numel = input.numel() if numel is None else numel
    nbytes = numel * input.element_size()
    chosen = _one_pass_or_native(coll, algorithm, chosen, input.dtype, op, input.device, nbytes)
    if chosen == "native":
        return chosen
    if _one_pass(coll, algorithm, chosen, group, output, input, numel, op=op, root=root):
        return None
    return "native" if _declined(coll, algorithm, chosen, input, nbytes) else chosen


def _one_pass(coll, algorithm, chosen, group, output, input, numel: int, op: str = "sum", root: int = 0) -> bool:
    """Run the call in one pass over the peers' windows (:func:`dtrain.comm.peer.fused.one_pass`) where ``chosen``
    is a one-pass schedule and the call can be (CUDA, the peer transport, no ``DTRAIN_COMM_TIMEOUT``: the same on
    every rank; tensors that are not contiguous go in as contiguous copies), and keep it for the next such call
    (:func:`_fast`); False where it cannot.
    ``numel``: the elements each rank puts in."""
    if not input.is_cuda or round_timeout() is not None:
        return False
    if numel == 0:  # nothing to move: the general plan's empty call
        return False
    name, via = _via(group, input.device, chosen)
    nbytes = numel * input.element_size()
    form = fused.one_pass_form(coll, name, input.dtype, op, input.device, nbytes)
    if form is None or via != "peer":
        return False
    try:
        window = peer.window_for(group, input.device, 2 * (nbytes + fused.ALIGN))
    except peer.PeerUnavailable as err:  # raised on every rank of the group alike
        if _transport_setting() != "auto":
            raise
        _fall_back(group, err)
        return False
    run = fused.one_pass(form, window, input.dtype, numel, root)
    world, device, limit = window.world_size, input.device, window.stall_limit(None)
    what = (coll.value, name, nbytes, str(input.dtype))
    place = (world, window.rank, window.global_rank, str(device))
    average = op == "avg" and (coll is not Collective.REDUCE or window.rank == root)  # a reduce writes the root's

    def again(out: torch.Tensor, inp: torch.Tensor) -> bool:
        if not (out.is_contiguous() and inp.is_contiguous()):
            return False
        window.calls += 1
        run(out, inp)
        if average:
            native.divide(out, world)
        if not torch.cuda.is_current_stream_capturing():
            watchdog.watch(device, limit, _label(what, place, window.calls))
        return True

    if output.is_contiguous() and input.is_contiguous():
        again(output, input)
    else:  # contiguous stand-ins: every rank runs the one pass whatever its own tensors' layout
        inp = input.contiguous()
        out = inp if output is input else torch.empty(output.shape, dtype=output.dtype, device=output.device)
        again(out, inp)
        unwritten = (form in ("rooted", "gather_to") and window.rank != root) or (
            form in ("broadcast", "relay") and window.rank == root
        )
        if not unwritten:
            output.copy_(out.view(output.shape))
    _keep(coll, group, algorithm, _kept_extra(coll, op, root), output, input, again)
    return True


def _kept_extra(coll: Collective, op: str, root: int):
    """What besides the tensors keys a kept call (:func:`_keep`) of ``coll``, as its public function asks
    :func:`_fast` for it: the reduction of a reduce-scatter, the root of a broadcast, gather or scatter, the root
    and the reduction of a reduce, nothing for the others."""
    if coll is Collective.REDUCE_SCATTER:
        return op
    if coll is Collective.REDUCE:
        return (root, op)
    return root if coll in (Collective.BROADCAST, Collective.GATHER, Collective.SCATTER) else None


def _group_key(group):
    return dist.group.WORLD if group is None else group


def _watch(schedule, work: torch.Tensor, window, timeout) -> None:
    """Hand a CUDA peer call to the watchdog, which reports it should it outlast the group's limit."""
    if not torch.cuda.is_current_stream_capturing():
        what = (schedule.collective.value, schedule.algorithm, work.numel() * work.element_size(), str(work.dtype))
        place = (window.world_size, window.rank, window.global_rank, str(work.device))
        watchdog.watch(work.device, window.stall_limit(timeout), _label(what, place, window.calls))


def _label(what: tuple, place: tuple, call: int):
    """The watchdog's description of a call, made only if it reports (plain values: it keeps nothing alive)."""

    def text() -> str:
        coll, algorithm, nbytes, dtype = what
        world, rank, global_rank, device = place
        return (
            f"{coll}/{algorithm} of {nbytes} bytes ({dtype.removeprefix('torch.')}) on the peer transport, call "
            f"{call} of a group of {world} (rank {rank}, global {global_rank}, {device})"
        )

    return text


def _fall_back(group, err: Exception) -> None:
    """Move ``group`` to the point-to-point transport for good (its peer window was refused)."""
    group_state(group).fell_back = True
    changed()
    warnings.warn(f"dtrain.comm: this group uses the point-to-point transport from now on: {err}", stacklevel=3)


def _transport_setting() -> str:
    return comm_env().transport


#: Variables by which a process knows it was started by an MPI launcher (Open MPI, PMIx, MPICH's PMI).
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK")


def default_group(group):
    """``group``, or for ``None`` under ``DTRAIN_COMM_TRANSPORT=mpi`` the :class:`~dtrain.comm.mpi.MPIGroup` over
    ``MPI_COMM_WORLD`` (:func:`dtrain.comm.mpi.world`). A one-line ``ValueError`` where the process was not
    started by mpirun or mpi4py is missing (before mpi4py is imported: a process outside mpirun would make an MPI
    world of one rank)."""
    if group is not None or _transport_setting() != "mpi":
        return group
    import os

    if not any(os.environ.get(v) for v in MPI_LAUNCHER_VARIABLES):
        raise ValueError(
            "DTRAIN_COMM_TRANSPORT=mpi: this process was not started by mpirun (none of "
            f"{', '.join(MPI_LAUNCHER_VARIABLES)} is set); launch with `mpirun -n N python -m mpi4py ...` or "
            "unset DTRAIN_COMM_TRANSPORT"
        )
    from dtrain.comm.mpi.group import mpi, world

    mpi()  # ValueError saying how to install mpi4py
    return world()


def transport_name(group, device: torch.device) -> str:
    """The transport our algorithms run on for ``group`` on ``device``: "mpi" for an
    :class:`~dtrain.comm.mpi.MPIGroup` (MPI point-to-point, whatever the variable says), else
    ``DTRAIN_COMM_TRANSPORT``, or "auto".

    "p2p": torch.distributed point-to-point messages (Gloo, NCCL), for any placement. "peer": ranks read and
    write each other's memory (:mod:`dtrain.comm.peer.window`), for a group whose ranks share one host. "auto" (the
    default) is "peer" for CUDA groups where :func:`dtrain.comm.peer.window.peer_default` holds (one host, torch's
    CUDA symmetric memory, a torch this transport was measured on), and "p2p" everywhere else: on the CPU,
    across hosts, for a group whose window torch cannot make (:class:`dtrain.comm.peer.window.PeerUnavailable`, after
    which the group stays on "p2p"), and while ``DTRAIN_COMM_TIMEOUT`` is set (the debugging mode in which
    every round waits on the host and a stall raises ``CommTimeoutError`` naming the round and the peer). A
    collective decision: every rank of the group reaches the same answer (set the variables alike on every
    rank).
    """
    if is_mpi_group(group):
        return "mpi"
    name = _transport_setting()
    if name == "mpi":  # the default group is MPI's (:func:`default_group`); a torch.distributed group keeps p2p
        return "p2p"
    if name != "auto":
        return name
    state = find_state(group)
    if round_timeout() is not None or (state is not None and state.fell_back):
        return "p2p"
    return "peer" if peer.peer_default(group, device) else "p2p"


def _lanes(schedule, work: torch.Tensor) -> int:
    """Lanes to cut a schedule into: ``DTRAIN_COMM_LANES``, else 1.

    Lanes overlap one lane's reductions with the next lane's transfers, but halve every message. On 4 H200s
    over NCCL the smaller messages fall into NCCL's slower point-to-point regime and lose more than the
    overlap wins (direct all-reduce of 1 GiB: 0.86x NCCL with one lane, 0.80x with two; docs/results.md),
    so they are off unless asked for, for links where reductions weigh more.
    """
    lanes = comm_env().lanes
    return lanes if schedule.reduces else 1


#: Work buffers kept for calls that cannot work in the caller's tensor (see :func:`_scratch`), most recent last.
SCRATCH_KEPT = 16


def _scratch(group, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """A flat work buffer of ``numel`` elements of ``like``'s dtype (``like``'s own numel and a copy of it when
    ``numel`` is None), for the collectives that cannot work in the caller's tensor (reduce-scatter below the
    push form, all-to-all, scatter, a non-root reduce or gather).

    Where calls are replayed (CUDA, the peer transport, :mod:`dtrain.comm.peer.graphs` on) the buffer is kept per
    group, device, dtype, size, stream and thread and reused by the next such call, so a call repeated on new
    inputs runs on the same storage and finds the graph recorded for it (graphs belong to a storage); calls
    of one thread on one stream are ordered, so reuse is safe. At most :data:`SCRATCH_KEPT` are kept per group,
    in its :class:`~dtrain.comm.state.GroupState`; they go with the group's graphs (a window replaced,
    :func:`dtrain.comm.peer.window.close_windows`).
    Inside a CUDA-graph capture, and everywhere else, it is a fresh tensor (a captured graph must own its
    memory)."""
    size = like.numel() if numel is None else numel
    keep = (
        like.is_cuda
        and not torch.cuda.is_current_stream_capturing()
        and persistent.enabled()
        and transport_name(group, like.device) == "peer"
    )
    if not keep:
        return like.reshape(-1).clone() if numel is None else torch.empty(size, dtype=like.dtype, device=like.device)
    stream = torch.cuda.current_stream(like.device).cuda_stream
    kept = group_state(group).scratch  # released with the group's graphs
    key = (like.device, like.dtype, size, stream, threading.get_ident())
    work = kept.pop(key, None)
    if work is None:
        with torch.inference_mode(False):  # kept for calls outside inference mode too
            work = torch.empty(size, dtype=like.dtype, device=like.device)
        while len(kept) >= SCRATCH_KEPT:
            kept.pop(next(iter(kept)), None)
    kept[key] = work  # most recently used last
    if numel is None:
        work.copy_(like.reshape(-1))
    return work


def _flat_work(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat contiguous view of ``t``, or a copy when there is none; the flag says it is a copy."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)  # fmt: skip


def _check_call(coll: Collective, algorithm: str, group, work_numel: int, like: torch.Tensor, what: str) -> None:
    """``DTRAIN_COMM_CHECK=1``: this call's collective, algorithm, element count and dtype against every other
    rank's, by one all-gather of four int64 a rank (the backend's own, or MPI's), before anything else is sent.
    Where any rank differs, every rank raises the same one-line ``ValueError`` naming the first two that differ:
    a rank that called another collective, or the same with other sizes, would otherwise meet the others'
    messages (Gloo's point-to-point takes a shorter message than it expects without a word)."""
    import zlib

    codes = list(Collective)
    dtype = _DTYPES.index(like.dtype) if like.dtype in _DTYPES else len(_DTYPES) + zlib.crc32(str(like.dtype).encode())
    mine = [codes.index(coll), zlib.crc32(algorithm.encode()), work_numel, dtype]
    if is_mpi_group(group):
        from dtrain.comm.mpi import native as mpi_native

        out = torch.empty(group.size * 4, dtype=torch.int64)
        mpi_native.all_gather(out, torch.tensor(mine, dtype=torch.int64), group)
    else:
        device = like.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        rows = [torch.empty(4, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
        out = torch.cat(rows)
    calls = [tuple(row) for row in out.view(-1, 4).tolist()]
    if all(call == calls[0] for call in calls):
        return

    def said(call: tuple) -> str:
        name = codes[call[0]].value if 0 <= call[0] < len(codes) else "?"
        kind = _DTYPES[call[3]] if 0 <= call[3] < len(_DTYPES) else "another dtype"
        return f"{name} of {call[2]} elements of {kind}".replace("torch.", "")

    other = next(r for r, call in enumerate(calls) if call != calls[0])
    algorithms = "" if calls[other][1] == calls[0][1] else " (and another algorithm)"
    raise ValueError(
        f"{what}: DTRAIN_COMM_CHECK: the group's ranks made different calls: rank 0 (of the group) {said(calls[0])}, "
        f"rank {other} {said(calls[other])}{algorithms}"
    )


def _prepare(coll: Collective, algorithm: str, group, work_numel: int, like: torch.Tensor, what: str):
    """(rank, world, chosen algorithm, node size) of a call, after every local check of it; resolving "auto"
    may talk to the group (once per group). A call the group already resolved, under the same environment and
    with nothing changed since (:data:`dtrain.comm.state.GENERATION`), is answered from the group's
    :attr:`~dtrain.comm.state.GroupState.calls`: host time is what a small collective costs."""
    if comm_env().check:
        _check_call(coll, algorithm, group, work_numel, like, what)
    state = find_state(group)
    key = (coll, algorithm, work_numel * like.element_size(), like.device)
    stamp = (comm_env(), GENERATION[0])
    if state is not None:
        at = state.calls_at
        if at is not None and at[0] is stamp[0] and at[1] == stamp[1]:
            known = state.calls.get(key)
            if known is not None:
                return known
        else:
            state.calls.clear()
            state.calls_at = stamp
    rank, world = group_info(group, what)
    if is_mpi_group(group) and like.device.type != "cpu":
        raise ValueError(f"{what}: an MPI group moves CPU tensors only, got one on {like.device}")
    local_size = check_algorithm(coll, algorithm, world, group, what)
    chosen = _resolve(coll, algorithm, world, work_numel * like.element_size(), like.device, local_size, group)
    resolved = (rank, world, chosen, local_size)
    state = find_state(group)
    at = None if state is None else state.calls_at
    if at is not None and at[0] is stamp[0] and at[1] == GENERATION[0] and len(state.calls) < 4096:
        state.calls[key] = resolved
    return resolved


# ---------------------------------------------------------------------------------------------- the API


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` over the group; every rank ends with the result, in place. ``op``: "sum", "avg",
    "prod", "max" or "min", or torch.distributed's ``ReduceOp`` of the same name."""
    op = op_name(op)
    if _fast_all_reduce(tensor, op, group, algorithm):
        return tensor
    with writable(tensor):
        return _all_reduce(tensor, op, group, algorithm)


def _all_reduce(tensor: torch.Tensor, op: str, group, algorithm: str) -> torch.Tensor:
    """:func:`all_reduce` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    group = default_group(group)
    what = "all_reduce"
    check_tensor(tensor, "tensor", what)
    check_written(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world, chosen, local = _prepare(Collective.ALL_REDUCE, algorithm, group, tensor.numel(), tensor, what)
    fusable = algorithm != "auto" or chosen not in fused.FORMS or not tensor.is_cuda
    if not (
        fusable
        or (
            fused.supports(chosen, tensor.dtype, op, tensor.device, tensor.numel(), world)
            and fused.measured(chosen, tensor, world)
        )
    ):
        chosen = "native"  # measured as our kernel; without it (another dtype or reduction) NCCL's is faster
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        _keep_native_all_reduce(group, algorithm, op, tensor, on=on)
        return _native(on).all_reduce(tensor, op, on)
    work, copied = _flat_work(tensor)
    ran = _run(Collective.ALL_REDUCE, chosen, work, group, op, local_size=local)
    if ran is not None and not copied:
        _keep_fused(group, algorithm, op, tensor, ran, world)
    if op == "avg":
        work.div_(world)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank, in place."""
    coll = Collective.BROADCAST
    fast = _fast(coll, group, algorithm, src, tensor, tensor)
    if fast is not None and fast(tensor, tensor):
        return tensor
    with writable(tensor):
        return _broadcast(tensor, src, group, algorithm)


def _broadcast(tensor: torch.Tensor, src: int, group, algorithm: str) -> torch.Tensor:
    """:func:`broadcast` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.BROADCAST
    group = default_group(group)
    what = "broadcast"
    check_tensor(tensor, "tensor", what)
    check_written(tensor, "tensor", what)
    src = check_root(src, group_info(group, what)[1], "src", what)
    rank, world, chosen, local = _prepare(coll, algorithm, group, tensor.numel(), tensor, what)
    chosen = _one_pass_first(coll, algorithm, chosen, group, tensor, tensor, root=src)
    if chosen is None:
        return tensor
    if _direct_declined(algorithm, chosen, tensor):
        chosen = "native"
    if _broadcast_direct(tensor, src, group, algorithm, chosen, world):
        return tensor
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        run = _native(on).broadcast
        _keep_native(coll, group, algorithm, src, tensor, tensor, lambda t, _t: run(t, src, on) is not None, src, on=on)
        return run(tensor, src, on)
    work, copied = _flat_work(tensor)
    _run(Collective.BROADCAST, chosen, work, group, root=src, local_size=local)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def reduce(tensor: torch.Tensor, dst: int, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` over the group into ``tensor`` of rank ``dst``; other ranks' tensors are untouched."""
    op = op_name(op)
    coll = Collective.REDUCE
    fast = _fast(coll, group, algorithm, (dst, op), tensor, tensor)
    if fast is not None and fast(tensor, tensor):
        return tensor
    with writable(tensor):
        return _reduce(tensor, dst, op, group, algorithm)


def _reduce(tensor: torch.Tensor, dst: int, op: str, group, algorithm: str) -> torch.Tensor:
    """:func:`reduce` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.REDUCE
    group = default_group(group)
    what = "reduce"
    check_tensor(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world = group_info(group, what)
    dst = check_root(dst, world, "dst", what)
    if rank == dst:  # the other ranks' tensors are only read
        check_written(tensor, "tensor", what)
    rank, world, chosen, local = _prepare(coll, algorithm, group, tensor.numel(), tensor, what)
    chosen = _one_pass_first(coll, algorithm, chosen, group, tensor, tensor, op=op, root=dst)
    if chosen is None:
        return tensor
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        run = _native(on).reduce

        def ran(t: torch.Tensor, _t: torch.Tensor) -> bool:
            return run(t, dst, op, on) is not None

        if is_mpi_group(on) or not native.keeps_inputs(tensor, on):  # a non-root's tensor is copied first
            _keep(coll, group, algorithm, (dst, op), tensor, tensor, ran)
        else:  # straight through the binding, in place on every rank
            _keep_native(coll, group, algorithm, (dst, op), tensor, tensor, ran, dst, op, on=on)
        return run(tensor, dst, op, on)
    if _reduce_direct(tensor, dst, op, group, chosen, world):

        def again(t: torch.Tensor, _t: torch.Tensor) -> bool:
            if not _run_direct_reduce(t, dst, op, group, world):
                return False
            if rank == dst and op == "avg":
                native.divide(t, world)
            return True

        if rank == dst and op == "avg":
            tensor.div_(world)
        _keep(coll, group, algorithm, (dst, op), tensor, tensor, again)
        return tensor
    if rank == dst:
        work, copied = _flat_work(tensor)
    else:  # partial sums pass through non-root ranks: keep the caller's tensor intact
        work, copied = _scratch(group, tensor), False
    _run(Collective.REDUCE, chosen, work, group, op, root=dst, local_size=local)
    if rank == dst:
        if op == "avg":
            work.div_(world)
        if copied:
            tensor.copy_(work.view(tensor.shape))
    return tensor


def scan(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Inclusive prefix reduction over ranks: rank r ends with op(x_0, ..., x_r), in place.

    ``avg`` gives the mean of the prefix, op(x_0..x_r) / (r + 1).
    """
    op = op_name(op)
    with writable(tensor):
        return _scan(tensor, op, group, algorithm)


def _scan(tensor: torch.Tensor, op: str, group, algorithm: str) -> torch.Tensor:
    """:func:`scan`, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    group = default_group(group)
    what = "scan"
    check_tensor(tensor, "tensor", what)
    check_written(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world, chosen, local = _prepare(Collective.SCAN, algorithm, group, tensor.numel(), tensor, what)
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        return _native(on).scan(tensor, op, on)
    work, copied = _flat_work(tensor)
    _run(Collective.SCAN, chosen, work, group, op, local_size=local)
    if op == "avg":
        work.div_(rank + 1)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``input`` concatenated rank-major into every rank's ``output``."""
    coll = Collective.ALL_GATHER
    fast = _fast(coll, group, algorithm, None, output, input)
    if fast is not None and fast(output, input):
        return output
    with writable(output, input):
        return _all_gather(output, input, group, algorithm)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, algorithm: str) -> torch.Tensor:
    """:func:`all_gather` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.ALL_GATHER
    group = default_group(group)
    what = "all_gather"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    rank, world = group_info(group, what)
    check_pair(output, input, world * input.numel(), what)
    check_written(output, "output", what)
    check_overlap(output, input, rank, what)
    rank, world, chosen, local = _prepare(coll, algorithm, group, output.numel(), output, what)
    chosen = _one_pass_first(coll, algorithm, chosen, group, output, input)
    if chosen is None:
        return output
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        run = _native(on).all_gather
        _keep_native(coll, group, algorithm, None, output, input, lambda o, i: run(o, i, on) is not None, on=on)
        return run(output, input, on)
    work, copied = _flat_work(output)
    m = input.numel()
    work[rank * m : (rank + 1) * m].copy_(input.reshape(-1))
    _run(Collective.ALL_GATHER, chosen, work, group, local_size=local)
    if copied:
        output.copy_(work.view(output.shape))
    return output


def gather(output: torch.Tensor | None, input: torch.Tensor, dst: int, group=None, algorithm: str = "auto"):
    """Every rank's ``input`` concatenated rank-major into ``output`` of rank ``dst`` (None elsewhere)."""
    coll = Collective.GATHER
    fast = _fast(coll, group, algorithm, dst, input if output is None else output, input)
    if fast is not None and fast(input if output is None else output, input):
        return output
    with writable(output, input):
        return _gather(output, input, dst, group, algorithm)


def _gather(output: torch.Tensor | None, input: torch.Tensor, dst: int, group, algorithm: str):
    """:func:`gather` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.GATHER
    group = default_group(group)
    what = "gather"
    check_tensor(input, "input", what)
    rank, world = group_info(group, what)
    dst = check_root(dst, world, "dst", what)
    if rank == dst:
        check_tensor(output, "output", what)
        check_pair(output, input, world * input.numel(), what)
        check_written(output, "output", what)
        check_overlap(output, input, rank, what)
    rank, world, chosen, local = _prepare(coll, algorithm, group, world * input.numel(), input, what)
    # in one pass a rank but the root writes nothing: its input stands in for the output it has not
    chosen = _one_pass_first(coll, algorithm, chosen, group, output if rank == dst else input, input, root=dst)
    if chosen is None:
        return output
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        return _native(on).gather(output, input, dst, on)
    m = input.numel()
    if rank == dst:
        work, copied = _flat_work(output)
    else:
        work, copied = _scratch(group, input, world * m), False
    work[rank * m : (rank + 1) * m].copy_(input.reshape(-1))
    _run(Collective.GATHER, chosen, work, group, root=dst, local_size=local)
    if copied:
        output.copy_(work.view(output.shape))
    return output


def scatter(output: torch.Tensor, input: torch.Tensor | None, src: int, group=None, algorithm: str = "auto"):
    """Block r of ``input`` on rank ``src`` (rank-major, ``world`` equal blocks) into ``output`` of rank r."""
    coll = Collective.SCATTER
    fast = _fast(coll, group, algorithm, src, output, output if input is None else input)
    if fast is not None and fast(output, output if input is None else input):
        return output
    with writable(output, input):
        return _scatter(output, input, src, group, algorithm)


def _scatter(output: torch.Tensor, input: torch.Tensor | None, src: int, group, algorithm: str):
    """:func:`scatter` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.SCATTER
    group = default_group(group)
    what = "scatter"
    check_tensor(output, "output", what)
    check_written(output, "output", what)
    rank, world = group_info(group, what)
    src = check_root(src, world, "src", what)
    if rank == src:
        check_tensor(input, "input", what)
        check_pair(input, output, world * output.numel(), what, names=("input", "output"))
        check_overlap(input, output, rank, what, names=("input", "output"))
    m = output.numel()
    rank, world, chosen, local = _prepare(coll, algorithm, group, world * m, output, what)
    # in one pass a rank but the root puts nothing in: its output stands in for the input it has not
    chosen = _one_pass_first(
        coll, algorithm, chosen, group, output, input if rank == src else output, root=src, numel=world * m
    )
    if chosen is None:
        return output
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        return _native(on).scatter(output, input, src, on)
    work = _scratch(group, input) if rank == src else _scratch(group, output, world * m)
    _run(Collective.SCATTER, chosen, work, group, root=src, local_size=local)
    output.copy_(work[rank * m : (rank + 1) * m].view(output.shape))
    return output


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto"
) -> torch.Tensor:
    """Reduce ``input`` over the group; rank r keeps block r of the result in ``output``."""
    op = op_name(op)
    coll = Collective.REDUCE_SCATTER
    fast = _fast(coll, group, algorithm, op, output, input)
    if fast is not None and fast(output, input):
        return output
    with writable(output, input):
        return _reduce_scatter(output, input, op, group, algorithm)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group, algorithm: str) -> torch.Tensor:
    """:func:`reduce_scatter` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.REDUCE_SCATTER
    group = default_group(group)
    what = "reduce_scatter"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    check_op(op, input.dtype, what)
    rank, world = group_info(group, what)
    check_pair(input, output, world * output.numel(), what, names=("input", "output"))
    check_written(output, "output", what)
    in_place = check_overlap(input, output, rank, what, names=("input", "output"))
    rank, world, chosen, local = _prepare(coll, algorithm, group, input.numel(), input, what)
    chosen = _one_pass_first(coll, algorithm, chosen, group, output, input, op=op)
    if chosen is None:
        return output
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        run = _native(on).reduce_scatter
        keep = lambda o, i: run(o, i, op, on) is not None  # noqa: E731
        _keep_native(coll, group, algorithm, op, output, input, keep, op=op, on=on)
        return run(output, input, op, on)
    m = output.numel()
    contiguous = input.is_contiguous() and output.is_contiguous()
    if contiguous and not in_place and _out_of_place(coll, chosen, group, input, local):
        mine = output.view(-1)
        _run(coll, chosen, input.view(-1), group, op, local_size=local, out=mine)  # reads input, writes mine
    else:
        work = _scratch(group, input)  # the schedule reduces in place: a copy of the input
        _run(coll, chosen, work, group, op, local_size=local)
        mine = work[rank * m : (rank + 1) * m]
    if op == "avg":
        mine.div_(world)
    if mine.data_ptr() != output.data_ptr():
        output.copy_(mine.view(output.shape))
    return output


def _out_of_place(coll: Collective, algorithm: str, group, input: torch.Tensor, local_size) -> bool:
    """Whether a reduce-scatter can read the caller's input and write its block straight into the output: the
    peer transport's push form, with a plan that stores only into the rank's own block
    (:func:`dtrain.comm.peer.push.writes_own_block_only`). Every rank answers alike (one schedule, one size)."""
    algorithm, via = _via(group, input.device, algorithm)
    if via != "peer":
        return False
    world = dist.get_world_size(group)
    local = local_size if registry.needs_local_size(algorithm) else None
    schedule = registry.build(coll, algorithm, world, local_size=local)
    nbytes = input.numel() * input.element_size()
    return peer.push_mode(schedule, nbytes, input.device.type) and peer_push.writes_own_block_only(
        schedule, input.numel()
    )


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Block j of rank i's ``input`` lands in block i of rank j's ``output`` (equal blocks, rank-major)."""
    coll = Collective.ALL_TO_ALL
    fast = _fast(coll, group, algorithm, None, output, input)
    if fast is not None and fast(output, input):
        return output
    with writable(output, input):
        return _all_to_all(output, input, group, algorithm)


def _all_to_all(output: torch.Tensor, input: torch.Tensor, group, algorithm: str) -> torch.Tensor:
    """:func:`all_to_all` past its kept path, in the context :func:`~dtrain.comm.arguments.writable` gives."""
    coll = Collective.ALL_TO_ALL
    group = default_group(group)
    what = "all_to_all"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    rank, world = group_info(group, what)
    check_pair(output, input, input.numel(), what)
    if input.numel() % world:
        raise ValueError(f"all_to_all: input has {input.numel()} elements, not a multiple of the group size {world}")
    check_written(output, "output", what)
    check_overlap(output, input, 0, what)
    rank, world, chosen, local = _prepare(coll, algorithm, group, input.numel(), input, what)
    chosen = _one_pass_first(coll, algorithm, chosen, group, output, input)
    if chosen is None:
        return output
    if chosen in NATIVE_CHOICES:
        on = _backend_group(group, chosen)
        run = _native(on).all_to_all
        _keep_native(coll, group, algorithm, None, output, input, lambda o, i: run(o, i, on) is not None, on=on)
        return run(output, input, on)
    work = _scratch(group, input)
    _run(coll, chosen, work, group, local_size=local)
    output.copy_(work.view(output.shape))
    return output


def barrier(group=None, algorithm: str = "dissemination") -> None:
    """Return only once every rank of the group has entered the barrier: the dissemination algorithm ("auto"
    too), or the backend's own barrier ("native": torch.distributed's, or MPI_Barrier on an MPI group)."""
    group = default_group(group)
    rank, world = group_info(group, "barrier")
    check_algorithm(Collective.BARRIER, algorithm, world, group, "barrier")
    if algorithm == "native":
        if is_mpi_group(group):
            _native(group).barrier(group)
        else:
            dist.barrier(group=group)
        return
    token = torch.ones(1, dtype=torch.int32, device=_barrier_device(group))
    _run(Collective.BARRIER, "dissemination" if algorithm == "auto" else algorithm, token, group, "max")
    if token.is_cuda:
        torch.cuda.current_stream().synchronize()


def _barrier_device(group) -> torch.device:
    if is_mpi_group(group):
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
