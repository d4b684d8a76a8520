#!/usr/bin/env bash
# GPU checks in one call, for a lent GPU host that has CUDA and torch but no Rust toolchain.
#
# Build here (x86-64), copy the binaries into BIN (default .gpu/), then run this there:
#   cargo build --release -p kindred-kernels --features cuda --example gpu_bench
#   cargo build --release -p kindred-distill --features kindred-kernels/cuda --example distill_bench
#   cargo test --release -p kindred-kernels --features cuda --no-run   # the test binaries
#   cargo build --release -p kindred-node --features cuda --bin kindred
#   BIN=.gpu OUT=results bash kernels/examples/gpu_check.sh
#
# Steps: (1) the kernel test suite with the CUDA backend required; (2) gpu_bench at 100M f32
# twice (parity with the CPU, timings against a device-to-device copy and torch on the same
# tensors), and each kernel's device time under ncu where it runs; (3) distill_bench with the CUDA backend next to one CPU core; (4) the 16-process demo,
# each node distilling on the GPU. JSON lines go to $OUT; the exit status is the first failure's.
set -uo pipefail
BIN="${BIN:-.gpu}"
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
status=0
step() { echo "== $*"; }
fail() { echo "FAILED: $*"; [ "$status" -ne 0 ] || status=1; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
# cudarc opens libnvrtc.so (or .so.12) by name: the toolkit's lib64 holds it on these hosts.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
ls /usr/local/cuda/lib64/libnvrtc* 2>/dev/null | head -3
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

step "kernel tests on the CUDA backend"
for t in "$BIN"/tests/*; do
    echo "-- $(basename "$t")" >> "$OUT/tests.log"
    KINDRED_REQUIRE_GPU=1 KINDRED_REQUIRE_NVRTC=1 timeout 300 "$t" --test-threads 4 \
        >> "$OUT/tests.log" 2>&1 || fail "test $(basename "$t")"
    grep -E "^test result|panicked" "$OUT/tests.log" | tail -n 1
done

step "gpu_bench, 100M f32, two runs"
for run in 1 2; do
    timeout 200 "$BIN/gpu_bench" --elems 100000000 --k-frac 0.01 --iters 20 \
        > "$OUT/gpu_bench-$run.jsonl" || fail "gpu_bench run $run"
    cat "$OUT/gpu_bench-$run.jsonl"
done

if command -v ncu > /dev/null; then
    step "per-kernel device time (ncu, one timed run; parity launches first)"
    timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
        -k 'regex:radix|topk|accumulate|quantize|sign|sketch' --launch-count 60 \
        "$BIN/gpu_bench" --elems 100000000 --iters 1 --torch none > "$OUT/ncu.txt" 2>&1 ||
        echo "ncu did not finish (see ncu.txt)"
    grep -E '^  [a-z_]+\(|gpu__time_duration' "$OUT/ncu.txt" | paste - - |
        awk '{print $1, $(NF-1), $NF}' | tail -n 30
fi

step "distill_bench, CUDA backend and one CPU core"
timeout 300 "$BIN/distill_bench" --elems 16777216,67108864 --runs 5 --cuda \
    > "$OUT/distill_bench.jsonl" || fail "distill_bench"
grep -E '"(distill_pipeline|memcpy|topk_exact|int8_quantize)"' "$OUT/distill_bench.jsonl" |
    cut -c1-200

[ -z "${SKIP_DEMO:-}" ] || exit "$status"
step "demo: 16 node processes distilling on the GPU"
demo_dir="$(mktemp -d)"
KINDRED_DATA="$BIN/mnist" timeout 240 "$BIN/kindred" demo --json --dir "$demo_dir" \
    > "$OUT/demo.log" 2>&1 || fail "demo"
grep -h "kernels:" "$demo_dir"/*/node.log 2>/dev/null | sed 's/.*kernels:/kernels:/' | sort |
    uniq -c | head -3
tail -n 3 "$OUT/demo.log"
exit "$status"
