# Issue 24's GPU figures in one device call (scripts/gpu/README.md): part D as built, the 1-row vs 32-row decode
# step and part M on the GPU (serve_checks.py), then the GPU tests. Each step has its own time limit and log in $OUT.
. scripts/gpu/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
t0=$(date +%s)
timeout 240 python3 -m app bench --only D --device cuda --out-dir "$OUT/d" >"$OUT/d.log" 2>&1; echo "D rc=$? $(($(date +%s)-t0)) s"
grep -E "^ *D |ratio|floor|ms/token" "$OUT/d.log" | tail -8
timeout 220 python3 scripts/gpu/serve_checks.py --out "$OUT/serve_checks.json" >"$OUT/serve.log" 2>&1; echo "serve_checks rc=$? $(($(date +%s)-t0)) s"
grep -E "rows at once|step /|^M:|ready in" "$OUT/serve.log"
timeout 100 python3 -m pytest -W default -q -x -m gpu tests/engine/test_models.py -k "compiled or fp32" >"$OUT/pytest.log" 2>&1; echo "pytest rc=$? $(($(date +%s)-t0)) s"
tail -5 "$OUT/pytest.log"
