# Shared by the sbatch templates in this folder: where logs go, and the requeue decision.
# Sourced, not run. Expects the bridge arguments (recipe and overrides) in "$@".

set -euo pipefail

export PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
LOG_DIR=${LOG_DIR:-logs/${SLURM_JOB_NAME:-bridge}}
mkdir -p "$LOG_DIR"
LOG_FILE="$LOG_DIR/${SLURM_JOB_ID:-local}.log"
PYTHON=${PYTHON:-python}

# Megatron-LM's way to stop before the time limit: save and exit cleanly after EXIT_MINUTES.
# Defaults to the job's time limit minus 10 minutes when Slurm reports one.
if [[ -z "${EXIT_MINUTES:-}" && -n "${SLURM_JOB_ID:-}" ]]; then
    limit=$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null || true)   # [D-]HH:MM:SS or UNLIMITED
    if [[ "$limit" =~ ^(([0-9]+)-)?([0-9]+):([0-9]+):([0-9]+)$ ]]; then
        EXIT_MINUTES=$(( ${BASH_REMATCH[2]:-0} * 1440 + 10#${BASH_REMATCH[3]} * 60 + 10#${BASH_REMATCH[4]} - 10 ))
    fi
fi
BRIDGE_ARGS=("$@" "train.exit_signal_handler=true")
if [[ -n "${EXIT_MINUTES:-}" ]]; then
    BRIDGE_ARGS+=("train.exit_duration_in_mins=$EXIT_MINUTES")
fi

# The resolved train.train_iters and checkpoint.save of this run (one --dry-run on this node).
read_plan() {
    "$PYTHON" -m bridge_cli pretrain "${BRIDGE_ARGS[@]}" --dry-run 2>/dev/null | awk '
        /^train:/ {section="train"} /^checkpoint:/ {section="checkpoint"} /^[a-z_]+:/ && !/^(train|checkpoint):/ {section=""}
        section=="train" && $1=="train_iters:" {iters=$2}
        section=="checkpoint" && $1=="save:" {save=$2}
        END {print iters, save}'
}

# After the run: requeue the job when it saved a checkpoint short of train.train_iters
# (time limit reached or SIGTERM); the next start resumes from it (--resume auto).
requeue_if_unfinished() {
    local iters save done
    read -r iters save < <(read_plan)
    if [[ -z "$save" || "$save" == "null" ]]; then
        echo "bridge: checkpoint.save is not set; nothing to resume from, not requeueing" | tee -a "$LOG_FILE"
        return
    fi
    done=$(cat "$save/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
    if [[ "$done" =~ ^[0-9]+$ && "$done" -lt "$iters" && -n "${SLURM_JOB_ID:-}" ]]; then
        echo "bridge: stopped at iteration $done of $iters; requeueing job $SLURM_JOB_ID" | tee -a "$LOG_FILE"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}
