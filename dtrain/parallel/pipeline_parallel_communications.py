"""Where pipeline parallelism talks to the network: activations forward, gradients backward, to the neighbours.

Point to point with ``torch.distributed.isend`` / ``irecv`` (Gloo on CPU, NCCL on GPU), peers translated from
group ranks with ``dist.get_global_rank``. The receiver never needs the shape by hand: the first message of
each (direction, virtual stage) the link ever carries is preceded by a fixed-size int64 header (ndim, dtype
code, dims, padding), never a pickle; every later message, in this step and the next ones, reuses it, so the
steady state sends payload only and reads nothing back to the host (Megatron-LM's ``p2p_communication`` exchanges
shapes the same way, once).

Every rank knows every stage's actions (:meth:`StageLink.plan`), so it knows, for each peer, the order in which
that peer will send to it (:func:`messages`). It posts its receives in that order (NCCL ignores tags and matches
in order), ahead of the action that needs them: :meth:`StageLink.prefetch` after each action posts the receives
of the next two, so a transfer overlaps the compute before it. Sends are asynchronous, polled between actions
and waited at the end of the step only.

Messages to a higher stage travel on ``group``, to a lower one on ``grad_group`` (:func:`backward_group` for the
whole world, the rank grid's ``pp_grad_group`` otherwise). ProcessGroupNCCL runs a pair's sends and receives of
one communicator on one stream, in the order posted, and a large send waits for its receive; with both
directions of a pair on one communicator, two stages that each send before they receive wait on each other (seen
on 4 H200s with 1F1B, docs/parallel.md). With one direction a communicator, each stream carries a one-way flow,
and no wait can close a cycle, whatever the schedule: GPipe and 1F1B (activations up, gradients down),
interleaved 1F1B (whose ring sends the last rank's activations down to rank 0) and ZB-V (whose second chunk runs
down the stages).

Chunk ``c`` of rank ``s`` is virtual stage :func:`~dtrain.parallel.pipeline_schedules.virtual_stage` ``(s, c)``:
``c p + s`` for interleaved 1F1B, ``s`` and ``2p - 1 - s`` in ZB-V's V, where the turn from virtual stage
``p - 1`` to ``p`` stays on the last rank and is handed over without a message. Every message carries the tag
``2 u' + direction`` of the virtual stage ``u'`` that receives it (Gloo matches by peer and tag).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtrain.parallel.pipeline_schedules import Timeline, TimelineEvent, chunk_of, stage_of_virtual, virtual_stage

__all__ = ["HEADER_NUMEL", "MAX_NDIM", "StageLink", "decode_header", "encode_header", "messages"]

MAX_NDIM = 8
HEADER_NUMEL = 2 + MAX_NDIM  # ndim, dtype code, dims padded with -1
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_FORWARD, _BACKWARD = 0, 1  # the direction bit of a message's tag


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    """The (HEADER_NUMEL,) int64 header that tells a receiver ``tensor``'s shape and dtype."""
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"a pipeline activation may have at most {MAX_NDIM} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _CODES:
        raise ValueError(f"dtype {tensor.dtype} cannot cross a pipeline stage; supported: {list(_CODES)}")
    header = torch.full((HEADER_NUMEL,), -1, dtype=torch.int64)
    header[0] = tensor.dim()
    header[1] = _CODES[tensor.dtype]
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) from a header made by :func:`encode_header`."""
    values = header.tolist()
    ndim, code = values[0], values[1]
    if not 0 <= ndim <= MAX_NDIM or not 0 <= code < len(_DTYPES):
        raise ValueError(f"corrupt pipeline header {values}")
    return tuple(values[2 : 2 + ndim]), _DTYPES[code]


_BACKWARD_GROUPS: dict[object, dist.ProcessGroup] = {}


def backward_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The default group for ``group``'s gradient messages when none is given.

    For a group of the whole world, a second group over the same ranks, made once (every rank is a member, so
    every rank makes it, as torch.distributed requires). For a smaller group, the group itself: a new group
    would need every process of the world to take part, which only the caller can arrange, so pass
    ``grad_group`` (:class:`~dtrain.parallel.grid.RankGrid` makes one for each pipeline group).
    """
    if dist.get_world_size(group) == 1 or dist.get_world_size(group) != dist.get_world_size():
        return group
    made = _BACKWARD_GROUPS.get(group)
    if made is None:
        made = _BACKWARD_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group))
    return made


Key = tuple[int, int, int]  # (direction, receiving virtual stage, micro-batch)


def messages(
    schedules: Sequence[Sequence[tuple]], placement: str = "loop", *, forward_only: bool = False
) -> dict[tuple[int, int], list[Key]]:
    """Every message between two different stages, per (sending stage, receiving stage), in the order sent.

    A stage sends in the order of its actions: an F on virtual stage ``u`` sends its output to ``u + 1``, a B its
    input gradient to ``u - 1``; a message between two chunks of one stage (the turn of the V) is no message.
    """
    p = len(schedules)
    last = p * (1 + max((chunk_of(a) for stage in schedules for a in stage), default=0)) - 1
    out: dict[tuple[int, int], list[Key]] = {}
    for s, actions in enumerate(schedules):
        for action in actions:
            kind, mb = action[0], action[1]
            u = virtual_stage(s, chunk_of(action), p, placement)
            if kind == "F" and u < last:
                to, key = u + 1, (_FORWARD, u + 1, mb)
            elif kind == "B" and u > 0 and not forward_only:
                to, key = u - 1, (_BACKWARD, u - 1, mb)
            else:
                continue
            dest = stage_of_virtual(to, p, placement)[0]
            if dest != s:
                out.setdefault((s, dest), []).append(key)
    return out


class StageLink:
    """This rank's links to the neighbouring (virtual) stages: activations in and out, gradients out and in.

    ``group`` is the pipeline group, its rank ``i`` is stage ``i``; chunk ``c`` is virtual stage
    :func:`~dtrain.parallel.pipeline_schedules.virtual_stage` ``(i, c)`` under ``placement`` ("loop" or "v").
    Messages to a higher stage travel on ``group``, to a lower one on ``grad_group``, so that on each
    communicator every pair of ranks carries one direction only. :meth:`plan` takes every stage's actions; from
    them each rank knows, per peer, the order in which that peer sends, and posts its receives in that order
    (NCCL ignores tags and matches in order), ahead of the action that needs them (:meth:`prefetch`).

    Shapes are agreed once: the first message of each (direction, virtual stage) the link ever carries is preceded
    by a header (:func:`encode_header`), and later messages reuse it, across steps. A payload of another shape
    afterwards is a ValueError (call :meth:`forget_shapes` on every stage first). Sends are asynchronous and
    waited lazily: polled between actions, waited at the end of the step. Each message is recorded in the current
    :class:`Timeline` when one is set with :meth:`begin_step`. Received tensors land on ``device``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        stage: int,
        num_stages: int,
        device: torch.device | None = None,
        *,
        virtual_stages: int = 1,
        grad_group: dist.ProcessGroup | None = None,
        placement: str = "loop",
        lookahead: int = 2,
    ) -> None:
        self.group = group
        self.grad_group = grad_group if grad_group is not None else backward_group(group)
        self.device = device if device is not None else torch.device("cpu")
        self.stage = stage
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.placement = placement
        self.lookahead = lookahead
        self.timeline: Timeline | None = None
        self._pending: list[tuple[object, list[torch.Tensor], TimelineEvent]] = []
        self._shapes: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}  # agreed, persistent
        self._agreed: set[tuple[int, int]] = set()  # (direction, virtual stage) whose header has been planned
        self._schedules: list[list[tuple]] = []
        self._plans: dict[bool, dict[tuple[int, int], list[Key]]] = {}
        self._local: dict[Key, torch.Tensor] = {}
        self._incoming: dict[int, list[tuple[Key, bool]]] = {}  # peer -> [(key, header first)] this step
        self._cursor: dict[int, int] = {}
        self._posted: dict[Key, tuple[object, torch.Tensor]] = {}
        self._headers: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self._header_out: set[Key] = set()
        self._actions: Sequence[tuple] = ()
        #: record a CUDA event pair around each receive's stream wait (see :meth:`step_report`)
        self.measure_device = False
        self._counts = {"sends": 0, "recvs": 0, "headers": 0, "send_s": 0.0, "recv_wait_s": 0.0}
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # -- the plan of a step

    def plan(self, schedules: Sequence[Sequence[tuple]]) -> None:
        """Every stage's actions (the same on every rank): what each peer sends, in order."""
        self._schedules = [list(a) for a in schedules]
        self._plans.clear()

    def begin_step(self, timeline: Timeline | None, *, forward_only: bool = False) -> None:
        """Start a step (``timeline`` None ends one): the receives to post this step, in each peer's send order."""
        self.timeline = timeline
        if timeline is None:
            return
        self._counts = dict.fromkeys(self._counts, 0)
        self._counts["send_s"] = self._counts["recv_wait_s"] = 0.0
        self._wait_events = []
        if forward_only not in self._plans:
            self._plans[forward_only] = messages(self._schedules, self.placement, forward_only=forward_only)
        channels = self._plans[forward_only]
        self._incoming, self._cursor, self._local = {}, {}, {}
        headers = {}
        for (src, dst), keys in sorted(channels.items()):
            flagged = []
            for key in keys:
                agreed = (key[0], key[1])
                first = agreed not in self._agreed and agreed not in headers.get((src, dst), set())
                headers.setdefault((src, dst), set()).update({agreed} if first else set())
                flagged.append((key, first))
            if dst == self.stage:
                self._incoming[src] = flagged
                self._cursor[src] = 0
            if src == self.stage:
                self._header_out |= {key for key, first in flagged if first}
        for found in headers.values():
            self._agreed |= found
        mine = self._schedules[self.stage] if self._schedules else []
        self._actions = [a for a in mine if a[0] == "F"] if forward_only else mine

    def forget_shapes(self) -> None:
        """Agree shapes again on the next message of each kind (every stage of the group must call it)."""
        self._shapes.clear()
        self._agreed.clear()

    # -- sending

    def send_forward(self, activation: torch.Tensor, microbatch: int, chunk: int = 0) -> None:
        u = self._virtual(chunk)
        self._send(activation, (_FORWARD, u + 1, microbatch), "send_forward", chunk)

    def send_backward(self, grad: torch.Tensor, microbatch: int, chunk: int = 0) -> None:
        u = self._virtual(chunk)
        self._send(grad, (_BACKWARD, u - 1, microbatch), "send_backward", chunk)

    def recv_forward(self, microbatch: int, chunk: int = 0) -> torch.Tensor:
        return self._recv((_FORWARD, self._virtual(chunk), microbatch), "recv_forward", chunk)

    def recv_backward(self, microbatch: int, chunk: int = 0) -> torch.Tensor:
        return self._recv((_BACKWARD, self._virtual(chunk), microbatch), "recv_backward", chunk)

    def _virtual(self, chunk: int) -> int:
        return virtual_stage(self.stage, chunk, self.num_stages, self.placement)

    def _peer_stage(self, virtual: int, kind: str) -> int:
        if not 0 <= virtual < self.num_stages * self.virtual_stages:
            raise ValueError(
                f"stage {self.stage} of {self.num_stages} has no peer to {kind} (virtual stage {virtual} of "
                f"{self.num_stages * self.virtual_stages})"
            )
        return stage_of_virtual(virtual, self.num_stages, self.placement)[0]

    def _comm(self, src: int, dst: int) -> dist.ProcessGroup:
        return self.group if dst > src else self.grad_group

    def _send(self, tensor: torch.Tensor, key: Key, kind: str, chunk: int) -> None:
        direction, to, microbatch = key
        dest = self._peer_stage(to, kind)
        payload = tensor.detach()
        if dest == self.stage:  # the turn of the V: the next chunk is on this rank
            self._local[key] = payload
            return
        start = time.perf_counter()
        payload = payload.contiguous()
        group, peer, tag = self._comm(self.stage, dest), dist.get_global_rank(self.group, dest), 2 * to + direction
        buffers = [payload]
        works = []
        known = self._shapes.get((direction, to))
        if key in self._header_out:
            self._header_out.discard(key)
            header = encode_header(payload).to(payload.device)
            self._shapes[direction, to] = (tuple(payload.shape), payload.dtype)
            works.append(dist.isend(header, peer, group=group, tag=tag))
            buffers.append(header)
        elif known is None or known != (tuple(payload.shape), payload.dtype):
            raise ValueError(
                f"stage {self.stage}: micro-batch {microbatch} would {kind} {tuple(payload.shape)} "
                f"{payload.dtype}, but the pipeline agreed on {known} for these messages; call forget_shapes() "
                "on every stage before changing the micro-batch shape"
            )
        works.append(dist.isend(payload, peer, group=group, tag=tag))
        event = self._record(kind, microbatch, chunk, start)
        self._counts["sends"] += 1
        self._counts["headers"] += len(works) - 1
        self._counts["send_s"] += time.perf_counter() - start
        self._pending += [(w, buffers, event) for w in works]

    # -- receiving

    def _recv(self, key: Key, kind: str, chunk: int) -> torch.Tensor:
        direction, u, microbatch = key
        source = self._peer_stage(u - 1 if direction == _FORWARD else u + 1, kind)
        if source == self.stage:
            return self._local.pop(key)
        start = time.perf_counter()
        self._post_until(source, key)
        work, payload = self._posted.pop(key)
        measure = self.measure_device and payload.is_cuda
        if measure:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        waited = time.perf_counter()
        work.wait()  # on NCCL the compute stream waits for the receive, the host does not
        end = time.perf_counter()
        if measure:
            after.record()
            self._wait_events.append((before, after))
        self._record(kind, microbatch, chunk, start).end_s = end
        self._counts["recvs"] += 1
        self._counts["recv_wait_s"] += end - waited
        return payload

    def _post_until(self, source: int, key: Key) -> None:
        """Post the receives from ``source`` in its send order, up to and including ``key``."""
        if key in self._posted:
            return
        items = self._incoming.get(source, [])
        group, peer = self._comm(source, self.stage), dist.get_global_rank(self.group, source)
        while self._cursor.get(source, 0) < len(items):
            item, header_first = items[self._cursor[source]]
            self._cursor[source] += 1
            direction, u, _ = item
            tag = 2 * u + direction
            if header_first:
                header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
                self._headers[direction, u] = (dist.irecv(header, peer, group=group, tag=tag), header)
            if (direction, u) not in self._shapes:  # the first step: read the header (a host wait, once)
                work, header = self._headers.pop((direction, u))
                work.wait()
                self._shapes[direction, u] = decode_header(header)
            shape, dtype = self._shapes[direction, u]
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            self._posted[item] = (dist.irecv(payload, peer, group=group, tag=tag), payload)
            if item == key:
                return
        raise ValueError(f"stage {self.stage}: no message {key} from stage {source} in this step's schedule")

    def prefetch(self, index: int) -> None:
        """Post the receives of the next ``lookahead`` actions after action ``index`` of this step."""
        p, last = self.num_stages, self.num_stages * self.virtual_stages - 1
        for action in self._actions[index + 1 : index + 1 + self.lookahead]:
            kind, mb = action[0], action[1]
            u = virtual_stage(self.stage, chunk_of(action), p, self.placement)
            if kind == "F" and u > 0:
                key, source = (_FORWARD, u, mb), stage_of_virtual(u - 1, p, self.placement)[0]
            elif kind == "B" and u < last:
                key, source = (_BACKWARD, u, mb), stage_of_virtual(u + 1, p, self.placement)[0]
            else:
                continue
            if source != self.stage and (key[0], key[1]) in self._shapes:
                self._post_until(source, key)

    def _record(self, kind: str, microbatch: int, chunk: int, start: float) -> TimelineEvent:
        event = TimelineEvent(kind, microbatch, start, start, chunk=chunk)
        if self.timeline is not None:
            self.timeline.events.append(event)
        return event

    def step_report(self) -> dict[str, float | int | None]:
        """What this rank's link did in the step last begun: ``sends`` and ``recvs`` (payload messages),
        ``headers`` (shape headers sent, the first step only), ``send_s`` (host seconds spent posting sends),
        ``recv_wait_s`` (host seconds blocked in receive waits: the wait itself on Gloo, next to nothing on
        NCCL, where the stream waits instead) and ``device_wait_s``: with :attr:`measure_device` on a GPU, the
        seconds the compute stream stood still waiting for receives (CUDA events recorded around each stream wait;
        this call waits for the last of them), else None."""
        report: dict[str, float | int | None] = dict(self._counts)
        report["device_wait_s"] = None
        if self._wait_events:
            self._wait_events[-1][1].synchronize()
            report["device_wait_s"] = sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3
        return report

    def poll_sends(self) -> None:
        """Stamp and release the sends that have completed (cheap; called between actions)."""
        still = []
        for work, buffers, event in self._pending:
            if work.is_completed():
                event.end_s = max(event.end_s, time.perf_counter())
            else:
                still.append((work, buffers, event))
        self._pending = still

    def wait_sends(self) -> None:
        """Block until every send of the step is done; their buffers may be reused after this."""
        for work, _, event in self._pending:
            work.wait()
            event.end_s = max(event.end_s, time.perf_counter())
        self._pending = []
