#!/usr/bin/env bash
# The tests on other torch releases than the one installed: 2.11 is what the GPU machines have (with Python 3.12),
# 2.6 the declared floor. Each release gets a venv of its own, ${LMFORGE_VENVS:-/tmp/lmforge-torch}/PYTHON-TORCH,
# made once: PyPI's torch (a CUDA build, ~5 GB with its libraries; it runs on the CPU) and this checkout installed
# editable with its test extras. Then pytest runs there with the arguments after --, the fast lane by default.
#
#   bash scripts/torch_matrix.sh                         # 2.6.0 and 2.11.0, pytest -m "not slow" -n 2
#   bash scripts/torch_matrix.sh 2.11.0 -- -m slow -x    # one release, other pytest arguments
#   PYTHON=python3.12 bash scripts/torch_matrix.sh 2.11.0
#
# torchao is pinned to the release built against each torch where peft accepts it (QLoRA's NF4, Float8's CPU side).
set -euo pipefail
cd "$(dirname "$0")/.."
versions="2.6.0,2.11.0"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then versions=$1; shift; fi
[ "${1:-}" = "--" ] && shift
args=("$@")
defaulted=0
[ ${#args[@]} -eq 0 ] && args=(-m "not slow") && defaulted=1
python=${PYTHON:-python3}
root=${LMFORGE_VENVS:-/tmp/lmforge-torch}
status=0
for v in ${versions//,/ }; do
    case $v in
        # none before 2.11: peft (the LoRA tests' reference) refuses a torchao older than 0.16, which needs a newer
        # torch; lmforge's QLoRA and Float8 tests skip without torchao
        2.6.* | 2.7.*) extra=("numpy<2.3") ;;
        2.11.*) extra=("torchao==0.18.0") ;;
        *) extra=() ;;
    esac
    venv="$root/$("$python" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')-torch$v"
    if [ ! -x "$venv/bin/pytest" ]; then
        echo "== making $venv"
        "$python" -m venv "$venv"
        # PIP_CONSTRAINT= : a machine-wide pip constraint (e.g. a cap on torch) does not apply to this venv
        PIP_CONSTRAINT= "$venv/bin/pip" install -q -e ".[test]" "torch==$v" "${extra[@]}"
        # The test extra's torchao is the newest, built for the newest torch: installed beside an older torch it
        # breaks transformers' import (torch.utils._pytree.register_constant is 2.7+); those tests skip without it.
        case $v in 2.[6-9].* | 2.10.*) "$venv/bin/pip" uninstall -q -y torchao ;; esac
    fi
    run=("${args[@]}")
    # two workers, as the README's command, where the venv has pytest-xdist (venvs made before it joined the extra
    # do not)
    if [ $defaulted -eq 1 ] && "$venv/bin/python" -c "import xdist" 2>/dev/null; then run+=(-n 2 --dist loadscope); fi
    echo "== torch $v: pytest ${run[*]}"
    if ! CI=true PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${run[@]}"; then
        status=1
    fi
done
exit $status
