"""Where sharded data parallelism (ZeRO) talks to the network: a bucket-major flat layout, the reduce-scatter of
each bucket from gradient hooks during backward (stage 2), and the all-gather of updated shards.

Layout (after Rajbhandari et al. 2020, "ZeRO", SC20, section 5.2, and DeepSpeed's bucketed reduce-scatter):
parameters are taken in reverse registration order, the order backward roughly produces their gradients, and
cut into buckets of about ``bucket_bytes`` (:func:`~dtrain.parallel.data_parallel_communications.cut_buckets`'s
rule). Each bucket is padded to a multiple of the group size N and the buckets lie one after another in one
flat buffer. Rank r owns chunk r of every bucket: a reduce-scatter of a bucket's gradients hands each rank
exactly the gradients of the elements it steps, and an all-gather of a bucket's chunks rebuilds the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtrain import comm
from dtrain.parallel.data_parallel_communications import cut_buckets

__all__ = ["ShardedBucket", "ShardedGradientReducer", "all_gather_buckets", "layout_buckets"]


@dataclass(eq=False)
class ShardedBucket:
    """A run of parameters laid out in ``flat[start : start + numel]`` (``numel`` padded to a multiple of N).

    ``offsets[i]`` is where ``params[i]`` starts inside the bucket; every rank owns ``numel // N`` elements of it
    (``chunk``), rank r the ``r``-th chunk.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    start: int
    numel: int
    chunk: int
    pending: set[int] = field(default_factory=set, repr=False)  # id() of parameters not ready in this pass

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}


def layout_buckets(params: list[nn.Parameter], world_size: int, bucket_bytes: int) -> list[ShardedBucket]:
    """Cut ``params`` (reverse order) into buckets of about ``bucket_bytes``, each padded to a multiple of N."""
    buckets, start = [], 0
    for plain in cut_buckets(list(reversed(params)), bucket_bytes):
        offsets, numel = [], 0
        for p in plain.params:
            offsets.append(numel)
            numel += p.numel()
        padded = -(-numel // world_size) * world_size
        bucket = ShardedBucket(
            params=plain.params, offsets=offsets, start=start, numel=padded, chunk=padded // world_size
        )
        bucket.reset()
        buckets.append(bucket)
        start += padded
    return buckets


def all_gather_buckets(
    flat: torch.Tensor, shards: list[torch.Tensor], buckets: list[ShardedBucket], group, *, algorithm: str
) -> None:
    """Every rank's updated chunk of each bucket back into every rank's ``flat`` (one all-gather a bucket)."""
    for bucket, shard in zip(buckets, shards, strict=True):
        # The shard is a view of flat, which all_gather overwrites: give it a copy as input.
        comm.all_gather(
            flat[bucket.start : bucket.start + bucket.numel], shard.detach().clone(), group=group, algorithm=algorithm
        )


class ShardedGradientReducer:
    """ZeRO-2's gradient path: reduce-scatter each bucket as soon as its gradients are ready, keep only the shard.

    From each parameter's post-accumulate-grad hook (:meth:`mark_ready`): when a bucket is complete (buckets go
    out in index order, so every rank issues the same collectives), its gradients are packed into one
    bucket-sized message, reduce-scattered with ``op="avg"``, this rank's chunk is *added* to ``grad_shards[b]``
    (so several backward passes accumulate, as ``param.grad`` would), and the full per-parameter gradients are
    released (``param.grad = None``). :meth:`finish` (queued at the end of each backward) sends what is left, a
    missing gradient counting as zero; :meth:`zero` starts a new accumulation. ``reduce_dtype`` packs the
    message in that dtype (e.g. bf16 for float32 gradients) and adds the result back in the shard's.
    """

    def __init__(
        self,
        buckets: list[ShardedBucket],
        grad_shards: list[torch.Tensor],
        group,
        *,
        algorithm: str,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.buckets = buckets
        self.reduce_dtype = reduce_dtype
        self.grad_shards = grad_shards
        self.group = group
        self.algorithm = algorithm
        self._bucket_of = {id(p): b for b, bucket in enumerate(buckets) for p in bucket.params}
        self._next_launch = 0
        self._finish_queued = False
        self._written: set[int] = set()  # buckets reduced since zero(): later passes add into their shard
        self.used: set[int] = set()  # id() of the parameters that had a gradient on this rank since zero()
        self.launches = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self.mark_ready) for b in buckets for p in b.params]

    def mark_ready(self, param: torch.Tensor) -> None:
        """``param.grad`` holds this pass's gradient: reduce-scatter every bucket now complete, in order."""
        if not self._finish_queued:  # buckets left (unused parameters) go out when the whole backward is done
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        b = self._bucket_of[id(param)]
        if b < self._next_launch:
            return
        self.buckets[b].pending.discard(id(param))
        while self._next_launch < len(self.buckets) and not self.buckets[self._next_launch].pending:
            self._launch(self._next_launch)
            self._next_launch += 1

    def finish(self) -> None:
        """Reduce-scatter every bucket not sent yet in this pass, then rearm."""
        self._finish_queued = False
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
            self._next_launch += 1
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0

    def zero(self) -> None:
        """Forget the accumulated gradient shards: the next pass writes them afresh."""
        self._written.clear()
        self.used.clear()
        for shard in self.grad_shards:
            shard.zero_()

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        work = torch.empty(bucket.numel, dtype=self.grad_shards[b].dtype, device=self.grad_shards[b].device)
        views, grads, missing = [], [], []
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            view = work[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                missing.append(view)  # a parameter this pass did not use counts as a zero gradient
            else:
                views.append(view)
                grads.append(p.grad)
                self.used.add(id(p))
        if grads:
            torch._foreach_copy_(views, grads)
        if missing:
            torch._foreach_zero_(missing)
        work[bucket.offsets[-1] + bucket.params[-1].numel() :].zero_()  # the padding to a multiple of N
        del views, missing
        for p in bucket.params:
            p.grad = None  # stage 2 keeps only the shard: the full gradients go as soon as they are packed
        shard = self.grad_shards[b]
        low = self.reduce_dtype is not None and self.reduce_dtype != work.dtype
        if low:
            work = work.to(self.reduce_dtype)
        direct = b not in self._written and not low
        target = shard if direct else torch.empty(shard.shape, dtype=work.dtype, device=work.device)
        comm.reduce_scatter(target, work, op="avg", group=self.group, algorithm=self.algorithm)
        if b in self._written:
            shard.add_(target)
        elif not direct:
            shard.copy_(target)
        self._written.add(b)
        self.launches += 1
