#!/usr/bin/env bash
# Slurm adapter for the reference run: one service per srun step, no experiment settings here
# (they live in deploy.toml). Usage: sbatch --nodes=16 --gpus-per-node=4 slurm.sh
#   RIPTIDE_TOKEN_FILE  file (mode 0600) holding the admin token
#   DAYTONA_API_KEY     in the environment of the sandbox step (or a file sourced here)
# Nodes 0-7 train, nodes 8-15 each run one SGLang engine; node 0 also runs Redis, the router,
# the sandbox and the rollout service. The trainer is one srun step over the 8 training nodes,
# one rank per GPU (parallel.launcher = "external"): rank 0 lands on node 0 and serves, the
# other ranks meet it at MASTER_ADDR:MASTER_PORT. Its checkpoint dir must be on a filesystem
# every training node shares (each rank writes its shard into the same step folder).
#SBATCH --job-name=riptide-glm52
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/deploy.toml}"
MODEL_FP8="${MODEL_FP8:-/models/glm-5.2-fp8}"
ENGINE_PORT=30000
TRAINER_RENDEZVOUS_PORT=29500
GPUS_PER_NODE="${GPUS_PER_NODE:-4}"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#NODES[@]} >= 10 )) || { echo "need at least 10 nodes, got ${#NODES[@]}" >&2; exit 2; }
HEAD="${NODES[0]}"
TRAIN=("${NODES[@]:0:8}")
INFER=("${NODES[@]:8}")

[ -r "${RIPTIDE_TOKEN_FILE:-}" ] || { echo "set RIPTIDE_TOKEN_FILE" >&2; exit 2; }
# Secrets travel in the environment (srun passes it on), never on a command line.
RIPTIDE_ADMIN_TOKEN="$(cat "$RIPTIDE_TOKEN_FILE")"
export RIPTIDE_ADMIN_TOKEN
urls=""
for node in "${INFER[@]}"; do urls+="\"http://$node:$ENGINE_PORT\","; done
SETS=(--set "redis.url=\"redis://$HEAD:6379/0\""
      --set "rollout.fleet.attach_urls=[${urls%,}]"
      --set "trainer.weight_sync.rollout_address=\"$HEAD:50052\"")
for svc in router sandbox rollout; do SETS+=(--set "$svc.host=\"$HEAD\""); done
SETS+=(--set "trainer.host=\"$HEAD\"" --set "trainer.weight_sync.master_address=\"$HEAD\"")

step() {  # step NODE NAME COMMAND...: one srun step on one node, logged per step
  local node="$1" name="$2"; shift 2
  srun --nodes=1 --ntasks=1 -w "$node" --output="logs/%j-$name.log" "$@" &
}
mkdir -p logs
step "$HEAD" redis redis-server --bind 0.0.0.0 --protected-mode no --appendonly yes
for i in "${!INFER[@]}"; do
  step "${INFER[$i]}" "engine-$i" python -m sglang.launch_server --model-path "$MODEL_FP8" \
    --host 0.0.0.0 --port "$ENGINE_PORT" --tp-size 4 --dp-size 4 --ep-size 4 \
    --enable-dp-attention --mem-fraction-static 0.85 --kv-cache-dtype fp8_e4m3 \
    --page-size 64 --chunked-prefill-size 32768 --max-running-requests 256 \
    --cuda-graph-max-bs 32 --enable-metrics --weight-version 0
done
step "$HEAD" router riptide serve router --config "$CONFIG" "${SETS[@]}"
step "$HEAD" sandbox riptide serve sandbox --config "$CONFIG" "${SETS[@]}"
step "$HEAD" rollout riptide serve rollout --config "$CONFIG" "${SETS[@]}"
srun --nodes="${#TRAIN[@]}" --ntasks-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1 \
  -w "$(IFS=,; echo "${TRAIN[*]}")" --output="logs/%j-trainer-%t.log" \
  env MASTER_ADDR="$HEAD" MASTER_PORT="$TRAINER_RENDEZVOUS_PORT" \
  riptide serve trainer --config "$CONFIG" "${SETS[@]}" &
wait -n  # the first step to exit ends the job; Slurm then stops the others
