# Issue 24's GPU figures in one device call (scripts/gpu/README.md): the Triton decode-attention kernel's tests
# first (the run stops there when they fail), part D as built, the 1-row vs 32-row decode step and part M on the
# GPU (serve_checks.py), the GPU tests, then, where an older tree was carried in old/ (untracked, a `git archive` of
# the commit to compare with), its 1-row vs 32-row steps on the same machine. Each step has its own time limit and
# log in $OUT.
. scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
t0=$(date +%s)
python3 -c "import triton; print('triton', triton.__version__)"
timeout 120 python3 -m pytest -W default -q -p no:cacheprovider tests/unit/test_cuda_kernels.py -k "not engine" >"$OUT/kernel.log" 2>&1
rc=$?; echo "kernel tests rc=$rc $(($(date +%s)-t0)) s"; tail -3 "$OUT/kernel.log"
if [ $rc -ne 0 ]; then grep -E "Error|error|assert" "$OUT/kernel.log" | head -30; exit 1; fi
timeout 240 python3 -m app bench --only D --device cuda --out-dir "$OUT/d" >"$OUT/d.log" 2>&1; echo "D rc=$? $(($(date +%s)-t0)) s"
grep -E "^ *D |ratio|floor|ms/token" "$OUT/d.log" | tail -8
timeout 220 python3 scripts/gpu/serve_checks.py --out "$OUT/serve_checks.json" >"$OUT/serve.log" 2>&1; echo "serve_checks rc=$? $(($(date +%s)-t0)) s"
grep -E "rows at once|step /|^M:|ready in" "$OUT/serve.log"
grep -A20 "engine step failed" /tmp/serve-checks-logs/* 2>/dev/null | head -40
timeout 120 python3 -m pytest -W default -q -p no:cacheprovider tests/unit/test_cuda_kernels.py tests/engine/test_models.py -k "compiled_decoding or fp32_logprobs or engine_decode" >"$OUT/pytest.log" 2>&1; echo "pytest rc=$? $(($(date +%s)-t0)) s"
tail -5 "$OUT/pytest.log"
if [ -d old/app ]; then
    ln -sfn "$PWD/.cache" old/.cache
    (cd old && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/gpu/serve_checks.py --no-m --out "$OUT/old_serve_checks.json" >"$OUT/old_serve.log" 2>&1)
    echo "old tree serve_checks rc=$? $(($(date +%s)-t0)) s"
    grep -E "rows at once|step /|ready in" "$OUT/old_serve.log"
fi
