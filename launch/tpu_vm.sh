#!/usr/bin/env bash
# Cloud TPU VM launcher for memjax: create a TPU (on-demand, spot or queued),
# copy the code to every worker, install it, start the same training command on
# every worker, follow logs, stop, delete. Single-host slices (v5litepod-8) and
# pod slices (v4-32, v5p-64) are handled alike: every command addresses all
# workers with --worker=all, and on TPU memjax.train finds its peers itself.
# It drives the TPU VM API of "gcloud compute tpus" (v4, v5e, v5p, v6e), which
# Google keeps for fixes only and which does not offer TPU7x (Ironwood) or later.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: launch/tpu_vm.sh [settings] SUBCOMMAND... [-- memjax.train flags]

Subcommands (several run in order, e.g. "sync setup run"):
  create   Create the TPU VM (on-demand; --spot for Spot; --queued for a queued
           resource request, which is granted later: watch it with "status").
  status   Describe the TPU VM (or the queued resource with --queued).
  sync     Copy the code (git archive of --git-ref, by default the current
           tracked files including uncommitted changes) to --remote-dir on all
           workers; files that the previous sync brought and the repository no
           longer has are deleted there (nothing else: logs, workdirs and
           virtualenvs in --remote-dir stay).
  setup    Create a Python >= 3.11 virtualenv (--venv) on all workers with uv
           (installed if missing; it fetches --python-version when the image
           has an older Python, as tpu-ubuntu2204-base with 3.10 does), then
           pip install memjax (with gs:// support) and jax[tpu] into it (after sync).
  run      Start python -m memjax.train on all workers in the background;
           worker N logs to --remote-dir/--log-dir/worker-N.log. Every worker
           is checked first: one whose TPU is held by another process stops the
           run with the fix (--clear-tpu kills such processes); a stale
           /tmp/libtpu_lockfile (no process holds the TPU) is removed.
  logs     Print the last --lines lines of worker --worker's log.
  tail     Follow worker --worker's log.
  stop     Send --signal to the training process on all workers (SIGTERM: the
           run saves a checkpoint at the next step and exits; "run" resumes).
  delete   Delete the TPU VM (with --queued: the queued resource and its VM).

Supported: v4, v5e (v5litepod), v5p, v6e through the Cloud TPU VM API of
"gcloud compute tpus". That API is in maintenance (fixes only) and does not
create TPU7x (Ironwood) or later generations: those run as TPU node pools of
Google Kubernetes Engine (GKE 1.34 or later; multi-host slices take a workload
placement policy), which this script does not drive.

Example:
  launch/tpu_vm.sh --tpu-name=memjax-v4 --zone=us-central2-b \\
      --accelerator-type=v4-32 create sync setup
  launch/tpu_vm.sh --tpu-name=memjax-v4 --zone=us-central2-b \\
      --config=configs/transformer_xl_wt103_base.py \\
      --workdir=gs://my-bucket/memjax/wt103 run -- --config.train.num_steps=200000

Layout for a pod: the workdir is a gs:// URL in the TPU's region (the VM's
service account needs roles/storage.objectUser on the bucket); the prepared
data is read from each worker's disk (data.data_dir: copy it there, e.g.
gcloud storage cp -r gs://my-bucket/tfds ~/tensorflow_datasets, or point it at
a Cloud Storage FUSE mount). See docs/scaling.md, "Running on a TPU pod".
EOF
  print_settings
}

define_common_flags
define_flag tpu-name '' 'TPU VM name (also the queued resource name with --queued). Required.'
define_flag zone '' 'Zone of the TPU (e.g. us-central2-b); it must offer --accelerator-type. Required.'
define_flag project '' 'Google Cloud project; empty uses the gcloud default project.'
define_flag accelerator-type v5litepod-8 \
  'TPU type and size: v5litepod-8 (one host), v4-32, v5p-64, v6e-16 (pod slices).'
define_flag runtime-version '' \
  'TPU software version; empty picks it from --accelerator-type: v6e -> v2-alpha-tpuv6e, v5p -> v2-alpha-tpuv5, v5e/v5litepod -> v2-alpha-tpuv5-lite, others -> tpu-ubuntu2204-base.'
define_switch spot 'Create a Spot TPU (cheaper, can be preempted at any time).'
define_switch queued 'Use a queued resource (gcloud compute tpus queued-resources) for create, status and delete.'
define_flag create-flags '' 'Space-separated extra flags for the create command (e.g. "--reserved" or "--network=my-net").'
define_flag remote-dir memjax 'Code directory on the workers, relative to the remote home directory.'
define_flag log-dir logs 'Log and pid directory on the workers, relative to --remote-dir.'
define_flag git-ref '' 'Git revision to sync; empty syncs the tracked files of the local working tree.'
define_flag pip-find-links '' \
  'Extra pip -f page for "setup". jax[tpu] takes libtpu from PyPI; set https://storage.googleapis.com/jax-releases/libtpu_releases.html for libtpu builds that are only there.'
define_flag venv memjax-venv \
  'Virtualenv on the workers (relative to the remote home, or absolute) that "setup" creates and "run" uses, unless --python names an interpreter.'
define_flag python-version 3.12 'Python that uv puts into --venv (memjax needs >= 3.11).'
define_switch clear-tpu 'Before "run": kill the processes that hold the TPU of a worker.'
define_flag strict-host-key-checking no \
  'Passed to gcloud ssh/scp: "no" accepts each worker'"'"'s host key on first connection instead of asking once per worker; "yes" or "ask" to verify; empty: gcloud'"'"'s default.'
define_flag worker 0 'Worker whose log "logs" and "tail" show.'
define_flag lines 100 'Number of log lines "logs" and "tail" print first.'
define_flag signal TERM 'Signal "stop" sends (TERM: checkpoint and exit; KILL: immediately).'
define_train_flags ''

parse_flags "$@"

# "run" and "setup" name the interpreter as a word the worker's shell expands.
readonly VENV_PYTHON=@VENV_PYTHON@

# Prints the worker index of the TPU VM it runs on (the metadata attribute that
# JAX itself reads), falling back to the "-w-N" suffix of the host name.
# shellcheck disable=SC2016  # expanded on the worker, not here
readonly WORKER_ID_SNIPPET='id=$(curl -sf -m 10 -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname | sed -n "s/.*-w-\([0-9]*\)$/\1/p"); id=${id:-0}'

gcloud_location_flags() {
  GCLOUD_FLAGS=("--zone=$MEMJAX_ZONE")
  if [[ -n $MEMJAX_PROJECT ]]; then
    GCLOUD_FLAGS+=("--project=$MEMJAX_PROJECT")
  fi
  SSH_FLAGS=()
  if [[ -n $MEMJAX_STRICT_HOST_KEY_CHECKING ]]; then
    SSH_FLAGS=("--strict-host-key-checking=$MEMJAX_STRICT_HOST_KEY_CHECKING")
  fi
}

ssh_worker() {  # WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$MEMJAX_TPU_NAME" "${GCLOUD_FLAGS[@]}" ${SSH_FLAGS[@]+"${SSH_FLAGS[@]}"} \
    "--worker=$1" "--command=$2"
}

# --venv as a shell word for the workers (a relative path is under the remote home).
remote_venv() {
  # shellcheck disable=SC2153  # set by define_flag
  if [[ $MEMJAX_VENV == /* ]]; then
    shell_quote "$MEMJAX_VENV"
  else
    # shellcheck disable=SC2016  # expanded on the worker
    printf '"$HOME"/%s' "$(shell_quote "$MEMJAX_VENV")"
  fi
}

# The interpreter on the workers, as a shell word: --python, or the python of --venv.
remote_python() {
  if [[ -n $MEMJAX_PYTHON ]]; then
    shell_quote "$MEMJAX_PYTHON"
  else
    printf '%s/bin/python' "$(remote_venv)"
  fi
}

# Prints the worker snippet that unpacks ARCHIVE into DIR and then deletes the files that
# the previous sync brought but this archive no longer has (each sync records its file list
# in DIR/.memjax-sync-files), so deleted sources do not linger. Nothing else in DIR is touched:
# logs, a workdir or a virtualenv kept there survive.
sync_snippet() {  # ARCHIVE DIR
  local list=.memjax-sync-files
  printf '%s' "mkdir -p $(shell_quote "$2") && cd $(shell_quote "$2") &&" \
    " tar -tzf ~/$1 > $list.raw && LC_ALL=C sort $list.raw > $list.new && rm -f $list.raw &&" \
    " if [ -f $list ]; then LC_ALL=C comm -23 $list $list.new | while IFS= read -r f; do" \
    " case \"\$f\" in */) ;; *) rm -f -- \"\$f\" ;; esac; done; fi &&" \
    " tar -xzf ~/$1 && mv $list.new $list && rm -f ~/$1"
}

ssh_worker_in_dir() {  # WORKER COMMAND, run in --remote-dir
  ssh_worker "$1" "$(in_dir_snippet "$MEMJAX_REMOTE_DIR" "$2")"
}

runtime_version() {
  if [[ -n $MEMJAX_RUNTIME_VERSION ]]; then
    printf '%s' "$MEMJAX_RUNTIME_VERSION"
    return
  fi
  case "$MEMJAX_ACCELERATOR_TYPE" in
    v6e-*) printf v2-alpha-tpuv6e ;;
    v5p-*) printf v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) printf v2-alpha-tpuv5-lite ;;
    *) printf tpu-ubuntu2204-base ;;
  esac
}

cmd_create() {
  local extra=() cmd
  if [[ -n $MEMJAX_CREATE_FLAGS ]]; then
    read -r -a extra <<<"$MEMJAX_CREATE_FLAGS"
  fi
  if ((MEMJAX_SPOT)); then
    extra+=(--spot)
  fi
  if ((MEMJAX_QUEUED)); then
    cmd=(gcloud compute tpus queued-resources create "$MEMJAX_TPU_NAME" "--node-id=$MEMJAX_TPU_NAME"
      "${GCLOUD_FLAGS[@]}" "--accelerator-type=$MEMJAX_ACCELERATOR_TYPE" "--runtime-version=$(runtime_version)")
  else
    cmd=(gcloud compute tpus tpu-vm create "$MEMJAX_TPU_NAME"
      "${GCLOUD_FLAGS[@]}" "--accelerator-type=$MEMJAX_ACCELERATOR_TYPE" "--version=$(runtime_version)")
  fi
  run "${cmd[@]}" ${extra[@]+"${extra[@]}"}
}

cmd_status() {
  if ((MEMJAX_QUEUED)); then
    run gcloud compute tpus queued-resources describe "$MEMJAX_TPU_NAME" "${GCLOUD_FLAGS[@]}"
  else
    run gcloud compute tpus tpu-vm describe "$MEMJAX_TPU_NAME" "${GCLOUD_FLAGS[@]}"
  fi
}

cmd_sync() {
  local repo ref archive remote_archive=memjax-src.tar.gz
  repo=$(cd "$SCRIPT_DIR/.." && pwd)
  git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 ||
    die "sync needs the memjax git checkout, but $repo is not one"
  ref=$MEMJAX_GIT_REF
  if [[ -z $ref ]]; then
    # A commit object of the working tree that touches no branch or stash.
    ref=$(git -C "$repo" stash create)
    ref=${ref:-HEAD}
  fi
  archive="${TMPDIR:-/tmp}/memjax-src-$MEMJAX_TPU_NAME.tar.gz"
  run git -C "$repo" archive --format=tar.gz -o "$archive" "$ref"
  run gcloud compute tpus tpu-vm scp "$archive" "$MEMJAX_TPU_NAME:$remote_archive" "${GCLOUD_FLAGS[@]}" \
    ${SSH_FLAGS[@]+"${SSH_FLAGS[@]}"} --worker=all
  ssh_worker all "$(sync_snippet "$remote_archive" "$MEMJAX_REMOTE_DIR")"
  run rm -f "$archive"
}

# Prints the worker snippet that makes --venv a Python >= 3.11 virtualenv, with uv.
venv_snippet() {
  local venv py uv_dir
  # shellcheck disable=SC2016  # expanded on the worker
  uv_dir='"$HOME"/.local/bin'
  venv=$(remote_venv)
  py="$venv/bin/python"
  printf '%s' "if [ ! -x $py ] || ! $py -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then" \
    " uv=\$(command -v uv || echo $uv_dir/uv);" \
    " if [ ! -x \"\$uv\" ]; then curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=$uv_dir UV_NO_MODIFY_PATH=1 sh >/dev/null ||" \
    " { echo \"\$(hostname): cannot install uv (https://astral.sh/uv/install.sh), which provides Python >= 3.11 here; install Python >= 3.11 and pass --python\" >&2; exit 1; }; fi;" \
    " \"\$uv\" venv --seed --clear --python $(shell_quote "$MEMJAX_PYTHON_VERSION") $venv ||" \
    " { echo \"\$(hostname): uv could not create $venv with Python $(shell_quote "$MEMJAX_PYTHON_VERSION")\" >&2; exit 1; };" \
    " fi"
}

# Prints the worker snippet that stops unless PYTHON (a shell word) is Python >= 3.11.
python_check_snippet() {
  printf '%s' "$1 -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||" \
    " { echo \"\$(hostname): memjax needs Python >= 3.11 but $1 is \$($1 -V 2>&1); run setup without --python (it builds --venv with uv), or name another interpreter\" >&2; exit 1; }"
}

cmd_setup() {
  local pip_cmd python prepare=''
  python=$(remote_python)
  pip_cmd=(-m pip install -e '.[gcs]' 'jax[tpu]')
  if [[ -n $MEMJAX_PIP_FIND_LINKS ]]; then
    pip_cmd+=(-f "$MEMJAX_PIP_FIND_LINKS")
  fi
  if [[ -z $MEMJAX_PYTHON ]]; then
    prepare="$(venv_snippet); "
  fi
  ssh_worker_in_dir all "$prepare$(python_check_snippet "$python") && $python -m pip install --upgrade pip && $python $(shell_quote "${pip_cmd[@]}")"
}

cmd_run() {
  local log pidfile command check
  log="$(shell_quote "$MEMJAX_LOG_DIR")/worker-\$id.log"
  pidfile="$(shell_quote "$MEMJAX_LOG_DIR")/worker-\$id.pid"
  command=$(shell_quote "${TRAIN_CMD[@]}")
  command=${command//"$VENV_PYTHON"/"$(remote_python)"}
  # Every worker is checked before any starts: a pod where some workers started would wait
  # for the others until the coordinator's timeout.
  check="$WORKER_ID_SNIPPET; if $(owned_pid_snippet "$pidfile" memjax.train); then"
  check+=" echo \"\$(hostname): already running (pid \$(cat $pidfile)); stop it first\" >&2; exit 1; fi;"
  check+=" $(tpu_free_snippet "$MEMJAX_CLEAR_TPU")"
  ssh_worker_in_dir all "$check"
  ssh_worker_in_dir all "mkdir -p $(shell_quote "$MEMJAX_LOG_DIR"); $WORKER_ID_SNIPPET; $(detached_start_snippet "$log" "$pidfile" "$command" memjax.train)"
}

# Prints the worker snippet that stops unless the TPU is free: another process holding its
# device files is reported (with CLEAR=1: killed); libtpu's lock file, left behind by a
# process that ended without cleaning up, is removed once no process holds the TPU.
tpu_free_snippet() {  # CLEAR
  local lock=/tmp/libtpu_lockfile holders
  holders="holders=\$(lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -u | xargs);"
  if (($1)); then
    printf '%s' "$holders if [ -n \"\$holders\" ]; then echo \"\$(hostname): killing TPU holders \$holders\"; kill -9 \$holders; sleep 2; fi;"
  else
    printf '%s' "$holders if [ -n \"\$holders\" ]; then echo \"\$(hostname): the TPU is held by process(es) \$holders (\$(ps -o comm= -p \"\$(echo \$holders | tr ' ' ',')\" | xargs)): stop them (launch/tpu_vm.sh stop, or kill them), or run again with --clear-tpu to kill them\" >&2; exit 1; fi;"
  fi
  printf '%s' " if [ -e $lock ]; then echo \"\$(hostname): removing $lock, left by a process that no longer holds the TPU\"; rm -f $lock; fi"
}

cmd_logs() {  # TAIL_FLAGS...
  require_int lines
  [[ $MEMJAX_WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker index (0, 1, ...), got '$MEMJAX_WORKER'"
  ssh_worker_in_dir "$MEMJAX_WORKER" "$(shell_quote tail -n "$MEMJAX_LINES" "$@" "$MEMJAX_LOG_DIR/worker-$MEMJAX_WORKER.log")"
}

cmd_stop() {
  ssh_worker_in_dir all "$WORKER_ID_SNIPPET; $(detached_stop_snippet "$(shell_quote "$MEMJAX_LOG_DIR")/worker-\$id.pid" "$MEMJAX_SIGNAL" memjax.train)"
}

cmd_delete() {
  if ((MEMJAX_QUEUED)); then
    run gcloud compute tpus queued-resources delete "$MEMJAX_TPU_NAME" "${GCLOUD_FLAGS[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$MEMJAX_TPU_NAME" "${GCLOUD_FLAGS[@]}" --quiet
  fi
}

main() {
  local sub
  ((${#POSITIONAL[@]})) || die "no subcommand given (create, status, sync, setup, run, logs, tail, stop, delete); see --help"
  # Validate every subcommand before running any, so a typo in "sync stup run"
  # does not leave a half-done sequence behind.
  for sub in "${POSITIONAL[@]}"; do
    case "$sub" in
      create | status | sync | setup | run | logs | tail | stop | delete) ;;
      *) die "unknown subcommand '$sub' (create, status, sync, setup, run, logs, tail, stop, delete); see --help" ;;
    esac
    if [[ $sub == create && $MEMJAX_ACCELERATOR_TYPE =~ ^(tpu|v)([7-9]|[1-9][0-9]) ]]; then
      die "--accelerator-type='$MEMJAX_ACCELERATOR_TYPE': TPU7x (Ironwood) and later are not offered by the 'gcloud compute tpus' API this script drives; create them as a GKE TPU node pool (see --help)"
    fi
    if [[ $sub == create && ! $MEMJAX_ACCELERATOR_TYPE =~ ^v[0-9]+[a-z]*-[0-9]+$ ]]; then
      die "--accelerator-type='$MEMJAX_ACCELERATOR_TYPE' is not a TPU type like v5litepod-8, v4-32 or v5p-64"
    fi
    if [[ $sub == run ]]; then
      # On TPU, memjax.train needs no coordinator flags.
      if [[ -z $MEMJAX_PYTHON ]]; then
        # shellcheck disable=SC2119
        MEMJAX_PYTHON=$VENV_PYTHON build_train_command
      else
        # shellcheck disable=SC2119
        build_train_command
      fi
    fi
  done
  require tpu-name zone
  if [[ ! $MEMJAX_SIGNAL =~ ^[A-Z]+[0-9]*$ ]]; then
    die "--signal must be a signal name such as TERM, INT or KILL, got '$MEMJAX_SIGNAL'"
  fi
  gcloud_location_flags
  for sub in "${POSITIONAL[@]}"; do
    case "$sub" in
      logs) cmd_logs ;;
      tail) cmd_logs -F ;;
      *) "cmd_$sub" ;;
    esac
  done
}

main
