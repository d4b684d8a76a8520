#!/usr/bin/env bash
# A fuzz campaign over every decoder target: seeds each corpus with the golden packet (the same
# bytes as proto/tests/golden.rs), runs each target for its share of executions, and prints one
# summary line per target (executions, coverage, corpus, peak RSS, exec/s, result).
#
#   cd proto/fuzz && ./campaign.sh                 # the shares in RUNS below
#   RUNS="decode_rpc=1000 decode_header=1000" ./campaign.sh
#
# Needs cargo-fuzz (cargo install cargo-fuzz); on a stable toolchain it sets RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1

RUNS=${RUNS:-"decode_rpc=45000000 decode_header=40000000 header_canonical=8000000 decode_body=7000000"}
FLAGS=(-rss_limit_mb=256 -malloc_limit_mb=64 -max_len=8192 -print_final_stats=1)

# The golden v1 packet (proto/tests/golden.rs).
HEADER=013985bcbe20bfccf987dbca4f0b4f4706d82da1a227f5ce872ff29e2d8e5cb6342a260024080112208a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c80d095ffbc31d8040000a03e00254a6f94b9de03284d7297bce1062b50759abfe4092e53789dc2e70c31567b10c0c8d0d8e0e8f0f800081018202830380ad7a33c4640e59528c2714c8981187305663c7001242bf8750032ef04cc0e96ef1ee52670020101fa0137208a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c404c58943acc9e6c3e952be64ac41d6507483fdc874a77bf5ccf39d2f72f6fcf860051b221d9dcdee326ed64e280715e7175a15ddc4697034b0022a3477a5c9f0d
BODY=040224080ff05a5a0a0000000000003e000108003800bc0000004001c80105050007017a45057f8103ff406f12833a0002140000cd3d4d3e9a3ecd3e003f1a3f333f4d3f663f
seed() { mkdir -p "corpus/$1"; python3 -c "import sys; open(sys.argv[1],'wb').write(bytes.fromhex(sys.argv[2]))" "corpus/$1/$2" "$3"; }
seed decode_header golden "$HEADER"
seed decode_body golden "00$BODY"
# A 4-bit top-k layer (proto/tests/golden.rs, v1_topk4_layer_is_pinned).
seed decode_body topk4 "000104c801030300077b029f070000003f0000803e"
# The signed part of the golden header (without its 98-byte seal), behind a selector byte.
seed header_canonical golden "00${HEADER:0:$(( ${#HEADER} - 196 ))}"
seed decode_rpc empty "00"

mkdir -p logs
for entry in $RUNS; do
  target=${entry%%=*}
  runs=${entry#*=}
  cargo fuzz build -O "$target" >/dev/null 2>&1
  start=$(date +%s)
  if cargo fuzz run -O "$target" -- -runs="$runs" "${FLAGS[@]}" >"logs/$target.log" 2>&1; then
    result="no crash, no allocation over 64 MB"
  else
    result="FAILED (see logs/$target.log and artifacts/$target)"
  fi
  secs=$(( $(date +%s) - start ))
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "logs/$target.log" | tail -1 || true)
  execs=$(grep -oE 'stat::number_of_executed_units: +[0-9]+' "logs/$target.log" | awk '{print $2}' || true)
  rss=$(grep -oE 'stat::peak_rss_mb: +[0-9]+' "logs/$target.log" | awk '{print $2}' || true)
  cov=$(echo "$done_line" | grep -oE 'cov: [0-9]+' | awk '{print $2}' || true)
  corp=$(echo "$done_line" | grep -oE 'corp: [0-9]+' | awk '{print $2}' || true)
  eps=$(( ${execs:-0} / (secs > 0 ? secs : 1) ))
  echo "$target: ${execs:-?} executions in ${secs} s, ${cov:-?} edges, ${corp:-?} corpus entries, peak RSS ${rss:-?} MB, ${eps:-?} exec/s: $result"
done
