#!/usr/bin/env bash
# Plain multi-node launcher for memjax over ssh, for GPU machines without a
# scheduler: starts one training process per host (or one per GPU with
# --procs-per-host) with the coordinator on the first host, a log per process,
# and stops them again. The code and the workdir must be on a filesystem every
# host sees at --remote-dir and --workdir.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: launch/ssh_multinode.sh [settings] SUBCOMMAND [-- memjax.train flags]

Subcommands:
  start  Start the training processes. Host i (from 0) runs processes
         i*P .. i*P+P-1 with P = --procs-per-host; with P > 1 process i*P+j
         sees only GPU j (CUDA_VISIBLE_DEVICES=j). Process K logs to
         --remote-dir/--log-dir/process-K.log on its host.
  stop   Send --signal to every process (SIGTERM: checkpoint at the next
         step, then exit; "start" again resumes).
  logs   Print the last --lines lines of process --process's log.
  tail   Follow process --process's log.

Example (2 hosts with 8 GPUs each, 16 processes):
  launch/ssh_multinode.sh --hosts=gpu-a,gpu-b --procs-per-host=8 \\
      --config=configs/transformer_xl_wt103_base.py --workdir=/shared/runs/wt103 start
EOF
  print_settings
}

define_common_flags
define_flag hosts '' 'Hosts separated by commas or spaces ([user@]host); the first one runs the coordinator. This or --hosts-file is required.'
define_flag hosts-file '' 'File with one [user@]host per line (blank lines and # comments are skipped).'
define_flag procs-per-host 1 'Training processes per host: 1 (one process drives all local GPUs) or the number of GPUs (one process per GPU).'
define_flag port 8476 'Coordinator port on the first host; must be free and reachable from all hosts.'
define_flag coordinator-address '' \
  'Host name or IP (optionally HOST:PORT) at which every host reaches the coordinator on the first host, e.g. its address on the cluster network; empty: the first host name, which must then resolve on every host.'
define_flag remote-dir "$(cd "$SCRIPT_DIR/.." && pwd)" 'memjax checkout on the hosts (default: this checkout, assuming a shared filesystem).'
define_flag log-dir logs 'Log and pid directory, relative to --remote-dir.'
define_flag ssh-flags '-o BatchMode=yes -o StrictHostKeyChecking=accept-new' \
  'Space-separated flags for ssh (e.g. "-p 2222"). accept-new records the key of a host seen for the first time instead of prompting (BatchMode would fail there), and still refuses a changed key.'
define_flag signal TERM '"stop" sends this signal (TERM: checkpoint and exit; KILL: immediately).'
define_flag process 0 'Process whose log "logs" and "tail" show.'
define_flag lines 100 'Number of log lines "logs" and "tail" print first.'
define_train_flags

parse_flags "$@"

read_hosts() {
  local line
  HOSTS=()
  if [[ -n $MEMJAX_HOSTS && -n $MEMJAX_HOSTS_FILE ]]; then
    die "give either --hosts or --hosts-file, not both"
  fi
  if [[ -n $MEMJAX_HOSTS_FILE ]]; then
    [[ -r $MEMJAX_HOSTS_FILE ]] || die "--hosts-file=$MEMJAX_HOSTS_FILE cannot be read"
    while IFS= read -r line || [[ -n $line ]]; do
      line=${line%%#*}
      read -r -a words <<<"$line"
      HOSTS+=(${words[@]+"${words[@]}"})
    done <"$MEMJAX_HOSTS_FILE"
  else
    read -r -a HOSTS <<<"${MEMJAX_HOSTS//,/ }"
  fi
  ((${#HOSTS[@]})) || die "no hosts: set --hosts=host1,host2 or --hosts-file=FILE (or MEMJAX_HOSTS / MEMJAX_HOSTS_FILE)"
}

ssh_host() {  # HOST REMOTE_COMMAND
  local flags=()
  if [[ -n $MEMJAX_SSH_FLAGS ]]; then
    read -r -a flags <<<"$MEMJAX_SSH_FLAGS"
  fi
  run ssh ${flags[@]+"${flags[@]}"} "$1" "$(in_dir_snippet "$MEMJAX_REMOTE_DIR" "$2")"
}

process_file() {  # PROCESS_ID EXTENSION
  printf '%s/process-%s.%s' "$(shell_quote "$MEMJAX_LOG_DIR")" "$1" "$2"
}

cmd_start() {
  local h j id num coordinator snippets command
  num=$((${#HOSTS[@]} * MEMJAX_PROCS_PER_HOST))
  # The coordinator address is dialled by every host, so drop any "user@".
  coordinator=$(coordinator_address "${MEMJAX_COORDINATOR_ADDRESS:-${HOSTS[0]##*@}}")
  # Every host is checked before any starts: processes started on some hosts would wait for
  # the others until the coordinator's timeout, and block a corrected start until then.
  for h in "${!HOSTS[@]}"; do
    snippets="mkdir -p $(shell_quote "$MEMJAX_LOG_DIR")"
    for ((j = 0; j < MEMJAX_PROCS_PER_HOST; j++)); do
      id=$((h * MEMJAX_PROCS_PER_HOST + j))
      snippets+="; if $(owned_pid_snippet "$(process_file "$id" pid)" memjax.train "--process_id=$id"); then"
      snippets+=" echo \"\$(hostname): process $id is already running; stop it first\" >&2; exit 1; fi"
    done
    ssh_host "${HOSTS[$h]}" "$snippets"
  done
  for h in "${!HOSTS[@]}"; do
    snippets="mkdir -p $(shell_quote "$MEMJAX_LOG_DIR")"
    for ((j = 0; j < MEMJAX_PROCS_PER_HOST; j++)); do
      id=$((h * MEMJAX_PROCS_PER_HOST + j))
      build_train_command "--coordinator_address=$coordinator" "--num_processes=$num" "--process_id=$id"
      if ((MEMJAX_PROCS_PER_HOST > 1)); then
        TRAIN_CMD=(env "CUDA_VISIBLE_DEVICES=$j" "${TRAIN_CMD[@]}")
      fi
      command=$(shell_quote "${TRAIN_CMD[@]}")
      snippets+="; $(detached_start_snippet "$(process_file "$id" log)" "$(process_file "$id" pid)" "$command" \
        memjax.train "--process_id=$id")"
    done
    ssh_host "${HOSTS[$h]}" "$snippets"
  done
}

# Prints HOST:PORT for the coordinator given as HOST, HOST:PORT, an IPv6 address or [IPv6]:PORT
# (--port is added where the value has none; a bare IPv6 address is bracketed).
coordinator_address() {  # ADDRESS
  local address=$1
  case $address in
    \[*\]:*) ;;
    \[*\]) address="$address:$MEMJAX_PORT" ;;
    *:*:*) address="[$address]:$MEMJAX_PORT" ;;
    *:*) ;;
    *) address="$address:$MEMJAX_PORT" ;;
  esac
  printf '%s' "$address"
}

cmd_stop() {
  local h j id snippets
  for h in "${!HOSTS[@]}"; do
    snippets=''
    for ((j = 0; j < MEMJAX_PROCS_PER_HOST; j++)); do
      id=$((h * MEMJAX_PROCS_PER_HOST + j))
      snippets+="${snippets:+; }$(detached_stop_snippet "$(process_file "$id" pid)" "$MEMJAX_SIGNAL" \
        memjax.train "--process_id=$id")"
    done
    ssh_host "${HOSTS[$h]}" "$snippets"
  done
}

cmd_logs() {  # TAIL_FLAGS...
  local num=$((${#HOSTS[@]} * MEMJAX_PROCS_PER_HOST))
  require_int lines
  if [[ ! $MEMJAX_PROCESS =~ ^[0-9]+$ ]] || ((MEMJAX_PROCESS >= num)); then
    die "--process must be a process id from 0 to $((num - 1)), got '$MEMJAX_PROCESS'"
  fi
  ssh_host "${HOSTS[$((MEMJAX_PROCESS / MEMJAX_PROCS_PER_HOST))]}" \
    "$(shell_quote tail -n "$MEMJAX_LINES" "$@") $(process_file "$MEMJAX_PROCESS" log)"
}

main() {
  ((${#POSITIONAL[@]} == 1)) || die "give exactly one subcommand (start, stop, logs, tail); see --help"
  require_int procs-per-host port
  read_hosts
  case "${POSITIONAL[0]}" in
    start)
      # Validate before contacting any host.
      build_train_command
      cmd_start
      ;;
    stop) cmd_stop ;;
    logs) cmd_logs ;;
    tail) cmd_logs -F ;;
    *) die "unknown subcommand '${POSITIONAL[0]}' (start, stop, logs, tail); see --help" ;;
  esac
}

main
