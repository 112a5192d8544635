#!/usr/bin/env bash
# Site adapter of the reference run: job header, container and node discovery only. Every
# experiment setting lives in run_glm5_2_744b_a40b_daytona.py, which gets this script's own
# arguments and runs one srun step per service from the first node of the job.
#
#   sbatch examples/glm52_tbench2/launch_16node_slurm.sh train
#   sbatch --nodes=2 examples/glm52_tbench2/launch_16node_slurm.sh train --smoke
#   sbatch examples/glm52_tbench2/launch_16node_slurm.sh plan
#
# Environment (all optional):
#   RIPTIDE_CONTAINER     container image; every step runs in it (pyxis: --container-image)
#   RIPTIDE_MOUNTS        container mounts, e.g. /data:/data,/models:/models,/local:/local
#   RIPTIDE_PYTHON        the Python that has Riptide installed (default: python3)
#   RIPTIDE_HEAD_ADDRESS  the first node's fabric address (default: its first `hostname -I`)
#   RIPTIDE_FABRIC_IF     pick the head address of this interface instead (e.g. ib0)
#SBATCH --job-name=riptide-glm52
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=riptide-%j.out
# Sites with GPU scheduling add: #SBATCH --gpus-per-node=4
set -euo pipefail

# sbatch runs a spooled copy of this script: find the recipe beside the submitted one.
SCRIPT="$(scontrol show job "$SLURM_JOB_ID" -o | sed -n 's/.* Command=\([^ ]*\).*/\1/p')"
HERE="$(cd "$(dirname "${SCRIPT:-${BASH_SOURCE[0]}}")" && pwd)"
PYTHON="${RIPTIDE_PYTHON:-python3}"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"

CONTAINER_ARGS=()
if [ -n "${RIPTIDE_CONTAINER:-}" ]; then
  CONTAINER_ARGS=(--container-image="$RIPTIDE_CONTAINER" --container-workdir="$PWD")
  [ -n "${RIPTIDE_MOUNTS:-}" ] && CONTAINER_ARGS+=(--container-mounts="$RIPTIDE_MOUNTS")
fi

head_address() {
  if [ -n "${RIPTIDE_FABRIC_IF:-}" ]; then
    srun --overlap -N1 -n1 -w "$HEAD" ip -4 -o addr show "$RIPTIDE_FABRIC_IF" |
      awk '{split($4, a, "/"); print a[1]; exit}'
  else
    srun --overlap -N1 -n1 -w "$HEAD" hostname -I | awk '{print $1}'
  fi
}
HEAD_ADDRESS="${RIPTIDE_HEAD_ADDRESS:-$(head_address)}"
[ -n "$HEAD_ADDRESS" ] || { echo "no address found for $HEAD" >&2; exit 2; }

SRUN_ARGS=()
for arg in "${CONTAINER_ARGS[@]}"; do SRUN_ARGS+=(--srun-arg="$arg"); done

COMMAND="${1:-train}"; shift || true
# The recipe itself runs on this (the first) node, in the container when there is one.
exec "$PYTHON" "$HERE/run_glm5_2_744b_a40b_daytona.py" "$COMMAND" \
  --nodes "$(IFS=,; echo "${NODES[*]}")" --head-address "$HEAD_ADDRESS" \
  "${SRUN_ARGS[@]}" "$@"
