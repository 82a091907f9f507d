"""A training step's compute as the sum of its operations, each priced by what the device measured.

A layer of one micro-batch on one device runs (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", section 3.2 and appendix; Dao 2023, "FlashAttention-2"):

- matrix products: the query/key/value projection (grouped key-value heads), the attention output, and the MLP
  (two matrices, or three for SwiGLU), split over the tensor-parallel ranks; backward runs each twice over (the
  input's gradient and the weight's);
- the attention core as one fused kernel (flash attention): ``2 b s^2 h / t`` FLOPs forward for a causal mask
  (half the scores computed), ``2.5x`` that backward (the backward recomputes the scores);
- memory-bound element-wise work: two norms, two residual additions, the rotary embedding, the MLP's
  activation, each reading and writing ``b s h``-sized tensors (bytes, not FLOPs), about twice that backward;
- on the first stage the embedding lookup, on the last the logits (a ``b s x h x V / t`` product) and the
  softmax cross-entropy over them (memory-bound);
- under mixed precision with float32 master weights, the cast of every local weight to 16 bits once a
  micro-batch (PyTorch autocast's weight cache);
- recomputation adds the layer's forward again (full) or the attention core's (selective) to backward.

Each matrix product is priced at the FLOP rate measured for the nearest measured shape (``dtrain bench
compute``), the attention at the rate measured for the nearest sequence length and head size, memory-bound work
at the measured copy bandwidth. The optimizer step is priced at the measured fused-AdamW rate. A
:class:`ComputeProfile` holds the measurements of one device; where none exists the simulator uses a single
efficiency (:class:`dtrain.sim.step.StepConfig`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.sim.model import Layout, ModelSpec

__all__ = ["ComputeProfile", "StageCompute", "load_profile", "packaged_profile", "profile", "stage_compute"]

#: element-wise bytes of one layer's forward, in units of ``b s h`` values: two norms (read, write: 4), two
#: residual additions (read two, write one: 6), the rotary embedding of queries and keys (read, write: 2 x 2)
ELEMENTWISE_PER_HIDDEN = 14.0
#: the MLP activation reads its inputs and writes its output: 3 (SwiGLU: gate, up, product) or 2 (GELU) per
#: ``b s ffn`` value
ACTIVATION_PER_FFN = {True: 3.0, False: 2.0}
#: backward of the element-wise work moves about twice the forward's bytes (gradients in and out, inputs again)
BACKWARD_MEMORY_FACTOR = 2.0
#: flash attention's backward costs 2.5x its forward (Dao 2023, section 3.1: five matrix products against two)
ATTENTION_BACKWARD_FACTOR = 2.5
#: bytes a value of the logits costs in the loss: the 16-bit logits read and the float32 log-softmax written and
#: read forward, its gradient written and read back in 16 bits backward
LOSS_BYTES_PER_LOGIT = 16.0


@dataclass(frozen=True)
class ComputeProfile:
    """What one device measured (``dtrain bench compute``): matrix-product rates by shape, flash-attention rates
    by sequence length and head size, copy bandwidth, and the fused AdamW rate."""

    device: str
    matmul: tuple[tuple[int, int, int, float], ...]  # (m, n, k, FLOP/s)
    attention: tuple[tuple[int, int, float, float], ...]  # (seq, head_dim, forward FLOP/s, backward FLOP/s)
    copy_bytes_per_s: float
    adam_params_per_s: float
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.matmul or not self.attention:
            raise ValueError(f"compute profile of {self.device!r}: needs matmul and attention measurements")
        rates = [r[3] for r in self.matmul] + [x for r in self.attention for x in r[2:]]
        rates += [self.copy_bytes_per_s, self.adam_params_per_s]
        if not all(isinstance(r, int | float) and math.isfinite(r) and r > 0 for r in rates):
            raise ValueError(f"compute profile of {self.device!r}: every rate must be a positive number")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "compute profile") -> ComputeProfile:
        try:
            return cls(
                device=str(data["device"]),
                matmul=tuple((int(r["m"]), int(r["n"]), int(r["k"]), float(r["flops_per_s"])) for r in data["matmul"]),
                attention=tuple(
                    (
                        int(r["seq"]),
                        int(r["head_dim"]),
                        float(r["forward_flops_per_s"]),
                        float(r["backward_flops_per_s"]),
                    )
                    for r in data["attention"]
                ),
                copy_bytes_per_s=float(data["copy_bytes_per_s"]),
                adam_params_per_s=float(data["adam_params_per_s"]),
                dtype=str(data.get("dtype", "bfloat16")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: not a dtrain bench compute profile ({type(exc).__name__}: {exc})") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "matmul": [{"m": m, "n": n, "k": k, "flops_per_s": r} for m, n, k, r in self.matmul],
            "attention": [
                {"seq": s, "head_dim": d, "forward_flops_per_s": f, "backward_flops_per_s": b}
                for s, d, f, b in self.attention
            ],
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "adam_params_per_s": self.adam_params_per_s,
        }

    def matmul_s(self, m: int, n: int, k: int) -> float:
        """Seconds of an ``(m, k) x (k, n)`` product: its FLOPs at the rate of the measured shapes nearest in log
        space (the geometric mean of the rates of the nearest few, weighted by inverse distance)."""
        flops = 2.0 * m * n * k
        if flops == 0:
            return 0.0
        point = (math.log(m), math.log(n), math.log(k))
        near = sorted(
            (math.dist(point, (math.log(a), math.log(b), math.log(c))), rate) for a, b, c, rate in self.matmul
        )
        return flops / _blend(near[:4])

    def attention_s(self, tokens: int, seq: int, heads: int, head_dim: int, backward: bool) -> float:
        """Seconds of causal flash attention over ``tokens`` tokens in sequences of ``seq``, ``heads`` heads of
        ``head_dim``: forward ``2 tokens seq heads head_dim`` FLOPs (half of the scores), backward 2.5x."""
        flops = 2.0 * tokens * seq * heads * head_dim * (ATTENTION_BACKWARD_FACTOR if backward else 1.0)
        point = (math.log(seq), math.log(head_dim))
        near = sorted(
            (math.dist(point, (math.log(s), math.log(d))), b if backward else f) for s, d, f, b in self.attention
        )
        return flops / _blend(near[:2])


def _blend(near: list[tuple[float, float]]) -> float:
    """A rate from ``(distance, rate)`` pairs: exact where one is at distance 0, else inverse-distance weights
    over log rates."""
    if near[0][0] < 1e-9:
        return near[0][1]
    weights = [1.0 / d for d, _ in near]
    return math.exp(sum(w * math.log(r) for w, (_, r) in zip(weights, near, strict=True)) / sum(weights))


def load_profile(path: str | os.PathLike) -> ComputeProfile:
    """A profile written by ``dtrain bench compute --profile-out``; ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the compute profile: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a dtrain bench compute profile (a JSON object)")
    return ComputeProfile.from_dict(data, str(path))


PROFILES = Path(__file__).with_name("profiles")


def profile(name_or_path: str | os.PathLike) -> ComputeProfile:
    """A profile file, or the name of one shipped with dtrain (``h100-sxm``: ``dtrain/sim/profiles/NAME.json``)."""
    shipped = PROFILES / f"{name_or_path}.json"
    if not Path(name_or_path).exists() and shipped.exists():
        return load_profile(shipped)
    if not Path(name_or_path).exists():
        names = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise ValueError(f"{name_or_path}: no such profile file, nor a profile shipped with dtrain ({names})")
    return load_profile(name_or_path)


def packaged_profile(device_name: str) -> ComputeProfile | None:
    """The profile measured on a device of this name shipped with dtrain (``dtrain/sim/profiles/``), or None."""
    for path in sorted(PROFILES.glob("*.json")):
        profile = load_profile(path)
        if profile.device == device_name:
            return profile
    return None


@dataclass(frozen=True)
class StageCompute:
    """Seconds of one micro-batch's forward and backward on one device of a stage, recomputation included, and
    its share spent in matrix products, attention and memory-bound work."""

    forward_s: float
    backward_s: float
    matmul_s: float
    attention_s: float
    memory_s: float


def _layer(model: ModelSpec, layout: Layout, profile: ComputeProfile) -> tuple[float, float, float, float, float]:
    """(forward matmul, forward attention, forward memory, backward matmul, backward attention) seconds of one
    layer; backward memory is the forward's times :data:`BACKWARD_MEMORY_FACTOR`."""
    t, s, h, tp = layout.micro_batch * model.sequence, model.sequence, model.hidden, layout.tp
    head_dim = h // model.heads
    heads, kv = model.heads // tp, max(1, model.key_value_heads // tp)
    ffn = model.ffn // tp
    shapes = [(t, (heads + 2 * kv) * head_dim, h), (t, h, heads * head_dim)]  # qkv, attention output
    shapes += [(t, 2 * ffn, h), (t, h, ffn)] if model.gated_mlp else [(t, ffn, h), (t, h, ffn)]
    forward = sum(profile.matmul_s(m, n, k) for m, n, k in shapes)
    # backward: the input's gradient (m x n) x (n x k) and the weight's (k x m) x (m x n)
    backward = sum(profile.matmul_s(m, k, n) + profile.matmul_s(k, n, m) for m, n, k in shapes)
    attention = profile.attention_s(t, s, heads, head_dim, backward=False)
    attention_back = profile.attention_s(t, s, heads, head_dim, backward=True)
    values = t * h * ELEMENTWISE_PER_HIDDEN / (tp if layout.sequence_parallel else 1)
    values += t * ffn * ACTIVATION_PER_FFN[model.gated_mlp]
    memory = values * model.bytes_per_value / profile.copy_bytes_per_s
    return forward, attention, memory, backward, attention_back


def stage_compute(model: ModelSpec, layout: Layout, profile: ComputeProfile, stage: int) -> StageCompute:
    """One micro-batch of pipeline stage ``stage`` on one of its devices (see the module docstring)."""
    fm, fa, fmem, bm, ba = _layer(model, layout, profile)
    layers = model.layers // layout.pp
    recompute = {"none": 0.0, "selective": fa, "full": fm + fa + fmem}[layout.recompute]
    t, h, tp = layout.micro_batch * model.sequence, model.hidden, layout.tp
    forward = layers * (fm + fa + fmem)
    backward = layers * (bm + ba + BACKWARD_MEMORY_FACTOR * fmem + recompute)
    matmul, attention = layers * (fm + bm), layers * (fa + ba)
    memory = layers * (1 + BACKWARD_MEMORY_FACTOR) * fmem
    # the 16-bit copies of the stage's float32 weights, made once a micro-batch's forward
    local = model.parameters / (tp * layout.pp)
    cast = local * (4 + model.bytes_per_value) / profile.copy_bytes_per_s
    forward += cast
    memory += cast
    if model.vocab and stage == layout.pp - 1:  # the logits and the loss
        v = model.vocab // tp
        logits, logits_back = profile.matmul_s(t, v, h), profile.matmul_s(t, h, v) + profile.matmul_s(h, v, t)
        loss = t * v * LOSS_BYTES_PER_LOGIT / profile.copy_bytes_per_s
        forward += logits + loss / 2
        backward += logits_back + loss / 2
        matmul += logits + logits_back
        memory += loss
    if model.vocab and stage == 0:  # the embedding's lookup forward and its gradient's scatter backward
        lookup = t * h * model.bytes_per_value / profile.copy_bytes_per_s
        forward += lookup
        backward += 2 * lookup
        memory += 3 * lookup
    return StageCompute(forward_s=forward, backward_s=backward, matmul_s=matmul, attention_s=attention, memory_s=memory)
