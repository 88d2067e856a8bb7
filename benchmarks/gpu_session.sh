#!/usr/bin/env bash
# Issue 13's GPU checks and measurements in two device calls. GPU sessions are rare and their
# device time short (30 min, a minute or more of it per machine start), so the commands live
# here rather than in a session's notes.
#
#   bash benchmarks/gpu_session.sh wheels     # here, once: .whl/ (git-ignored, ~7 MB)
#   bash benchmarks/gpu_session.sh measure    # device call 1, carry [".whl"]: GPU tests, the
#                                             # table and ragkv bench's workload
#   bash benchmarks/gpu_session.sh profile    # device call 2, carry [".whl"]: rag rows with
#                                             # profiles + the whole suite
#   bash benchmarks/gpu_session.sh recompute  # one device call, carry [".whl"]: the quality
#                                             # modes' rows, then the GPU and recompute tests
#   bash benchmarks/gpu_session.sh quant      # one device call, carry [".whl"]: the int8-group
#                                             # kernels' tests, then bench_gpu_quant.py (~4 min)
#   bash benchmarks/gpu_session.sh windows    # one device call, carry [".whl"]: sliding windows
#                                             # in the kernels and graphs (tests, compiled), then
#                                             # bench_window.py at 8k and 32k tokens (~3 min)
#   bash benchmarks/gpu_session.sh smoke      # here: the same bench commands, tiny, on CPU
#
# The device image has PyTorch, Triton, transformers, hypothesis, httpx, xxhash, numpy and
# pytest-xdist, but not the server's packages, gguf, redis or openai: those travel as wheels
# for its Python 3.12, pinned so every session installs the same set. Logs and JSON go to
# $OUT (at most 8 files come back, two folders down), each log tee'd as it runs so a call cut
# off at its limit still returns what it printed.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
        annotated_types==0.8.0 annotated_doc==0.0.7 typing_inspection==0.4.5
        opentelemetry_api==1.45.2 uvicorn==0.54.0 gguf==0.19.0 redis==8.1.0 openai==3.57.0
        httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 truststore==0.10.5
        # Present in the image, but at versions these need (or the image's are unknown).
        anyio==4.16.0 idna==3.20 typing_extensions==4.16.0 sniffio==1.3.1 h11==0.16.0)

on_device() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    OUT=${OUT:?run this through the device tool, which sets OUT}
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
}

case "${1:-}" in
wheels)
    exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    ls .whl | wc -l; du -sh .whl
    ;;
measure)
    on_device
    # Kernels, graphs and the GPU end-to-end tests first: a failure here makes the table moot.
    python3 -m pytest -q -n 8 -rfE tests/test_triton_kernels.py tests/test_gpu.py \
        tests/test_positions.py tests/test_slot_table.py 2>&1 | tee "$OUT/gpu_tests.log"
    python3 benchmarks/bench_gpu.py --json "$OUT/gpu.json" 2>&1 \
        | tee "$OUT/bench_gpu.log"
    ;;
profile)
    on_device
    # The warm question with host and device profiles (prof/rag_warm.txt, prof/rag_blend.txt).
    python3 benchmarks/bench_gpu.py --rows rag --skip-hf --skip-rag-bench --json "$OUT/rag.json" \
        --profile "$OUT/prof" 2>&1 | tee "$OUT/bench_rag.log"
    # The whole suite: issue 13 asks for "well under 10 minutes" on a GPU machine.
    start=$(date +%s)
    python3 -m pytest -q -n 8 -rfE --durations=15 2>&1 | tee "$OUT/pytest.log"
    echo "whole suite: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.log"
    ;;
recompute)
    on_device
    # Timings first, on an idle GPU; then the tests that run the kernels and graphs.
    python3 benchmarks/bench_gpu.py --rows recompute --skip-hf --skip-rag-bench \
        --json "$OUT/recompute.json" 2>&1 | tee "$OUT/bench_recompute.log"
    timeout 240 python3 -m pytest -q -n 8 -rfE tests/test_triton_kernels.py tests/test_gpu.py \
        tests/test_positions.py tests/test_recompute.py 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
quant)
    on_device
    timeout 240 python3 -m pytest -q -n 8 -rfE tests/test_int8_linear.py 2>&1 \
        | tee "$OUT/quant_tests.log"
    python3 benchmarks/bench_gpu_quant.py --parts engine,kernels,dot --json "$OUT/q8.json" 2>&1 \
        | tee "$OUT/bench_q8.log"
    ;;
windows)
    on_device
    timeout 300 python3 -m pytest -q -n 8 -rfE tests/test_triton_kernels.py \
        tests/test_positions.py tests/test_rag.py -k "triton or graphs or sliding or warmup" \
        2>&1 | tee "$OUT/window_tests.log"
    python3 benchmarks/bench_window.py --json "$OUT/window8k.json" 2>&1 \
        | tee "$OUT/bench_window.log"
    python3 benchmarks/bench_window.py --tokens 32768 --batch 8 --json "$OUT/window32k.json" \
        2>&1 | tee -a "$OUT/bench_window.log"
    ;;
smoke)
    python3 benchmarks/bench_window.py --smoke || exit 1
    tiny=(--layers 2 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --vocab 4096
          --device cpu --dtype float32 --quick)
    python3 benchmarks/bench_gpu.py "${tiny[@]}" --skip-rag-bench --json /tmp/gpu_smoke.json &&
    python3 benchmarks/bench_gpu.py "${tiny[@]}" --rows rag --skip-hf --skip-rag-bench \
        --profile /tmp/gpu_smoke_prof
    ;;
*)
    sed -n '2,10p' "$0"; exit 2
    ;;
esac
