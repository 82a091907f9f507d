#!/usr/bin/env bash
# Usage: benchmarks/gpu/run.sh OUTDIR MODE [MODE...]   (benchmarks/gpu/run.sh --help lists the modes)
#
# The GPU measurements behind docs/results.md, on every GPU of one host, with dtrain's defaults (no DTRAIN_COMM_*
# set unless a mode says so) and NVLink multicast off. Each mode runs under its own time limit (LIMIT seconds
# overrides it), so one that stalls costs its limit and not the whole call; results go to OUTDIR.
#
# Modes, by what they measure:
#   machine            GPUs, topology, torch/NCCL/Triton versions                          -> machine.txt
#   verify             bench verify: every (collective, algorithm) against NCCL's result     -> verify.txt
#   verify-push        the same with every schedule in the push form (DTRAIN_COMM_PEER_MODE=push)
#   calibrate          the cost model's alpha/beta/gamma                                     -> calibration.json
#   all-reduce         all-reduce 1 MiB-1 GiB: NCCL, ring, halving-doubling, auto            -> all_reduce.jsonl
#   all-reduce-eager   the same 16 MiB-1 GiB without graph replays (DTRAIN_COMM_PERSISTENT=0)
#   pull-push          all-reduce in the pull and the push form, eager and replayed          -> all_reduce-{pull,push}-*.jsonl
#   rules              all-reduce, all-gather, reduce-scatter writing measured rules, then a launch following them
#   host               every collective and algorithm at 16 KiB, 100 calls: the host's time per call
#   sweep-symmetric    all-reduce, all-gather, reduce-scatter, all-to-all, every algorithm, 1 MiB-1 GiB
#   sweep-rooted       broadcast, reduce, gather, scatter, the same
#   captured           both sets, 16 KiB-1 GiB, each call also captured whole as a CUDA graph (the devices' time)
#                      -> captured-symmetric.jsonl, captured-rooted.jsonl
#   nccl-tuning        NCCL's algorithm and protocol per collective and size (NCCL_DEBUG_SUBSYS=TUNING)
#   transports         all-reduce over NVLink, host shared memory (NCCL_P2P_DISABLE=1) and sockets (+NCCL_SHM_DISABLE=1)
#   p2p-channels       NCCL point-to-point with NCCL_MIN_P2P_NCHANNELS=32 and a 2 MiB NVLink chunk, against default
#   dp                 data parallel against DDP, 1 and 4 GPUs, 32 and 16 sequences a GPU  -> dp_vs_ddp-b{32,16}.jsonl
#   dp-bind            dp at 16 sequences a GPU, unbound and each rank bound to its own cores, alternating
#                      -> dp_vs_ddp-bind_{plain,bound}-launch{1..4}-b16.jsonl
#   dp-profile         the same under torch.profiler (1 GPU and every GPU; DP_BATCHES, default "16 32"): host enqueue
#                      time, device busy, compute, NCCL and its exposed part, idle, the host's Python functions -> dp_profile.txt
#   zero               ZeRO-1/2 against DDP and ZeroRedundancyOptimizer: step time, peak memory -> zero.jsonl
#   tp                 tensor parallel against DTensor's                                     -> tp.jsonl
#   pp                 pipeline parallel against torch.distributed.pipelining, p = 4           -> pp.jsonl
#   bubble             pipeline bubble and activations against (p - 1)/(v m + p - 1), p = 2 and 4
#   llama              Llama 1B (LLAMA_PRESET) bf16, dp over every GPU: dtrain, DDP, FSDP2, eager and compiled
#                      -> llama_1b_dp.jsonl
#   plan-score         dtrain bench compute on one GPU (the curves the planner prices with), dtrain plan of the Llama 1B
#                      config on every GPU, then dtrain train of the written config: the plan's predicted step time
#                      and memory beside the measured ones -> compute_curves.json, bench_compute.jsonl, plan_score.json
#   largest            the largest Llama (8B width, more blocks) that trains with ZeRO-3 and full activation
#                      checkpointing, against FSDP2 with the same: blocks grow by LARGEST_STEP until a launch fails;
#                      both under expandable CUDA segments, as dtrain train sets them (LARGEST_ALLOC overrides)
#                      -> largest.jsonl, largest.log
#   llama-layouts      dtrain train on it as dp, tp, pp (and dp x tp2, tp2 x pp, ZeRO-3 with and without activation
#                      checkpointing on 4+), 100 steps                                      -> llama_1b_*.jsonl
#   probe-port         how transfers share one GPU's NVLink port                           -> port.jsonl
#   probe-port-chain   the chain broadcast's round patterns through the port               -> port-chain.jsonl
#   probe-chain        the chain broadcast by piece count                                   -> probe-chain.txt
#   probe-chain-timeline  the chain broadcast's device timeline, pull and push              -> chain-timeline-*/
#   probe-chain-channels  the slot chain broadcast by piece size and lanes, same and fresh tensors, beside NCCL
#                      -> probe-chain-channels{,-fresh}.txt
#   probe-direct-broadcast  the ring broadcast as copies between the callers' tensors, same and fresh tensors,
#                      beside NCCL; on 2 GPUs also where a lone call's time goes -> probe-direct-broadcast{,-lone}.txt
#   probe-direct-reduce  the ring reduce as a chain combining the callers' tensors, same and fresh tensors, beside
#                      NCCL; on 2 GPUs also the root's bare ways to combine -> probe-direct-reduce.txt
#   defaults           every collective with the defaults (auto) beside NCCL (torch.distributed's own call, and
#                      native through dtrain), 8 KiB-1 GiB (DEFAULTS_MIN, DEFAULTS_MAX, DEFAULTS_FACTOR), same
#                      tensors and fresh ones
#                      -> defaults.jsonl, defaults-fresh.jsonl
#   defaults-beside    the same in one launch, each name also on fresh tensors in the same rounds (NAME+fresh)
#                      -> defaults-beside.jsonl
#   reduce-beside      the reduce: the one pass (star) to 32 MiB, then the defaults to 1 GiB, each beside
#                      torch.distributed's, same and fresh tensors    -> reduce_one_pass.jsonl, reduce_defaults.jsonl
#   one-pass           all-gather, reduce-scatter, all-to-all (direct) and broadcast (star) in one pass over CUDA
#                      symmetric memory beside NCCL (torch, native) and auto, 8 KiB-64 MiB (ONE_PASS_MAX), same
#                      tensors and fresh ones, on every GPU
#                      and on 2 (NP_SMALL; ONE_PASS_NP="4 2" names the counts), with DTRAIN_COMM_ONE_PASS=1 and
#                      bench verify first
#                      -> verify-one-pass.txt, one_pass{,-fresh}-np{N}.jsonl
#   large-beside       the defaults from 4 MiB to 1 GiB, fresh tensors beside, where auto takes NCCL's wide communicator
#   one-shot-ar        bench verify, then the all-reduce's one-shot and two-shot kernels beside NCCL (torch, native)
#                      and auto, 8 KiB-16 MiB (AR_MIN, AR_FACTOR), same and fresh tensors (ONE_PASS_NP)  -> one_shot_ar{,-fresh}-np{N}.jsonl
#   two-shot           bench verify, then the all-reduce (one-shot, two-shot) and the broadcast (star,
#                      scatter-allgather) beside NCCL (torch, native) and auto, 1-64 MiB by factors of 2 (TWO_SHOT_MIN,
#                      TWO_SHOT_MAX), same and fresh tensors (ONE_PASS_NP)      -> two_shot{,-fresh}-np{N}.jsonl
#   one-pass-gather    the same for the all-gather and all-to-all alone, 8 KiB-16 MiB (ONE_PASS_NP as above), with
#                      torch.distributed's own call (torch) beside native
#                      -> verify-one-pass.txt, one_pass_gather{,-fresh}-np{N}.jsonl
#   pipeline-profile   dtrain bench pipeline --profile, 1F1B and interleaved at m = 16 of batch 1024, eager and as
#                      CUDA graphs: each rank's
#                      host time by function                                                  -> pipeline_profile.txt
#   bench-pipeline     dtrain bench pipeline, 16 x Linear(4096) on every GPU, batch 1024 at m = 8, 16, eager and
#                      with CUDA graphs, over the process groups and over peer channels, beside torch pipelining
#                                                                                        -> bench_pipeline.jsonl
#   bench-pipeline-step  the same with the whole step one CUDA graph a stage beside each forward and backward one
#                      (GRAPHS=actions,step), on the peer channels, batch BATCH (1024)
#                                                                       -> bench_pipeline_step-bBATCH.jsonl
#   bench-pipeline-large  the same at batch 4096, m = 8, 16                              -> bench_pipeline-b4096.jsonl
#   pipeline-groups    1F1B and interleaved 1F1B with micro-batches in groups of p, 2p and 4p (where they divide m),
#                      m = 8, 16, eager and with CUDA graphs (each action, the whole step), on the peer channels, at
#                      batch GROUP_BATCHES ("1024 4096")                      -> pipeline_groups-bBATCH.jsonl
#   pipeline-engines   where a stage's message is copied into the next stage's slot (ENGINES of the peer channels:
#                      a copy engine on the channel's stream or on the compute stream, or a kernel), A/B in one
#                      launch with the step one CUDA graph a stage (and eager), 1F1B and interleaved, batch
#                      ENGINE_BATCH (1024) at m = 8, 16; then the in-place receive against copies, the same launch
#                      shape; the probe of one message's latency first          -> probe-channel-latency.txt,
#                                                 pipeline_engines-bBATCH.jsonl, pipeline_in_place_ab-bBATCH.jsonl
#   pipeline-steady    every schedule at batch STEADY_BATCHES ("1024 4096"), m = 8, 16, eager and the step one CUDA
#                      graph a stage, beside torch.distributed.pipelining; each step timed alone (synchronized) and
#                      in a run of steps back to back                                   -> pipeline_steady-bBATCH.jsonl
#   pipeline-fusion    one GPU: a linear layer's weight gradient accumulated by autograd and in its GEMM (float32,
#                      bf16 into float32) -> grad_accumulation.jsonl; then 1F1B, interleaved 1F1B and ZB-H1 at batch
#                      FUSION_BATCHES ("1024 4096"), m = 8, 16, eager and the step one CUDA graph, with and without
#                      gradient-accumulation fusion, beside torch pipelining       -> pipeline_fusion-bBATCH.jsonl
#   pipeline-transport 1F1B, interleaved, ZB-H1, ZB-V at batch 4096 (m = 8, 16, eager), 1F1B and interleaved at batch
#                      1024 (m = 16, eager and with CUDA graphs), over the process groups and over peer channels, with
#                      receives posted 0 and 2 actions ahead (TRANSPORT_BATCHES, TRANSPORT_SCHEDULES,
#                      TRANSPORT_LOOKAHEAD narrow it)              -> pipeline_transport-b4096.jsonl, -b1024.jsonl
#   probe-one-shot | probe-one-pass | probe-symm | probe-p2p | probe-pull-kernel | probe-peer-host | probe-replay-host | probe-watchdog
#                      | probe-exchange-programs | probe-channels
#                      benchmarks/collectives/probe.py MODE                                 -> probe-MODE.txt
set -uo pipefail
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  [ $# -ge 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; } && exit 0
  exit 2
fi
out=$1; shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DTRAIN_COMM_TRANSPORT DTRAIN_COMM_PERSISTENT DTRAIN_COMM_PEER_MODE DTRAIN_COMM_TIMEOUT DTRAIN_COMM_RULES
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# torchrun on every GPU (NP=... for fewer) under LIMIT seconds, warnings filtered
tr() { timeout "${LIMIT:-150}" torchrun --nproc-per-node "${NP:-$n}" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
summ() { python3 benchmarks/collectives/summarize.py "$@" | tail -n +3; }
counts() { echo "$1: $(grep -c '^ok' "$2") ok, $(grep -ciE '^(fail|mismatch)|error' "$2") failed"; }
sym=all_reduce,all_gather,reduce_scatter,all_to_all
rooted=broadcast,reduce,gather,scatter
for mode in "$@"; do
  start=$SECONDS
  case $mode in
    machine)
      { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m
        python3 -c 'import torch, triton; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__)'
      } >"$out/machine.txt" 2>&1; cat "$out/machine.txt" ;;
    verify) LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify.txt"; counts verify "$out/verify.txt" ;;
    verify-push)
      DTRAIN_COMM_PEER_MODE=push LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify-push.txt"
      counts "verify, pushed" "$out/verify-push.txt" ;;
    calibrate) tr -m dtrain bench calibrate --out "$out/calibration.json" ;;
    all-reduce|all-reduce-eager)
      extra="--min-bytes 1M"; file=all_reduce
      [ "$mode" = all-reduce-eager ] && { export DTRAIN_COMM_PERSISTENT=0; extra="--min-bytes 16M"; file=all_reduce-eager; }
      tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,halving_doubling,auto $extra \
        --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/$file.jsonl" >/dev/null
      unset DTRAIN_COMM_PERSISTENT
      summ "$out/$file.jsonl" --collective all_reduce --algorithms native,ring,halving_doubling,auto ;;
    pull-push)
      for form in pull push; do
        for graphs in 0 1; do
          name=all_reduce-$form-$([ $graphs = 1 ] && echo graphs || echo eager)
          DTRAIN_COMM_TRANSPORT=peer DTRAIN_COMM_PEER_MODE=$form DTRAIN_COMM_PERSISTENT=$graphs LIMIT=${LIMIT:-90} \
            tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,halving_doubling,auto \
            --min-bytes 1M --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/$name.jsonl" >/dev/null
          echo "== $name"; summ "$out/$name.jsonl" --collective all_reduce --algorithms native,ring,halving_doubling,auto
        done
      done ;;
    rules)
      export DTRAIN_COMM_RULES="$out/rules.json"; rm -f "$DTRAIN_COMM_RULES"
      for run in 1 2; do
        extra=""; [ $run = 1 ] && extra="--rules-out"
        tr -m dtrain bench comm --collectives all_reduce,all_gather,reduce_scatter \
          --algorithms native,ring,halving_doubling,recursive_doubling,direct,auto --min-bytes 1M --max-bytes 1G \
          --factor 4 --iters 20 --trials 3 --out "$out/ar_ag_rs-run$run.jsonl" $extra >"$out/ar_ag_rs-run$run.log"
        for c in all_reduce all_gather reduce_scatter; do
          summ "$out/ar_ag_rs-run$run.jsonl" --collective $c --algorithms native,ring,auto
        done
      done
      python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['rules'])" "$DTRAIN_COMM_RULES"
      unset DTRAIN_COMM_RULES ;;
    host)
      tr -m dtrain bench comm --collectives $sym,$rooted --min-bytes 16K --max-bytes 16K --iters 100 --trials 3 \
        --out "$out/host.jsonl" >"$out/host.log"; echo "exit $?" ;;
    sweep-symmetric|sweep-rooted|captured)
      parts=$mode; [ "$mode" = captured ] && parts="captured-symmetric captured-rooted"
      for part in $parts; do
        set_=$sym; [ "${part#*-}" = rooted ] && set_=$rooted
        extra="--min-bytes 1M"; [ "${part%-*}" = captured ] && extra="--min-bytes 16K --graphs"
        LIMIT=${LIMIT:-300} tr -m dtrain bench comm --collectives $set_ $extra --max-bytes 1G --factor 4 --iters 20 \
          --trials 3 --out "$out/$part.jsonl" >"$out/$part.log"; echo "$part: exit $?"
      done ;;
    nccl-tuning)
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING,COLL LIMIT=${LIMIT:-90} tr -m dtrain bench comm --collectives $sym,$rooted \
        --algorithms native --min-bytes 16K --max-bytes 1G --factor 4 --iters 1 --trials 1 --warmup 0 --warm-s 0 \
        --out "$out/tuning.jsonl" >"$out/tuning.log"
      # one line per distinct message, the host/pid prefix and the per-call addresses cut
      grep "NCCL INFO" "$out/tuning.log" | sed -E 's/^.*NCCL INFO //; s/0x[0-9a-f]+/0x/g; s/opCount [0-9a-f]+/opCount/' \
        | sort | uniq -c | sort -k2 | head -1500 >"$out/nccl_tuning.txt"; wc -l "$out/nccl_tuning.txt" ;;
    transports)
      tr -m dtrain bench comm --algorithms native,ring,tree,recursive_doubling,halving_doubling,direct,auto \
        --min-bytes 1M --max-bytes 1G --factor 4 --iters 10 --trials 3 --out "$out/transport-nvlink.jsonl" >"$out/transports.log"
      NCCL_P2P_DISABLE=1 tr -m dtrain bench comm --algorithms native,ring,direct --min-bytes 1M --max-bytes 1G \
        --factor 4 --iters 5 --trials 3 --out "$out/transport-shm.jsonl" >>"$out/transports.log"
      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 tr -m dtrain bench comm --algorithms native,ring --min-bytes 1M \
        --max-bytes 256M --factor 4 --iters 3 --trials 3 --out "$out/transport-socket.jsonl" >>"$out/transports.log"
      for t in nvlink shm socket; do echo "== $t"; summ "$out/transport-$t.jsonl" --algorithms native,ring,direct,auto; done ;;
    p2p-channels)
      for setting in default 32 32-chunk2m; do
        env_=(); [ $setting != default ] && env_+=(NCCL_MIN_P2P_NCHANNELS=32)
        [ $setting = 32-chunk2m ] && env_+=(NCCL_P2P_NVL_CHUNKSIZE=2097152)
        env "${env_[@]}" DTRAIN_COMM_TRANSPORT=p2p timeout "${LIMIT:-90}" torchrun --nproc-per-node "$n" -m dtrain bench comm \
          --algorithms native,ring,direct --min-bytes 16M --max-bytes 1G --factor 4 --iters 10 --trials 3 \
          --out "$out/p2p_channels-$setting.jsonl" >"$out/p2p_channels-$setting.log" 2>&1
        echo "== $setting"; summ "$out/p2p_channels-$setting.jsonl" --algorithms native,ring,direct
      done ;;
    defaults)
      for fresh in "" --fresh; do
        name=defaults${fresh:+-fresh}
        LIMIT=${LIMIT:-300} tr -m dtrain bench comm --collectives $sym,broadcast --algorithms torch,native,auto \
          --min-bytes ${DEFAULTS_MIN:-8K} --max-bytes ${DEFAULTS_MAX:-1G} --factor ${DEFAULTS_FACTOR:-4} --iters 20 \
          --trials 5 --warm-s 0.3 $fresh \
          --out "$out/$name.jsonl" >"$out/$name.log"
        echo "== $name"; for c in all_reduce all_gather reduce_scatter all_to_all broadcast; do
          summ "$out/$name.jsonl" --collective $c --algorithms torch,native,auto; done
      done ;;
    defaults-beside)
      # the same sweep in one launch, fresh tensors beside the same ones (rows NAME+fresh)
      LIMIT=${LIMIT:-420} tr -m dtrain bench comm --collectives $sym,broadcast --algorithms torch,native,auto \
        --min-bytes ${DEFAULTS_MIN:-8K} --max-bytes ${DEFAULTS_MAX:-1G} --factor ${DEFAULTS_FACTOR:-4} --iters 20 \
        --trials 5 --warm-s 0.3 --fresh-beside --out "$out/defaults-beside.jsonl" >"$out/defaults-beside.log"
      echo "== defaults-beside"; for c in all_reduce all_gather reduce_scatter all_to_all broadcast; do
        summ "$out/defaults-beside.jsonl" --collective $c --algorithms torch,auto,torch+fresh,auto+fresh; done ;;
    reduce-beside)
      LIMIT=${LIMIT:-200} tr -m dtrain bench comm --collectives reduce --algorithms torch,native,star,auto \
        --min-bytes 8K --max-bytes 32M --factor 2 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside \
        --out "$out/reduce_one_pass.jsonl" >"$out/reduce_one_pass.log"
      LIMIT=${LIMIT:-300} tr -m dtrain bench comm --collectives reduce --algorithms torch,native,auto \
        --min-bytes 8K --max-bytes 1G --factor 4 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside \
        --out "$out/reduce_defaults.jsonl" >"$out/reduce_defaults.log"
      summ "$out/reduce_one_pass.jsonl" --collective reduce --algorithms torch,star,star+fresh
      summ "$out/reduce_defaults.jsonl" --collective reduce --algorithms torch,auto,auto+fresh ;;
    large-beside)
      # the defaults from 4 MiB on NP GPUs (default all), fresh tensors beside the same ones: where auto runs NCCL's
      # own call on the group's wide communicator (native_wide)
      LIMIT=${LIMIT:-300} tr -m dtrain bench comm --collectives $sym,broadcast --algorithms torch,native,auto \
        --min-bytes 4M --max-bytes 1G --factor 4 --iters 20 --trials 5 --warm-s 0.3 --fresh-beside \
        --out "$out/collectives_wide.jsonl" >"$out/collectives_wide.log"
      for c in all_reduce all_gather reduce_scatter all_to_all broadcast; do
        summ "$out/collectives_wide.jsonl" --collective $c --algorithms torch,auto,torch+fresh,auto+fresh; done ;;
    one-shot-ar)
      LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify.txt"; counts verify "$out/verify.txt"
      for np_ in ${ONE_PASS_NP:-$n ${NP_SMALL:-2}}; do
        for fresh in "" --fresh; do
          name=one_shot_ar${fresh:+-fresh}-np$np_
          NP=$np_ LIMIT=${LIMIT:-150} tr -m dtrain bench comm --collectives all_reduce \
            --algorithms torch,native,one_shot,direct,auto --min-bytes ${AR_MIN:-8K} --max-bytes 16M \
            --factor ${AR_FACTOR:-4} --iters 20 \
            --trials 5 --warm-s 0.3 $fresh --out "$out/$name.jsonl" >"$out/$name.log"
          echo "== $name"; summ "$out/$name.jsonl" --collective all_reduce --algorithms torch,native,one_shot,direct,auto
        done
      done ;;
    two-shot)
      LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify.txt"; counts verify "$out/verify.txt"
      for np_ in ${ONE_PASS_NP:-$n ${NP_SMALL:-2}}; do
        for fresh in "" --fresh; do
          name=two_shot${fresh:+-fresh}-np$np_
          NP=$np_ LIMIT=${LIMIT:-150} tr -m dtrain bench comm --collectives all_reduce,broadcast \
            --algorithms torch,native,one_shot,direct,star,scatter_allgather,auto --min-bytes ${TWO_SHOT_MIN:-1M} \
            --max-bytes ${TWO_SHOT_MAX:-64M} --factor 2 --iters 20 --trials 5 --warm-s 0.3 $fresh \
            --out "$out/$name.jsonl" >"$out/$name.log"
          echo "== $name"
          summ "$out/$name.jsonl" --collective all_reduce --algorithms torch,native,one_shot,direct,auto
          summ "$out/$name.jsonl" --collective broadcast --algorithms torch,native,star,scatter_allgather,auto
        done
      done ;;
    one-pass-gather)
      export DTRAIN_COMM_ONE_PASS=1
      LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify-one-pass.txt"; counts "verify, one pass" "$out/verify-one-pass.txt"
      for np_ in ${ONE_PASS_NP:-$n ${NP_SMALL:-2}}; do
        for fresh in "" --fresh; do
          name=one_pass_gather${fresh:+-fresh}-np$np_
          NP=$np_ LIMIT=${LIMIT:-150} tr -m dtrain bench comm --collectives all_gather,all_to_all \
            --algorithms torch,native,direct,auto --min-bytes 8K --max-bytes 16M --factor 4 --iters 20 --trials 5 \
            --warm-s 0.3 $fresh --out "$out/$name.jsonl" >"$out/$name.log"
          echo "== $name"; for c in all_gather all_to_all; do
            summ "$out/$name.jsonl" --collective $c --algorithms torch,native,direct,auto; done
        done
      done
      unset DTRAIN_COMM_ONE_PASS ;;
    one-pass)
      export DTRAIN_COMM_ONE_PASS=1
      LIMIT=${LIMIT:-150} tr -m dtrain bench verify >"$out/verify-one-pass.txt"; counts "verify, one pass" "$out/verify-one-pass.txt"
      for np_ in ${ONE_PASS_NP:-$n ${NP_SMALL:-2}}; do
        for fresh in "" --fresh; do
          name=one_pass${fresh:+-fresh}-np$np_
          # one launch for the three whose one-pass schedule is direct, one for broadcast's star
          for part in all_gather,reduce_scatter,all_to_all:direct broadcast:star; do
            NP=$np_ LIMIT=${LIMIT:-150} tr -m dtrain bench comm --collectives "${part%:*}" \
              --algorithms "torch,native,${part#*:},auto" --min-bytes 8K --max-bytes ${ONE_PASS_MAX:-64M} --factor 4 \
              --iters 20 --trials 5 --warm-s 0.3 $fresh --out "$out/$name-${part#*:}.jsonl" >"$out/$name-${part#*:}.log"
          done
          cat "$out/$name"-direct.jsonl "$out/$name"-star.jsonl >"$out/$name.jsonl" && rm -f "$out/$name"-{direct,star}.jsonl
          echo "== $name"; for c in all_gather reduce_scatter all_to_all broadcast; do
            a=direct; [ $c = broadcast ] && a=star
            summ "$out/$name.jsonl" --collective $c --algorithms torch,native,$a,auto; done
        done
      done
      unset DTRAIN_COMM_ONE_PASS ;;
    bench-pipeline)
      LIMIT=${LIMIT:-300} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch 1024 --microbatches 8,16 \
        --graphs --transport group,peer --out "$out/bench_pipeline.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread" ;;
    bench-pipeline-step)
      LIMIT=${LIMIT:-420} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "${BATCH:-1024}" \
        --microbatches 8,16 --graphs "${GRAPHS:-actions,step}" --transport auto \
        --out "$out/bench_pipeline_step-b${BATCH:-1024}.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread" ;;
    pipeline-groups)
      for b in ${GROUP_BATCHES:-1024 4096}; do
        LIMIT=${LIMIT:-280} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" --microbatches 8,16 \
          --schedules 1f1b,interleaved-1f1b --microbatch-group 0,$((2 * n)),$((4 * n)) --graphs actions,step \
          --transport auto --out "$out/pipeline_groups-b$b.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread"
      done ;;
    pipeline-engines)
      b=${ENGINE_BATCH:-1024}
      NP=2 LIMIT=${LIMIT:-120} tr benchmarks/collectives/probe.py channel-latency >"$out/probe-channel-latency.txt"
      cat "$out/probe-channel-latency.txt"
      LIMIT=${LIMIT:-300} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" --microbatches 8,16 \
        --schedules 1f1b,interleaved-1f1b --graphs step --transport peer --no-torch \
        --send-engine stream,inline,kernel,stream --out "$out/pipeline_engines-b$b.jsonl" \
        | grep -vE "^\[rank[0-9]+\]:\[W|^Thread"
      LIMIT=${LIMIT:-200} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" --microbatches 16 \
        --schedules 1f1b,interleaved-1f1b --graphs step --transport peer --no-torch --in-place yes,no,yes \
        --out "$out/pipeline_in_place_ab-b$b.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread" ;;
    pipeline-steady)
      for b in ${STEADY_BATCHES:-1024 4096}; do
        LIMIT=${LIMIT:-280} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" --microbatches 8,16 \
          --graphs step --transport auto --steps 8 --out "$out/pipeline_steady-b$b.jsonl" \
          | grep -vE "^\[rank[0-9]+\]:\[W|^Thread"
      done ;;
    pipeline-fusion)
      NP=1 LIMIT=${LIMIT:-120} tr benchmarks/training/grad_accumulation.py --out "$out/grad_accumulation.jsonl"
      for b in ${FUSION_BATCHES:-1024 4096}; do
        LIMIT=${LIMIT:-300} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" --microbatches 8,16 \
          --schedules 1f1b,interleaved-1f1b,zb-h1 --graphs step --transport auto --steps 8 --grad-fusion no,yes \
          --out "$out/pipeline_fusion-b$b.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread"
      done ;;
    bench-pipeline-large)
      # micro-batches of 256-512 rows: the stages' compute outweighs the host's time per action
      LIMIT=${LIMIT:-480} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch 4096 --microbatches 8,16 \
        --graphs --transport group,peer --out "$out/bench_pipeline-b4096.jsonl" | grep -vE "^\[rank[0-9]+\]:\[W|^Thread" ;;
    pipeline-transport)
      # batch 4096 (m = 8, 16) eager; batch 1024 (m = 16, 64-row micro-batches, host-bound) eager and as graphs
      for b in ${TRANSPORT_BATCHES:-4096 1024}; do
        if [ "$b" = 4096 ]; then
          extra="--microbatches 8,16 --schedules ${TRANSPORT_SCHEDULES:-1f1b,interleaved-1f1b,zb-h1,zb-v}"
        else
          extra="--microbatches 16 --schedules ${TRANSPORT_SCHEDULES:-1f1b,interleaved-1f1b} --graphs"
        fi
        LIMIT=${LIMIT:-280} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch "$b" $extra --no-torch \
          --transport group,peer --lookahead "${TRANSPORT_LOOKAHEAD:-0,2}" --out "$out/pipeline_transport-b$b.jsonl" \
          | grep -vE "^\[rank[0-9]+\]:\[W|^Thread"
      done ;;
    pipeline-profile)
      # where the host's time per action goes with micro-batches of 64 rows: cProfile around each rank's timed steps
      LIMIT=${LIMIT:-200} tr -m dtrain bench pipeline --layers 16 --width 4096 --batch 1024 --microbatches 16 \
        --schedules 1f1b,interleaved-1f1b --no-torch --graphs --profile "$out/pipeline-profile" \
        --out "$out/pipeline_profile.jsonl" | grep -vE "^\[|Thread"
      python3 -c 'import glob, pstats, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.prof")):
    print("==", f); pstats.Stats(f, stream=sys.stdout).sort_stats("tottime").print_stats(25)' \
        "$out/pipeline-profile" >"$out/pipeline_profile.txt"; grep -c "==" "$out/pipeline_profile.txt"
      rm -r "$out/pipeline-profile" ;;
    dp)
      for b in 32 16; do
        LIMIT=${LIMIT:-120} tr benchmarks/training/dp_zero.py --sections dp --sizes 4 1 --batch-per-rank $b --stall-s 110 ${DP_EXTRA:-} \
          --out "$out/dp_vs_ddp-b$b.jsonl" | grep "^timed" | paste -sd' '
      done
      python3 benchmarks/training/dp_summary.py "$out" ;;
    dp-bind)
      # 16 sequences a GPU, twice unbound and twice with each rank bound to its own cores (benchmarks/gpu/bind.py)
      for launch in 1 2 3 4; do
        how=plain pre=(); [ $((launch % 2)) = 0 ] && how=bound pre=(--no-python python3 benchmarks/gpu/bind.py python3)
        LIMIT=${LIMIT:-150} tr "${pre[@]}" benchmarks/training/dp_zero.py --sections dp --sizes 4 1 --batch-per-rank 16 \
          --variants ours-auto local --stall-s 140 --out "$out/dp_vs_ddp-bind_$how-launch$launch-b16.jsonl" | grep "^timed"
      done ;;
    dp-profile)
      LIMIT=${LIMIT:-240} tr benchmarks/training/dp_zero.py --sections dp --sizes 4 1 --batch-per-rank ${DP_BATCHES:-16 32} \
        --stall-s 220 --profile "$out/dp-profile" --profile-steps 5 ${DP_EXTRA:-} --out "$out/dp_profile.jsonl" \
        | grep -E "^timed|enqueues|span"
      cat "$out"/dp-profile/*.txt >"$out/dp_profile.txt" && rm -r "$out/dp-profile" ;;
    zero) tr benchmarks/training/dp_zero.py --sections zero --stall-s 140 --out "$out/zero.jsonl" | grep "^timed" | paste -sd' ' ;;
    tp) LIMIT=${LIMIT:-120} tr benchmarks/training/tp_pp.py --sections tp --sizes 4 1 --stall-s 110 --out "$out/tp.jsonl" | tail -4 ;;
    pp) tr benchmarks/training/tp_pp.py --sections pp --pp-width 4096 --pp-batch 8192 --microbatches 2 4 8 \
          --pp-warmup 2 --pp-iters 3 --pp-trials 3 --pp-budget-s 3 --stall-s 45 --out "$out/pp.jsonl" | cut -c1-200 ;;
    bubble)
      bub() { timeout "$1" torchrun --nproc-per-node "$2" benchmarks/pipeline/bubble.py --layers 32 --width 4096 \
          --batch 8192 --stall-s 40 "${@:3}" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$|^Thread 0x|no Python frame"; }
      bub 100 2 --out "$out/bubble-p2.jsonl"
      bub 150 4 --microbatches 16 8 4 1 2 --out "$out/bubble-p4.jsonl"
      python3 benchmarks/pipeline/bubble.py --report "$out"/bubble-p*.jsonl --plot "$out/bubble.png" ;;
    llama)
      # a Llama-family model (LLAMA_PRESET, default 1b) in bf16, dp over every GPU: dtrain against DDP and FSDP2
      rm -f "$out/llama_${LLAMA_PRESET:-1b}_dp.jsonl"
      # each eager and with every block and the loss compiled (LLAMA_VARIANTS, LLAMA_COMPILE narrow it down)
      for compiled in ${LLAMA_COMPILE:-no yes}; do
        for variant in ${LLAMA_VARIANTS:-ddp dtrain fsdp2 dtrain-bf16-reduce}; do
          flags=(); [ "$compiled" = yes ] && flags=(--compile)
          LIMIT=${LIMIT:-200} tr benchmarks/training/llama.py --preset "${LLAMA_PRESET:-1b}" --seq-len 2048 \
            --batch-per-gpu "${LLAMA_BATCH:-4}" --steps 20 --warmup 5 --variants $variant "${flags[@]}" \
            ${LLAMA_PROFILE:+--profile "$out/llama_profile.txt"} \
            --out "$out/llama_${LLAMA_PRESET:-1b}_dp.jsonl" | grep -E "ms/step|x DDP" | tail -9
        done
      done ;;
    plan-score)
      python3 -m dtrain bench compute --out "$out/bench_compute.jsonl" --write-curves dtrain/sim/compute_curves.json | tail -1
      cp dtrain/sim/compute_curves.json "$out/"
      python3 -m dtrain plan --config "${PLAN_CONFIG:-configs/llama-1b-gpu.toml}" --topology h100-node --devices "$n" \
        --write "$out/plan.toml"
      LIMIT=${LIMIT:-400} tr -m dtrain train --config "$out/plan.toml" --steps "${PLAN_STEPS:-20}" --warmup-steps 2 \
        --eval-every 0 --checkpoint-every 0 --no-export --no-tensorboard --out "$out/planrun" | tail -2 | cut -c1-300
      cp "$out/planrun/plan_score.json" "$out/" && rm -rf "${out:?}/planrun"
      cat "$out/plan_score.json" ;;
    largest)
      # one launch per (variant, depth); a failed launch (out of memory) ends that variant's climb
      for variant in ${LARGEST_VARIANTS:-dtrain-zero3 fsdp2}; do
        layers=${LARGEST_FROM:-64}
        while [ "$layers" -le "${LARGEST_TO:-120}" ]; do
          PYTORCH_CUDA_ALLOC_CONF=${LARGEST_ALLOC-expandable_segments:True} LIMIT=${LIMIT:-150} \
            tr benchmarks/training/llama.py --preset 8b --layers "$layers" --seq-len 2048 \
            --batch-per-gpu 1 --steps 2 --warmup 1 --activation-checkpointing full --variants $variant \
            --out "$out/largest.jsonl" >"$out/largest-$variant-$layers.log" 2>&1
          if grep -q "ms/step" "$out/largest-$variant-$layers.log"; then
            echo "$variant $layers blocks: $(grep ms/step "$out/largest-$variant-$layers.log" | head -1)"
          else
            why=$(grep -m1 -oE "OutOfMemoryError|Error[A-Za-z]*" "$out/largest-$variant-$layers.log" || echo "no result")
            echo "$variant $layers blocks: failed: $why"
            echo "{\"variant\": \"$variant\", \"preset\": \"8b\", \"layers\": $layers, \"failed\": \"$why\"}" >>"$out/largest.jsonl"
            break
          fi
          layers=$((layers + ${LARGEST_STEP:-8}))
        done
      done ;;
    llama-layouts)
      # dtrain train on the same model, global batch and data in each layout over every GPU, 100 steps each
      # (LLAMA_LAYOUTS=first|more|all: the first four, the rest, or both)
      layouts=("--dp $n" "--tp $n" "--pp $n --microbatches 4")
      [ "$n" -ge 4 ] && layouts+=("--dp $((n / 2)) --tp 2")
      more=("--tp 2 --pp $((n / 2)) --microbatches 4" "--dp $n --zero 3" "--dp $n --zero 3 --activation-checkpointing full")
      case ${LLAMA_LAYOUTS:-all} in first) ;; more) layouts=("${more[@]}") ;; *) layouts+=("${more[@]}") ;; esac
      for layout in "${layouts[@]}"; do
        name=${layout//[ -]/}; name=${name/activationcheckpointingfull/ac}; name=llama_${LLAMA_PRESET:-1b}_${name/microbatches4/}
        LIMIT=${LIMIT:-300} tr -m dtrain train --preset "${LLAMA_PRESET:-1b}" $layout --seq-len 2048 --batch-size 16 \
          --steps "${LLAMA_STEPS:-100}" --lr 3e-4 --warmup-steps 10 --set data.tokenizer_vocab=8192 --precision bf16 \
          --no-export --no-tensorboard --out "$out/$name" | tail -1 | cut -c1-250
        cp "$out/$name/metrics.jsonl" "$out/$name.jsonl" && rm -rf "${out:?}/$name"
      done ;;
    probe-port) LIMIT=${LIMIT:-240} tr benchmarks/collectives/probe.py port --out "$out/port.jsonl" | grep -E "MiB|barrier" ;;
    probe-port-chain)
      LIMIT=${LIMIT:-240} tr benchmarks/collectives/probe.py port --patterns "chain read,chain read 2 outs,read 1 ring,read 1 ring 2 outs" \
        --sizes-mib 16,64,256 --out "$out/port-chain.jsonl" | grep -E "MiB|barrier" ;;
    probe-chain) tr benchmarks/collectives/probe.py chain | tee "$out/probe-chain.txt" ;;
    probe-chain-channels)
      for fresh in "" --fresh; do
        LIMIT=${LIMIT:-200} tr benchmarks/collectives/probe.py chain-channels $fresh \
          | tee "$out/probe-chain-channels${fresh:+-fresh}.txt" | grep -E "api ring|ce-push" ; done ;;
    probe-direct-broadcast)
      LIMIT=${LIMIT:-200} tr benchmarks/collectives/probe.py direct-broadcast >"$out/probe-direct-broadcast.txt"
      LIMIT=${LIMIT:-200} tr benchmarks/collectives/probe.py direct-broadcast --fresh >>"$out/probe-direct-broadcast.txt"
      grep -E "api ring|WRONG" "$out/probe-direct-broadcast.txt"
      if [ "${NP:-$n}" = 2 ]; then
        LIMIT=${LIMIT:-100} tr benchmarks/collectives/probe.py direct-broadcast --lone --sizes 16,64,256,1024 \
          | tee "$out/probe-direct-broadcast-lone.txt"
      fi ;;
    probe-direct-reduce)
      LIMIT=${LIMIT:-200} tr benchmarks/collectives/probe.py direct-reduce >"$out/probe-direct-reduce.txt"
      LIMIT=${LIMIT:-200} tr benchmarks/collectives/probe.py direct-reduce --fresh >>"$out/probe-direct-reduce.txt"
      grep -E "api ring|bare|WRONG" "$out/probe-direct-reduce.txt" ;;
    probe-chain-timeline)
      for form in pull push; do
        flag=""; [ $form = push ] && flag=--push
        tr benchmarks/collectives/probe.py chain-timeline $flag --out-dir "$out/chain-timeline-$form" | tail -5
      done ;;
    probe-watchdog) python3 benchmarks/collectives/probe.py watchdog 2>&1 | grep " us$" | tee "$out/probe-watchdog.txt" ;;
    probe-*) tr benchmarks/collectives/probe.py "${mode#probe-}" | tee "$out/$mode.txt" ;;
    *) echo "run.sh: unknown MODE '$mode' (benchmarks/gpu/run.sh --help lists them)" >&2; exit 2 ;;
  esac
  echo "mode $mode: $((SECONDS - start)) s"
done
