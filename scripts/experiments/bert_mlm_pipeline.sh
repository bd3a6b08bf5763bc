#!/usr/bin/env bash
# Experiment 3 (docs/experiments/bert-mlm-pipeline.md): BERT masked-LM pretraining with 2 pipeline stages,
# the interleaved 1F1B schedule (2 virtual stages per rank), 12 microbatches and data parallelism on top
# (4 processes = pipeline 2 x data 2), against one process on the same global batch of 24.
#   scripts/experiments/bert_mlm_pipeline.sh [key=value ...]     (overrides go to both runs)
# Data (made once, kept in OUT/data): a byte-level BPE with BERT's special tokens trained on WikiText-2
# valid, which is also the training text (this machine has no WikiText train split); WikiText-2 test
# is the validation text. The two runs go one after the other (4 + 1 processes would fight over 2 cores).
# Output: OUT/bert-mlm-pipeline, OUT/bert-mlm-one, the comparison in OUT/bert-mlm-report, and the
# largest per-step loss difference on stdout.
set -euo pipefail
OUT=${OUT:-runs/experiments}
SHARED=${LMFORGE_SHARED_DATA:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CONFIG=configs/experiments/bert-mlm-pipeline.yaml
DATA=$OUT/data
WIKI=$SHARED/corpora/wikitext-2
mkdir -p "$DATA"

# 1. Tokenizer and .bin/.idx, skipped when already made. [PAD] takes id 0, the id the MLM samples pad with.
if [ ! -f "$DATA/bert-tok/tokenizer.json" ]; then
    lmforge tokenizer train --input "$WIKI/valid.articles.jsonl" --vocab-size 4096 --out "$DATA/bert-tok" \
        --special-tokens "[PAD]" "[CLS]" "[SEP]" "[MASK]" "[UNK]" --overwrite
fi
# No --append-eod: this tokenizer's eod would be [PAD]; MLM samples are cut from the token stream anyway.
if [ ! -f "$DATA/wikitext2-bert_text_document.idx" ]; then
    lmforge preprocess --input "$WIKI/valid.articles.jsonl" --output-prefix "$DATA/wikitext2-bert" \
        --tokenizer "$DATA/bert-tok" --no-progress
fi
if [ ! -f "$DATA/wikitext2-bert-valid_text_document.idx" ]; then
    lmforge preprocess --input "$WIKI/test.articles.jsonl" --output-prefix "$DATA/wikitext2-bert-valid" \
        --tokenizer "$DATA/bert-tok" --no-progress
fi
common=(trainer.progress_bar=false "data.tokenizer=$DATA/bert-tok" "data.paths=[$DATA/wikitext2-bert_text_document]"
        "data.valid_file=$DATA/wikitext2-bert-valid_text_document")

# 2. Pipelined, 4 processes: pipeline rank = process // 2 (ranks 0, 1 hold layer chunks 0 and 2; ranks 2, 3
#    hold chunks 1 and 3), data-parallel rank = process % 2; micro 1 x 12 microbatches x DP 2 = global 24.
rm -rf "$OUT/bert-mlm-pipeline" "$OUT/bert-mlm-one"
start=$(date +%s%N)
torchrun --standalone --nproc_per_node 4 -m lmforge.cli finetune "$CONFIG" "${common[@]}" \
    "run_dir=$OUT/bert-mlm-pipeline" "$@" > "$OUT/bert-mlm-pipeline.log" 2>&1
pipeline_ms=$((($(date +%s%N) - start) / 1000000))

# 3. One process, no pipeline, the whole global batch of 24 as one micro-batch.
start=$(date +%s%N)
lmforge finetune "$CONFIG" "${common[@]}" parallel.pipeline=1 parallel.pipeline_schedule=1f1b \
    parallel.virtual_stages=1 parallel.microbatches=0 trainer.micro_batch_size=24 \
    "run_dir=$OUT/bert-mlm-one" "$@" > "$OUT/bert-mlm-one.log" 2>&1
one_ms=$((($(date +%s%N) - start) / 1000000))
echo "wall time, launch to exit: pipeline $((pipeline_ms / 1000)).$((pipeline_ms % 1000 / 100)) s," \
    "one process $((one_ms / 1000)).$((one_ms % 1000 / 100)) s"

# 4. Plots and table (the one-process run is the reference: loss_difference.png is pipeline minus it).
lmforge compare "$OUT/bert-mlm-one" "$OUT/bert-mlm-pipeline" --out "$OUT/bert-mlm-report" \
    --labels "1 process" "4 processes: pipeline 2 x 2 virtual, 12 microbatches, DP 2"
python - "$OUT/bert-mlm-one" "$OUT/bert-mlm-pipeline" <<'EOF'
import sys
from lmforge.report import load_run

runs = [load_run(p) for p in sys.argv[1:]]
one, pp = (dict(zip(*r.series("loss"))) for r in runs)
(vs1, vl1), (vs2, vl2) = (r.series("val_loss") for r in runs)
steps = sorted(set(one) & set(pp))
worst = max(steps, key=lambda s: abs(pp[s] - one[s]))
print(f"steps compared: {len(steps)} (one process {len(one)}, pipeline {len(pp)})")
print(f"max |loss difference|: {abs(pp[worst] - one[worst]):.3g} at step {worst}; "
      f"max relative: {max(abs(pp[s] - one[s]) / abs(one[s]) for s in steps):.3g}")
print(f"max |val loss difference|: {max(abs(a - b) for a, b in zip(vl1, vl2)):.3g} over steps {vs1}")
print(f"final train loss: one process {one[steps[-1]]:.6f}, pipeline {pp[steps[-1]]:.6f}")
print(f"final val loss: one process {vl1[-1]:.6f}, pipeline {vl2[-1]:.6f}")
EOF
