"""Backward split in two: the input gradient now (B), the linear layers' weight gradients later (W).

Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR) run a micro-batch's
backward as B, which computes only what the previous stage waits for, and W, which computes the weight
gradients whenever the stage would otherwise idle. The paper's Megatron-LM implementation does it with a
weight-gradient store, as here: during B each attached linear layer computes ``grad_input = grad_output @ W``
only and pushes ``(input, grad_output)`` into the store under the current micro-batch; :meth:`WeightGradStore.
flush` (W) runs the deferred GEMMs ``grad_W = grad_output^T @ input`` (and bias sums) of that micro-batch,
accumulating into ``.grad``. Every other parameter (norms, embeddings, a row-parallel bias added after its
all-reduce) gets its gradient in B from autograd as usual.

:meth:`WeightGradStore.attach` routes a module's ``nn.Linear`` layers and its tensor-parallel linears
(:mod:`dtrain.parallel.tensor_parallel`: column, row, vocabulary head; their weight gradient needs only local
tensors, so it defers too) through :func:`linear`. Outside :meth:`WeightGradStore.deferring` the layers compute
their weight gradients at once, as plain autograd does, so the same modules train unchanged in any other step.
Under ``torch.autocast`` the layer computes in the autocast dtype, as ``F.linear`` would, and its gradients come
back in the dtypes of the input and the parameters.

Gradient-accumulation fusion (Megatron-LM's ``--gradient-accumulation-fusion``, its
``LinearWithGradAccumulationAndAsyncCommunication``): with :attr:`WeightGradStore.accumulate_in_place` set, an
attached layer's backward outside the deferral adds its weight gradient into an existing ``.grad`` in the GEMM
itself (beta = 1), as W does: over micro-batches the gradient is not made in a temporary and then added by a second
pass, which on a thin micro-batch moves more bytes than the product. A 16-bit product under autocast accumulates
into a float32 ``.grad`` the same way on CUDA (``torch.addmm(..., out_dtype=torch.float32)``), never rounded to 16
bits on the way. Autograd then never sees that weight's gradient, so hooks on its accumulation (a data-parallel
bucket's, ZeRO-2's) do not run: set it only where gradients are reduced after the backward. A store made with
``defers=False`` only fuses: its layers run plain ``F.linear`` (autograd's own accumulation) for a call whose product
has fewer than :attr:`WeightGradStore.min_macs` multiply-adds. The autograd function is Python, tens of microseconds
of host time a layer and micro-batch, which an eager step that the host paces pays in full:
:data:`EAGER_FUSION_MACS` is where the product's own time covers it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EAGER_FUSION_MACS", "WeightGradStore", "linear"]

#: Multiply-adds (rows x in x out) from which an eager call fuses its accumulation: 2^32, about 15 us of an H100's
#: bf16 product. Eager pipelines on 4 H100s with every call fused: Llama 1B (4096-row micro-batches, 4.3e9-6.9e10 a
#: layer) 1.13x faster, 16 x Linear(4096) at 256-512 rows (4.3e9-8.6e9) 1.02-1.04x; at 64 rows (1.1e9), where the host
#: paces the step, 0.61-0.78x at m = 16 (one launch, the host's issue time up by a fifth to a third).
EAGER_FUSION_MACS = 2**32


class WeightGradStore:
    """Deferred weight-gradient GEMMs, grouped by a key (a (chunk, micro-batch) pair of a pipeline stage)."""

    def __init__(self, *, accumulate_in_place: bool = False, defers: bool = True, min_macs: int = 0) -> None:
        self._pending: dict[Hashable, list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]]] = {}
        self._key: Hashable | None = None
        #: outside the deferral, add each weight gradient into its existing ``.grad`` in the GEMM (see the module)
        self.accumulate_in_place = accumulate_in_place
        #: whether a backward may defer (zero-bubble schedules); False: the store only fuses accumulation
        self.defers = defers
        #: with ``defers`` False, a call's product of fewer multiply-adds runs as plain ``F.linear``
        self.min_macs = min_macs
        #: weight gradients added in place outside the deferral, since the store was made
        self.fused = 0

    def attach(self, module: nn.Module) -> int:
        """Route ``module``'s linear layers through this store; returns how many were attached.

        ``nn.Linear`` layers get an instance ``forward`` calling :func:`linear`; layers that call :func:`linear`
        themselves (the tensor-parallel ones) get their ``weight_grad_store`` set.
        """
        count = 0
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                sub.forward = types.MethodType(_linear_forward, sub)
            elif not hasattr(sub, "weight_grad_store"):
                continue
            sub.weight_grad_store = self
            count += 1
        return count

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a layer's call on ``x`` goes through the store's autograd function (else plain ``F.linear``)."""
        if self.defers:
            return True
        return self.accumulate_in_place and x.numel() // max(x.shape[-1], 1) * weight.numel() >= self.min_macs

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Within it, the backward of attached layers pushes their weight-gradient work under ``key``."""
        previous, self._key = self._key, key
        try:
            yield
        finally:
            self._key = previous

    def push(self, weight: nn.Parameter, bias: nn.Parameter | None, inp: torch.Tensor, grad: torch.Tensor) -> bool:
        """Keep one layer's (input, grad_output) for later; False (nothing kept) outside :meth:`deferring`. The
        tensors are kept detached: the input's autograd history (the step's graph, with its parameters' gradient
        accumulators) must not outlive the backward that pushed it, which a CUDA graph's capture would see as a
        dependency on work outside it."""
        if self._key is None or not self.defers:
            return False
        self._pending.setdefault(self._key, []).append((weight, bias, inp.detach(), grad.detach()))
        return True

    def pending(self, key: Hashable | None = None) -> int:
        """How many layers' weight gradients wait (under ``key``, or in all)."""
        if key is not None:
            return len(self._pending.get(key, ()))
        return sum(len(v) for v in self._pending.values())

    def take(self, key: Hashable) -> list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]]:
        """Remove and return what waits under ``key``: (weight, bias, input, grad_output) per layer, in the order the
        backward pushed them (a CUDA graph's capture keeps them: its replays rewrite these tensors in place)."""
        return self._pending.pop(key, [])

    def flush(self, key: Hashable) -> None:
        """W: run the deferred weight-gradient GEMMs (and bias sums) of ``key``, accumulating into ``.grad``."""
        self.run(self._pending.pop(key, ()))

    @staticmethod
    @torch.no_grad()
    def run(entries) -> None:
        """The weight-gradient GEMMs (and bias sums) of ``entries`` (as :meth:`take` returns them), accumulating into
        ``.grad``; the entries are kept. Without autograd: a layer's input requires grad, and a GEMM recorded on it
        would tie ``.grad`` to the step's autograd graph and keep that graph alive."""
        for weight, bias, inp, grad in entries:
            if _fused_accumulate(weight, inp, grad):
                if bias is not None:
                    _accumulate(bias, grad.reshape(-1, grad.shape[-1]).sum(0))
                continue
            grad_w, grad_b = _weight_grads(inp, grad, bias is not None)
            _accumulate(weight, grad_w)
            if bias is not None:
                _accumulate(bias, grad_b)

    def clear(self) -> None:
        """Drop every deferred gradient (after a failed step)."""
        self._pending.clear()


def _fused_accumulate(weight: nn.Parameter, inp: torch.Tensor, grad: torch.Tensor) -> bool:
    """``weight.grad += grad_output^T @ input`` as one GEMM with beta = 1, where ``weight.grad`` exists: no (out, in)
    temporary and no separate pass to add it, which for a thin micro-batch costs more memory traffic than the GEMM
    itself. Every operand of one dtype: ``addmm_``; 16-bit operands into a float32 gradient on CUDA: ``addmm`` with
    ``out_dtype`` into the gradient (where this torch has it). False (nothing done) otherwise."""
    acc = weight.grad
    if acc is None or inp.dtype != grad.dtype or not acc.is_contiguous():
        return False
    a, b = grad.reshape(-1, grad.shape[-1]).t(), inp.reshape(-1, inp.shape[-1])
    if acc.dtype == inp.dtype:
        acc.addmm_(a, b)
        return True
    if not _mixed_addmm(acc, inp):
        return False
    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return True


#: device -> whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` adds 16-bit products into c there
_MIXED: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _mixed_addmm(acc: torch.Tensor, inp: torch.Tensor) -> bool:
    """Whether a float32 ``acc`` can take ``inp``'s 16-bit products in place on its device: CUDA, and a check of a
    small product against its float32 sum, run once a device and dtype (never inside a CUDA graph's capture, where
    the answer is only taken)."""
    if acc.dtype != torch.float32 or inp.dtype not in (torch.bfloat16, torch.float16) or acc.device.type != "cuda":
        return False
    key = (acc.device.type, acc.device.index, inp.dtype)
    if key not in _MIXED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _MIXED[key] = _check_mixed_addmm(acc.device, inp.dtype)
    return _MIXED[key]


def _check_mixed_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(shape, generator=gen).to(device, dtype) for shape in ((32, 48), (48, 16)))
    c = torch.randn(32, 16, generator=gen).to(device)
    want = c + a.float() @ b.float()
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(c, want, rtol=1e-3, atol=1e-3))


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _weight_grads(inp: torch.Tensor, grad: torch.Tensor, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = grad.reshape(-1, grad.shape[-1])  # (N, out)
    x = inp.reshape(-1, inp.shape[-1])  # (N, in)
    return g.t() @ x, (g.sum(0) if with_bias else None)  # (out, in), (out,)


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight (and bias) gradient to a store while it defers."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):  # noqa: ANN001
        device = x.device.type
        xc, wc, bc = x, weight, bias
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            dtype = torch.get_autocast_dtype(device)
            xc, wc = x.to(dtype), weight.to(dtype)
            bc = bias.to(dtype) if bias is not None else None
        y = F.linear(xc, wc, bc)  # operands of the autocast dtype already: autocast casts nothing more
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.weight, ctx.bias, ctx.x_dtype = store, weight, bias, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        xc, wc = ctx.saved_tensors
        grad_x = (grad @ wc).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        wants_w, wants_b = ctx.needs_input_grad[1], ctx.bias is not None and ctx.needs_input_grad[2]
        if not (wants_w or wants_b):
            return grad_x, None, None, None
        if wants_w and ctx.store.push(ctx.weight, ctx.bias if wants_b else None, xc, grad):
            return grad_x, None, None, None
        if wants_w and ctx.store.accumulate_in_place and _fused_accumulate(ctx.weight, xc, grad):
            ctx.store.fused += 1
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias.dtype) if wants_b else None
            return grad_x, None, grad_b, None
        grad_w, grad_b = _weight_grads(xc, grad, wants_b)
        return (
            grad_x,
            grad_w.to(ctx.weight.dtype) if wants_w else None,
            grad_b.to(ctx.bias.dtype) if wants_b else None,
            None,
        )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, store: WeightGradStore | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with a ``store``, its weight gradient deferrable to it (see the module)."""
    if store is None or not torch.is_grad_enabled() or not store.takes(x, weight):
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, self.weight_grad_store)
