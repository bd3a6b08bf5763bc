#!/usr/bin/env bash
# Experiment 1 (docs/experiments/gpt2-sst2.md): GPT-2-shaped model on SST-2, eager vs torch.compile.
# Both runs go at the same time, one thread each, so that they share whatever else the machine is
# doing (fair on a shared machine; on a quiet one with more cores, run them one after the other with
# all threads). Extra key=value arguments go to both runs. Output: runs/experiments/gpt2-sst2-*/ and
# the comparison report in runs/experiments/gpt2-sst2-report/.
set -euo pipefail
OUT=${OUT:-runs/experiments}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"
lmforge finetune configs/experiments/gpt2-sst2.yaml trainer.progress_bar=false "run_dir=$OUT/gpt2-sst2-eager" "$@" \
    > "$OUT/gpt2-sst2-eager.log" 2>&1 &
eager=$!
lmforge finetune configs/experiments/gpt2-sst2.yaml trainer.progress_bar=false trainer.compile=true \
    "run_dir=$OUT/gpt2-sst2-compiled" "$@" > "$OUT/gpt2-sst2-compiled.log" 2>&1 &
compiled=$!
wait "$eager"
wait "$compiled"
lmforge compare "$OUT/gpt2-sst2-eager" "$OUT/gpt2-sst2-compiled" --out "$OUT/gpt2-sst2-report"
