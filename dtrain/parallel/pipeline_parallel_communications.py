"""Where pipeline parallelism talks to the network: activations forward, gradients backward, to the neighbours.

Point to point over the pipeline group with ``torch.distributed.isend`` / ``irecv`` (Gloo on CPU, NCCL on GPU),
peers translated from group ranks with ``dist.get_global_rank``. The receiver never needs the shape by hand:
the first message of each direction in a step is preceded by a fixed-size int64 header (ndim, dtype code,
dims, padding), never a pickle; the other micro-batches of the step reuse it (all micro-batches of a step have
one shape), so the steady state sends payload only, as Megatron-LM's ``p2p_communication`` does with its
shape exchange.

Sends are non-blocking and only waited on at the end of a step (their buffers are kept alive until then);
receives block. With sends that never block, the GPipe and 1F1B schedules cannot deadlock (Narayanan et al.
2021 rely on the same property). On NCCL that holds for the host but not for the GPU: ProcessGroupNCCL runs a
pair's unbatched sends and receives on one stream, both directions, in the order posted, and a large send
waits for its receive. In 1F1B's steady state stage s posts send_forward before recv_backward while stage
s + 1 posts send_backward before recv_forward, and each send then waits behind the other rank's send (seen
on 4 H200s with 32-64 MiB activations, docs/parallel.md). So gradients travel on a second process group
over the same ranks (``grad_group``; :func:`backward_group` for the whole world, the rank grid's
``pp_grad_group`` otherwise): each direction of a pair has its own communicator and stream, and within one
direction the receives come in the order of the sends.

With interleaved 1F1B each rank holds ``v`` model chunks, chunk ``c`` of rank ``s`` being virtual stage
``u = c p + s``: activations go from ``u`` to ``u + 1`` (rank ``s + 1``, or rank 0's next chunk after the last
rank), so the links form a ring. Every message carries the tag ``2 u' + direction`` of the virtual stage ``u'``
that receives it: on 2 ranks both directions join the same pair of processes, and a receive must not take a
message meant for another chunk or direction (Gloo matches by peer and tag, in order within a tag). NCCL
ignores tags; it needs no more, since on every ordered pair of ranks the schedule's receives come in the order
of the sends (tests/parallel/test_pipeline_parallel.py checks it for p = 2 to 4).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtrain.parallel.pipeline_schedules import Timeline, TimelineEvent

__all__ = ["HEADER_NUMEL", "MAX_NDIM", "StageLink", "decode_header", "encode_header"]

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


class StageLink:
    """This rank's links to the neighbouring (virtual) stages: activations in and out, gradients out and in.

    ``group`` is the pipeline group, its rank ``i`` is stage ``i``; with ``virtual_stages`` chunks per rank,
    chunk ``c`` is virtual stage ``c * num_stages + stage``. Each message is recorded in the current
    :class:`Timeline` when one is set with :meth:`begin_step`. Received tensors land on ``device`` (a GPU for
    NCCL).
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
    ) -> None:
        self.group = group
        self.grad_group = grad_group if grad_group is not None else backward_group(group)
        self.device = device if device is not None else torch.device("cpu")
        self.stage = stage
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self._pending: list[tuple[object, list[torch.Tensor], TimelineEvent]] = []
        self._shapes: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self.timeline: Timeline | None = None

    def begin_step(self, timeline: Timeline | None) -> None:
        """Forget the shapes of the last step (the batch may have changed) and record into ``timeline``."""
        self._shapes.clear()
        self.timeline = timeline

    def send_forward(self, activation: torch.Tensor, microbatch: int, chunk: int = 0) -> None:
        self._send(activation, self._virtual(chunk) + 1, _FORWARD, "send_forward", microbatch, chunk)

    def recv_forward(self, microbatch: int, chunk: int = 0) -> torch.Tensor:
        return self._recv(self._virtual(chunk) - 1, _FORWARD, "recv_forward", microbatch, chunk)

    def send_backward(self, grad: torch.Tensor, microbatch: int, chunk: int = 0) -> None:
        self._send(grad, self._virtual(chunk) - 1, _BACKWARD, "send_backward", microbatch, chunk)

    def recv_backward(self, microbatch: int, chunk: int = 0) -> torch.Tensor:
        return self._recv(self._virtual(chunk) + 1, _BACKWARD, "recv_backward", microbatch, chunk)

    def _virtual(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage

    def _peer(self, virtual: int, kind: str) -> int:
        if not 0 <= virtual < self.num_stages * self.virtual_stages:
            raise ValueError(
                f"stage {self.stage} of {self.num_stages} has no peer to {kind} (virtual stage {virtual} of "
                f"{self.num_stages * self.virtual_stages})"
            )
        return dist.get_global_rank(self.group, virtual % self.num_stages)

    def _send(self, tensor: torch.Tensor, to: int, direction: int, kind: str, microbatch: int, chunk: int) -> None:
        peer, tag = self._peer(to, kind), 2 * to + direction
        group = self.grad_group if direction == _BACKWARD else self.group
        start = time.perf_counter()
        payload = tensor.detach().contiguous()
        buffers = [payload]
        known = self._shapes.get((kind, chunk))
        if known is None:
            header = encode_header(payload).to(payload.device)
            self._shapes[kind, chunk] = (tuple(payload.shape), payload.dtype)
            works = [dist.isend(header, peer, group=group, tag=tag)]
            buffers.append(header)
        else:
            if known != (tuple(payload.shape), payload.dtype):
                raise ValueError(
                    f"stage {self.stage}: micro-batch {microbatch} would {kind} {tuple(payload.shape)} "
                    f"{payload.dtype}, but this step's micro-batches had {known[0]} {known[1]}"
                )
            works = []
        works.append(dist.isend(payload, peer, group=group, tag=tag))
        event = self._record(kind, microbatch, chunk, start)
        self._pending += [(w, buffers, event) for w in works]

    def _recv(self, source: int, direction: int, kind: str, microbatch: int, chunk: int) -> torch.Tensor:
        peer, tag = self._peer(source, kind), 2 * self._virtual(chunk) + direction
        group = self.grad_group if direction == _BACKWARD else self.group
        start = time.perf_counter()
        known = self._shapes.get((kind, chunk))
        if known is None:
            header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
            dist.irecv(header, peer, group=group, tag=tag).wait()
            known = self._shapes[kind, chunk] = decode_header(header)
        shape, dtype = known
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        dist.irecv(payload, peer, group=group, tag=tag).wait()
        self._record(kind, microbatch, chunk, start).end_s = time.perf_counter()
        return payload

    def _record(self, kind: str, microbatch: int, chunk: int, start: float) -> TimelineEvent:
        event = TimelineEvent(kind, microbatch, start, start, chunk=chunk)
        if self.timeline is not None:
            self.timeline.events.append(event)
        return event

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
