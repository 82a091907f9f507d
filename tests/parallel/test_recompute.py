"""Activation checkpointing (:mod:`dtrain.parallel.recompute`): the same losses and gradients with less kept
for backward, on one process and under tensor, pipeline and data parallelism (real Gloo processes of the pool).

The tiny Llama preset in float32. Memory is measured on CPU as the bytes of the storages that the forward made
and that are still alive when backward starts (the activations autograd or the checkpoint keeps).
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtrain.parallel.recompute import checkpoint_activations, checkpointed_blocks, op_kind, parse_layers
from dtrain.train import loop
from tests.jobs import recompute as jobs

POOL_WORLD = 8
REPO = Path(__file__).resolve().parents[2]


def _loss(model: torch.nn.Module) -> torch.Tensor:
    x, y = jobs.batch(0)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _grads(model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    loss = _loss(model)
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def plain():
    return _grads(jobs.tiny_model())


CASES = {
    "full": ("full", {}),
    "selective-default": ("selective", {}),
    "selective-every-2": ("selective", {"layers": 2}),
    "selective-keep-matmul-attention": ("selective", {"ops": ["matmul", "attention"]}),
    "selective-layer-1-keep-elementwise": ("selective", {"layers": [1], "ops": ["elementwise", "norm"]}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_loss_and_gradients_on_one_process(plain, name):
    mode, kwargs = CASES[name]
    model = jobs.tiny_model(mode, **kwargs)
    assert checkpointed_blocks(model)  # something is checkpointed
    loss, grads = _grads(model)
    want_loss, want_grads = plain
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_marks_the_chosen_blocks_with_the_kept_kinds():
    assert checkpointed_blocks(jobs.tiny_model("full")) == dict.fromkeys(["1", "2", "3", "4"])
    assert checkpointed_blocks(jobs.tiny_model("selective", layers=2)) == {"1": None, "3": None}
    assert checkpointed_blocks(jobs.tiny_model("selective", layers=[2], ops=["norm", "matmul"])) == {
        "3": ("matmul", "norm")
    }
    assert checkpointed_blocks(jobs.tiny_model("selective")) == dict.fromkeys(["1", "2", "3", "4"], ("matmul",))
    assert checkpointed_blocks(jobs.tiny_model("none")) == {}


def test_dropout_draws_the_same_masks_when_recomputed():
    from dataclasses import replace

    from dtrain.models import build, preset

    config = replace(preset("gpt2", "tiny"), resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)

    def run(mode, seed=1):
        torch.manual_seed(0)
        model = checkpoint_activations(build(config), mode)
        model.train()
        torch.manual_seed(seed)
        return _grads(model)

    (want_loss, want), (loss, got) = run("none"), run("full")
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    # the masks are drawn: other draws give other gradients
    other_loss, _ = run("none", seed=2)
    assert other_loss != pytest.approx(want_loss, rel=1e-3)


def test_evaluation_without_grad_runs_the_plain_forward():
    model = jobs.tiny_model("full")
    with torch.no_grad():
        got = _loss(model)
    torch.testing.assert_close(got, _loss(jobs.tiny_model()).detach())


def _kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages the forward made (parameters aside) still alive when backward starts."""
    made: list = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Track():
        loss = _loss(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    refs = {s.data_ptr(): (StorageWeakRef(s), s.nbytes()) for s in made if s.data_ptr() not in params}
    made.clear()
    gc.collect()
    kept = sum(n for ref, n in refs.values() if not ref.expired())
    loss.backward()
    return kept


def test_checkpointing_keeps_fewer_activation_bytes():
    none = _kept_bytes(jobs.tiny_model())
    full = _kept_bytes(jobs.tiny_model("full"))
    every_2 = _kept_bytes(jobs.tiny_model("selective", layers=2))
    keep_matmul = _kept_bytes(jobs.tiny_model("selective"))
    assert full < keep_matmul < none
    assert full < every_2 < none
    assert full < 0.3 * none  # each block keeps only its input: the embedding, head and loss remain


def test_op_kinds():
    aten = torch.ops.aten
    assert op_kind(aten.mm.default) == "matmul"
    assert op_kind(aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert op_kind(aten.silu.default) == "elementwise"
    assert op_kind(aten.native_layer_norm.default) == "norm"
    assert op_kind(aten.clone.default) is None  # a copy that a collective may write into is always recomputed
    assert op_kind(aten.view.default) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "partial"}, "mode 'partial': accepted: none, full, selective"),
        ({"mode": "full", "layers": 2}, "takes no layers or ops"),
        ({"mode": "selective", "layers": [4]}, "block index 4 is not in [0, 4)"),
        ({"mode": "selective", "layers": 0}, "K >= 1"),
        ({"mode": "selective", "ops": ["softmax"]}, "accepted op kinds to keep: attention, matmul, norm, elementwise"),
    ],
)
def test_bad_arguments_raise_one_line_value_errors(kwargs, message):
    model = jobs.tiny_model()
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        checkpoint_activations(model, **kwargs)
    assert "\n" not in str(info.value)
    assert checkpointed_blocks(model) == {}  # nothing changed


def test_parse_layers():
    assert parse_layers("") is None
    assert parse_layers("every:3") == 3
    assert parse_layers(" 0, 2,5") == [0, 2, 5]
    for bad in ("every:0", "1-3", "every:x", "0,,1"):
        with pytest.raises(ValueError, match="accepted: '' \\(every block\\), 'every:K'"):
            parse_layers(bad)


LAYOUTS = {  # name -> (dp, pp, tp, HybridParallel keywords)
    "tp2": (1, 1, 2, {}),
    "dp2xpp2": (2, 2, 1, {"num_microbatches": 2}),
    "tp2xpp2-zb-h1": (1, 2, 2, {"num_microbatches": 2, "schedule": "zb-h1"}),
    "dp2-zero2": (2, 1, 1, {"zero_stage": 2}),
    "dp2-zero3": (2, 1, 1, {"zero_stage": 3}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_training_under_parallelism(pool, layout):
    dp, pp, tp, kwargs = LAYOUTS[layout]
    results = pool.run(jobs.equivalence, dp, pp, tp, kwargs)  # every process: building the grid is collective
    world = dp * pp * tp
    assert results[world:] == [None] * (POOL_WORLD - world)
    blocks_per_rank = 4 // pp
    assert results[0]["params"] > 0  # grid rank 0 compared the whole model
    for rank, got in enumerate(results[:world]):
        assert got["norm"] > 1e-3, (rank, got)
        for name in jobs.VARIANTS:
            assert got[name] <= 1e-5, (rank, name, got)
        assert got["full-blocks"] == blocks_per_rank, (rank, got)
        assert got["selective-ops-blocks"] == blocks_per_rank, (rank, got)
        assert got["selective-layers-blocks"] == 2 // pp, (rank, got)  # blocks 0 and 2: one on each stage


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recompute-layers", "1-3"], "--recompute-layers: must be empty (every block), every:K"),
        (["--recompute-keep", "matmul,softmax"], "--recompute-keep: must be comma-separated op kinds"),
        (
            ["--activation-checkpointing", "selective", "--recompute-layers", "0,4"],
            "--recompute-layers: layers: block index 4 is not in [0, 4)",
        ),
    ],
)
def test_bad_options_fail_before_any_rank_starts(tmp_path, capsys, monkeypatch, flags, message):
    from dtrain.cli.main import main

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(loop, "run_ranks", refuse)
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    printed = capsys.readouterr().err
    assert message in printed and printed.count("\n") == 1, printed
