#!/usr/bin/env bash
# Everything kvtier checks on a CUDA GPU, in one short run on a machine with one NVIDIA GPU: one
# line per check (PASS/FAIL, seconds), logs under $GPU_CHECK_LOGS (default /tmp/kvtier-gpu-check).
# Runs from the source tree with the machine's own python3 and torch (no install); needs exactly
# $NEEDS below (torch with CUDA). First a preflight (tools/gpu_preflight.py) imports every need,
# the kvtier modules and test files the checks use, with kvtier's imports limited to the needs;
# it fails with exit 3 before any GPU time is spent. Without a GPU it then refuses, exit 2.
# --preflight: stop after the preflight and the GPU probe (what CI runs on its CPU boxes).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs=${GPU_CHECK_LOGS:-/tmp/kvtier-gpu-check}
mkdir -p "$logs"

NEEDS="torch transformers safetensors tokenizers xxhash tqdm numpy pytest hypothesis"
# the files the checks select
GPU_TESTS="tests/device/test_device_cuda.py tests/gpu/test_cuda_engine.py tests/gpu/test_moe_cuda.py"
CLI_MODULES="kvtier.cli kvtier.bench.garble kvtier.bench.throughput"  # every bench below
# shellcheck disable=SC2086  # the lists are words
if ! python3 tools/gpu_preflight.py --needs $NEEDS --modules $CLI_MODULES --tests $GPU_TESTS \
    >"$logs/preflight.log" 2>&1; then
    echo "gpu_check: preflight failed ($logs/preflight.log):" >&2
    sed -n '/^preflight:/,$p' "$logs/preflight.log" | sed 's/^/    /' >&2
    exit 3
fi
tail -n 1 "$logs/preflight.log" | sed 's/^/gpu_check: /'

if ! why=$(python3 - 2>&1 <<'PY'
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"torch is not importable ({exc})")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA GPU visible: torch {torch.__version__} reports torch.cuda.is_available() False "
             f"(built with CUDA {torch.version.cuda})")
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
); then
    echo "gpu_check: refused: $why" >&2
    exit 2
fi
echo "gpu_check: $why"
if [ "${1:-}" = "--preflight" ]; then
    exit 0
fi

failed=0
check() {  # check NAME SECONDS COMMAND...: one line, PASS or FAIL, with the log's last lines
    local name=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then
        echo "PASS $name ($(($(date +%s) - start)) s)"
    else
        echo "FAIL $name ($(($(date +%s) - start)) s, exit $?; $logs/$name.log):"
        tail -n 8 "$logs/$name.log" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}

pytest_gpu() { python3 -m pytest -q -p no:cacheprovider -m gpu "$@"; }

check device-races 90 pytest_gpu tests/device/test_device_cuda.py
check goldens-fp32-bf16 120 pytest_gpu tests/gpu/test_cuda_engine.py -k "transformers"
check modes-sanitized 150 pytest_gpu tests/gpu/test_cuda_engine.py -k "scheduling_mode"
check offload-on-off 60 pytest_gpu tests/gpu/test_cuda_engine.py -k "offload"
check moe-no-sync 60 pytest_gpu tests/gpu/test_moe_cuda.py
check garble-none-vs-all 150 python3 -m kvtier.cli bench garble --device cuda --dtype float64 \
    --num-prompts 48 --rounds 2 --concurrency 16 --max-tokens 96 --variants none,all \
    --out "$logs/garble.json"
check garble-all-clean 10 python3 - "$logs/garble.json" <<'PY'
import json, sys
rows = {r["variant"]: r for r in json.load(open(sys.argv[1]))["rows"]}
print({k: (r["garbled"], r["hazards"]) for k, r in rows.items()})
assert rows["all"]["garbled"] == 0 and rows["all"]["hazards"] == 0, rows["all"]
PY
check throughput 120 python3 -m kvtier.cli bench throughput --device cuda \
    --models tiny-llama,default --dtypes float32,bfloat16 --num-prompts 32 \
    --out "$logs/throughput.json"
echo "gpu_check: $failed failed"
exit $((failed > 0))
