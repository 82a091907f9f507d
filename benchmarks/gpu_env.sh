# Sourced by the session-5 GPU scripts: NVLink multicast off, dtrain from this checkout with its defaults (no
# DTRAIN_COMM_* set), and tr: torchrun on every GPU (NP=... for fewer) under LIMIT seconds, warnings filtered.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DTRAIN_COMM_TRANSPORT DTRAIN_COMM_PERSISTENT DTRAIN_COMM_PEER_MODE DTRAIN_COMM_TIMEOUT DTRAIN_COMM_RULES
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tr() { timeout "${LIMIT:-120}" torchrun --nproc-per-node "${NP:-$n}" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
