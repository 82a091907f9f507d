"""The transport's two paths: one coalesced group per round (NCCL) and one request per message (Gloo).

CI has no GPU, so the NCCL path runs here against a stand-in process group that records what it is asked,
the same calls torch.distributed.batch_isend_irecv makes.
"""

from __future__ import annotations

import pytest
import torch

from dtrain.comm.p2p.transport import TorchP2PTransport


class _Work:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name))


class _Backend:
    def __init__(self, coalesces: bool) -> None:
        self.supports_coalescing = coalesces


class _FakeGroup:
    """Records the point-to-point calls a transport makes."""

    def __init__(self, coalesces: bool) -> None:
        self.coalesces = coalesces
        self.log: list = []

    def _get_backend(self, device):
        return _Backend(self.coalesces)

    def _start_coalescing(self, device):
        self.log.append(("start",))

    def _end_coalescing(self, device):
        self.log.append(("end",))
        return _Work(self.log, "group")

    def send(self, tensors, peer, tag):
        self.log.append(("send", peer, tensors[0].numel()))
        return _Work(self.log, f"send{peer}")

    def recv(self, tensors, peer, tag):
        self.log.append(("recv", peer, tensors[0].numel()))
        return _Work(self.log, f"recv{peer}")


def _transport(group: _FakeGroup) -> TorchP2PTransport:
    t = TorchP2PTransport.__new__(TorchP2PTransport)
    t.group, t.rank, t.world_size, t._global, t._coalesces = group, 0, 3, [0, 1, 2], {}
    return t


def test_a_coalescing_backend_gets_one_group_per_round():
    group = _FakeGroup(coalesces=True)
    pending = _transport(group).start([(1, torch.ones(4))], [(2, torch.ones(3)), (1, torch.ones(2))])
    assert group.log == [("start",), ("send", 1, 4), ("recv", 2, 3), ("recv", 1, 2), ("end",)]
    assert len({id(p.work) for p in pending}) == 1
    assert [(p.peer, p.is_send, p.nbytes) for p in pending] == [(1, True, 16), (2, False, 12), (1, False, 8)]


def test_other_backends_get_one_request_per_message_receives_posted_first():
    group = _FakeGroup(coalesces=False)
    pending = _transport(group).start([(1, torch.ones(4))], [(2, torch.ones(3))])
    assert group.log == [("recv", 2, 3), ("send", 1, 4)]  # receives announced before our payload goes out
    assert len({id(p.work) for p in pending}) == 2
    assert [(p.peer, p.is_send, p.nbytes) for p in pending] == [(1, True, 16), (2, False, 12)]


def test_an_empty_round_starts_nothing():
    group = _FakeGroup(coalesces=True)
    assert _transport(group).start([], []) == []
    assert group.log == []


def test_capture_without_cuda_says_so():
    from dtrain import comm

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs CUDA"):
        comm.capture(lambda: None)
