"""Where pipeline parallelism talks to the network: activations forward, gradients backward, to the neighbours.

Two transports (``transport``). The first step of a link always goes through the process groups' point-to-point
``send`` / ``recv`` (Gloo on CPU, NCCL on GPU), peers translated from group ranks with ``dist.get_global_rank``.
The receiver never needs the shape by hand: the first message of each (direction, virtual stage) the link ever
carries is preceded by a fixed-size int64 header (ndim, dtype code, dims, padding), never a pickle; every later
message, in this step and the next ones, reuses it, so the steady state sends payload only and reads nothing back
to the host (Megatron-LM's ``p2p_communication`` exchanges shapes the same way, once). From the second step on,
with every shape agreed, stages of one host move to peer channels (:mod:`dtrain.comm.peer.channels`,
``transport="auto"`` or ``"peer"``): one ring of slots per (sending stage, receiving stage) pair, sized to a step's
messages; the sender pushes each payload into the receiver's slot with a copy through peer memory and raises a
counter, and the receiver's stream waits on that counter where it uses the data. Where a ring holds the whole
step's messages the receiver computes on each message in its slot (taken lent, no copy out) and gives the slots
back at the step's end. On a GPU those are stream memory operations that hold no SM while they wait; an NCCL
receive or send posted before its partner holds its CTAs spinning, which slows the products it shares the SMs
with. On 4 H100s (16 x Linear(4096), float32, batch 4096), the peer channels took interleaved 1F1B's step from 51.8
to 46.7 ms at 8 micro-batches and ZB-V's from 49.1 to 41.3 ms (``bench_pipeline-b4096-h100x4.jsonl``).

On the process groups, every rank knows every stage's actions (:meth:`StageLink.plan`), so it knows, for each
peer, the order in which that peer will send to it (:func:`messages`). It posts its receives in that order (NCCL
ignores tags and matches in order), ahead of the action that needs them: :meth:`StageLink.prefetch` after each
action posts the receives of the next ``lookahead`` actions, so a transfer overlaps the compute before it. Sends are
asynchronous, polled between actions and waited at the end of the step only. ProcessGroupNCCL runs the
point-to-point operations of one communicator on one stream, in the order posted, and a send waits for its
receive. Messages to a higher stage travel on ``group``, to a lower one on ``grad_group`` (:func:`backward_group`
for the whole world, the rank grid's ``pp_grad_group`` otherwise): each stream then carries a one-way flow and no
wait can close a cycle, whatever the schedule (GPipe and 1F1B, interleaved 1F1B, whose ring sends the last rank's
activations down to rank 0, and ZB-V, whose second chunk runs down the stages). A communicator for each ordered
pair of stages was measured as well and changed nothing (``pipeline_pair_links-b4096-h100x4.jsonl``): what costs
is the spinning kernels, not the sharing of streams.

Chunk ``c`` of rank ``s`` is virtual stage :func:`~dtrain.parallel.pipeline_schedules.virtual_stage` ``(s, c)``:
``c p + s`` for interleaved 1F1B, ``s`` and ``2p - 1 - s`` in ZB-V's V, where the turn from virtual stage
``p - 1`` to ``p`` stays on the last rank and is handed over without a message. Every message carries the tag
``2 u' + direction`` of the virtual stage ``u'`` that receives it (Gloo matches by peer and tag).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from dtrain.parallel.pipeline_schedules import (
    Timeline,
    TimelineEvent,
    apply_device_times,
    chunk_of,
    stage_of_virtual,
    virtual_stage,
)

__all__ = [
    "DeviceClock",
    "HEADER_NUMEL",
    "MAX_NDIM",
    "Route",
    "StageLink",
    "auto_takes_channels",
    "decode_header",
    "encode_header",
    "messages",
]

MAX_NDIM = 8
#: The most elements an activation crossing a stage may have (a header asking for more is corrupt).
MAX_NUMEL = 1 << 40
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


class DeviceClock:
    """One pipeline step's times on a GPU: CUDA events with timing on, recorded on the compute stream (the stream
    current on ``device`` where each interval is marked), read once after the step by :meth:`finish`.

    Made as the step begins: the host waits for the stream to drain the work of earlier steps, so that the start
    event runs as it is recorded and the host clock read then (``start_s``) is when the device began the step;
    the timelines of ranks on one host then line up as their host clocks do. Between the actions nothing waits:
    marking is one ``cudaEventRecord``. An action's start marker is recorded after the stream's wait for its
    received inputs, so a stage waiting for its peer is idle, not busy. Not for a step being recorded into a CUDA
    graph: events recorded in a capture are not timed at the replay.
    """

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether ``device`` has a clock to read (a CUDA device)."""
        return device.type == "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.current_stream(device).synchronize()
        self.start = self.mark()
        self.start_s = time.perf_counter()
        self.end: torch.cuda.Event | None = None
        self.intervals: list[tuple[TimelineEvent, torch.cuda.Event, torch.cuda.Event]] = []

    def mark(self) -> torch.cuda.Event:
        """A timing event recorded now on the compute stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, event: TimelineEvent, start: torch.cuda.Event) -> None:
        """``event`` ran on the compute stream from marker ``start`` to now (its end marker is recorded here)."""
        self.intervals.append((event, start, self.mark()))

    def stop(self) -> None:
        """Mark the step's end on the compute stream."""
        self.end = self.mark()

    def finish(self, timeline: Timeline) -> Timeline:
        """Wait for the step's end marker and put the device times into ``timeline``
        (:func:`~dtrain.parallel.pipeline_schedules.apply_device_times`)."""
        if self.end is None:
            self.stop()
        self.end.synchronize()
        return apply_device_times(timeline, self.start, self.end, self.intervals)


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
    shape = tuple(values[2 : 2 + ndim])
    if any(d < 0 for d in shape) or any(v != -1 for v in values[2 + ndim :]) or math.prod(shape) > MAX_NUMEL:
        raise ValueError(f"corrupt pipeline header {values}: a shape of at most {MAX_NUMEL} elements, -1 after it")
    return shape, _DTYPES[code]


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


class Route(NamedTuple):
    """Where the messages of one (direction, receiving virtual stage) go to or come from, resolved once."""

    peer: int  # the other stage (this stage itself for the turn of the V: no message)
    group: dist.ProcessGroup | None  # the communicator carrying them
    rank: int  # the peer's rank in ``group``
    tag: int  # 2 u + direction


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


#: The actions ahead whose receives a stage posts after each action on the CPU's process groups (Gloo sends
#: complete only once the receiver has posted, so receives posted early let the neighbour's sends go while this
#: stage computes). On the peer channels a receive is only booked ahead, so the number does not matter there.
LOOKAHEAD = 2

#: Where a link's messages travel: the process groups' own send and recv ("group"), or, once every message's
#: shape is agreed, :class:`~dtrain.comm.peer.channels.PeerChannels` between ranks of one host ("peer"); "auto"
#: takes the peer channels where every stage is on one host (and a GPU has the driver's stream memory
#: operations and messages of :data:`PEER_FROM_BYTES` or more), the process groups elsewhere.
TRANSPORTS = ("auto", "group", "peer")

#: With ``transport="auto"`` on a GPU, the least bytes of a pipeline's largest message for peer channels: below
#: it no step was measured. With each step of a message one driver call, a message costs the host less over the
#: channels than over NCCL's send and recv: 66-84 us against 86-127 us (two launches), 64 KiB to 16 MiB, on 4 H100s
#: (``probe-channels-h100x4.txt``); on 16 x Linear(4096), every schedule eager and graphed, NCCL's step over the
#: channels' was 0.90-1.51x with messages of 1 and 2 MiB (19 of 20 rows faster over the channels;
#: ``bench_pipeline-h100x4.jsonl``) and 1.01-1.18x with 4 and 8 MiB (``bench_pipeline-b4096-h100x4.jsonl``). On the CPU,
#: where Gloo's messages cross sockets, Gloo's step over the channels' was 0.91-1.31x with 2 stages and 0.86-1.44x
#: with 4 (on 2 cores; 7 and 5 of 8 rows faster over the channels; ``pipeline_transport-p{2,4}-cpu2.jsonl``), so
#: ``auto`` takes them there at any size.
PEER_FROM_BYTES = 64 << 10

#: The most bytes a peer channel's ring of slots takes on a GPU. Its slots are one step's messages, so that a send
#: never waits for a slot within a step; where they would take more, ``auto`` keeps the process groups (whose
#: receives take memory only while they are used), and ``peer`` gives the ring fewer slots: a send then waits, on
#: its channel's stream, for the receiver to free one (not measured on a GPU).
RING_BYTES = 1 << 30


def auto_takes_channels(device_type: str, largest_bytes: int, ring_bytes: int) -> bool:
    """Whether ``transport="auto"`` moves a pipeline of one host to peer channels, given its largest message and
    the bytes of one step's messages on its busiest channel: always on the CPU; on a GPU from
    :data:`PEER_FROM_BYTES` on, while a ring of a step's messages fits in :data:`RING_BYTES`."""
    if device_type != "cuda":
        return True
    return largest_bytes >= PEER_FROM_BYTES and ring_bytes <= RING_BYTES


class StageLink:
    """This rank's links to the neighbouring (virtual) stages: activations in and out, gradients out and in.

    ``group`` is the pipeline group, its rank ``i`` is stage ``i``; chunk ``c`` is virtual stage
    :func:`~dtrain.parallel.pipeline_schedules.virtual_stage` ``(i, c)`` under ``placement`` ("loop" or "v").
    On the process groups, messages to a higher stage travel on ``group``, to a lower one on ``grad_group``, so
    that on each communicator every pair of ranks carries one direction only; from the second step, ``transport``
    "auto" (stages of one host) or "peer" moves them to peer channels (see the module). :meth:`plan` takes every
    stage's actions; from them each rank knows, per peer, the order in which that peer sends, and posts its
    receives in that order (NCCL ignores tags and matches in order), ahead of the action that needs them
    (:meth:`prefetch`): the next ``lookahead`` actions' receives (default :data:`LOOKAHEAD`, but none ahead on
    NCCL, where a receive posted early holds its kernel's CTAs spinning and the communicator's stream: on 4
    H100s, 16 x Linear(4096) with micro-batches of 512 rows, 1F1B's step fell from 65.0 to 55.2 ms and ZB-H1's
    from 48.9 to 44.1 ms with no receive posted ahead).

    Shapes are agreed once: the first message of each (direction, virtual stage) the link ever carries is preceded
    by a header (:func:`encode_header`), and later messages reuse it, across steps. A payload of another shape
    afterwards is a ValueError (call :meth:`forget_shapes` on every stage first). A forward-only step (evaluation)
    agrees its own shapes, each step, over the process groups, and leaves training's as they were: an evaluation
    batch may have any number of rows. Sends are asynchronous and
    waited lazily: polled between actions, waited at the end of the step. Each message is recorded in the current
    :class:`Timeline` when one is set with :meth:`begin_step`. Received tensors land on ``device``.

    What a message costs the host is kept small, as on a GPU the host's time per action sets the pace of a step
    once micro-batches are small: each (direction, virtual stage)'s peer, communicator and tag are resolved once
    and cached; the receives each action posts ahead, and the order of each peer's messages, are worked out once
    per schedule (and forward-only or not), not per step or message; messages go to the process group's own
    ``send`` / ``recv`` (what ``torch.distributed.isend`` / ``irecv`` call after their argument checks, done here
    once); polling the sends looks at the oldest ones only, so it costs O(1) an action, not O(sends in flight).
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
        lookahead: int | None = None,
        transport: str = "auto",
        in_place: bool = True,
        send_engine: str = "stream",
    ) -> None:
        from dtrain.comm.peer.channels import ENGINES

        group = group if group is not None else dist.group.WORLD
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if send_engine not in ENGINES:
            raise ValueError(f"send_engine must be one of {', '.join(ENGINES)}, got {send_engine!r}")
        self.group = group
        #: "group": the process groups' send and recv; "peer": peer channels once shapes are agreed; "auto":
        #: peer channels where available (decided at the second step, on every stage alike)
        self.transport = transport
        #: on peer channels whose ring holds the whole step, compute on each message in its slot (lent) or on a copy
        self.in_place = in_place
        #: where a message's copy runs on a peer channel whose ring holds the whole step (ENGINES of
        #: dtrain.comm.peer.channels); a smaller ring keeps "stream", whose slot waits hold no caller's stream
        self.send_engine = send_engine
        self._lends: list[bool] = []  # per channel: whether its messages are taken lent (computed on in their slots)
        self._engines: list[str] = []  # per channel: the engine of its sends
        self._channels = None  # the PeerChannels of the steady state (transport "peer")
        self._channel_of: dict[tuple[int, int], int] = {}  # (sending stage, receiving stage) -> channel index
        self.grad_group = grad_group if grad_group is not None else backward_group(group)
        self.device = device if device is not None else torch.device("cpu")
        self.stage = stage
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.placement = placement
        if lookahead is None:
            nccl = self.device.type == "cuda" and transport != "peer"
            lookahead = 0 if nccl else LOOKAHEAD
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be a non-negative int, got {lookahead!r}")
        self.lookahead = lookahead
        self.timeline: Timeline | None = None
        #: the step's device clock (None: the host clock alone): each message's interval on the compute stream is
        #: marked on it as well (:meth:`begin_step`)
        self.clock: DeviceClock | None = None
        self._pending: deque[tuple[object, list[torch.Tensor], TimelineEvent | None]] = deque()
        self._shapes: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}  # agreed, persistent
        self._agreed: set[tuple[int, int]] = set()  # (direction, virtual stage) whose header has been planned
        self._schedules: list[list[tuple]] = []
        self._plans: dict[bool, dict[tuple[int, int], list[Key]]] = {}
        # (direction, virtual stage receiving) -> (peer stage, communicator, the peer's rank in it, tag); the peer
        # is this stage for the turn of the V (no message)
        self._send_routes: dict[tuple[int, int], Route] = {}
        self._recv_routes: dict[tuple[int, int], Route] = {}
        self._steady: dict[bool, dict[int, list[tuple[Key, bool]]]] = {}  # per forward_only, once shapes agreed
        self._ahead: dict[tuple[bool, int], list[list[tuple[int, Key]]]] = {}  # receives to post after action i
        self._ahead_now: list[list[tuple[int, Key]]] = []
        self._local: dict[Key, torch.Tensor] = {}
        self._incoming: dict[int, list[tuple[Key, bool]]] = {}  # peer -> [(key, header first)] this step
        self._cursor: dict[int, int] = {}
        self._posted: dict[Key, tuple[object, torch.Tensor]] = {}
        self._headers: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self._header_out: set[Key] = set()
        # during a forward-only step: training's agreed shapes, plans, channels and headers to send, put back after it
        self._training_state: tuple | None = None
        self._actions: Sequence[tuple] = ()
        self._last: set[Key] = set()  # the step's last message of each (sending, receiving stage) pair
        #: record a CUDA event pair around each receive's stream wait (see :meth:`step_report`)
        self.measure_device = False
        #: the step is being recorded into a CUDA graph: no event is queried or timed
        self.capturing = False
        self._counts = {"sends": 0, "recvs": 0, "headers": 0, "send_s": 0.0, "recv_wait_s": 0.0}
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def transport_in_use(self) -> str:
        """ "peer" once the peer channels carry the messages, else "group"."""
        return "peer" if self._channels is not None else "group"

    @property
    def receives_in_place(self) -> bool:
        """Whether this stage computes on messages in their peer-channel slots (taken lent), on one channel or more."""
        return self._channels is not None and any(self._lends)

    @property
    def send_engines_in_use(self) -> tuple[str, ...]:
        """Where this stage's sends on each peer channel copy (empty off the peer channels)."""
        return tuple(self._engines) if self._channels is not None else ()

    # -- the plan of a step

    def plan(self, schedules: Sequence[Sequence[tuple]]) -> None:
        """Every stage's actions (the same on every rank): what each peer sends, in order."""
        self._schedules = [list(a) for a in schedules]
        self._plans.clear()
        self._steady.clear()
        self._ahead.clear()

    def begin_step(
        self, timeline: Timeline | None, *, forward_only: bool = False, clock: DeviceClock | None = None
    ) -> None:
        """Start a step (``timeline`` None ends one): the receives to post this step, in each peer's send order.
        With ``clock``, each message is also marked on the compute stream: a receive from before to after the
        stream's wait for it (and, on the peer channels, its copy out), a send around what posting it puts on the
        stream (the copy of the "inline" and "kernel" engines; next to nothing where the copy runs on another
        stream)."""
        self.timeline = timeline
        self.clock = clock if timeline is not None else None
        if self._training_state is not None:  # a forward-only step ends (or failed): training's state comes back
            (self._shapes, self._agreed, self._steady, self._channels, self._header_out) = self._training_state
            self._training_state = None
            if timeline is None:
                return
        if timeline is None:
            if self._channels is not None:
                self._channels.release()  # the step is done with the messages it computed on in their slots
            return
        if forward_only:
            # an evaluation agrees its own shapes, afresh each step (its batch may differ from training's and from
            # the last evaluation's), over the process groups (the peer channels' slots are sized for training's)
            self._training_state = (self._shapes, self._agreed, self._steady, self._channels, self._header_out)
            self._shapes, self._agreed, self._steady, self._channels, self._header_out = {}, set(), {}, None, set()
        self._counts = {"sends": 0, "recvs": 0, "headers": 0, "send_s": 0.0, "recv_wait_s": 0.0}
        self._wait_events = []
        self._local = {}
        mine = self._schedules[self.stage] if self._schedules else []
        self._actions = [a for a in mine if a[0] == "F"] if forward_only else mine
        steady = self._steady.get(forward_only)
        if steady is None:
            steady = self._plan_incoming(forward_only)
        if self.transport != "group" and self._channels is None and not forward_only and False in self._steady:
            self._open_channels()
        self._incoming = steady
        self._cursor = dict.fromkeys(steady, 0)
        # each pair's last message of the step ends the channel's round (dtrain.comm.peer.channels)
        self._last = {keys[-1] for keys in self._plans[forward_only].values() if keys}
        ahead = self._ahead.get((forward_only, self.lookahead))
        if ahead is None:
            ahead = self._ahead[forward_only, self.lookahead] = self._plan_ahead()
        self._ahead_now = ahead

    def _open_channels(self) -> None:
        """Open a peer channel for each (sending stage, receiving stage) pair of the training schedule (every stage
        does it at the same step: the first whose messages all have agreed shapes): slots of the pair's largest
        message, as many as one step sends on it (on a GPU at most :data:`RING_BYTES` of them). ``auto`` keeps the
        process groups instead where the stages are not on one host, or on a GPU where no message reaches
        :data:`PEER_FROM_BYTES` or a ring would pass :data:`RING_BYTES`."""
        from dtrain.comm.peer.channels import Channel, PeerChannels, channels_available
        from dtrain.comm.peer.window import PeerUnavailable

        pairs = sorted(self._plans[False])
        sizes = torch.zeros(max(1, len(pairs)), dtype=torch.int64)
        for i, (src, dst) in enumerate(pairs):
            if self.stage in (src, dst):
                sizes[i] = max(self._message_bytes(key) for key in self._plans[False][src, dst])
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        sizes = sizes.to(device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.group)
        # a step's messages on the busiest channel: what its ring takes with a slot for each
        ring = max((int(sizes[i]) * len(self._plans[False][pair]) for i, pair in enumerate(pairs)), default=0)
        if self.transport == "auto" and not auto_takes_channels(self.device.type, int(sizes.max()), ring):
            self.transport = "group"  # every stage sees the same sizes, so every stage decides alike
            return
        if not channels_available(self.group, self.device):
            if self.transport == "auto":
                self.transport = "group"
                return
            raise ValueError(
                "transport 'peer' needs every stage on one host (and on a GPU CUDA symmetric memory and stream "
                "memory operations); use transport 'group'"
            )
        channels = []
        self._lends, self._engines = [], []
        for i, (src, dst) in enumerate(pairs):
            nbytes, count = int(sizes[i]), len(self._plans[False][src, dst])
            whole = count
            if self.device.type == "cuda":
                count = min(count, max(2, RING_BYTES // max(1, nbytes)))
            channels.append(Channel(src, dst, max(1, nbytes), count))
            # a ring that holds the whole step lends its slots: a stage computes on its messages where they
            # landed, and gives the slots back at the step's end (no copy out, nothing sent back per message)
            self._lends.append(self.in_place and count >= whole)
            self._engines.append(self.send_engine if count >= whole else "stream")
        try:
            self._channels = PeerChannels(self.group, self.device, channels)
        except PeerUnavailable:  # raised on every stage alike
            if self.transport != "auto":
                raise
            self.transport = "group"
            return
        self._channel_of = {pair: i for i, pair in enumerate(pairs)}

    def _message_bytes(self, key: Key) -> int:
        shape, dtype = self._shapes[key[0], key[1]]
        numel = 1
        for d in shape:
            numel *= d
        return numel * dtype.itemsize

    def _plan_incoming(self, forward_only: bool) -> dict[int, list[tuple[Key, bool]]]:
        """Per peer, the messages it sends this rank in its order, each flagged when a header precedes it; kept for
        every later step once no message of the step needs a header."""
        if forward_only not in self._plans:
            self._plans[forward_only] = messages(self._schedules, self.placement, forward_only=forward_only)
        channels = self._plans[forward_only]
        incoming, headers, any_header = {}, {}, False
        for (src, dst), keys in sorted(channels.items()):
            flagged = []
            for key in keys:
                agreed = (key[0], key[1])
                first = agreed not in self._agreed and agreed not in headers.get((src, dst), set())
                headers.setdefault((src, dst), set()).update({agreed} if first else set())
                flagged.append((key, first))
                any_header |= first
            if dst == self.stage:
                incoming[src] = flagged
            if src == self.stage:
                self._header_out |= {key for key, first in flagged if first}
        for found in headers.values():
            self._agreed |= found
        if not any_header:
            self._steady[forward_only] = incoming
        return incoming

    def _plan_ahead(self) -> list[list[tuple[int, Key]]]:
        """For each action of this step, the (peer, message) receives of the next ``lookahead`` actions."""
        needed: list[tuple[int, Key] | None] = []
        for action in self._actions:
            kind, mb = action[0], action[1]
            u = virtual_stage(self.stage, chunk_of(action), self.num_stages, self.placement)
            direction = _FORWARD if kind == "F" else _BACKWARD if kind == "B" else None
            route = self._recv_route(direction, u) if direction is not None else None
            remote = route is not None and route.peer != self.stage
            needed.append((route.peer, (direction, u, mb)) if remote else None)
        return [[n for n in needed[i + 1 : i + 1 + self.lookahead] if n is not None] for i in range(len(self._actions))]

    def forget_shapes(self) -> None:
        """Agree shapes again on the next message of each kind (every stage of the group must call it)."""
        self._shapes.clear()
        self._agreed.clear()
        self._steady.clear()
        self._channels = None  # their slots were sized for the old shapes
        self._channel_of = {}

    # -- routes, resolved once

    def _send_route(self, direction: int, to: int, kind: str) -> Route:
        route = self._send_routes.get((direction, to))
        if route is None:
            dest = self._peer_stage(to, kind)
            route = self._send_routes[direction, to] = self._route(dest, to, direction, sending=True)
        return route

    def _recv_route(self, direction: int, u: int) -> Route | None:
        """The route of the message ``direction`` into virtual stage ``u``; None where no stage sends it (the
        first stage's forward input, the last stage's gradient)."""
        route = self._recv_routes.get((direction, u))
        if route is None:
            frm = u - 1 if direction == _FORWARD else u + 1
            if not 0 <= frm < self.num_stages * self.virtual_stages:
                return None
            source = stage_of_virtual(frm, self.num_stages, self.placement)[0]
            route = self._recv_routes[direction, u] = self._route(source, u, direction, sending=False)
        return route

    def _route(self, peer: int, u: int, direction: int, *, sending: bool) -> Route:
        """The :class:`Route` of a message into virtual stage ``u`` to (``sending``) or from ``peer``."""
        tag = 2 * u + direction
        if peer == self.stage:
            return Route(peer, None, -1, tag)
        comm = self._comm(self.stage, peer) if sending else self._comm(peer, self.stage)
        return Route(peer, comm, dist.get_group_rank(comm, dist.get_global_rank(self.group, peer)), tag)

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
        dest, group, rank, tag = self._send_route(direction, to, kind)
        payload = tensor.detach()
        if dest == self.stage:  # the turn of the V: the next chunk is on this rank
            self._local[key] = payload
            return
        start = time.perf_counter()
        clock = self.clock if not self.capturing else None
        marked = clock.mark() if clock is not None else None
        if not payload.is_contiguous():
            payload = payload.contiguous()
        if self._header_out and key in self._header_out:
            self._header_out.discard(key)
            header = encode_header(payload).to(payload.device)
            self._shapes[direction, to] = (tuple(payload.shape), payload.dtype)
            self._pending.append((_send(header, group, rank, tag), [header], None))
            self._counts["headers"] += 1
        else:
            known = self._shapes.get((direction, to))
            if known is None or payload.shape != known[0] or payload.dtype != known[1]:
                raise ValueError(
                    f"stage {self.stage}: micro-batch {microbatch} would {kind} {tuple(payload.shape)} "
                    f"{payload.dtype}, but the pipeline agreed on {known} for these messages; call forget_shapes() "
                    "on every stage before changing the micro-batch shape"
                )
        if self._channels is not None:
            index = self._channel_of[self.stage, dest]
            work = self._channels.send(index, payload, last=key in self._last, engine=self._engines[index])
        else:
            work = _send(payload, group, rank, tag)
        event = self._record(kind, microbatch, chunk, start)
        if clock is not None:
            clock.add(event, marked)
        self._pending.append((work, [payload], event))
        counts = self._counts
        counts["sends"] += 1
        counts["send_s"] += time.perf_counter() - start

    # -- receiving

    def _recv(self, key: Key, kind: str, chunk: int) -> torch.Tensor:
        direction, u, microbatch = key
        route = self._recv_route(direction, u)
        if route is None:
            self._peer_stage(u - 1 if direction == _FORWARD else u + 1, kind)  # raises: no such peer
        source = route.peer
        if source == self.stage:
            return self._local.pop(key)
        start = time.perf_counter()
        posted = self._posted.pop(key, None)
        if posted is None:
            self._post_until(source, key)
            posted = self._posted.pop(key)
        work, payload = posted
        measure = self.measure_device and payload.is_cuda and not self.capturing
        clock = self.clock if not self.capturing else None
        if measure:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        marked = clock.mark() if clock is not None else None
        waited = time.perf_counter()
        work.wait()  # on NCCL the compute stream waits for the receive, the host does not
        end = time.perf_counter()
        if measure:
            after.record()
            self._wait_events.append((before, after))
        event = self._record(kind, microbatch, chunk, start)
        event.end_s = end
        if clock is not None:
            clock.add(event, marked)
        counts = self._counts
        counts["recvs"] += 1
        counts["recv_wait_s"] += end - waited
        return payload

    def _post_until(self, source: int, key: Key) -> None:
        """Post the receives from ``source`` in its send order, up to and including ``key``."""
        if key in self._posted:
            return
        items = self._incoming.get(source, ())
        cursor = self._cursor.get(source, 0)
        while cursor < len(items):
            item, header_first = items[cursor]
            cursor += 1
            self._cursor[source] = cursor
            direction, u, _ = item
            _, group, rank, tag = self._recv_route(direction, u)
            if header_first:
                header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
                self._headers[direction, u] = (_recv(header, group, rank, tag), header)
            agreed = self._shapes.get((direction, u))
            if agreed is None:  # the first step: read the header (a host wait, once)
                work, header = self._headers.pop((direction, u))
                work.wait()
                agreed = self._shapes[direction, u] = decode_header(header)
            if self._channels is not None:
                channel = self._channel_of[source, self.stage]
                received = self._channels.post(
                    channel, agreed[0], agreed[1], last=item in self._last, lend=self._lends[channel]
                )
                self._posted[item] = (received, received.tensor)
            else:
                payload = torch.empty(agreed[0], dtype=agreed[1], device=self.device)
                self._posted[item] = (_recv(payload, group, rank, tag), payload)
            if item == key:
                return
        raise ValueError(f"stage {self.stage}: no message {key} from stage {source} in this step's schedule")

    def prefetch(self, index: int) -> None:
        """Post the receives of the next ``lookahead`` actions after action ``index`` of this step."""
        if index >= len(self._ahead_now):
            return
        for source, key in self._ahead_now[index]:
            if key not in self._posted and (key[0], key[1]) in self._shapes:
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
        """Stamp and release the oldest sends that have completed, up to the first still in flight (cheap; called
        between actions: sends complete about in the order posted, so this looks at one or two of them)."""
        pending = self._pending
        while pending and not self.capturing and pending[0][0].is_completed():
            event = pending.popleft()[2]
            if event is not None:
                event.end_s = max(event.end_s, time.perf_counter())

    def wait_sends(self) -> None:
        """Block until every send of the step is done; their buffers may be reused after this."""
        pending = self._pending
        while pending:
            work, _, event = pending.popleft()
            work.wait()
            if event is not None:  # a header's send has none
                event.end_s = max(event.end_s, time.perf_counter())


def _send(tensor: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int):  # noqa: ANN202
    """``dist.isend(tensor, group=group, group_dst=peer, tag=tag)``: the group's own send, for a plain tensor."""
    if type(tensor) is torch.Tensor and not tensor.is_complex():
        return group.send([tensor], peer, tag)
    return dist.isend(tensor, group=group, group_dst=peer, tag=tag)


def _recv(tensor: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int):  # noqa: ANN202
    """``dist.irecv(tensor, group=group, group_src=peer, tag=tag)``: the group's own recv, for a plain tensor."""
    if type(tensor) is torch.Tensor and not tensor.is_complex():
        return group.recv([tensor], peer, tag)
    return dist.irecv(tensor, group=group, group_src=peer, tag=tag)
