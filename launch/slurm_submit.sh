#!/usr/bin/env bash
# Submits launch/slurm_gpu.sbatch with the job shape (nodes x GPUs per node,
# one process per GPU) and the training settings given here.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: launch/slurm_submit.sh [settings] [-- memjax.train flags]

Submits a job of --nodes nodes with --gpus-per-node GPUs each and one training
process per GPU; the job runs in this checkout (shared filesystem) and logs to
--output.

Example (2 nodes x 8 GPUs = 16 processes):
  launch/slurm_submit.sh --nodes=2 --gpus-per-node=8 --partition=gpu \\
      --config=configs/transformer_xl_wt103_base.py --workdir=/shared/runs/wt103
EOF
  print_settings
}

define_common_flags
define_flag nodes 1 'Number of nodes.'
define_flag gpus-per-node 8 'GPUs per node; one training process runs per GPU.'
define_flag partition '' 'SLURM partition; empty uses the cluster default.'
define_flag account '' 'SLURM account; empty uses your default account.'
define_flag time '' 'Time limit (e.g. 24:00:00); empty uses the partition default.'
define_flag cpus-per-task '' 'CPU cores per process (data loading); empty uses the cluster default.'
define_flag job-name memjax 'SLURM job name.'
define_flag term-before-end 300 \
  'Seconds before the time limit at which Slurm sends SIGTERM to the training processes (sbatch --signal=TERM@N; Slurm may send it up to 60 s earlier), so that they save a checkpoint and exit 0 instead of being killed; 0: no early signal.'
define_flag output 'logs/slurm-%x-%j.out' 'Job log, relative to the checkout (%x: job name, %j: job id).'
define_flag sbatch-flags '' 'Space-separated extra flags for sbatch (e.g. "--exclusive --qos=high").'
define_train_flags
define_flag port '' 'Coordinator port (passed to slurm_gpu.sbatch; empty: derived from the job id).'
define_flag srun-flags '' 'Space-separated extra flags for srun (passed to slurm_gpu.sbatch).'

parse_flags "$@"

main() {
  local repo config_file output_dir name var cmd extra=() forwarded=()
  ((${#POSITIONAL[@]} == 0)) || die "unexpected argument '${POSITIONAL[0]}'; flags for memjax.train go after --"
  require_int nodes gpus-per-node
  [[ $MEMJAX_TERM_BEFORE_END =~ ^[0-9]+$ ]] ||
    die "--term-before-end must be a number of seconds (0: off), got '$MEMJAX_TERM_BEFORE_END'"
  # Fail here rather than after the job waited in the queue.
  require_train_settings
  repo=$(cd "$SCRIPT_DIR/.." && pwd)
  config_file=${MEMJAX_CONFIG%%:*}
  [[ $config_file == /* ]] || config_file="$repo/$config_file"
  [[ -f $config_file ]] || die "--config=$MEMJAX_CONFIG: $config_file does not exist"

  cmd=(sbatch "--job-name=$MEMJAX_JOB_NAME" "--nodes=$MEMJAX_NODES"
    "--ntasks-per-node=$MEMJAX_GPUS_PER_NODE" "--gpus-per-node=$MEMJAX_GPUS_PER_NODE"
    "--chdir=$repo" "--output=$MEMJAX_OUTPUT")
  if ((MEMJAX_TERM_BEFORE_END > 0)); then
    # Without "B:" Slurm signals the job steps, i.e. the srun-started training processes.
    cmd+=("--signal=TERM@$MEMJAX_TERM_BEFORE_END")
  fi
  for name in partition account time cpus-per-task; do
    var=$(flag_var "$name")
    if [[ -n ${!var} ]]; then
      cmd+=("--$name=${!var}")
    fi
  done
  if [[ -n $MEMJAX_SBATCH_FLAGS ]]; then
    read -r -a extra <<<"$MEMJAX_SBATCH_FLAGS"
  fi
  # The batch script reads the same settings; hand over the ones that are set.
  for name in config workdir python env train-args port srun-flags; do
    var=$(flag_var "$name")
    if [[ -n ${!var} ]]; then
      forwarded+=("--$name=${!var}")
    fi
  done
  if ((${#PASSTHROUGH[@]})); then
    forwarded+=(-- "${PASSTHROUGH[@]}")
  fi

  output_dir=$(dirname "$MEMJAX_OUTPUT")
  [[ $output_dir == /* ]] || output_dir="$repo/$output_dir"
  log "$MEMJAX_NODES node(s) x $MEMJAX_GPUS_PER_NODE GPU(s) = $((MEMJAX_NODES * MEMJAX_GPUS_PER_NODE)) processes; config $MEMJAX_CONFIG; workdir $MEMJAX_WORKDIR"
  run mkdir -p "$output_dir"
  run "${cmd[@]}" ${extra[@]+"${extra[@]}"} "$repo/launch/slurm_gpu.sbatch" ${forwarded[@]+"${forwarded[@]}"}
}

main
