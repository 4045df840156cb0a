# shellcheck shell=bash
# Shared helpers for the memjax launch scripts, sourced by each of them:
# settings from flags or environment variables, dry-run aware execution, the
# training command line, and the shell snippets that start and stop detached
# training processes on remote machines.
#
# Written for bash >= 3.2 because the TPU and ssh launchers usually run on a
# laptop (macOS ships bash 3.2): no associative arrays, no mapfile, and empty
# arrays are expanded as ${a[@]+"${a[@]}"} (bash < 4.4 treats "${a[@]}" of an
# empty array as unbound under `set -u`).

LAUNCH_SCRIPT=$(basename "$0")
FLAG_NAMES=()
FLAG_DEFAULTS=()
FLAG_HELPS=()
FLAG_IS_SWITCH=()
POSITIONAL=()
PASSTHROUGH=()

log() {
  printf '[%s] %s\n' "$LAUNCH_SCRIPT" "$*" >&2
}

die() {
  printf '%s: error: %s\n' "$LAUNCH_SCRIPT" "$*" >&2
  exit 2
}

# The environment variable (and shell variable) that holds setting NAME:
# MEMJAX_ plus NAME upper-cased with dashes as underscores. The prefix keeps
# generic names such as ZONE or PROJECT in a user's shell from leaking in.
flag_var() {
  printf 'MEMJAX_%s' "$(printf '%s' "${1//-/_}" | tr '[:lower:]' '[:upper:]')"
}

# define_flag NAME DEFAULT HELP: a setting read from --NAME=VALUE, --NAME VALUE
# or the environment variable $(flag_var NAME); flags win over the environment.
define_flag() {
  local var
  var=$(flag_var "$1")
  FLAG_NAMES+=("$1")
  FLAG_DEFAULTS+=("$2")
  FLAG_HELPS+=("$3")
  FLAG_IS_SWITCH+=(0)
  printf -v "$var" '%s' "${!var:-$2}"
}

# define_switch NAME HELP: an on/off setting (--NAME / --no-NAME, or the
# environment variable set to 1/true/yes or 0/false/no); stored as 1 or 0.
define_switch() {
  local var
  var=$(flag_var "$1")
  FLAG_NAMES+=("$1")
  FLAG_DEFAULTS+=(0)
  FLAG_HELPS+=("$2")
  FLAG_IS_SWITCH+=(1)
  case "${!var:-0}" in
    1 | true | yes) printf -v "$var" 1 ;;
    0 | false | no) printf -v "$var" 0 ;;
    *) die "environment variable $var='${!var}' must be 1/true/yes or 0/false/no" ;;
  esac
}

flag_index() {
  local i
  for i in "${!FLAG_NAMES[@]}"; do
    if [[ ${FLAG_NAMES[$i]} == "$1" ]]; then
      printf '%s' "$i"
      return 0
    fi
  done
  die "unknown flag --$1; see --help"
}

# Prints the settings table; each script's usage() calls it after its own text.
print_settings() {
  local i default
  printf '\nSettings (a flag, or the environment variable in brackets; flags win):\n'
  for i in "${!FLAG_NAMES[@]}"; do
    if ((FLAG_IS_SWITCH[i])); then
      printf '  --%s / --no-%s  [%s, default: off]\n' \
        "${FLAG_NAMES[$i]}" "${FLAG_NAMES[$i]}" "$(flag_var "${FLAG_NAMES[$i]}")"
    else
      default=${FLAG_DEFAULTS[$i]}
      printf '  --%s=VALUE  [%s, default: %s]\n' \
        "${FLAG_NAMES[$i]}" "$(flag_var "${FLAG_NAMES[$i]}")" "${default:-(none)}"
    fi
    printf '      %s\n' "${FLAG_HELPS[$i]}"
  done
}

# Parses the command line into the settings, POSITIONAL (subcommands) and
# PASSTHROUGH (everything after "--", appended verbatim to memjax.train).
# Calls the script's usage() for -h/--help.
parse_flags() {
  local name value i
  while (($#)); do
    case "$1" in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        PASSTHROUGH=("$@")
        return 0
        ;;
      --*=*)
        name=${1%%=*}
        name=${name#--}
        value=${1#*=}
        i=$(flag_index "$name")
        if ((FLAG_IS_SWITCH[i])); then
          die "--$name is a switch and takes no value (use --$name or --no-$name)"
        fi
        printf -v "$(flag_var "$name")" '%s' "$value"
        ;;
      --no-*)
        name=${1#--no-}
        i=$(flag_index "$name")
        ((FLAG_IS_SWITCH[i])) || die "--$1 is not a switch; use --$name=VALUE"
        printf -v "$(flag_var "$name")" 0
        ;;
      --*)
        name=${1#--}
        i=$(flag_index "$name")
        if ((FLAG_IS_SWITCH[i])); then
          printf -v "$(flag_var "$name")" 1
        else
          (($# > 1)) || die "--$name needs a value (--$name=VALUE)"
          shift
          printf -v "$(flag_var "$name")" '%s' "$1"
        fi
        ;;
      -*) die "unknown option $1; see --help" ;;
      *) POSITIONAL+=("$1") ;;
    esac
    shift
  done
}

# require NAME...: fails early, naming the flag and the variable to set.
require() {
  local name var
  for name in "$@"; do
    var=$(flag_var "$name")
    [[ -n ${!var} ]] || die "missing required setting --$name (or environment variable $var); see --help"
  done
}

# require_int NAME...: the settings must be positive integers.
require_int() {
  local name var
  for name in "$@"; do
    var=$(flag_var "$name")
    [[ ${!var} =~ ^[1-9][0-9]*$ ]] || die "--$name must be a positive integer, got '${!var}'"
  done
}

# Joins the arguments into one line that a POSIX shell splits back into exactly
# these arguments. Plain words stay bare and only the value of --flag=value is
# quoted, so dry-run output stays readable.
shell_quote() {
  local arg value prefix out='' q="'" flag_re='^(--?[A-Za-z0-9_.-]+=)(.*)$'
  for arg in "$@"; do
    if [[ -n $arg && $arg != *[!A-Za-z0-9_./:=,@%+-]* ]]; then
      out+=" $arg"
      continue
    fi
    prefix=''
    value=$arg
    if [[ $arg =~ $flag_re ]]; then
      prefix=${BASH_REMATCH[1]}
      value=${BASH_REMATCH[2]}
    fi
    out+=" $prefix'${value//$q/$q\\$q$q}'"
  done
  printf '%s' "${out# }"
}

# run CMD ARGS...: prints the command (--dry-run) or logs and executes it.
run() {
  if ((MEMJAX_DRY_RUN)); then
    printf '%s\n' "$(shell_quote "$@")"
  else
    log "+ $(shell_quote "$@")"
    "$@"
  fi
}

define_common_flags() {
  define_switch dry-run 'Print the exact commands instead of running them.'
}

# --config and --workdir are set, and the workdir is a path or a gs:// URL (memjax.train refuses
# other URLs too, but only after a job waited in a queue or every worker started).
require_train_settings() {
  require config workdir
  if [[ $MEMJAX_WORKDIR == *://* && $MEMJAX_WORKDIR != gs://* ]]; then
    die "--workdir=$MEMJAX_WORKDIR: memjax reads and writes local paths and gs:// URLs; give a gs://bucket/run URL or a path every process sees (an NFS share such as Filestore)"
  fi
}

# define_train_flags [PYTHON_DEFAULT]: the settings of the training command.
define_train_flags() {
  define_flag config '' \
    'Training config, relative to the repository root (e.g. configs/transformer_xl_wt103_base.py). Required to start training.'
  define_flag workdir '' \
    'Checkpoints, metrics and logs: a gs://bucket/run URL (on TPU pods; needs memjax[gcs]) or a directory every process sees (NFS such as Filestore). Required to start training.'
  define_flag python "${1-python3}" 'Python interpreter that has memjax installed (Python >= 3.11).'
  define_flag env '' \
    'Space-separated KEY=VALUE environment variables for the training processes (e.g. "XLA_FLAGS=--xla_dump_to=/tmp/dump").'
  define_flag train-args '' \
    'Space-separated extra flags for memjax.train (e.g. "--config.train.num_steps=1000"). Arguments after "--" are appended verbatim.'
}

# Fills TRAIN_CMD with the training command; the arguments (coordinator flags)
# go between the required flags and the user's overrides.
build_train_command() {
  local words=()
  require_train_settings
  TRAIN_CMD=()
  if [[ -n $MEMJAX_ENV ]]; then
    read -r -a words <<<"$MEMJAX_ENV"
    TRAIN_CMD=(env "${words[@]}")
  fi
  TRAIN_CMD+=("$MEMJAX_PYTHON" -m memjax.train "--config=$MEMJAX_CONFIG" "--workdir=$MEMJAX_WORKDIR" "$@")
  if [[ -n $MEMJAX_TRAIN_ARGS ]]; then
    read -r -a words <<<"$MEMJAX_TRAIN_ARGS"
    TRAIN_CMD+=("${words[@]}")
  fi
  TRAIN_CMD+=(${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"})
}

# Prints a remote shell snippet that runs BODY in DIR, and nothing if DIR is
# missing (a training process started elsewhere would write in the wrong place).
in_dir_snippet() {
  printf 'cd %s && { %s; }' "$(shell_quote "$1")" "$2"
}

# Prints a remote shell condition: PIDFILE names a live process of this host whose command line
# holds each of WORDS. A pid file outlives its process, the pid may be reused, and in a
# folder every host shares, another host's file names a process of that host: none of these is
# taken for a trainer (neither refused as running nor signalled).
owned_pid_snippet() {  # PIDFILE WORD...
  local pidfile=$1 word
  shift
  printf '%s' "{ [ -f $pidfile ] && memjax_args=\" \$(ps -o args= -p \"\$(cat $pidfile)\" 2>/dev/null) \""
  for word in "$@"; do
    printf '%s' " && case \"\$memjax_args\" in *\" $word \"*) true;; *) false;; esac"
  done
  printf '%s' "; }"
}

# Prints a remote shell snippet that starts the command (already shell-quoted)
# detached from the ssh session, output in LOG and pid in PIDFILE (shell words
# that may reference remote variables). It refuses to start a second copy
# because two trainers on one host would fight over the accelerators; WORDS
# tell the running copy (owned_pid_snippet).
detached_start_snippet() {  # LOG PIDFILE COMMAND WORD...
  local log=$1 pidfile=$2 command=$3
  shift 3
  printf '%s' "if $(owned_pid_snippet "$pidfile" "$@"); then" \
    " echo \"\$(hostname): already running (pid \$(cat $pidfile)); stop it first\" >&2; exit 1; fi;" \
    " nohup $command > $log 2>&1 < /dev/null & echo \$! > $pidfile;" \
    " echo \"\$(hostname): started pid \$!, log $log\""
}

# Prints a remote shell snippet that sends SIGNAL to the process in PIDFILE if it
# is the trainer WORDS tell (owned_pid_snippet); a stale pid file is removed.
# SIGTERM makes memjax.train save a checkpoint at the next step and exit.
detached_stop_snippet() {  # PIDFILE SIGNAL WORD...
  local pidfile=$1 signal=$2
  shift 2
  printf '%s' "if $(owned_pid_snippet "$pidfile" "$@") && kill -s $signal \"\$(cat $pidfile)\" 2>/dev/null; then" \
    " echo \"\$(hostname): sent SIG$signal to pid \$(cat $pidfile)\";" \
    " else echo \"\$(hostname): no running process recorded in $pidfile\"; rm -f $pidfile; fi"
}
