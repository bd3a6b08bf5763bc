#!/usr/bin/env bash
# Experiment 4 (docs/experiments/llama-continued.md): continued pretraining of an imported Hugging Face
# Llama-shaped model on a new corpus, exported back to Hugging Face, loaded and run by transformers.
#   scripts/experiments/llama_continued.sh [key=value ...]       (overrides go to `lmforge pretrain`)
# OUT (default runs/experiments/llama-continued) holds everything it makes; CORPUS (default
# tinyshakespeare) is the new text. With a real Llama 2 folder,
# skip make-model and point import-hf at it (and raise the config's shapes: nothing else changes).
set -euo pipefail
OUT=${OUT:-runs/experiments/llama-continued}
SHARED=${LMFORGE_SHARED_DATA:-../shared/data}
HERE=$(dirname "$0")
mkdir -p "$OUT"
# 1. A "downloaded" Llama: a small random LlamaForCausalLM saved by transformers, with the Llama 2 tokenizer.
python "$HERE/llama_continued.py" make-model "$OUT/hf-source" --tokenizer "$SHARED/tokenizers/llama2"
# 2. Into lmforge's format (weights checked against transformers' layout, tokenizer copied along).
lmforge import-hf "$OUT/hf-source" "$OUT/imported" --overwrite
# 3. The new corpus: Shakespeare, one document per paragraph, tokenized with the model's own tokenizer.
python "$HERE/llama_continued.py" corpus "${CORPUS:-$SHARED/corpora/tinyshakespeare/input.txt}" "$OUT/data/shakespeare.jsonl"
lmforge preprocess --input "$OUT/data/shakespeare.jsonl" --output-prefix "$OUT/data/shakespeare" \
    --tokenizer "$OUT/imported" --append-eod --no-progress
# 4. Continued pretraining from the imported weights; checkpoint.convert_to_hf writes RUN_DIR/hf at the end.
rm -rf "$OUT/run"
lmforge pretrain configs/experiments/llama-continued.yaml "model.init_from=$OUT/imported" \
    "data.paths=[$OUT/data/shakespeare_text_document]" "run_dir=$OUT/run" trainer.progress_bar=false "$@"
# 5. transformers on the exported folder: logits equal lmforge's, weights changed, a greedy continuation.
python "$HERE/llama_continued.py" check "$OUT/run/hf" "$OUT/run/model" --source "$OUT/hf-source" --prompt "ROMEO:" \
    | tee "$OUT/check.json"
lmforge compare "$OUT/run" --out "$OUT/report"
