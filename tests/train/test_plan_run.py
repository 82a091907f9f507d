"""``dtrain plan --config RUN.toml --write OUT.toml``: the simulator's fastest layout of a run, written as a run
config that ``dtrain train`` accepts, with the prediction in ``[plan]``; and the hybrid-sharding key.

(tests/train/test_train.py trains a config carrying a ``[plan]`` and checks the scored metrics.)"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from dtrain.cli.main import build_parser, main
from dtrain.cluster.files import resolve
from dtrain.sim.model import Layout, memory_per_device
from dtrain.train import loop
from dtrain.train.config import ConfigError, TrainConfig, from_arguments, load_config
from dtrain.train.plan import model_spec, plan_run, refusal, run_shape
from tests.jobs import plan as jobs

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"


def test_plan_writes_the_fastest_runnable_layout_and_its_prediction(tmp_path, capsys):
    out = tmp_path / "planned.toml"
    assert main(["plan", "--config", str(TINY), "--topology", "h100-node", "--devices", "4", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("dtrain plan: dp") and f"written to {out}" in printed
    original, planned = load_config(TINY), load_config(out)
    par, tr, predicted = planned.parallel, planned.training, planned.plan
    assert par.dp * par.tp * par.pp == 4 and (predicted.topology, predicted.devices) == ("h100-node", 4)
    # the [plan] section describes exactly the layout written
    dp, tp, pp, mb, m = map(int, re.match(r"dp(\d+) tp(\d+) pp(\d+) mb(\d+)x(\d+)", predicted.layout).groups())
    assert (dp, tp, pp) == (par.dp, par.tp, par.pp)
    assert (par.microbatches if pp > 1 else tr.accumulation) == m and dp * mb * m == tr.batch_size
    assert predicted.step_s > 0 and predicted.tokens_per_s == pytest.approx(
        tr.batch_size * planned.data.seq_len / predicted.step_s
    )
    # the run config is otherwise the one given, and the layout passes the launching process's own checks
    for section in ("model", "data", "optimizer", "lr_schedule", "checkpoint", "logging"):
        assert getattr(planned, section) == getattr(original, section)
    loop.validate_layout(planned, 4, run_shape(planned))


def test_plan_run_skips_layouts_dtrain_train_cannot_run_and_predicts_the_memory_of_the_one_it_keeps():
    config = load_config(TINY)
    shape = run_shape(config)
    topo = resolve("h100-node")
    planned = plan_run(config, topo, devices=2, shape=shape, zero_stages=[0], recompute=["none"])
    layout = planned.plan.layout
    assert isinstance(layout, Layout) and layout.world_size == 2
    spec = model_spec(shape, config.data.seq_len)
    assert spec.vocab == shape.vocab_size and spec.layers == shape.num_hidden_layers and spec.gated_mlp
    assert planned.config.plan.memory_gib == pytest.approx(memory_per_device(spec, layout, "dtrain").total / 2**30)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--write", "x.toml"], "--write"),
        (["--config", "/nonexistent/run.toml"], "/nonexistent/run.toml"),
        (["--config", str(TINY), "--global-batch", "3"], "--global-batch"),
        (["--config", str(TINY), "--devices", "64"], "--devices"),
    ],
)
def test_plan_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, named):
    assert main(["plan", "--topology", "h100-node", *argv]) == 2
    said = capsys.readouterr()
    assert len(said.err.splitlines()) == 1 and named in said.err and not said.out
    assert not list(tmp_path.iterdir()) and not Path("x.toml").exists()


def test_plan_says_so_when_no_layout_fits(tmp_path, capsys):
    big = tmp_path / "big.toml"
    big.write_text(TINY.read_text().replace('preset = "tiny"', 'preset = "8b"'))
    out = tmp_path / "planned.toml"
    assert main(["plan", "--config", str(big), "--topology", "h100-node", "--devices", "1", "--write", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.startswith("dtrain: error: --config: no layout of the model trains on 1 device(s)") and not out.exists()


def test_hybrid_sharding_key_needs_zero_3_and_a_divisor_of_dp():
    base = {"parallel": {"dp": 4, "zero": 3, "zero_shard_size": 2}, "training": {"batch_size": 8}}
    assert TrainConfig.from_dict(base).parallel.zero_shard_size == 2
    with pytest.raises(ConfigError, match=r"\[parallel\] zero_shard_size: shards parameters over part of dp"):
        TrainConfig.from_dict({**base, "parallel": {**base["parallel"], "zero": 2}})
    with pytest.raises(ConfigError, match=r"must divide dp=4"):
        TrainConfig.from_dict({**base, "parallel": {**base["parallel"], "zero_shard_size": 3}})


def test_grad_accumulation_fusion_on_is_refused_where_it_cannot_apply():
    on = {"grad_accumulation_fusion": "on"}
    pipelined = {"parallel": {"pp": 2, **on}, "training": {"batch_size": 8}}
    assert TrainConfig.from_dict(pipelined).parallel.grad_accumulation_fusion == "on"
    for change, why in (
        ({"parallel": {"pp": 1, **on}}, r"pp = 1"),
        ({"parallel": {"pp": 2, "dp": 2, "zero": 2, **on}}, r"zero = 2"),
        ({"training": {"batch_size": 8, "compile": True}}, r"training.compile"),
    ):
        config = {**pipelined, **change}
        with pytest.raises(ConfigError, match=rf"^\[parallel\] grad_accumulation_fusion: 'on' needs pp > 1.*{why}"):
            TrainConfig.from_dict(config)
    # auto and off apply or not by themselves
    assert TrainConfig.from_dict({"parallel": {"grad_accumulation_fusion": "auto"}}).parallel.pp == 1


def test_only_layouts_dtrain_train_runs_as_priced_are_kept():
    config = load_config(TINY)  # the tiny Llama ties its embedding to its head: stage 0 and the last stage share it
    shape = run_shape(config)
    staged = dataclasses.replace(config.parallel, dp=2, pp=2, microbatches=2)

    def layout(**changes):
        return dataclasses.replace(config, parallel=dataclasses.replace(staged, **changes))

    assert refusal(layout(zero=1), shape) is None
    assert "--zero 2: with --pp above 1 the tied embedding" in refusal(layout(zero=2), shape)
    assert "the oblivious placement" in refusal(layout(zero=1), shape, "oblivious")
    assert "does not divide by tp=4" in refusal(layout(dp=1, pp=1, tp=4, microbatches=1), shape)
    planned = plan_run(config, resolve("h100-node"), devices=4, shape=shape, zero_stages=[2], recompute=["none"])
    assert refusal(planned.config, shape) is None and planned.config.parallel.pp == 1
    assert planned.plan.placement == "aware" and planned.config.plan.devices == 4
    # Megatron-LM's order is dtrain train's rank_order tp-dp-pp: a plan placed so is written with it
    assert "the megatron placement" in refusal(layout(zero=1), shape, "megatron")
    megatron = dataclasses.replace(config, parallel=dataclasses.replace(staged, zero=1, rank_order="tp-dp-pp"))
    assert refusal(megatron, shape, "megatron") is None and "the aware placement" in refusal(megatron, shape, "aware")
    ordered = plan_run(config, resolve("h100-node"), devices=4, shape=shape, placements=("megatron",))
    assert ordered.plan.placement == "megatron" and ordered.config.parallel.rank_order == "tp-dp-pp"
    assert refusal(ordered.config, shape, "megatron") is None


def test_across_servers_the_plan_takes_the_faster_rank_order_and_writes_it():
    # two servers of 8: a pipeline of 2 stages with 8 replicas each is faster with a stage's replicas on one
    # server (their gradients reduced over NVLink) than with a replica's stages on one server
    from dtrain.cluster.presets import preset
    from dtrain.sim.placement import place
    from dtrain.sim.step import StepConfig, simulate_step
    from dtrain.train.plan import run_kernels

    config = load_config(TINY)
    shape = run_shape(config)
    topology = preset("h100-rail", racks=1, servers_per_rack=2)
    planned = plan_run(config, topology, devices=16, shape=shape)
    lay = planned.plan.layout
    assert planned.plan.placement == "megatron" and planned.config.parallel.rank_order == "tp-dp-pp"
    assert lay.dp > 1 and lay.pp > 1 and refusal(planned.config, shape) is None
    spec = model_spec(shape, config.data.seq_len, name=config.model.preset)
    step_config = StepConfig(kernels=run_kernels(config))
    assert simulate_step(spec, lay, topology, place(topology, lay, "megatron"), step_config).step_s == pytest.approx(
        planned.plan.result.step_s
    )
    assert (
        planned.plan.result.step_s
        < simulate_step(spec, lay, topology, place(topology, lay, "aware"), step_config).step_s
    )


def test_zero_shard_size_reaches_the_trainer_sharding_within_blocks(pool, tmp_path):
    """``dtrain train --dp 4 --zero 3 --zero-shard-size 2``'s trainer: parameters sharded over 2 ranks and
    replicated twice (tests/parallel/test_fsdp.py checks that layout's numerics against one process)."""
    flags = ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--warmup-steps", "1", "--dp", "4"]
    flags += ["--zero", "3", "--zero-shard-size", "2"]
    config = from_arguments(build_parser().parse_args(["train", "--out", str(tmp_path), *flags]))
    got = pool.run(jobs.trainer, config, loop.check_run(config, 4), 2)  # every process: groups are collective
    assert got[4:] == [None] * 4
    for rank in got[:4]:
        assert (rank["shard"], rank["replicas"]) == (2, 2)
        assert rank["losses"] == pytest.approx(got[0]["losses"], rel=1e-6) and all(map(math.isfinite, rank["norms"]))


def test_the_trainer_trains_alike_in_either_rank_order(pool, tmp_path):
    """``dtrain train --dp 2 --pp 2 --rank-order tp-dp-pp``'s trainer: the pipeline outermost (rank 1 is the
    second replica of stage 0), the same losses and gradient norms as the default order."""
    flags = ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--warmup-steps", "1", "--dp", "2"]
    flags += ["--pp", "2", "--microbatches", "2"]
    got = {}
    for order in ("tp-pp-dp", "tp-dp-pp"):
        argv = ["train", "--out", str(tmp_path / order), *flags, "--rank-order", order]
        config = from_arguments(build_parser().parse_args(argv))
        plan = loop.check_run(config, 4)
        assert plan.dims.order == order
        got[order] = pool.run(jobs.trainer, config, plan, 2)
    ours, megatron = got["tp-pp-dp"], got["tp-dp-pp"]
    assert [r["coords"] for r in ours[:4]] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [r["coords"] for r in megatron[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    for a, b in zip(ours[:4], sorted(megatron[:4], key=lambda r: (r["coords"][0], r["coords"][1])), strict=True):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6) and b["norms"] == pytest.approx(a["norms"], rel=1e-6)


def test_the_scored_peak_memory_is_the_most_of_any_rank(pool):
    per_rank = [[1.0, 3.0], [2.0], [0.5, 7.25], [4.0], [1.0], [6.0], [2.0], [3.0]]
    assert pool.run(jobs.peak_over_ranks, per_rank) == [7.25] * 8
    assert pool.run(jobs.peak_over_ranks, [[None]] * 8) == [None] * 8  # a CPU measures none: no collective


@pytest.mark.parametrize("preset", ["1b", "tiny"])
def test_the_simulator_prices_the_cut_partition_layers_makes(preset):
    """``Layout.balance``'s blocks a stage (torch-free, from the model's shape) are those of
    ``partition_layers`` on the model ``dtrain train`` builds, for each schedule's chunks and both balances."""
    from dtrain.models.decoder import build
    from dtrain.models.presets import preset as model_preset
    from dtrain.parallel.pipeline_parallel import partition_layers
    from dtrain.parallel.pipeline_schedules import PLACEMENT, stage_of_virtual
    from dtrain.sim.model import stage_blocks

    shape = model_preset("llama", preset)
    model = build(shape, device="meta")
    spec = model_spec(shape, 64)
    for pp in (2, 3, 4):
        for schedule, chunks in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)):
            if len(model) < pp * chunks:
                continue
            stage_of = [stage_of_virtual(u, pp, PLACEMENT.get(schedule, "loop"))[0] for u in range(pp * chunks)]
            for balance in ("layers", "flops"):
                cuts = partition_layers(model, pp * chunks, balance=balance, stage_of=stage_of)
                blocks = [0] * pp
                for u, cut in enumerate(cuts):
                    blocks[stage_of[u]] += sum(1 for i in cut if 0 < i < len(model) - 1)  # not embedding nor head
                layout = Layout(pp=pp, micro_batch=1, global_batch=pp, schedule=schedule, chunks=chunks,
                                balance=balance)  # fmt: skip
                assert stage_blocks(spec, layout) == tuple(blocks), (pp, schedule, balance)


def test_plan_run_writes_the_cut_it_priced():
    from dtrain.train.plan import _run_config

    config = load_config(TINY)
    shape = run_shape(config)
    planned = plan_run(config, resolve("h100-node"), devices=4, shape=shape, zero_stages=[0], recompute=["none"])
    for balance in ("layers", "flops"):
        staged = dataclasses.replace(
            planned.plan.layout,
            dp=1,
            tp=1,
            pp=4,
            schedule="1f1b",
            chunks=1,
            micro_batch=1,
            global_batch=config.training.batch_size,
            balance=balance,
        )
        run = _run_config(config, staged, planned.plan, "h100-node", 4)  # fmt: skip
        assert (run.parallel.pp, run.parallel.balance) == (4, balance)


@pytest.mark.parametrize("preset", ["8b", "1b"])
def test_the_simulator_holds_each_stage_s_parameters_tied_or_not(preset):
    """Each stage's parameters as the simulator counts them are those of the stage ``partition_layers`` cuts from
    the model ``dtrain train`` builds: Llama 3.1 8B's untied output layer a matrix of its own, beside the
    embedding on the V's first stage and on 1F1B's last, Llama 3.2 1B's tied one held once on the V's first."""
    from dtrain.models.decoder import build
    from dtrain.models.presets import preset as model_preset
    from dtrain.parallel.pipeline_parallel import partition_layers
    from dtrain.parallel.pipeline_schedules import PLACEMENT, stage_of_virtual
    from dtrain.sim.model import stage_parameters

    shape = model_preset("llama", preset)
    model = build(shape, device="meta")
    spec = model_spec(shape, 64)
    assert spec.tied_embeddings == shape.tie_word_embeddings
    pp = 4
    for schedule, chunks in (("1f1b", 1), ("zb-v", 2)):
        stage_of = [stage_of_virtual(u, pp, PLACEMENT.get(schedule, "loop"))[0] for u in range(pp * chunks)]
        for balance in ("layers", "flops"):
            held = [{} for _ in range(pp)]  # a tied matrix counted once on its stage
            for u, cut in enumerate(partition_layers(model, pp * chunks, balance=balance, stage_of=stage_of)):
                for i in cut:
                    held[stage_of[u]].update({id(q): q.numel() for q in model[i].parameters()})
            layout = Layout(pp=pp, micro_batch=1, global_batch=pp, schedule=schedule, chunks=chunks,
                            balance=balance)  # fmt: skip
            for stage in range(pp):
                want = sum(held[stage].values())
                assert stage_parameters(spec, layout, stage) == pytest.approx(want, rel=1e-4), (schedule, balance)


def test_the_simulator_builds_zb_v_s_order_for_the_chunk_weights_pipeline_parallel_uses():
    from dtrain.models.decoder import build
    from dtrain.models.presets import preset as model_preset
    from dtrain.parallel.pipeline_parallel import forward_flops_weight, partition_layers
    from dtrain.parallel.pipeline_schedules import stage_of_virtual, zb_v_weights
    from dtrain.sim.model import chunk_flops

    shape = model_preset("llama", "1b")
    model, spec = build(shape, device="meta"), model_spec(shape, 64)
    for pp in (2, 4):
        stage_of = [stage_of_virtual(u, pp, "v")[0] for u in range(2 * pp)]
        for balance in ("layers", "flops"):
            cuts = partition_layers(model, 2 * pp, balance=balance, stage_of=stage_of)
            runtime = [sum(forward_flops_weight(model[i]) for i in cut) for cut in cuts]  # as PipelineParallel
            layout = Layout(pp=pp, micro_batch=1, global_batch=pp, schedule="zb-v", chunks=2, balance=balance)
            assert zb_v_weights(chunk_flops(spec, layout), pp) == zb_v_weights(runtime, pp), (pp, balance)
