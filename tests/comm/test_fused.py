"""Which all-reduce calls run as one kernel on CUDA symmetric memory (dtrain.comm.peer.fused), and what ``auto``
does with a call the kernel cannot run. The kernels themselves need GPUs (`dtrain bench verify` checks them
against NCCL's result); the one-shot schedule they run is checked on every transport by test_collectives.py."""

from __future__ import annotations

import torch

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.check import check
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.peer import fused


def test_one_shot_is_one_round_every_rank_reducing_every_peer():
    for world in (2, 3, 4, 8):
        schedule = registry.build(Collective.ALL_REDUCE, "one_shot", world)
        report = check(schedule)
        assert report.num_rounds == 1 and report.num_transfers == world * (world - 1)


def test_only_sums_of_float32_and_bfloat16_on_cuda_run_as_one_kernel(monkeypatch):
    monkeypatch.setitem(fused._state, "present", True)  # as on a GPU whose torch has the kernels
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert fused.supports("one_shot", torch.bfloat16, "sum", cuda)
    assert fused.supports("direct", torch.float32, "avg", cuda)
    assert not fused.supports("one_shot", torch.float16, "sum", cuda)
    assert not fused.supports("one_shot", torch.float32, "max", cuda)
    assert not fused.supports("one_shot", torch.float32, "sum", cpu)
    assert not fused.supports("ring", torch.float32, "sum", cuda)
    monkeypatch.setenv("DTRAIN_COMM_FUSED", "0")
    assert not fused.supports("one_shot", torch.float32, "sum", cuda)


def test_a_bfloat16_buffer_of_odd_length_runs_as_one_kernel_only_where_the_exchange_kernel_takes_it(monkeypatch):
    """torch's symmetric-memory kernels refuse a buffer that is not whole 4-byte words ("input size must be at
    least 4-byte aligned"); the exchange kernel copies in 2-byte words. Without Triton, or past the exchange
    kernel's limits (the one-shot's 256 KiB, the two-shot's blocks of equal size), such a call takes the general
    plan, and `auto` NCCL's call."""
    from dtrain.comm.peer import kernels

    monkeypatch.setitem(fused._state, "present", True)
    cuda = torch.device("cuda", 0)
    odd, big_odd = 13, (fused.REDUCE_MAX_BYTES // 2) + 1  # bfloat16 elements: 26 bytes, 256 KiB + 2 bytes
    for triton in (False, True):
        monkeypatch.setattr(kernels, "triton_ready", lambda triton=triton: triton)
        assert fused.supports("one_shot", torch.bfloat16, "sum", cuda, 14, 2)  # whole words: torch's kernel too
        assert fused.supports("one_shot", torch.float32, "sum", cuda, odd, 2)
        assert fused.supports("one_shot", torch.bfloat16, "sum", cuda, odd, 2) is triton
        assert not fused.supports("one_shot", torch.bfloat16, "sum", cuda, big_odd, 2)
        assert fused.supports("direct", torch.bfloat16, "sum", cuda, 3 * 4099, 3) is triton  # blocks alike
        assert not fused.supports("direct", torch.bfloat16, "sum", cuda, 4099, 3)
        schedule = registry.build(Collective.ALL_REDUCE, "one_shot", 2)
        want = "one" if triton else None
        assert fused.fused_form(schedule, torch.zeros(odd, dtype=torch.bfloat16), "sum") is None  # on the CPU
        monkeypatch.setattr(torch.Tensor, "device", property(lambda self: cuda))
        assert fused.fused_form(schedule, torch.zeros(odd, dtype=torch.bfloat16), "sum") == want
        assert fused.fused_form(schedule, torch.zeros(big_odd, dtype=torch.bfloat16), "sum") is None
        monkeypatch.undo()
        monkeypatch.setitem(fused._state, "present", True)


def test_the_general_plan_runs_where_no_kernel_can(monkeypatch):
    monkeypatch.setitem(fused._state, "present", False)  # a torch without the kernels
    work = torch.zeros(8)
    for algorithm in fused.FORMS:
        schedule = registry.build(Collective.ALL_REDUCE, algorithm, 4)
        assert fused.fused_form(schedule, work, "sum") is None
    assert fused.fused_form(registry.build(Collective.ALL_GATHER, "direct", 4), work, "sum") is None


def test_a_combine_with_a_scale_gives_the_bits_of_the_combine_then_the_multiply():
    """``combine(..., scale=)`` (an average's division in the summing pass) equals the sum followed by ``mul_``,
    bit for bit, in every float dtype, with one output or two and with more sources than one kernel reads."""
    from dtrain.comm.peer.kernels import combine

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for count in (1, 3, 5):
            base = torch.randn(1000, generator=g).to(dtype)
            sources = [torch.randn(1000, generator=g).to(dtype) for _ in range(count)]
            want = base.clone()
            for s in sources:
                want.add_(s)
            want.mul_(1.0 / 3)
            mine, other = base.clone(), torch.empty_like(base)
            combine([mine, other], mine, sources, "sum", scale=1.0 / 3)
            assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8)), (dtype, count)
            assert torch.equal(other, want)


def test_a_one_element_tensor_of_any_stride_goes_to_the_kernels_as_its_own_bytes():
    """``x[:, 0]`` of a (1, 2) tensor is contiguous (one element) with stride 2: the kernels' flat byte view is
    its element, not a refused view."""
    from dtrain.comm.peer.kernels import flat_bytes

    base = torch.tensor([[1.5, 2.5]])
    for column in (0, 1):
        x = base[:, column]
        assert x.is_contiguous() and x.stride() == (2,)
        assert torch.equal(flat_bytes(x).view(torch.float32), base[0, column : column + 1])
    y = torch.arange(6, dtype=torch.bfloat16)
    assert flat_bytes(y).numel() == 12 and flat_bytes(y).data_ptr() == y.data_ptr()
    assert flat_bytes(torch.empty(0)).numel() == 0
