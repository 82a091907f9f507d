"""dtrain.models.dropout: masks that are a function of the step, the site and each value's place in the global
batch, so that a slice of the batch or of the heads draws the slice of one process's mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dtrain.models import dropout as dropouts
from dtrain.models import dropout_kernel
from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import build
from dtrain.parallel.recompute import checkpoint_activations


@pytest.fixture(autouse=True)
def _untracked():
    yield
    dropouts.untracked()


def _gpt2(p: float = 0.1):
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p
    )
    return build(cfg)


def test_the_tensor_hash_is_the_integer_one():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    got = dropouts.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [dropouts._mix(v) for v in values]
    assert all(0 <= v < 2**32 for v in got)


def test_masks_keep_one_minus_p_and_are_independent_of_site_step_and_neighbours():
    dropouts.set_step(7, 3)
    a = dropouts.keep_mask((64, 64, 256), 0.5, 0, "cpu").float()  # 2**20 values
    b = dropouts.keep_mask((64, 64, 256), 0.5, 1, "cpu").float()
    dropouts.set_step(7, 4)
    c = dropouts.keep_mask((64, 64, 256), 0.5, 0, "cpu").float()
    sigma = 0.5 / 2**10  # of a mean of 2**20 fair bits
    for agreement in (
        a.mean(),
        (a == b).float().mean(),  # another site
        (a == c).float().mean(),  # another step
        (a[..., 1:] == a[..., :-1]).float().mean(),  # neighbouring features, positions, rows
        (a[:, 1:] == a[:, :-1]).float().mean(),
        (a[1:] == a[:-1]).float().mean(),
    ):
        assert abs(agreement.item() - 0.5) < 5 * sigma
    dropouts.set_step(1, 0)
    kept = dropouts.keep_mask((256, 4096), 0.1, 2, "cpu").float().mean().item()
    assert abs(kept - 0.9) < 5 * (0.09 / 2**20) ** 0.5


def test_a_slice_of_rows_or_heads_draws_its_slice_of_the_whole_mask():
    dropouts.set_step(3, 1)
    whole = dropouts.keep_mask((8, 6, 5, 5), 0.3, 4, "cpu")
    with dropouts.rows(4):  # a replica's rows 4..7
        assert torch.equal(dropouts.keep_mask((4, 6, 5, 5), 0.3, 4, "cpu"), whole[4:])
        with dropouts.rows(2):  # its second micro-batch of 2: rows 6..7
            assert torch.equal(dropouts.keep_mask((2, 6, 5, 5), 0.3, 4, "cpu"), whole[6:])
        # heads 2..3 of rows 4..7 (a tensor-parallel rank's heads)
        assert torch.equal(dropouts.keep_mask((4, 2, 5, 5), 0.3, 4, "cpu", offsets=(0, 2)), whole[4:, 2:4])
    assert torch.equal(dropouts.keep_mask((8, 6, 5, 5), 0.3, 4, "cpu"), whole)  # the rows are back at 0


def test_the_same_step_draws_the_same_masks_and_a_new_one_others():
    x = torch.ones(4, 8, 16)
    drop = dropouts.Dropout(0.25, site=1)
    dropouts.set_step(0, 5)
    first, again = drop(x), drop(x)
    assert torch.equal(first, again)
    assert first.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]
    dropouts.set_step(0, 6)
    assert not torch.equal(drop(x), first)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_untracked_it_is_torch_dropout():
    x = torch.randn(4, 8, 16)
    torch.manual_seed(11)
    want = F.dropout(x, 0.3, training=True)
    torch.manual_seed(11)
    assert torch.equal(dropouts.Dropout(0.3)(x), want)
    assert not dropouts.tracked()


def test_edges_and_refusals():
    dropouts.set_step(0, 0)
    x = torch.randn(2, 3)
    assert torch.equal(dropouts.Dropout(0.0)(x), x)
    assert torch.equal(dropouts.Dropout(1.0)(x), torch.zeros_like(x))
    for seed, step in ((-1, 0), (0, -1), (0, 1.5), (True, 0)):
        with pytest.raises(ValueError, match="dropout (seed|step)"):
            dropouts.set_step(seed, step)
    with pytest.raises(ValueError, match="dropout rows"), dropouts.rows(-1):
        pass
    with dropouts.rows(1), dropouts.rows(2), pytest.raises(ValueError, match="at most 2 nested levels"):
        dropouts.rows(3).__enter__()


def test_a_model_numbers_its_dropouts_in_order():
    model = _gpt2()
    sites = [(name, m.site) for name, m in model.named_modules() if isinstance(m, dropouts.Dropout)]
    assert [s for _, s in sites] == list(range(len(sites))) and len(sites) == 7  # embedding, 3 a block
    assert sites[1][0] == "1.attn.attn_dropout"


def test_a_batch_in_pieces_trains_like_the_whole_batch_also_when_recomputed():
    """GPT-2 with every dropout 0.1: the forwards of a batch's pieces (each under its rows), then their backwards
    once every forward has run, as a pipeline orders them, give the whole batch's logits and gradients; with full
    and selective recomputation too, whose backward runs outside the pieces' rows."""
    model = _gpt2()
    x = torch.randint(0, 97, (8, 16))
    dropouts.set_step(1, 0)
    whole = model(x)
    (whole.float().pow(2).sum() / 1000).backward()
    want = [p.grad.clone() for p in model.parameters()]
    for mode in ("none", "full", "selective"):
        net = checkpoint_activations(copy.deepcopy(model), mode)
        net.zero_grad()
        outs = []
        for i, piece in enumerate(x.chunk(4)):
            with dropouts.rows(2 * i):
                outs.append(net(piece))
        for out in reversed(outs):
            (out.float().pow(2).sum() / 1000).backward()
        assert torch.equal(torch.cat(outs), whole), mode
        for got, ref in zip((p.grad for p in net.parameters()), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7, msg=mode)


def test_attention_written_out_is_the_fused_kernels_where_nothing_is_dropped():
    """Tracked attention dropout runs the attention written out (the fused kernels take no mask): grouped-query
    Llama heads, causal, at a probability that drops nothing of these values, equal to SDPA's."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attention_dropout=1e-12,
    )
    model = build(cfg)
    x = torch.randint(0, 97, (3, 16))
    fused = model(x)  # untracked: SDPA with dropout_p 1e-12
    dropouts.set_step(0, 0)
    written = model(x)
    torch.testing.assert_close(written, fused, rtol=1e-5, atol=1e-5)


GPU_KERNEL = torch.cuda.is_available() and dropout_kernel.available()


@pytest.mark.skipif(not GPU_KERNEL, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "offsets"), [((37,), ()), ((6, 50), (0, 9)), ((3, 17, 40), (0, 5, 2)), ((2, 6, 33, 33), (0, 3))]
)
def test_the_gpu_kernel_draws_the_tensor_forms_bits_forward_and_backward(shape, offsets, dtype):
    dropouts.set_step(9, 2)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    salt = torch.tensor(dropouts.site_salt(3), dtype=torch.int64, device="cuda")
    with dropouts.rows(5), dropouts.rows(2):
        st = dropouts.state(x.device)
        keep = dropouts._keep(x.shape, 0.3, salt, st, offsets)
        want = torch.where(keep, x * (1.0 / 0.7), torch.zeros((), dtype=dtype, device="cuda"))
        got = dropout_kernel.HashDropout.apply(x, st, salt, dropouts.threshold(0.3), 1.0 / 0.7, offsets)
    assert torch.equal(got, want)
    g = torch.randn_like(x)
    (grad,) = torch.autograd.grad(got, x, g)  # after the rows are back at 0: drawn from the forward's
    (want_grad,) = torch.autograd.grad(want, x, g)
    assert torch.equal(grad, want_grad)


def test_compiled_blocks_compile_once_for_every_step_and_site():
    """The blocks of a GPT-2 with dropout 0.1, each through ``torch.compile`` (dynamo, no code generation), over
    four steps: no block compiles again for a new step's key or another site's salt, and every step's logits are
    the uncompiled model's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counts of earlier compilations in this process
    model = _gpt2()
    compiled = copy.deepcopy(model)
    for block in list(compiled)[1:-1]:
        block.compile(backend="eager")
    x = torch.randint(0, 97, (4, 16))
    for step in range(4):
        dropouts.set_step(2, step)
        with dropouts.rows(4):
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # both blocks, every step: one graph
    torch._dynamo.reset()


@pytest.mark.skipif(not GPU_KERNEL, reason="needs a CUDA GPU and Triton")
def test_on_a_gpu_float64_and_scalars_take_the_tensor_form_and_a_recording_reads_each_steps_key():
    drop = dropouts.Dropout(0.45, site=3).cuda()
    dropouts._states.clear()  # as in a fresh process: set_step makes the GPU's state before any recording
    dropouts.set_step(9, 2)
    for x in (torch.randn(5, 7, device="cuda", dtype=torch.float64), torch.tensor(1.5, device="cuda")):
        keep = dropouts._keep(x.shape, 0.45, drop.salt, dropouts.state(x.device), ())
        assert torch.equal(drop(x), torch.where(keep, x * (1.0 / 0.55), torch.zeros_like(x)))
    x = torch.randn(8, 64, device="cuda")
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = drop(x)
    for step in (3, 4):
        dropouts.set_step(9, step)
        graph.replay()
        assert torch.equal(out, drop(x))  # the replay drew this step's mask, as an eager call does
