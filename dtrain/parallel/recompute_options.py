"""What activation recomputation can be told, without torch: the modes, the op kinds a selective block keeps,
and the text of the blocks it applies to (:mod:`dtrain.parallel.recompute` does the recomputing). The training
configuration checks its options against these before any rank starts, so a bad value costs no torch import."""

from __future__ import annotations

__all__ = ["DEFAULT_KEEP", "MODES", "OP_KINDS", "parse_layers"]

MODES = ("none", "full", "selective")
OP_KINDS = ("attention", "matmul", "norm", "elementwise")
DEFAULT_KEEP = ("matmul",)  # what "selective" keeps when given neither layers nor ops


def parse_layers(text: str) -> int | list[int] | None:
    """The ``layers`` of :func:`checkpoint_activations` from their config text: ``""`` every block,
    ``"every:K"`` every K-th block (0, K, 2K, ...), or comma-separated block indices ``"0,2,5"``; ValueError
    naming the accepted forms otherwise."""
    text = text.strip()
    if not text:
        return None
    accepted = "accepted: '' (every block), 'every:K' (K >= 1) or block indices like '0,2,5'"
    if text.startswith("every:"):
        k = text.removeprefix("every:").strip()
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"layers {text!r}: {accepted}")
        return int(k)
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"layers {text!r}: {accepted}")
    return [int(p) for p in parts]
