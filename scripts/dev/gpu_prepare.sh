#!/usr/bin/env bash
# Before a session's device calls (see scripts/gpu_session.py): fill .gpu/ (git-ignored) with what the GPU machine
# lacks and cannot download there, then carry it: run(command="python3 scripts/gpu_session.py", carry=[".gpu"]).
#
#   .gpu/whl/    wheels for its Python 3.12 (the packages lmforge needs that its image does not hold: omegaconf,
#                fastapi and pydantic, uvicorn, torchao for trainer.float8; with --eval, lm-eval and its own needs)
#   .gpu/data/   from ../shared/data (never committed): the GPT-NeoX tokenizer (gpu_check's text check) and the Alpaca
#                subset (benchmarks/sft_attention.py); with --eval, SST-2 and WikiText-2 (benchmarks/eval.py's tasks)
#
# The pins are the versions `pip install -e ".[test]"` resolves on the workstation (torchao 0.18.0: the release
# built against the GPU machine's torch 2.11). Usage: bash scripts/gpu_prepare.sh [--eval]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu/whl
mkdir -p "$out" .gpu/data/tokenizers .gpu/data/instruct .gpu/data/classification .gpu/data/corpora
pip_get() {  # pure-Python or manylinux wheels for CPython 3.12 on x86-64, without their dependencies
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$out" "$@" 2>&1 | grep -v "is ignored" || true
}
pip_get omegaconf==2.4.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2 uvicorn==0.54.0 torchao==0.18.0
if [ "${1:-}" = "--eval" ]; then
    pip_get lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 pytablewriter==1.2.1 dill==0.4.1 more-itertools==11.2.1 \
        multiprocess==0.70.19 nltk==3.10.4 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 \
        tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 defusedxml==0.7.1 zstandard==0.25.0
    # Published as source only: built here into pure-Python wheels.
    python3 -m pip wheel -q --no-deps -w "$out" rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1
fi
shared="${LMFORGE_SHARED_DATA:-../shared/data}"
wanted="tokenizers/gpt-neox-20b instruct/alpaca"
[ "${1:-}" = "--eval" ] && wanted="$wanted classification/sst-2 corpora/wikitext-2"
for d in $wanted; do
    if [ -d "$shared/$d" ]; then
        cp -r "$shared/$d" ".gpu/data/$(dirname "$d")/"
    else
        echo "no $shared/$d: what needs it on the device will skip or fail"
    fi
done
ls "$out" | wc -l | xargs echo "wheels in $out:"
du -sh .gpu | cut -f1 | xargs echo ".gpu/ to carry:"
