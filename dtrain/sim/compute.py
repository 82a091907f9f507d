"""A training step's compute priced operation by operation: the matrix products, the attention core, the
memory-bound element-wise work, the embedding, the logits and the optimizer, each on a per-device model.

Operations of one transformer layer and one micro-batch on one tensor-parallel rank (``T = b s`` tokens, ``t``
ranks, ``d = h / a`` the head width; Megatron-LM's layer, Shoeybi et al. 2019, section 3; Narayanan et al. 2021,
appendix, for the FLOP counts):

- matrix products ``(m, n, k)``, ``2 m n k`` FLOPs: QKV ``(T, (h + 2 kv d) / t, h)`` (grouped key/value heads),
  the attention output ``(T, h, h / t)``, the MLP ``(T, f / t, h)`` (twice that width when gated, SwiGLU) and
  ``(T, h, f / t)``; backward runs each twice, the input gradient ``(m, k, n)`` and the weight gradient
  ``(k, n, m)``;
- the attention core: flash attention (Dao 2023, "FlashAttention-2") ``4 b s^2 h / t`` FLOPs forward halved
  for the causal mask, backward 2.5 times the forward (it recomputes the scores), on a context-parallel rank
  (``ModelSpec.context_shards`` = ``cp``, :func:`dtrain.sim.model.context_view`) ``4 b (s / cp) s h / t`` halved,
  as ``cp`` kernels, one on each shard's keys (Transformer Engine's ring: the queries' two pieces, one from each
  end of the sequence, even out the causal mask's work over the ranks); or Megatron's unfused core,
  two batched products ``(s, s, d)`` and ``(s, d, s)`` over ``b a / t`` heads and the fused
  scale-mask-softmax and dropout over ``b a s^2 / t`` scores (9 bytes each forward, 11 backward);
- memory-bound work in bytes: two layer norms (read and write ``2 T h`` each), two bias-dropout-residual adds
  (``7 T h``: input, residual, output and a one-byte mask), the activation (``4 T f / t``, ``6 T f / t``
  gated); split over ``t`` only with sequence parallelism (Korthikanti et al. 2022, section 4.2.2), otherwise
  each rank repeats them; backward moves twice the forward's bytes; each micro-batch's weight gradients are
  added into 32-bit gradients (Megatron-LM's ``main_grad``: 8 bytes a weight, read and written), unless the
  weight-gradient product adds them itself (``fused_accumulation``: Megatron-LM's
  ``--gradient-accumulation-fusion``, the product's output accumulated into ``main_grad`` with beta = 1, no pass
  of its own);
- the first stage looks up the embedding (``4 T h`` bytes forward, and backward touches the ``V / t`` rows of
  its gradient); the last stage runs the final norm, the logits ``(T, V / t, h)`` and the vocabulary-parallel
  cross-entropy (10 bytes a logit forward, 6 backward);
- recomputation: full runs every layer's forward again before its backward; selective runs the attention core's
  forward again (nothing with flash attention, whose backward recomputes by design).

FP8 linear layers (``Layout.fp8``; Transformer Engine's ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP``
under ``fp8_autocast``): the QKV, attention-output and both MLP products, forward and backward, run in 8-bit
floating point at the device's FP8 rate; the attention core, the logits and the memory-bound work stay 16-bit.
The products need their operands in 8 bits and, for Hopper's FP8 tensor cores, the backward's operands
transposed, so each micro-batch also moves (Transformer Engine's ``cast_transpose`` kernels):

- forward, the 8-bit transpose of each product's input, kept for the weight gradient (read 1, write 1 a value;
  the norms and the activation write their outputs in 8 bits, fused), and the attention output cast to 8 bits
  (read 2, write 1);
- backward, each product's output gradient cast to 8 bits with its transpose (read 2, write 2 a value);
- the weights cast to 8 bits with their transpose once a step, on the first micro-batch (read 2, write 2 a
  weight; with 8-bit weights, ``Layout.fp8_params``, only the transpose: read 1, write 1), priced here as that
  step's share a micro-batch.

``kernels = "megatron-lm"`` prices the layer as Megatron-LM of 2021-2022 runs it (commit de7dc40, the code of
Narayanan et al. 2021, ``examples/sc21``; the same lines in mid-2022, the code of Korthikanti et al. 2022), on top
of the operations above (:data:`MEGATRON_LM_KERNELS`):

- QKV's bias is added apart from its product (``ColumnParallelLinear`` calls ``F.linear`` on a 3-D input, which
  PyTorch runs as ``matmul`` and then ``add_``: read and write ``4`` bytes an output value), and its gradient is a
  sum over the tokens (read ``2``); the backward of ``split_tensor_along_last_dim`` concatenates the query, key
  and value gradients (read and write ``4``);
- ``baddbmm``'s ``alpha`` (``1 / norm_factor``) scales the query and key gradients in a separate pass (PyTorch's
  ``derivatives.yaml``: ``grad.bmm(batch2.transpose(1, 2)) * alpha``; read and write ``4`` bytes a value);
- the context is copied back to ``[s, b, h]`` (``context_layer.permute(2, 0, 1, 3).contiguous()``: ``4 T h / t``);
- the fused causal softmax (``ScaledUpperTriangMaskedSoftmax``, for ``16 < s <= 2048``) reads only the lower
  triangle of the scores, forward (scores) and backward (gradient and probabilities), and writes every score;
  with attention dropout (``torch.nn.Dropout``: read 2, write 2 and a one-byte mask; backward the same) 8 bytes a
  score forward and 9 backward; longer sequences take the unfused path (``FusedScaleMaskSoftmax.forward``'s
  ``else``: cast to 32 bits, scale, ``masked_fill_``, softmax, cast back: 36 bytes forward, 40 backward, with
  dropout 41 and 45);
- the fused layer norm's backward reads the output gradient and the input twice (``cuComputePartGradGammaBeta``
  and ``cuComputeGradInput``): 10 bytes a value, not 8;
- the word and position lookups, their sum, the embedding dropout and the transpose to ``[s, b, h]``
  (``Embedding.forward``, ``ParallelTransformer.forward``): 23 bytes a value forward, 17 backward; the final
  transpose back to ``[b, s, h]`` (4 forward, 4 backward);
- the cross-entropy on 32-bit logits (``vocab_parallel_cross_entropy(output.float(), labels)`` in
  ``post_language_model_processing``; ``_VocabParallelCrossEntropy``): the cast (read 2, write 4), max (read 4),
  ``sub_``, ``exp`` and ``div_`` in place (read and write 4 each) and the sum (read 4): 38 bytes a logit forward;
  backward ``mul_`` in place (8) and the cast back to 16 bits (read 4, write 2): 14.

``kernels = "dtrain"`` prices the layer as ``dtrain.models`` runs it eagerly under bf16 autocast with 32-bit
weights (``dtrain train --precision bf16``), one operation a kernel, each counted from the aten operations the
block dispatches (``benchmarks/gpu/eager_ops.py``; a test holds the bytes to that recording on an H200):

- the residual stream and the norms stay 32-bit (fused RMS norm: read and write 4 bytes a value, backward 12);
  attention's and the MLP's 32-bit inputs are each cast to 16 bits once for all their products (read 4, write
  2; with :class:`EagerForm` ``shared_inputs`` off, once a product: q, k, v, gate, up), every weight is cast
  anew each forward (6 bytes a weight), and the residual adds take the block's 16-bit output into the 32-bit
  stream (10 bytes a value);
- RoPE unfused (the angles' seven small kernels; per value of q and k: times cos, the negated half, cat, times
  sin, the sum: 20 bytes), grouped-query keys and values read in place by the attention (``enable_gqa``), SiLU
  and its product with up apart;
- backward casts the 32-bit gradients for the down and attention-output products and each cast input's
  gradient back to 32 bits, adds the gradients of one input (16-bit where the input is shared) and of the
  residual (32-bit), copies the head
  gradients contiguous for their products, and runs each forward kernel's backward; each weight gradient is cast
  to 32 bits and added into ``.grad`` (AccumulateGrad: 12 bytes a weight), or with ``fused_accumulation`` (what
  ``dtrain train``'s ``grad_accumulation_fusion = "auto"`` does in a pipeline with ZeRO 0 or 1, and ZB-H1's and
  ZB-V's weight passes always) added by the product itself, no pass of its own;
- the output layer casts its weight and input, ``F.cross_entropy`` casts the logits to 32 bits (6 bytes a
  logit) and runs PyTorch's log-softmax (:data:`LOG_SOFTMAX_BYTES`); backward zeroes the log-probabilities'
  gradient (4), runs the log-softmax's backward and casts the result to 16 bits (6);
- the embedding gathers 32-bit rows; backward zeroes the table's gradient and adds the rows into it.

No FP8, no sequence parallelism, and the attention core is SDPA's (priced as flash attention).

Each operation is priced on a :class:`DeviceCompute`: a roofline of peak dense FLOP/s and memory bandwidth with
efficiencies. A matrix product runs at ``matmul_efficiency`` of peak times its wave efficiency (output tiles of
128 x 128 or 256 x 128 spread over the streaming multiprocessors, the better of the two, as cuBLAS picks among
tile shapes; NVIDIA's "Matrix Multiplication Background User's Guide", wave quantization) plus a fixed
``kernel_s``, and no faster than its bytes allow; a memory-bound operation moves its bytes at
``bandwidth_efficiency`` of the memory's rate. Where ``dtrain bench compute`` measured the device
(:func:`load_curves`, the file ``compute_curves.json`` beside this module), the measured efficiency curves replace
the constants: matrix-product efficiency by FLOPs, attention efficiency by the FLOPs of a forward-and-backward
call (the size the curve was measured at: each pass is priced at its call's efficiency, :data:`ATTENTION_CALL`;
kernels without a mask, a context-parallel ring's on other ranks' keys, on the unmasked curve where measured),
bandwidth efficiency by bytes, each interpolated in the logarithm of the size.

Communication overlapped with compute shares the device with it: a collective's kernels hold multiprocessors
and, on a power-capped GPU, draw watts the products would run on. ``dtrain bench overlap`` measures, for each way
a collective goes (``nvlink`` within a server, ``network`` through NCCL's proxy as between servers) and each
product precision, how much slower a transformer layer's products run while a collective runs beside them
(``product``, x) and how much slower the collective runs (``collective``, y); :class:`Beside` holds them and
:meth:`DeviceCompute.beside_s` prices a collective of ``c`` seconds alone, run under compute, at ``c y (1 - 1/x)``
seconds more compute (the products lose ``1 - 1/x`` of their rate for the ``c y`` seconds the collective takes
beside them). H100 SXM takes H200 SXM's measurement where it has none of its own (the same chip: 132
multiprocessors, a 700 W cap, NVLink 4; NVIDIA H100 and H200 datasheets). A device without a measurement
prices overlapped communication as free.

Attention kernels differ by more than a model's error budget: on one H200 under torch 2.11 (cuDNN 9.19),
FlashAttention-2 as torch carries it takes 1.7-2.0 times as long as cuDNN's fused attention at the same shapes
(``benchmarks/results/bench_compute_attention_{default,flash,cudnn}-h200x1.jsonl``; torch's own choice there is
cuDNN's). A device's attention curves name the kernel that measured them (``attention_kernel``: ``"cudnn"`` for
the measured H100 and H200 curves, ``"fa2"`` for the built-in FlashAttention-2 constants); an attention kernel of
another family (:data:`ATTENTION_KERNELS`, chosen by ``DeviceCompute.kernel``, ``StepConfig.attention_kernel``)
is priced at the device's own price plus the difference between that family's and the device's own family's
device-paced time on a chip that measured both (:data:`ATTENTION_FROM`: the H100 takes the H200's, the same
chip), so a launch-timed curve keeps its launches and gains only the slower kernel's extra device time.

A training step runs its products back to back for seconds, and a power-capped GPU lowers its clock under them.
Where ``benchmarks/training/sustained_products.py`` measured it (the file's ``"sustained"`` entry, by curve), a
device's matrix products are priced at the sustained rate: their compute time times the measured ratio of a
layer's products run back to back for seconds to what the device's curves price them at (one call each at the
device's pace), the mean over the layers measured. It belongs with curves timed at the device's pace: the H200
SXM has it; the H100 SXM, whose curves are launch-timed, has none. A device without the measurement prices
products at its curves' rate.

Built-in constants (no measurement on file): the matrix-product ceiling is the Maximum Achievable Matmul FLOPS
of Bekman's table (S. Bekman, "Machine Learning Engineering", compute/accelerator, bf16: A100 SXM 271.2 of 312
TFLOP/s, H100 SXM 794.5 of 989); H200 SXM takes H100's (same chip and clocks, NVIDIA H200 datasheet). Flash
attention's efficiency is FlashAttention-2's forward and backward on a causal mask, head width 128 (Dao 2023,
figures 5-7: about 190 TFLOP/s on A100, 335 on H100). Bandwidth efficiency: 0.85 of the datasheet rate, what
stream-like copies reach on A100 and H100.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrain.sim.model import EAGER, EagerForm, Layout, ModelSpec, context_view, head_stage, stage_layers

__all__ = [
    "ATTENTION_CALL",
    "ATTENTION_FROM",
    "ATTENTION_KERNELS",
    "CURVES_PATH",
    "DEVICE_COMPUTE",
    "Beside",
    "Curve",
    "DeviceCompute",
    "FA1_FROM",
    "FA1_SPEEDS",
    "KERNELS",
    "LOG_SOFTMAX_BYTES",
    "MEGATRON_FP16_OPTIMIZER_BYTES",
    "MEGATRON_LM_KERNELS",
    "MEGATRON_LM_SOFTMAX_MAX_SEQUENCE",
    "MEASURED_ATTENTION_KERNELS",
    "Op",
    "StageCompute",
    "device_compute",
    "fa1_slowdown",
    "layer_ops",
    "load_curves",
    "optimizer_seconds",
    "price",
    "stage_compute",
    "stage_ops",
]

#: Where ``dtrain bench compute --write-curves`` results live for the simulator to load.
CURVES_PATH = Path(__file__).with_name("compute_curves.json")

#: Families of fused attention kernels the curves can name: cuDNN's fused attention (Transformer Engine's
#: ``FusedAttention`` on Hopper, torch's ``CUDNN_ATTENTION``) and FlashAttention-2 (the ``flash-attn`` package 2.x,
#: torch's ``FLASH_ATTENTION``).
MEASURED_ATTENTION_KERNELS = ("cudnn", "fa2")

#: Every family a step may be priced with: the measured ones and FlashAttention 1.x (the ``flash-attn`` package
#: 1.x, which no torch carries), priced as FlashAttention-2 slowed by :data:`FA1_SPEEDS`' ratio.
ATTENTION_KERNELS = (*MEASURED_ATTENTION_KERNELS, "fa1")

#: FlashAttention's (1.x) and FlashAttention-2's forward-and-backward speed in TFLOP/s, head width 128, by
#: sequence length (the keys a query reads), with and without the causal mask: Dao 2023, "FlashAttention-2",
#: figure 4 (b, d; A100 80GB SXM4) and figure 7 (b, d; H100 80GB SXM5), both kernels timed in one run on one
#: GPU, 16 heads and 16k tokens a call (the figures are the flash-attention repository's
#: ``assets/flash2_{a100,h100}_fwd_bwd_benchmark.png``). The A100's unmasked FlashAttention-2 bar at 512 is hidden
#: under the figure's legend and is left out. A device not here takes :data:`FA1_FROM`'s.
FA1_SPEEDS: dict[str, dict[bool, tuple[tuple[int, float, float], ...]]] = {
    "a100-sxm": {
        True: ((512, 55, 99), (1024, 62, 133), (2048, 69, 155), (4096, 76, 173), (8192, 80, 182), (16384, 83, 189)),
        False: ((1024, 72, 173), (2048, 76, 187), (4096, 80, 196), (8192, 82, 201), (16384, 83, 203)),
    },
    "h100-sxm": {
        True: ((512, 98, 163), (1024, 109, 221), (2048, 108, 265), (4096, 126, 294), (8192, 135, 308),
               (16384, 137, 328)),
        False: ((512, 127, 248), (1024, 127, 294), (2048, 128, 320), (4096, 131, 326), (8192, 137, 335),
                (16384, 139, 338)),
    },
}  # fmt: skip

#: A device that takes another's FlashAttention 1.x figures: the H200 the H100's (the same chip).
FA1_FROM = {"h200-sxm": "h100-sxm"}


def fa1_slowdown(device: str, keys: int, causal: bool = True) -> float:
    """How many times as long a FlashAttention 1.x kernel takes as FlashAttention-2's on ``device`` for attention
    over ``keys`` keys a query: FlashAttention-2's speed over FlashAttention 1.x's (:data:`FA1_SPEEDS`), their
    speeds' ratio interpolated in ``log(keys)`` between the figures' sequence lengths and held at the ends."""
    figures = FA1_SPEEDS.get(device) or FA1_SPEEDS.get(FA1_FROM.get(device, ""))
    if figures is None:
        raise ValueError(f"device {device!r}: no published FlashAttention 1.x speed (dtrain.sim.compute.FA1_SPEEDS)")
    if keys <= 0:
        raise ValueError("pricing FlashAttention 1.x needs the keys a query reads (Op.keys)")
    points = figures[causal]
    relative = Curve(tuple(float(n) for n, _, _ in points), tuple(fa1 / fa2 for _, fa1, fa2 in points))
    return 1.0 / relative(float(keys))


@dataclass(frozen=True)
class Curve:
    """Efficiency (achieved / peak) as a function of an operation's size, interpolated in ``log(size)`` between
    measured points and held at the ends."""

    sizes: tuple[float, ...]
    efficiencies: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.efficiencies):
            raise ValueError("a curve needs as many efficiencies as sizes, at least one")
        if list(self.sizes) != sorted(self.sizes) or any(s <= 0 for s in self.sizes):
            raise ValueError("curve sizes must be positive and increasing")
        if any(not 0 < e <= 1.5 for e in self.efficiencies):
            raise ValueError(f"curve efficiencies must be in (0, 1.5], got {self.efficiencies}")

    def __call__(self, size: float) -> float:
        i = bisect.bisect_left(self.sizes, size)
        if i == 0:
            return self.efficiencies[0]
        if i == len(self.sizes):
            return self.efficiencies[-1]
        lo, hi = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        w = (math.log(size) - lo) / (hi - lo) if hi > lo else 1.0
        return self.efficiencies[i - 1] + w * (self.efficiencies[i] - self.efficiencies[i - 1])


@dataclass(frozen=True)
class Beside:
    """Slowdowns measured by ``dtrain bench overlap``: ``factors`` rows of (path, product precision, product
    slowdown x, collective slowdown y); paths "nvlink", "network" (and "host" on the CPU), precisions "bf16",
    "fp8"."""

    factors: tuple[tuple[str, str, float, float], ...]

    def __post_init__(self) -> None:
        for path, precision, x, y in self.factors:
            if not (x >= 1.0 or math.isclose(x, 1.0, abs_tol=0.05)) or not y > 0:
                raise ValueError(f"beside[{path}][{precision}]: slowdowns must be near or above 1, got {x}, {y}")

    def get(self, path: str, precision: str) -> tuple[float, float] | None:
        """(x, y) for ``path`` and ``precision`` (bf16's where that precision was not measured)."""
        found = {(p, k): (x, y) for p, k, x, y in self.factors}
        return found.get((path, precision)) or found.get((path, "bf16"))


@dataclass(frozen=True, kw_only=True)
class DeviceCompute:
    """How fast one accelerator runs each kind of operation (see the module docstring)."""

    key: str
    peak_flops: float
    memory_bytes_per_s: float
    matmul_efficiency: float
    attention_efficiency: float
    bandwidth_efficiency: float
    sms: int  # streaming multiprocessors: one output tile each at a time
    kernel_s: float = 3e-6  # fixed cost of a kernel: launch, fill and drain
    fp8_peak_flops: float = 0.0  # dense FP8 FLOP/s; 0: the device has no FP8 products
    matmul_curve: Curve | None = None
    fp8_matmul_curve: Curve | None = None
    attention_curve: Curve | None = None
    #: flash attention without a mask (a context-parallel ring's kernels on other ranks' keys); None: the causal curve
    attention_full_curve: Curve | None = None
    bandwidth_curve: Curve | None = None
    beside: Beside | None = None
    #: the products' compute time under a sustained load over the curves' price, 16-bit and FP8 (module docstring)
    sustained: float = 1.0
    fp8_sustained: float = 1.0
    #: the attention kernel family (:data:`ATTENTION_KERNELS`) the attention curves (or constant) measured
    attention_kernel: str = "fa2"
    #: the family priced; None: ``attention_kernel``'s own
    kernel: str | None = None
    #: other families' device-paced curves beside the same chip's own family's, measured in one run: (family,
    #: its causal curve, its unmasked curve, the own family's causal curve, its unmasked curve)
    attention_alternates: tuple[tuple[str, Curve, Curve | None, Curve, Curve | None], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if self.attention_kernel not in MEASURED_ATTENTION_KERNELS:
            raise ValueError(
                f"measured attention kernel {self.attention_kernel!r} is not one of "
                f"{', '.join(MEASURED_ATTENTION_KERNELS)}"
            )
        if self.kernel is not None and self.kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {self.kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")

    def beside_s(self, seconds: float, path: str, *, fp8: bool = False) -> float:
        """Compute seconds lost to a collective that takes ``seconds`` alone and runs beside this device's products
        over ``path`` ("nvlink" or "network"): ``seconds y (1 - 1/x)`` with the measured slowdowns (module
        docstring); 0 with no measurement."""
        factors = self.beside.get(path, "fp8" if fp8 else "bf16") if self.beside is not None else None
        if factors is None or seconds <= 0:
            return 0.0
        x, y = factors
        return seconds * y * max(0.0, 1.0 - 1.0 / x)

    def matmul_s(self, m: int, n: int, k: int, batch: int = 1, itemsize: int = 2, *, fp8: bool = False) -> float:
        """Seconds of ``batch`` products ``(m x k) @ (k x n)``; ``fp8``: 8-bit operands, a 16-bit output, at the
        FP8 rate (its measured curve, else the 16-bit efficiency at the FP8 peak)."""
        flops = 2.0 * m * n * k * batch
        if fp8:
            if not self.fp8_peak_flops:
                raise ValueError(f"device {self.key!r} has no FP8 products (fp8 needs Hopper or later)")
            curve, peak = self.fp8_matmul_curve, self.fp8_peak_flops
            moved = batch * (m * k + k * n + 2 * m * n)
        else:
            curve, peak = self.matmul_curve, self.peak_flops
            moved = itemsize * batch * (m * k + k * n + m * n)
        eff = curve(flops) if curve is not None else self.matmul_efficiency * _wave_efficiency(m, n, batch, self.sms)
        held = self.fp8_sustained if fp8 else self.sustained
        return max(flops / (peak * eff) * held, self.memory_s(moved, fixed=False)) + self.kernel_s

    def attention_s(
        self, flops: float, *, call_flops: float | None = None, causal: bool = True, keys: int = 0
    ) -> float:
        """Seconds of a flash-attention kernel of ``flops``, at the efficiency the curve gives a call of
        ``call_flops`` (default ``flops``): the curves time a forward with its backward as one call, so each
        pass is priced at the efficiency of the whole call it belongs to. ``causal`` False: a kernel without a
        mask, on the unmasked curve where the device has one. ``keys``: the keys a query reads (FlashAttention
        1.x's price, :func:`fa1_slowdown`, depends on it)."""
        if self.kernel == "fa1":
            fa2 = replace(self, kernel="fa2").attention_s(flops, call_flops=call_flops, causal=causal)
            return (fa2 - self.kernel_s) * fa1_slowdown(self.key, keys, causal) + self.kernel_s
        curve = self.attention_curve if causal else (self.attention_full_curve or self.attention_curve)
        eff = curve(call_flops or flops) if curve is not None else self.attention_efficiency
        seconds = flops / (self.peak_flops * eff) + self.kernel_s
        if self.kernel is None or self.kernel == self.attention_kernel:
            return seconds
        for family, other, other_full, own, own_full in self.attention_alternates:
            if family == self.kernel:
                theirs, ours = (other, own) if causal else (other_full or other, own_full or own)
                size = call_flops or flops
                # the other family's extra device time on the chip that measured both
                return seconds + flops / self.peak_flops * (1.0 / theirs(size) - 1.0 / ours(size))
        raise ValueError(
            f"device {self.key!r}: no measurement of attention kernel {self.kernel!r} beside its "
            f"{self.attention_kernel!r} curves (dtrain bench compute --attention-backend)"
        )

    def memory_s(self, nbytes: float, *, fixed: bool = True) -> float:
        """Seconds to move ``nbytes`` through memory (read plus written)."""
        eff = self.bandwidth_curve(nbytes) if self.bandwidth_curve is not None else self.bandwidth_efficiency
        return nbytes / (self.memory_bytes_per_s * eff) + (self.kernel_s if fixed else 0.0)


def _wave_efficiency(m: int, n: int, batch: int, sms: int) -> float:
    """Share of the last wave's multiprocessors busy, the better of 128 x 128 and 256 x 128 output tiles."""
    best = 0.0
    for tm, tn in ((128, 128), (256, 128), (128, 256)):
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        # a tile smaller than the matrix does useless work where the matrix edge cuts it
        used = (m * n * batch) / (tiles * tm * tn)
        waves = math.ceil(tiles / sms)
        best = max(best, used * tiles / (waves * sms))
    return best


_DATASHEETS = "NVIDIA A100, H100 and H200 datasheets"
_MAMF = "Bekman, Machine Learning Engineering, Maximum Achievable Matmul FLOPS table (bf16)"
_FA2 = "Dao 2023, FlashAttention-2, figures 5-7 (causal, head width 128, forward + backward)"

#: Built-in per-device constants, by :data:`dtrain.cluster.devices.DEVICES` key.
DEVICE_COMPUTE: dict[str, DeviceCompute] = {
    "a100-sxm": DeviceCompute(key="a100-sxm", peak_flops=312e12, memory_bytes_per_s=2039e9,
                              matmul_efficiency=271.2 / 312, attention_efficiency=190 / 312,
                              bandwidth_efficiency=0.85, sms=108, source=f"{_DATASHEETS}; {_MAMF}; {_FA2}"),
    "a100-40gb": DeviceCompute(key="a100-40gb", peak_flops=312e12, memory_bytes_per_s=1555e9,
                               matmul_efficiency=271.2 / 312, attention_efficiency=190 / 312,
                               bandwidth_efficiency=0.85, sms=108, source=f"{_DATASHEETS}; {_MAMF}; {_FA2}"),
    "a100-pcie": DeviceCompute(key="a100-pcie", peak_flops=312e12, memory_bytes_per_s=1935e9,
                               matmul_efficiency=252.9 / 312, attention_efficiency=190 / 312,
                               bandwidth_efficiency=0.85, sms=108, source=f"{_DATASHEETS}; {_MAMF}; {_FA2}"),
    "h100-sxm": DeviceCompute(key="h100-sxm", peak_flops=989.4e12, memory_bytes_per_s=3350e9,
                              matmul_efficiency=794.5 / 989, attention_efficiency=335 / 989,
                              bandwidth_efficiency=0.85, sms=132, fp8_peak_flops=1978.9e12,
                              source=f"{_DATASHEETS}; {_MAMF}; {_FA2}"),
    "h200-sxm": DeviceCompute(key="h200-sxm", peak_flops=989.4e12, memory_bytes_per_s=4800e9,
                              matmul_efficiency=794.5 / 989, attention_efficiency=335 / 989,
                              bandwidth_efficiency=0.85, sms=132, fp8_peak_flops=1978.9e12,
                              source=f"{_DATASHEETS}; {_MAMF} (H100's); {_FA2}"),
}  # fmt: skip


def load_curves(path: str | os.PathLike | None = None) -> dict[str, dict[str, Curve | Beside]]:
    """Measured efficiency curves by device key (``{"h100-sxm": {"matmul": Curve, ...}}``) from ``path``
    (default :data:`CURVES_PATH`), under ``"beside"`` the device's :class:`Beside` slowdowns and under
    ``"sustained"`` its products' sustained factors by curve (``{"matmul": 1.08}``) where measured; an empty dict
    where the file does not exist."""
    path = Path(path) if path is not None else CURVES_PATH
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        out = {}
        for key, entry in data["devices"].items():
            out[key] = {
                kind: Curve(tuple(float(s) for s, _ in entry[kind]), tuple(float(e) for _, e in entry[kind]))
                for kind in CURVE_KINDS
                if entry.get(kind)
            }
            kernel = entry.get("attention_kernel")
            if kernel is not None:
                if kernel not in MEASURED_ATTENTION_KERNELS:
                    raise ValueError(
                        f"attention_kernel {kernel!r} is not one of {', '.join(MEASURED_ATTENTION_KERNELS)}"
                    )
                out[key]["attention_kernel"] = kernel
            for kind, factor in (entry.get("sustained") or {}).items():
                if kind not in ("matmul", "matmul-fp8") or not float(factor) > 0:
                    raise ValueError(f"sustained[{kind}]: a positive factor for matmul or matmul-fp8, got {factor}")
                out[key].setdefault("sustained", {})[kind] = float(factor)
            if entry.get("beside"):
                out[key]["beside"] = Beside(tuple(
                    (path, precision, float(f["product"]), float(f["collective"]))
                    for path, by_precision in sorted(entry["beside"].items())
                    for precision, f in sorted(by_precision.items())
                ))  # fmt: skip
        return out
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a compute-curve file ({err}); expected {{'devices': {{KEY: {{...}}}}}}") from err


#: The curves a curve file may hold for a device: the device's own attention family's (``attention``,
#: ``attention-full``) and another family's beside them (``attention-fa2``, ``attention-full-fa2``, ...).
CURVE_KINDS = ("matmul", "matmul-fp8", "attention", "attention-full", "memory",
               *(f"attention{full}-{k}" for k in MEASURED_ATTENTION_KERNELS for full in ("", "-full")))  # fmt: skip

_LOADED: dict[str, dict[str, dict[str, Curve | Beside]]] = {}

#: A device that takes another's :class:`Beside` measurement where it has none (module docstring).
BESIDE_FROM = {"h100-sxm": "h200-sxm"}

#: A device that takes another's attention-kernel differences (module docstring): the same chip.
ATTENTION_FROM = {"h100-sxm": "h200-sxm"}


def _alternates(measured: dict) -> tuple[tuple[str, Curve, Curve | None, Curve, Curve | None], ...]:
    """The other attention families a device's curves hold beside its own family's."""
    own, own_full = measured.get("attention"), measured.get("attention-full")
    if own is None:
        return ()
    return tuple(
        (k, measured[f"attention-{k}"], measured.get(f"attention-full-{k}"), own, own_full)
        for k in MEASURED_ATTENTION_KERNELS
        if f"attention-{k}" in measured and k != measured.get("attention_kernel")
    )


def device_compute(
    peak_flops: float,
    memory_bytes_per_s: float,
    *,
    curves: dict[str, dict[str, Curve | Beside]] | None = None,
    attention_kernel: str | None = None,
) -> DeviceCompute:
    """The compute model of a topology device: the catalogue device of the same peak and memory rate (with its
    measured curves from :func:`load_curves` where there are some), else an unnamed device with A100's
    efficiencies at the given peak and rate; its attention priced as ``attention_kernel``'s family (None: the
    family its curves measured)."""
    if curves is None:
        key = str(CURVES_PATH)
        if key not in _LOADED:
            _LOADED[key] = load_curves()
        curves = _LOADED[key]
    for spec in DEVICE_COMPUTE.values():
        if math.isclose(spec.peak_flops, peak_flops, rel_tol=0.01) and math.isclose(
            spec.memory_bytes_per_s, memory_bytes_per_s, rel_tol=0.01
        ):
            measured = curves.get(spec.key, {})
            beside = measured.get("beside") or curves.get(BESIDE_FROM.get(spec.key, ""), {}).get("beside")
            sustained = measured.get("sustained", {})
            alternates = _alternates(measured) or _alternates(curves.get(ATTENTION_FROM.get(spec.key, ""), {}))
            own = measured.get("attention_kernel", spec.attention_kernel) if "attention" in measured else None
            return replace(
                spec,
                attention_kernel=own or spec.attention_kernel,
                kernel=attention_kernel,
                attention_alternates=alternates if own else (),
                sustained=sustained.get("matmul", 1.0),
                fp8_sustained=sustained.get("matmul-fp8", 1.0),
                matmul_curve=measured.get("matmul"),
                fp8_matmul_curve=measured.get("matmul-fp8"),
                attention_curve=measured.get("attention"),
                attention_full_curve=measured.get("attention-full"),
                bandwidth_curve=measured.get("memory"),
                beside=beside,
            )
    base = DEVICE_COMPUTE["a100-sxm"]
    return replace(base, key="generic", peak_flops=peak_flops, memory_bytes_per_s=memory_bytes_per_s,
                   kernel=attention_kernel)  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One operation: a matrix product ``(m, n, k)`` ``batch`` times, a flash-attention kernel of ``flops``, or
    memory-bound work of ``nbytes``; ``phase`` is "F" (forward), "B" (input gradient) or "W" (weight gradient);
    ``causal`` False: an attention kernel without a mask."""

    name: str
    kind: str  # "matmul", "attention" or "memory"
    phase: str
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    flops: float = 0.0
    nbytes: float = 0.0
    fp8: bool = False  # a matrix product in 8-bit floating point
    causal: bool = True  # an attention kernel under the causal mask
    keys: int = 0  # the keys a query of an attention kernel reads

    @property
    def total_flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch if self.kind == "matmul" else self.flops


def _matmul(name: str, m: int, n: int, k: int, batch: int = 1, *, weight: bool = True, fp8: bool = False) -> list[Op]:
    """A product's forward and its two backward products (no weight gradient for activations x activations)."""
    ops = [Op(name, "matmul", "F", m, n, k, batch, fp8=fp8), Op(name, "matmul", "B", m, k, n, batch, fp8=fp8)]
    ops.append(Op(name, "matmul", "W" if weight else "B", k, n, m, batch, fp8=fp8))
    return ops


def _memory(name: str, forward_bytes: float) -> list[Op]:
    return [Op(name, "memory", "F", nbytes=forward_bytes), Op(name, "memory", "B", nbytes=2 * forward_bytes)]


#: The kernels a layer may be priced with: ``"fused"`` (the module's operations), ``"megatron-lm"`` (Megatron-LM's
#: layer of 2021-2022) or ``"dtrain"`` (``dtrain.models``' eager decoder under bf16 autocast; module docstring).
KERNELS = ("fused", "megatron-lm", "dtrain")

#: Bytes a logit of PyTorch's 32-bit log-softmax moves over a row too long for shared memory
#: (``aten/src/ATen/native/cuda/SoftMax.cu``, ``cunn_SoftMaxForward``: the maximum, the sum of exponentials and
#: the output, each a pass reading the row, the last writing it; ``cunn_SoftMaxBackward``: the gradient's sum, then
#: the gradient and the output read and the input gradient written). Measured on an H200 for Llama 3.2 1B's
#: 128,256 logits a token: 15.6 and 16.5 (``benchmarks/results/eager_ops-llama1b-h200.jsonl``).
LOG_SOFTMAX_BYTES = (16, 16)


def _dtrain_layer_ops(model: ModelSpec, layout: Layout, fused_accumulation: bool, eager: EagerForm) -> list[Op]:
    """The memory-bound operations of one ``dtrain.models`` block and one micro-batch under bf16 autocast with
    32-bit weights (``dtrain train --precision bf16``), each one kernel as eager PyTorch runs it (module
    docstring); ``model.gated_mlp`` picks Llama's block (RMS norm, RoPE, grouped-query heads, SwiGLU), otherwise
    GPT-2's (layer norm, GELU). Under ZeRO-3 the units gather 16-bit weights (``FullyShardedDataParallel``'s
    ``param_dtype``), so the block runs in 16 bits: no casts, a 16-bit residual stream and norms, and the
    gradients go to the shards by ZeRO-3's own reduction. ``eager``: the form of the inputs' casts and of the
    grouped-query heads (:class:`EagerForm`)."""
    b, s, h, a, t = layout.micro_batch, model.sequence, model.hidden, model.heads, layout.tp
    tokens, d, f = b * s, h // a, model.ffn // t
    query, key = tokens * a * d / t, tokens * model.key_value_heads * d / t  # values of q, and of k (and v)
    th = tokens * h
    llama = model.gated_mlp
    matrices = [h * a * d / t, h * model.key_value_heads * d / t, h * model.key_value_heads * d / t, a * d * h / t]
    matrices += [h * f, h * f, f * h] if llama else [h * f, f * h]
    # the 32-bit inputs cast to 16 bits: attention's and the MLP's once each, or one a product (q, k, v, and gate
    # and up, or up alone)
    inputs = 2 if eager.shared_inputs else 5 if llama else 4
    word = 2 if layout.zero_stage == 3 else 4  # bytes a value of the residual stream
    # the sums of the gradients of one input (q's, k's and v's; gate's and up's): 16-bit where the input is shared
    shared_sums = (3 if llama else 2) * [(6 if eager.shared_inputs and word == 4 else 3 * word) * th]
    if word == 2:
        inputs, matrices_cast = 0, []
    else:
        matrices_cast = matrices
    ops: list[Op] = []

    def add(name: str, phase: str, *sizes: float) -> None:
        ops.extend(Op(name, "memory", phase, nbytes=n) for n in sizes)

    add("norms", "F", 2 * word * th, 2 * word * th)  # fused RMS norm (or layer norm), stream in and out
    add("input-casts", "F", *[6 * th] * inputs)  # read 4, write 2
    add("weight-casts", "F", *(6 * w for w in matrices_cast))  # each forward casts every weight anew
    add("residual-adds", "F", *[(2 * word + 2) * th] * 2)  # the stream plus the block's 16-bit output
    if llama:
        angles = tokens // b * d * 4
        # the angles (arange, outer product, cat, cos, sin, two casts), then per q and k: x cos, the negated half,
        # cat, x sin, the sum (grouped-query attention reads the key-value heads in place)
        add("rope", "F", *[angles] * 7, *(n * e for e in (query, key) for n in (4, 2, 4, 4, 6)))
        if eager.repeat_kv and model.key_value_heads != a:
            add("gqa-repeat", "F", 2 * (key + query), 2 * (key + query))  # repeat_interleave of k and v
        add("activation", "F", 4 * tokens * f, 6 * tokens * f)  # silu, then its product with up
    else:
        add("activation", "F", 4 * tokens * f)  # gelu
    # backward: the 32-bit gradients cast for the products (down, attention-out) and each cast input's gradient
    # cast back to 32 bits; the sums of the gradients of one input, the norms, the residual
    add("grad-casts", "B", *[6 * th] * ((2 + inputs) if word == 4 else 0))
    add("grad-adds", "B", *shared_sums, *[3 * word * th] * 2)
    add("norms", "B", 3 * word * th, 3 * word * th)
    # the q gradient and one of the key-value heads' made contiguous for their products (the recording's two;
    # with the heads repeated, q's, k's and v's)
    add("head-copies", "B", 4 * query, *[4 * key] * (2 if eager.repeat_kv and model.key_value_heads != a else 1))
    if llama:
        add("rope", "B", *(n * e for e in (query, key) for n in (4, 2, 4, 4, 6)))
        if eager.repeat_kv and model.key_value_heads != a:
            add("gqa-repeat", "B", 2 * (key + query), 2 * (key + query))  # the sums over the repeated heads
        add("activation", "B", 6 * tokens * f, 6 * tokens * f, 6 * tokens * f)  # two products, silu_backward
    else:
        add("activation", "B", 6 * tokens * f)
    if matrices_cast and not fused_accumulation:  # the weight gradients cast to 32 bits, added into .grad
        add("weight-grad-casts", "W", *(6 * w for w in matrices))
        add("grad-accumulate", "W", 12 * sum(matrices))
    return ops


#: The operations ``kernels = "megatron-lm"`` adds, with the source line each comes from (Megatron-LM commit
#: de7dc40; PyTorch 1.8, the NGC 20.12 container of ``examples/sc21/SRUN.sh``).
MEGATRON_LM_KERNELS = {
    "qkv-bias": "megatron/mpu/layers.py ColumnParallelLinear.forward: F.linear(input_parallel, self.weight, bias) "
    "on [s, b, h]: matmul, then add_ of the bias; its gradient a sum over the tokens",
    "qkv-split": "megatron/model/transformer.py ParallelAttention.forward: split_tensor_along_last_dim(mixed_x_layer, "
    "3); backward concatenates the three gradients",
    "scores-scale": "ParallelAttention.forward: torch.baddbmm(..., alpha=1.0 / self.norm_factor); backward scales "
    "the query and key gradients by alpha apart (PyTorch tools/autograd/derivatives.yaml)",
    "context-copy": "ParallelAttention.forward: context_layer.permute(2, 0, 1, 3).contiguous()",
    "output-transpose": "ParallelTransformer.forward: hidden_states.transpose(0, 1).contiguous() before the final "
    "layer norm",
}

#: The longest sequence Megatron-LM's fused softmax takes (``FusedScaleMaskSoftmax.forward``,
#: ``custom_kernel_constraint``: ``16 < key_seq_len <= 2048``, commit de7dc40).
MEGATRON_LM_SOFTMAX_MAX_SEQUENCE = 2048


def _check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")


def layer_ops(
    model: ModelSpec,
    layout: Layout,
    kernels: str = "fused",
    *,
    fused_accumulation: bool = False,
    eager: EagerForm = EAGER,
) -> list[Op]:
    """One transformer layer's operations on one tensor-parallel rank for one micro-batch (module docstring),
    priced with ``kernels`` (:data:`KERNELS`); ``fused_accumulation``: the weight-gradient products accumulate
    into the 32-bit gradients themselves (no separate pass); ``eager`` (``"dtrain"`` only): the layer's form
    (:class:`EagerForm`)."""
    _check_kernels(kernels)
    model, layout = context_view(model, layout)
    megatron, dtrain = kernels == "megatron-lm", kernels == "dtrain"
    b, s, h, a, t = layout.micro_batch, model.sequence, model.hidden, model.heads, layout.tp
    tokens, d, f = b * s, h // a, model.ffn
    kv = model.key_value_heads
    outside = tokens * h / (t if layout.sequence_parallel else 1)
    fp8 = layout.fp8
    if dtrain and (fp8 or layout.sequence_parallel or layout.attention != "flash"):
        raise ValueError("kernels 'dtrain': dtrain.models runs no FP8, no sequence parallelism, and SDPA attention")
    mlp_in = (2 if model.gated_mlp else 1) * f // t
    ops = [
        *_matmul("qkv", tokens, (h + 2 * kv * d) // t, h, fp8=fp8),
        *_matmul("attention-out", tokens, h, h // t, fp8=fp8),
        *_matmul("mlp-in", tokens, mlp_in, h, fp8=fp8),
        *_matmul("mlp-out", tokens, h, f // t, fp8=fp8),
    ]
    weights = (h * (h + 2 * kv * d) + h * h + (3 if model.gated_mlp else 2) * h * f) / t
    if dtrain:
        ops += _dtrain_layer_ops(model, layout, fused_accumulation, eager)
    else:
        ops += [
            Op("norms", "memory", "F", nbytes=2 * 4 * outside),
            Op("norms", "memory", "B", nbytes=2 * (10 if megatron else 8) * outside),
            *_memory("residual-adds", 2 * 7 * outside),
            *_memory("activation", (6 if model.gated_mlp else 4) * tokens * f / t),
        ]
        if not fused_accumulation:
            ops.append(Op("grad-accumulate", "memory", "W", nbytes=8 * weights))
    if fp8:  # Transformer Engine's casts and transposes (module docstring)
        inputs = tokens * (2 * h + h / t + f / t)  # QKV and MLP-in (gathered), attention-out, MLP-out
        outputs = tokens * ((h + 2 * kv * d) / t + h + mlp_in + h)  # each product's output gradient
        weight_casts = (2 if layout.fp8_params else 4) * weights / layout.microbatches
        ops += [
            Op("fp8-cast", "memory", "F", nbytes=2 * inputs + 3 * tokens * h / t + weight_casts),
            Op("fp8-cast", "memory", "B", nbytes=4 * outputs),
        ]
    heads = b * a // t
    if layout.attention == "flash":
        # a context-parallel rank (model.context_shards = cp) runs cp kernels a pass, one on each shard's keys
        # as they come round the ring, each a cp-th of its queries' work over all the keys: under the causal mask
        # on its own keys, unmasked on the others' (the pieces that the mask would hide are left out)
        forward = 4.0 * b * s * model.keys * h / t * 0.5
        ring = model.context_shards
        keys = model.keys // ring  # each kernel's: one shard's
        for phase, work in (("F", forward / ring), ("B", 2.5 * forward / ring)):
            ops.append(Op("attention", "attention", phase, flops=work, keys=keys))
            ops += [Op("attention", "attention", phase, flops=work, causal=False, keys=keys)] * (ring - 1)
    else:
        ops += _matmul("scores", s, s, d, heads, weight=False) + _matmul("context", s, d, s, heads, weight=False)
        scores = heads * s * s
        forward, backward = 9, 11
        if megatron:
            fused = 16 < s <= MEGATRON_LM_SOFTMAX_MAX_SEQUENCE
            forward, backward = (8, 9) if fused else (41, 45)
        ops += [Op("softmax-dropout", "memory", "F", nbytes=forward * scores),
                Op("softmax-dropout", "memory", "B", nbytes=backward * scores)]  # fmt: skip
    if megatron:
        qkv = tokens * (h + 2 * kv * d) / t
        ops += [
            Op("qkv-bias", "memory", "F", nbytes=4 * qkv),
            Op("qkv-bias", "memory", "B", nbytes=2 * qkv),
            Op("qkv-split", "memory", "B", nbytes=4 * qkv),
            Op("scores-scale", "memory", "B", nbytes=4 * tokens * (h + kv * d) / t),
            Op("context-copy", "memory", "F", nbytes=4 * tokens * h / t),
        ]
    return ops


def _recomputed(ops: list[Op], recompute: str, attention: str) -> list[Op]:
    """The forward operations recomputation runs again in backward."""
    if recompute == "full":
        return [op for op in ops if op.phase == "F"]
    if recompute == "selective" and attention != "flash":
        core = ("scores", "context", "softmax-dropout", "context-copy")
        return [op for op in ops if op.phase == "F" and op.name in core]
    return []


def stage_ops(
    model: ModelSpec,
    layout: Layout,
    stage: int,
    kernels: str = "fused",
    *,
    fused_accumulation: bool = False,
    eager: EagerForm = EAGER,
) -> dict[str, list[Op]]:
    """The operations of pipeline stage ``stage`` for one micro-batch, by what they are: ``"layer"`` (one
    layer's, to be run ``layers`` times), ``"recompute"`` (one layer's recomputed forward), ``"first"``
    (embedding) and ``"last"`` (final norm, logits, cross-entropy); ``kernels`` and ``fused_accumulation`` as
    :func:`layer_ops`."""
    model, layout = context_view(model, layout)
    b, s, h, t, v = layout.micro_batch, model.sequence, model.hidden, layout.tp, model.vocab
    megatron = kernels == "megatron-lm"
    tokens = b * s
    ops = layer_ops(model, layout, kernels, fused_accumulation=fused_accumulation, eager=eager)
    out: dict[str, list[Op]] = {"layer": ops, "recompute": _recomputed(ops, layout.recompute, layout.attention)}
    first = []
    if stage == 0 and v:
        forward, backward = (23, 17) if megatron else (4, 4)
        first = [Op("embedding", "memory", "F", nbytes=forward * tokens * h),
                 Op("embedding", "memory", "B", nbytes=backward * tokens * h + 4 * v * h / t)]  # fmt: skip
        if kernels == "dtrain":  # 32-bit rows gathered; backward zeroes the table's gradient, adds rows, accumulates
            first = [Op("embedding", "memory", "F", nbytes=8 * tokens * h),
                     Op("embedding", "memory", "B", nbytes=4 * v * h / t),
                     Op("embedding", "memory", "B", nbytes=8 * tokens * h),
                     Op("grad-accumulate", "memory", "W", nbytes=12 * v * h / t)]  # fmt: skip
    out["first"] = first
    last = []
    if stage == head_stage(layout) and kernels == "dtrain":
        out["last"] = _dtrain_head_ops(model, layout, fused_accumulation)
        return out
    if stage == head_stage(layout):
        last += _memory("final-norm", 4 * tokens * h / (t if layout.sequence_parallel else 1))
        if megatron:
            last += [Op("output-transpose", "memory", "F", nbytes=4 * tokens * h),
                     Op("output-transpose", "memory", "B", nbytes=4 * tokens * h)]  # fmt: skip
        if v:
            logits = tokens * v / t
            forward, backward = (38, 14) if megatron else (10, 6)
            last += _matmul("logits", tokens, -(-v // t), h)
            last += [Op("cross-entropy", "memory", "F", nbytes=forward * logits),
                     Op("cross-entropy", "memory", "B", nbytes=backward * logits)]  # fmt: skip
    out["last"] = last
    return out


def _dtrain_head_ops(model: ModelSpec, layout: Layout, fused_accumulation: bool) -> list[Op]:
    """``dtrain.models``' final norm, output layer and loss for one micro-batch under bf16 autocast: the norm in 32
    bits, the weight and input cast, the logits cast to 32 bits for ``F.cross_entropy`` (log-softmax, then the
    loss's gather); backward zeroes the log-probabilities' gradient, runs the log-softmax's, casts it to 16 bits for
    the products, and casts and accumulates the weight's gradient. Under ZeRO-3, 16-bit weights and stream as
    :func:`_dtrain_layer_ops`: no casts but the logits'."""
    tokens, h, t, v = layout.micro_batch * model.sequence, model.hidden, layout.tp, model.vocab
    th, cast = tokens * h, layout.zero_stage != 3
    word = 4 if cast else 2
    ops = [
        Op("final-norm", "memory", "F", nbytes=2 * word * th),
        Op("final-norm", "memory", "B", nbytes=3 * word * th),
    ]
    if not v:
        return ops
    logits, weight = tokens * v / t, v * h / t
    forward, backward = LOG_SOFTMAX_BYTES
    if cast:
        ops += [Op("weight-casts", "memory", "F", nbytes=6 * weight), Op("input-casts", "memory", "F", nbytes=6 * th)]
    ops += [
        *_matmul("logits", tokens, -(-v // t), h),
        Op("cross-entropy", "memory", "F", nbytes=6 * logits),  # the cast to 32 bits
        Op("cross-entropy", "memory", "F", nbytes=forward * logits),
        Op("cross-entropy", "memory", "B", nbytes=4 * logits),  # nll_loss_backward's zeroed gradient
        Op("cross-entropy", "memory", "B", nbytes=backward * logits),
        Op("cross-entropy", "memory", "B", nbytes=6 * logits),  # the cast back to 16 bits
    ]
    if cast:
        ops.append(Op("grad-casts", "memory", "B", nbytes=6 * th))
    if cast and not fused_accumulation:
        ops += [
            Op("weight-grad-casts", "memory", "W", nbytes=6 * weight),
            Op("grad-accumulate", "memory", "W", nbytes=12 * weight),
        ]
    return ops


#: An attention pass's FLOPs times this is its forward-and-backward call's (the backward 2.5 times the forward), the
#: size the attention curves are measured by (``dtrain bench compute``)
ATTENTION_CALL = {"F": 3.5, "B": 3.5 / 2.5}


def price(op: Op, device: DeviceCompute) -> float:
    """Seconds of ``op`` on ``device``."""
    if op.kind == "matmul":
        return device.matmul_s(op.m, op.n, op.k, op.batch, fp8=op.fp8)
    if op.kind == "attention":  # at the efficiency of its forward-and-backward call (ATTENTION_CALL)
        return device.attention_s(
            op.flops, call_flops=op.flops * ATTENTION_CALL[op.phase], causal=op.causal, keys=op.keys
        )
    return device.memory_s(op.nbytes)


@dataclass(frozen=True)
class StageCompute:
    """Seconds of one micro-batch on one stage: forward, backward's input gradient (with any recomputation) and
    its weight gradient, and the share of each spent in the first and last stage's extra work."""

    forward_s: float
    backward_s: float
    weight_s: float
    recompute_s: float
    flops: float  # executed, recomputation included
    by_name: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.weight_s


def stage_compute(
    model: ModelSpec,
    layout: Layout,
    stage: int,
    device: DeviceCompute,
    kernels: str = "fused",
    *,
    fused_accumulation: bool = False,
    eager: EagerForm = EAGER,
) -> StageCompute:
    """Seconds of one micro-batch of pipeline stage ``stage`` on ``device`` (all its layers; see
    :func:`stage_ops`, ``kernels``, ``fused_accumulation`` and ``eager`` as :func:`layer_ops`)."""
    model, layout = context_view(model, layout)
    layers = stage_layers(model, layout, stage)
    parts = stage_ops(model, layout, stage, kernels, fused_accumulation=fused_accumulation, eager=eager)
    times = {"F": 0.0, "B": 0.0, "W": 0.0}
    by_name: dict[str, float] = {}
    flops = 0.0
    for what, repeat in (("layer", layers), ("first", 1), ("last", 1)):
        for op in parts[what]:
            seconds = price(op, device) * repeat
            times[op.phase] += seconds
            by_name[op.name] = by_name.get(op.name, 0.0) + seconds
            flops += op.total_flops * repeat
    recompute = 0.0
    for op in parts["recompute"]:
        recompute += price(op, device) * layers
        flops += op.total_flops * layers
    by_name["recompute"] = recompute
    return StageCompute(times["F"], times["B"] + recompute, times["W"], recompute, flops, by_name)


#: Bytes an Adam step reads and writes per parameter it owns: 32-bit master weight, momentum and variance read
#: and written (24), the 16-bit gradient read and the 16-bit weight written (4).
ADAM_BYTES_PER_PARAMETER = 28


#: Bytes Megatron-LM's mixed-precision optimizer step (``Float16OptimizerWithFloat16Params.step``,
#: megatron/optimizer/optimizer.py, 2021-2022) reads and writes per parameter it owns, each pass a memory-bound
#: sweep over the rank's shard: the 16-bit gradients copied into 32-bit main gradients (read 2, write 4), unscaled
#: with the inf/NaN check (``_amp_foreach_non_finite_check_and_unscale_``: read and write 4), their L2 norm for
#: clipping (``multi_tensor_l2norm``: read 4), Apex's fused Adam (32-bit weight, gradient, momentum and variance
#: read, weight, momentum and variance written: 28), the 32-bit weights copied back into the 16-bit model
#: (``multi_tensor_scale``: read 4, write 2) and the 16-bit gradient buffer zeroed (write 2). The clipping
#: product (read and write 4 more) runs only when the norm exceeds the threshold and is left out.
MEGATRON_FP16_OPTIMIZER_BYTES = 6 + 8 + 4 + 28 + 6 + 2


def optimizer_seconds(parameters: float, device: DeviceCompute, nbytes: int = ADAM_BYTES_PER_PARAMETER) -> float:
    """An optimizer step over ``parameters`` owned parameters, ``nbytes`` each (default a fused Adam,
    :data:`ADAM_BYTES_PER_PARAMETER`)."""
    return device.memory_s(parameters * nbytes)
