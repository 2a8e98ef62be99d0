#!/usr/bin/env bash
# The prepared GPU check: the environment, the GPU-marked tests, benchmarks.gpu, then (with 2
# GPUs or more) the 2-GPU data-parallel check benchmarks.gpu_ddp and the 2-GPU FSDP check
# benchmarks.gpu_fsdp; one JSON file with keys env, tests, bench, ddp, fsdp (written and printed
# whatever fails).
#
#   bash benchmarks/gpu_check.sh [OUT.json]        # default: gpu_check.json
#
# Runs from the repository root. Python: $PYTHON if set, else .venv/bin/python, else a new
# .venv (seeing the machine's own packages, its torch included) into which `pip install -e
# .[test]` is tried; torch is installed only if no torch imports. Offline, the install fails
# and engine runs from the source tree (PYTHONPATH). Time: set-up (only when .venv is missing),
# the tests (at most TESTS_TIMEOUT, 240 s, less if the set-up was slow) and the benchmark (at
# most BENCH_TIMEOUT, 180 s) fit in TOTAL_S (450 s). GPU_BENCH_ARGS adds arguments to
# benchmarks.gpu (a smoke run without a GPU: GPU_BENCH_ARGS="--device cpu --quick").
# The data-parallel check runs under `torchrun --standalone --nproc-per-node 2` (NCCL) when
# torch sees 2 GPUs or more, in at most DDP_TIMEOUT (90 s) beyond TOTAL_S, and is skipped with
# a message otherwise; GPU_DDP_ARGS adds arguments and runs it whatever the GPUs (a gloo smoke
# run: GPU_DDP_ARGS="--device cpu --quick"). The FSDP check (ZeRO-2/3 equivalents against DDP
# and one GPU: equality, memory per rank, step time) runs the same way, in at most FSDP_TIMEOUT
# (90 s) more, skipped with a message below 2 GPUs; GPU_FSDP_ARGS as GPU_DDP_ARGS.
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${1:-gpu_check.json}
case $OUT in /*) ;; *) OUT=$ROOT/$OUT ;; esac
TOTAL_S=${TOTAL_S:-450}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
DDP_TIMEOUT=${DDP_TIMEOUT:-90}
FSDP_TIMEOUT=${FSDP_TIMEOUT:-90}
WORK=$(mktemp -d)
NOTES=()
START=$SECONDS
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check +$((SECONDS - START))s] $*" >&2; }
note() { say "$*"; NOTES+=(--note "$*"); }
cuda_ok() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

# ------------------------------------------------------------------ the device
say "nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,clocks.max.sm \
        --format=csv || note "nvidia-smi --query-gpu failed"
    nvidia-smi -L
else
    note "nvidia-smi not found"
fi

# ------------------------------------------------------------------ the Python
HOST=$(command -v python3 || command -v python || true)
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif [ -z "$HOST" ]; then
    note "no python3 found"
    PY=python3
else
    say "no .venv: creating one that sees $HOST's packages"
    PY=$HOST
    # without ensurepip (a distribution's python3 lacking its venv package), a venv without
    # pip: the machine's pip, seen through the .pth file below, installs into it all the same
    if "$HOST" -m venv --system-site-packages .venv ||
        { rm -rf .venv && "$HOST" -m venv --system-site-packages --without-pip .venv; }; then
        PY=.venv/bin/python
        # a venv made by a venv's python (as on images whose python3 is itself a venv) sees the
        # base interpreter's packages, not that venv's: list the latter in a .pth file
        SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$HOST" -c 'import site; print("\n".join(site.getsitepackages()))' >"$SITE/_host_site.pth"
    else
        rm -rf .venv
        note "python -m venv failed: using $HOST itself"
    fi
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        note "torch does not import: pip install torch"
        timeout 240 "$PY" -m pip install -q torch || note "pip install torch failed"
    fi
    PIP=(-m pip install -q --disable-pip-version-check --retries 0 --timeout 10)
    if timeout 120 "$PY" "${PIP[@]}" -e ".[test]" >"$WORK/pip.log" 2>&1; then
        say "installed engine[test]"
    elif timeout 60 "$PY" "${PIP[@]}" --no-deps --no-build-isolation --no-index -e . \
        >>"$WORK/pip.log" 2>&1; then
        note "pip install -e .[test] failed (offline?); installed engine alone (--no-deps)"
    else
        note "pip install failed (offline?); engine runs from the source tree"
        tail -5 "$WORK/pip.log" >&2
    fi
fi
if command -v nvidia-smi >/dev/null 2>&1 && ! cuda_ok "$PY" && [ -n "$HOST" ] && cuda_ok "$HOST"; then
    note "$PY's torch sees no GPU but $HOST's does: using $HOST"
    PY=$HOST
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
say "python: $PY"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' ||
    note "torch does not import with $PY"
if ! "$PY" -c 'import engine' 2>/dev/null; then
    # a lent machine's image may hold an older torch than engine supports, and it cannot be
    # replaced offline: run what that torch allows (engine/_torch_check.py lists what fails)
    TV=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
    export ENGINE_ALLOW_UNSUPPORTED_TORCH=1
    note "engine refuses torch ${TV:-?}: ran with ENGINE_ALLOW_UNSUPPORTED_TORCH=1"
    "$PY" -c 'import engine' || note "engine does not import with $PY"
fi

# ------------------------------------------------------------------ the GPU-marked tests
LEFT=$((TOTAL_S - (SECONDS - START) - BENCH_TIMEOUT - 15))
T=$((LEFT < TESTS_TIMEOUT ? LEFT : TESTS_TIMEOUT))
T=$((T < 30 ? 30 : T))
say "pytest -m gpu (timeout ${T}s)"
timeout -k 10 "$T" "$PY" -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 |
    tee "$WORK/tests.log"
TESTS_RC=${PIPESTATUS[0]}
say "tests: rc $TESTS_RC"

# ------------------------------------------------------------------ the benchmark
say "benchmarks.gpu (timeout ${BENCH_TIMEOUT}s)"
# (stderr, the progress, shown and kept; stdout, the JSON again, kept only)
{ timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m benchmarks.gpu --json "$WORK/bench.json" \
    --budget-s $((BENCH_TIMEOUT * 2 / 3)) ${GPU_BENCH_ARGS:-} 2>&1 >"$WORK/bench.out"; } |
    tee "$WORK/bench.log" >&2
BENCH_RC=${PIPESTATUS[0]}
say "benchmark: rc $BENCH_RC"

# ------------------------------------------------------------------ the 2-GPU data-parallel check
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -1)
DDP=(--ddp-json "$WORK/ddp.json" --ddp-log "$WORK/ddp.log")
if [ "${NGPU:-0}" -ge 2 ] 2>/dev/null || [ -n "${GPU_DDP_ARGS:-}" ]; then
    say "benchmarks.gpu_ddp on 2 ranks (${NGPU} GPUs; timeout ${DDP_TIMEOUT}s)"
    { timeout -k 10 "$DDP_TIMEOUT" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node 2 -m benchmarks.gpu_ddp --json "$WORK/ddp.json" ${GPU_DDP_ARGS:-} \
        2>&1 >"$WORK/ddp.out"; } | tee "$WORK/ddp.log" >&2
    DDP_RC=${PIPESTATUS[0]}
    DDP+=(--ddp-rc "$DDP_RC")
    say "data-parallel check: rc $DDP_RC"
else
    SKIP="2-GPU data-parallel check skipped: torch sees ${NGPU:-0} GPU(s), it needs 2"
    say "$SKIP"
    DDP+=(--ddp-skipped "$SKIP")
fi

# ------------------------------------------------------------------ the 2-GPU FSDP check
FSDP=(--fsdp-json "$WORK/fsdp.json" --fsdp-log "$WORK/fsdp.log")
if [ "${NGPU:-0}" -ge 2 ] 2>/dev/null || [ -n "${GPU_FSDP_ARGS:-}" ]; then
    say "benchmarks.gpu_fsdp on 2 ranks (${NGPU} GPUs; timeout ${FSDP_TIMEOUT}s)"
    { timeout -k 10 "$FSDP_TIMEOUT" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node 2 -m benchmarks.gpu_fsdp --json "$WORK/fsdp.json" ${GPU_FSDP_ARGS:-} \
        2>&1 >"$WORK/fsdp.out"; } | tee "$WORK/fsdp.log" >&2
    FSDP_RC=${PIPESTATUS[0]}
    FSDP+=(--fsdp-rc "$FSDP_RC")
    say "FSDP check: rc $FSDP_RC"
else
    SKIP="2-GPU FSDP check skipped: torch sees ${NGPU:-0} GPU(s), it needs 2"
    say "$SKIP"
    FSDP+=(--fsdp-skipped "$SKIP")
fi

# ------------------------------------------------------------------ the report
REPORT_PY=$PY
"$PY" -c '' 2>/dev/null || REPORT_PY=${HOST:-python3}
"$REPORT_PY" benchmarks/gpu_report.py --out "$OUT" \
    --tests-log "$WORK/tests.log" --tests-rc "$TESTS_RC" \
    --bench-json "$WORK/bench.json" --bench-log "$WORK/bench.log" --bench-rc "$BENCH_RC" \
    "${DDP[@]}" "${FSDP[@]}" ${NOTES[@]+"${NOTES[@]}"}
RC=$?
say "wrote $OUT (rc $RC, $((SECONDS - START)) s in all)"
rm -rf "$WORK"
exit $RC
