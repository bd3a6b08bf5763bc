#!/usr/bin/env bash
# Experiment 2 (docs/experiments/pythia-precision.md): bf16-mixed vs bf16-sr vs bf16 on WikiText-2.
# The three runs go at the same time, one thread each (same machine load for all). Extra key=value
# arguments go to every run. LMFORGE_EMULATE_BF16=1 runs them through bf16_emulated.py (bf16 GEMMs as
# fp32 GEMMs of the same bf16 values) for CPUs without avx512_bf16/AMX; leave it unset elsewhere.
set -euo pipefail
OUT=${OUT:-runs/experiments}
SHARED=${LMFORGE_SHARED_DATA:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ ! -f "$OUT/data/wikitext2_text_document.idx" ]; then
    lmforge preprocess --input "$SHARED/corpora/wikitext-2/valid.articles.jsonl" \
        "$SHARED/corpora/wikitext-2/test.articles.jsonl" --output-prefix "$OUT/data/wikitext2" \
        --tokenizer "$SHARED/tokenizers/gpt-neox-20b" --append-eod
fi
if [ "${LMFORGE_EMULATE_BF16:-0}" = 1 ]; then
    run=(python "$(dirname "$0")/bf16_emulated.py" pretrain)
else
    run=(lmforge pretrain)
fi
pids=()
for precision in bf16-mixed bf16-sr bf16; do
    "${run[@]}" configs/experiments/pythia-wikitext-precision.yaml "trainer.precision=$precision" \
        trainer.progress_bar=false "data.paths=[$OUT/data/wikitext2_text_document]" \
        "run_dir=$OUT/pythia-$precision" "$@" > "$OUT/pythia-$precision.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
lmforge compare "$OUT/pythia-bf16-mixed" "$OUT/pythia-bf16-sr" "$OUT/pythia-bf16" --out "$OUT/pythia-precision-report"
python "$(dirname "$0")/drift.py" "$OUT/pythia-bf16-mixed" "$OUT/pythia-bf16-sr" "$OUT/pythia-bf16"
