#!/usr/bin/env bash
# The accelerator benchmark (python -m memjax.bench accel) on one GPU machine that has no network,
# in one call: the wheels that machine lacks installed from a folder carried with the checkout,
# the suite, then A/B runs of XLA flags on the wt103-large bf16 step while the time budget lasts.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: launch/accel_bench.sh [settings] [prepare | run]

prepare (on a machine with the package index): downloads into --wheels what the
  GPU machine's image lacks for the suite: transformers 4.37.2 (the last with
  Transformer-XL) with the tokenizers and huggingface-hub versions its import
  check demands, ml_collections, and pytest (the GPU check's runner, which the
  image is not known to have), for --python (the GPU machine's Python).
run (default; on the GPU machine): installs those wheels under --site (ahead of
  the image's own transformers on PYTHONPATH), records the machine, runs
  tests/test_fused_attention.py's GPU check (--check-seconds), then
  python -m memjax.bench accel in three processes by weight (the peak and the
  fused attention; the PyTorch peer; the profile, training, the roofline, evaluation,
  methods, attention, choices on the first process's peak), each leaving time to the next, then --probes (NAME=XLA flags, ';'-separated) each
  in a fresh process while more than --probe-seconds of --seconds are left.
  Everything lands in --out: accel.json, accel_peer.json, accel_more.json (each
  rewritten as its rows are measured, so a run stopped at its limit keeps
  them), their .log files, the profile's traces (accel_more_profile_*.xplane.pb), probe_NAME.json, machine.txt.

Example (a GPU machine without network that receives the checkout, .wheels included, and returns \$OUT):
  launch/accel_bench.sh prepare        # here, once
  launch/accel_bench.sh --out="\$OUT"  # there, in one call of at most 600 s
EOF
  print_settings
}

define_common_flags
define_flag out "${OUT:-accel_out}" "Folder for the reports and logs (default: \$OUT where set)."
define_flag wheels .wheels 'Folder of the carried wheels (git-ignored).'
define_flag site /tmp/memjax-site 'Where the wheels are installed on the GPU machine.'
define_flag python 3.12 'Python version of the GPU machine (prepare downloads wheels for it).'
define_flag seconds 570 'Time budget of the whole run, from its start (a 600 s call less copying back).'
define_flag check-seconds 180 "Seconds for the fused kernel's forward and gradient check on the GPU, first (0: none)."
define_flag probe-seconds 75 'Seconds a probe needs (start, compile, time); none starts with less left.'
define_flag probes 'latency_hiding=--xla_gpu_enable_latency_hiding_scheduler=true;no_triton_gemm=--xla_gpu_enable_triton_gemm=false;autotune_4=--xla_gpu_autotune_level=4;command_buffers_off=--xla_gpu_enable_command_buffer=' \
  'XLA flag variants of the probe, NAME=FLAGS separated by ";" (a baseline probe without flags runs first).'

parse_flags "$@"

WHEEL_PINS=(transformers==4.37.2 tokenizers==0.15.2 huggingface-hub==0.20.3 ml-collections==1.1.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0)

prepare() {
  run python3 -m pip download --no-deps --only-binary=:all: --implementation cp \
    "--python-version=$MEMJAX_PYTHON" --platform=manylinux2014_x86_64 "--dest=$MEMJAX_WHEELS" "${WHEEL_PINS[@]}"
}

seconds_left() {
  printf '%s' $((MEMJAX_SECONDS - SECONDS))
}

# bench NAME XLA_FLAGS RESERVE ARGS...: one suite run under the time left less RESERVE seconds
# (kept for the runs after it, unless that leaves this one none), its report in --out, rewritten
# as each row is measured.
bench() {
  local name=$1 flags=$2 limit
  limit=$(($(seconds_left) - 10 - $3))
  ((limit >= 30)) || limit=$(($(seconds_left) - 10))
  shift 3
  if ((limit < 30)); then
    log "skipped $name: $(seconds_left) s left"
    return 0
  fi
  run env "XLA_FLAGS=$flags" timeout -k 5 "$limit" python3 -m memjax.bench accel "$@" \
    "--out=$MEMJAX_OUT/$name.json" || log "$name stopped (exit $?); its rows so far are in the log"
}

run_suite() {
  local probe name flags wheels=() logs=$MEMJAX_OUT
  require_int seconds probe-seconds
  [[ $MEMJAX_CHECK_SECONDS =~ ^[0-9]+$ ]] ||
    die "--check-seconds must be a whole number of seconds (0: no check), got '$MEMJAX_CHECK_SECONDS'"
  shopt -s nullglob
  wheels=("$MEMJAX_WHEELS"/*.whl)
  ((${#wheels[@]})) || die "no wheels in $MEMJAX_WHEELS: run launch/accel_bench.sh prepare where the package index is reachable"
  run mkdir -p "$MEMJAX_OUT"
  if ((MEMJAX_DRY_RUN)); then
    logs=$(mktemp -d)  # A dry run writes nothing under --out.
  fi
  run python3 -m pip install --quiet --no-index --no-deps "--target=$MEMJAX_SITE" "${wheels[@]}"
  export PYTHONPATH="$MEMJAX_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  if ((!MEMJAX_DRY_RUN)); then
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
      lscpu | head -20 || true
      python3 -c 'import jax, flax, torch, transformers; print(jax.__version__, jax.devices(), flax.__version__, torch.__version__, torch.version.cuda, transformers.__version__)' || true
      git rev-parse HEAD 2>/dev/null || echo 'no git metadata'
    } >"$MEMJAX_OUT/machine.txt" 2>&1
  fi
  # The fused attention's correctness on this chip (interpret mode cannot show Triton's
  # compilation): its log says which cases passed and how long each took (compile included), each
  # case's line written as it ends, so that a check stopped at its limit still tells the cases it
  # finished; a failure is reported and the suite goes on. setup.cfg's addopts are
  # pytest-xdist's, which the image may lack: cleared.
  if ((MEMJAX_CHECK_SECONDS > 0)); then
    run timeout -k 5 "$MEMJAX_CHECK_SECONDS" python3 -m pytest -v -rA -o console_output_style=times \
      -o addopts= -p no:cacheprovider --durations=0 \
      tests/test_fused_attention.py -k on_a_gpu >"$logs/fused_gpu_check.log" 2>&1 ||
      log "the fused attention's GPU check failed or stopped (exit $?): see fused_gpu_check.log"
  fi
  # By weight, each leaving time to the ones after it: the peak and the fused attention (alone,
  # then in the training and evaluation steps), the PyTorch peer (in a process of its own: a
  # fresh JAX allocator beside PyTorch's), the rest, on the first process's peak: first the profile
  # of the two large bf16 training steps (where their time goes; their compile seconds and timed
  # steps are the train part's bf16 rows).
  bench accel '' 330 --parts=peak,fused 2> >(tee "$logs/accel.log" >&2)
  local peak_from=()
  if [[ -s "$MEMJAX_OUT/accel.json" ]]; then
    peak_from=("--peak_from=$MEMJAX_OUT/accel.json")
  fi
  bench accel_peer '' 150 --parts=peer 2> >(tee "$logs/accel_peer.log" >&2)
  bench accel_more '' 0 --parts=profile,train,roofline,eval,methods,attention,choices ${peak_from[@]+"${peak_from[@]}"} \
    2> >(tee "$logs/accel_more.log" >&2)
  IFS=';' read -r -a probes <<<"=;$MEMJAX_PROBES"
  for probe in "${probes[@]}"; do
    name=${probe%%=*}
    flags=${probe#*=}
    if (($(seconds_left) < MEMJAX_PROBE_SECONDS)); then
      log "skipped probe ${name:-baseline}: $(seconds_left) s left"
      continue
    fi
    bench "probe_${name:-baseline}" "$flags" 0 --parts=probe 2>>"$logs/probes.log"
  done
}

main() {
  ((${#POSITIONAL[@]} <= 1)) || die "one subcommand at most (prepare or run), got ${POSITIONAL[*]}"
  cd "$SCRIPT_DIR/.."
  case "${POSITIONAL[0]:-run}" in
    prepare) prepare ;;
    run) run_suite ;;
    *) die "unknown subcommand '${POSITIONAL[0]}'; prepare or run" ;;
  esac
}

main
