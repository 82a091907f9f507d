"""All-reduce in one kernel on CUDA symmetric memory: the one-shot and two-shot forms.

Two of our all-reduce schedules are, on the peer transport over NVLink, exactly what one kernel can run with
its barriers inside it (each a signal written into every peer's pad and awaited on the device, no launch of
its own):

- ``one_shot``: one round in which every rank reads every peer's whole buffer and reduces it locally. The
  kernel copies this rank's input into its window, signals, reads and sums the peers' windows, and signals
  again before the window may be written anew.
- ``direct`` (the two-shot form): every rank sums its own block from all peers (a direct reduce-scatter), then
  every rank reads every block from its owner (a direct all-gather).

torch's symmetric-memory kernels (``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` and
``two_shot_all_reduce_out``) implement both, for sums of float32 and bfloat16; they are what vLLM and SGLang run
for small all-reduces. Other reductions and dtypes, the CPU, and a torch without these kernels run the same
schedules through the general pull plan (:func:`dtrain.comm.peer.window.run_pull`), with a barrier and a pass a
round. ``DTRAIN_COMM_FUSED=0`` turns the kernels off.
"""

from __future__ import annotations

import torch

from dtrain.comm.ir.schedule import Collective, Schedule
from dtrain.env import comm_env

__all__ = ["FORMS", "fused_form", "run_fused", "supports"]

#: Our all-reduce schedules that one kernel runs, and the kernel's form.
FORMS = {"one_shot": "one", "direct": "two"}

#: What torch's kernels reduce: sums (``avg`` is a sum and a division) of these dtypes.
_DTYPES = (torch.float32, torch.bfloat16)
_state: dict[str, bool] = {}


def _kernels_present() -> bool:
    if "present" not in _state:
        ops = getattr(torch.ops, "symm_mem", None)
        try:
            _state["present"] = bool(
                torch.cuda.is_available()
                and ops is not None
                and hasattr(ops, "one_shot_all_reduce_copy_out")
                and hasattr(ops, "two_shot_all_reduce_out")
            )
        except Exception:  # a namespace that cannot be asked (CPU builds)
            _state["present"] = False
    return _state["present"]


def supports(algorithm: str, dtype: torch.dtype, op: str, device: torch.device) -> bool:
    """Whether an all-reduce by ``algorithm`` of ``dtype`` with ``op`` on ``device`` runs as one kernel."""
    return (
        algorithm in FORMS
        and device.type == "cuda"
        and dtype in _DTYPES
        and op in ("sum", "avg")
        and comm_env().fused
        and _kernels_present()
    )


def fused_form(schedule: Schedule, work: torch.Tensor, op: str) -> str | None:
    """The kernel form ("one" or "two") that runs ``schedule`` on ``work``, or None (the general plan runs it)."""
    if schedule.collective is not Collective.ALL_REDUCE:
        return None
    if not supports(schedule.algorithm, work.dtype, op, work.device):
        return None
    return FORMS[schedule.algorithm]


def run_fused(form: str, work: torch.Tensor, window) -> torch.Tensor:
    """Sum the flat contiguous ``work`` over the group in place through ``window`` (its group's CUDA window, at
    least ``work``'s size) in the ``form`` :func:`fused_form` gave (an ``avg`` is divided by the caller, as for
    every schedule)."""
    group_name = window.group_name
    mine = window.local(work.dtype, work.numel())
    if form == "one":
        # the kernel copies work into the window before its first barrier, and every element is read from
        # work by the thread that later writes it: work may be the output too
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(mine, work, "sum", group_name, work)
    else:
        mine.copy_(work)
        torch.ops.symm_mem.two_shot_all_reduce_out(mine, "sum", group_name, work)
    return work
