"""tensor_parallelize on the decoders of dtrain.models: the split model computes the unsplit one (forward,
loss and every gradient, float32 within rtol 1e-5, atol 1e-6), the vocabulary padded where tp does not
divide it; head counts and vocabularies a tp cannot split are refused; the pipeline's FLOP balance and its
activations' dtypes. Jobs in tests/jobs/parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.models.config import LlamaConfig
from dtrain.parallel.parallelize import validate_tensor_parallel
from dtrain.parallel.pipeline_parallel import forward_flops_weight, partition_layers
from dtrain.parallel.tensor_parallel import padded_vocab_size
from tests.jobs import parallel as jobs


@pytest.mark.parametrize(
    ("kind", "tp", "vocab", "loss_parallel"),
    [
        ("llama", 2, 40, True),
        ("llama", 2, 41, False),
        ("gpt2", 2, 41, True),
        ("gpt2", 4, 42, True),
        ("gpt2", 4, 41, False),
    ],
)
def test_split_model_computes_the_unsplit_one(pool, kind, tp, vocab, loss_parallel):
    # 41 and 42 do not divide by the group: the padding is never looked up, has -inf logits and no gradient
    assert pool.run(jobs.model_equivalence, kind, tp, vocab, loss_parallel, ranks=tp) == [[]] * tp


def test_a_tp_that_does_not_divide_the_key_value_heads_is_refused(pool):
    messages = pool.run(jobs.refused, "llama", 4, ranks=4)  # 4 query heads, 2 key-value heads
    assert all("n_kv_heads=2" in m and "tp=4" in m for m in messages), messages
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by tp=4"):
        validate_tensor_parallel(jobs.config("llama"), 4)


def test_config_checks_name_the_field_and_tp_before_any_rank_starts():
    validate_tensor_parallel(jobs.config("llama"), 2)
    validate_tensor_parallel(jobs.config("gpt2"), 4)
    with pytest.raises(ValueError, match="n_head=4 does not divide by tp=8"):
        validate_tensor_parallel(jobs.config("gpt2"), 8)
    wide = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=40,
        num_attention_heads=6,
        num_key_value_heads=6,
        num_hidden_layers=1,
    )
    with pytest.raises(ValueError, match="intermediate_size=40 does not divide by tp=3"):
        validate_tensor_parallel(wide, 3)
    with pytest.raises(ValueError, match="vocab_size=5 over tp=4 ranks would leave a rank with padding only"):
        validate_tensor_parallel(jobs.config("gpt2", vocab=5), 4)
    assert padded_vocab_size(103, 2) == 104


def test_flops_balance_counts_the_head_matmul_and_not_the_embedding_table():
    net = jobs.model("llama", vocab=4000)  # a table of 4000 x 32 beside blocks of ~8k matmul weights
    costs = [forward_flops_weight(layer) for layer in net]
    assert costs[0] == 0  # a lookup
    assert costs[-1] == 2 * 4000 * 32  # the head's matmul (its weight is the tied table)
    assert costs[1] == 2 * sum(m.weight.numel() for m in net[1].modules() if isinstance(m, nn.Linear))
    # by parameters the table weighs as much as the head, a stage each; by FLOPs the table is free: it joins the
    # blocks and the head stands alone
    assert partition_layers(net, 2, balance="params") == [range(0, 2), range(2, 4)]
    assert partition_layers(net, 2, balance="flops") == [range(0, 3), range(3, 4)]


def test_activations_cross_stages_in_the_dtype_they_were_sent(pool):
    assert pool.run(jobs.stage_link_dtypes, ranks=2) == [[], []]


def test_tied_embedding_stays_one_parameter_after_the_split(pool):
    assert torch.equal(torch.tensor(pool.run(jobs.tied_after_split, ranks=2)), torch.tensor([True, True]))
