#!/bin/bash
# Plain sbatch entry for people who don't use launch.py.
#
#   sbatch sbatch/libra.sh                                  # configs/default.yaml
#   sbatch sbatch/libra.sh configs/a800-6node.yaml          # another experiment
#   sbatch -N 6 --ntasks-per-node=8 --gpus-per-node=8 sbatch/libra.sh configs/a800-6node.yaml rl.steps=50
#   CONFIG=configs/x.yaml sbatch sbatch/libra.sh
#
# Arguments after the config are KEY=VALUE overrides (as launch.py --set). The allocation
# decides the world's shape: cluster.nodes and cluster.gpus_per_node are taken from it.
# One task per GPU (--ntasks-per-node = --gpus-per-node); the MPI world has one more
# rank, the controller, which shares the first node (--overcommit).
#SBATCH --job-name=libra
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR2@120
#SBATCH --requeue
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

CONFIG="${1:-${CONFIG:-configs/default.yaml}}"
shift $(( $# > 0 ? 1 : 0 ))
PYTHON="${PYTHON:-python}"

# Slurm does not create folders for --output: make logs/<name>-<id>/ and move the output
# file in (the open file follows the rename).
LOG_DIR="logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"
mkdir -p "$LOG_DIR"
# A requeued job (same id, same folder) keeps the earlier runs' output as slurm.out.<n>.
OUT_NAME="slurm.out"
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then OUT_NAME="slurm.out.${SLURM_RESTART_COUNT}"; fi
if [ -f "logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.out" ]; then
    mv "logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.out" "$LOG_DIR/$OUT_NAME"
fi

NODES="$SLURM_JOB_NUM_NODES"
GPUS="${SLURM_NTASKS_PER_NODE:?submit with --ntasks-per-node equal to --gpus-per-node}"
OVERRIDES=(--set "cluster.nodes=$NODES" --set "cluster.gpus_per_node=$GPUS")
for kv in "$@"; do OVERRIDES+=(--set "$kv"); done

echo "libra: job $SLURM_JOB_ID, $NODES nodes x $GPUS GPUs, config $CONFIG, log folder $LOG_DIR"
# A requeue marker is this run's to write: one an earlier run left (its script was killed
# before it read it) would requeue a job that finished; so would an earlier stop note
# (below) stop this run.
rm -f "$LOG_DIR/REQUEUE" "$LOG_DIR/STOP"
# Slurm's warning before the time limit (--signal=B:USR2@N) comes to this shell only: it
# tells rank 0 through the log folder (rank 0 reads STOP, then checkpoints and asks for a
# requeue), and no process of the job step is signalled (a vLLM instance's TP workers or a
# tool's sandbox would die of USR2). The step runs in the background so that the trap runs
# at once; `wait` returns early when it does, and is called again until srun has ended.
# MPICH over UCX can publish an address line longer than Slurm's pmi2 plugin reads at once,
# and the world then dies in MPI_Init; OFI's addresses are short. On a fabric (verbs, efa,
# cxi) set FI_PROVIDER before sbatch (WORLD_STEP_DEFAULTS in libra_hpc/cluster/slurm.py).
export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"
export FI_PROVIDER="${FI_PROVIDER:-tcp}"
trap 'echo "SIGUSR2 (the time-limit warning, to the batch shell at $(date -Is))" > "$LOG_DIR/STOP"' USR2
srun --mpi=pmi2 --overcommit --kill-on-bad-exit=1 \
    --nodes="$NODES" --ntasks=$(( NODES * GPUS + 1 )) \
    "$PYTHON" -m libra_hpc.run --config "$CONFIG" --log-dir "$LOG_DIR" "${OVERRIDES[@]}" &
SRUN=$!
while :; do
    STATUS=0
    wait "$SRUN" || STATUS=$?
    kill -0 "$SRUN" 2>/dev/null || break
done

# A rank that died ended the world: name it (rank, role, node, last activity) from srun's
# report and the heartbeats, and ask for a requeue while requeues are left.
if [ "$STATUS" -ne 0 ]; then
    "$PYTHON" -m libra_hpc.runtime.heartbeat "$LOG_DIR" "$LOG_DIR/$OUT_NAME" || true
fi

# The time-limit warning (USR2) stopped the run after a checkpoint, or a rank was lost,
# and the controller found requeues left (cluster.max_requeues): come back as the same
# job, which resumes from the newest checkpoint in $LOG_DIR.
if [ -f "$LOG_DIR/REQUEUE" ]; then
    echo "libra: $(cat "$LOG_DIR/REQUEUE"); requeueing job $SLURM_JOB_ID"
    rm -f "$LOG_DIR/REQUEUE"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$STATUS"
