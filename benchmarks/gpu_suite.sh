#!/usr/bin/env bash
# The GPU check in one call (issue 28): model FLOPs utilization at the peer's defaults (and the other settings
# it measures), the codec kernels against the device's copy bandwidth, the outer step of a 150M model, a
# pipeline of it on one GPU against the unsplit model, a 1-peer and a 2-peer swarm of it (H = 50,
# 3 outer steps), the multi-device peer over NCCL, and what each memory option holds on the card. One JSON
# line each, on stdout; their logs under $OUT (or ./gpu-suite) when set.
#
# On a machine without CUDA every line says "measured": false (the GPU benchmarks check for it) and the CPU
# runs small sizes, so the script itself is exercised by the tests (tests/test_gpu_suite.py). On an H100/H200 it takes at most
# SUITE_BUDGET_S (default 540 s), most of it compiling.
#
#   bash benchmarks/gpu_suite.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu-suite}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    GPU=1
else
    GPU=0
fi

BUDGET="${SUITE_BUDGET_S:-540}"  # the whole suite's seconds: a benchmark that would start past it is skipped

run() {  # run NAME TIMEOUT CMD...: its last line (the JSON one) on stdout, everything in $OUT_DIR/NAME.log
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
        printf '{"benchmark": "%s", "skipped": "the suite used its %s s budget"}\n' "$name" "$BUDGET"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local line
    line=$(grep '^{' "$OUT_DIR/$name.log" | tail -n 1)
    if [ -n "$line" ]; then
        echo "$line"
    else
        printf '{"benchmark": "%s", "error": "exit %s after %s s, no result line (see %s.log)"}\n' "$name" "$rc" \
            "$((SECONDS - t0))" "$name"
    fi
}

if [ "$GPU" = 1 ]; then
    # in order of what the issues ask first; each within its own limit and the suite's budget
    run gpu_codec 60 "$PY" benchmarks/gpu_codec.py
    # the int4 kernels, compiled, against the CPU codec on its edge cases (ties, subnormals, float32's limits)
    run int4_kernels_cuda 90 "$PY" tests/kernel_vectors.py
    run mfu 170 "$PY" benchmarks/mfu.py --batch 32 --variants "potluck.compile_scope=stage"
    run gpu_swarm_1 110 "$PY" benchmarks/gpu_swarm.py --peers 1 --preset llama-150m --inner-steps 50 --outer-steps 3
    run gpu_swarm_2 130 "$PY" benchmarks/gpu_swarm.py --peers 2 --preset llama-150m --inner-steps 50 --outer-steps 3 \
        --overlap
    run pipeline_scale 150 "$PY" benchmarks/pipeline_scale.py --device cuda --preset llama-150m --batch 16 \
        --micro-batches 8 --inner-steps 20 --outer-steps 2
    run outer_step 90 "$PY" benchmarks/outer_step.py --device cuda --preset llama-150m --vocab 32000 --steps 3
    # the multi-device peer over NCCL, replicated and sharded (says so and stops on a 1-GPU machine)
    run multidevice 120 "$PY" benchmarks/multidevice_throughput.py --device cuda --devices 2 --steps 10
    # what each memory option holds on the card, by the allocator's count (llama-1b, one stage)
    run device_memory 120 "$PY" benchmarks/device_memory.py --device cuda --preset llama-1b --steps 3
else
    # no CUDA: each GPU benchmark says so in its line, and the CPU runs the same code at small sizes
    run gpu_codec 60 "$PY" benchmarks/gpu_codec.py
    run int4_kernels_cuda 30 "$PY" tests/kernel_vectors.py
    run mfu 60 "$PY" benchmarks/mfu.py
    run outer_step 120 "$PY" benchmarks/outer_step.py --device cuda
    run gpu_swarm 60 "$PY" benchmarks/gpu_swarm.py
    run device_memory 30 "$PY" benchmarks/device_memory.py --device cuda
    if [ "$QUICK" = 0 ]; then
        run mfu_cpu 300 "$PY" benchmarks/mfu.py --device cpu --preset llama-20m --vocab 256 --seq 64 --batch 4 \
            --warmup 1 --steps 2 --variants ""
        run outer_step_cpu 300 "$PY" benchmarks/outer_step.py --device cpu --steps 2
        run gpu_swarm_cpu 600 "$PY" benchmarks/gpu_swarm.py --device cpu --peers 1 --inner-steps 5 --outer-steps 2
        run device_memory_cpu 300 "$PY" benchmarks/device_memory.py --device cpu --preset llama-20m --vocab 256 \
            --seq 64 --batch 4 --steps 2
    fi
fi
