#!/usr/bin/env bash
# Build llama.cpp's server (llama-server) for bench part K, once.
#
# The sources are the llama.cpp that the llama-cpp-python sdist vendors (vendor/llama.cpp), at a pinned
# version, fetched with pip from PyPI. Only the llama-server target is built: CPU only, Release, native CPU
# flags (named ones, AMX left out, where the CPU advertises AMX), no libcurl, no OpenSSL, no web UI download,
# static llama/ggml libraries. About 11 CPU-minutes (some 6 minutes on 2 idle cores; 25 on a busy shared machine).
#
#   scripts/build-llama-server.sh            # build unless the binary of this version is already there
#   scripts/build-llama-server.sh --force    # configure and build again (incremental)
#
# Output: .cache/llama.cpp/bin/llama-server (BENCH_LLAMA_DIR overrides .cache/llama.cpp; JOBS the build's
# parallel jobs, nproc by default). The last line printed is the binary's path. Exit status: 0 when the binary
# is there, 1 when a tool is missing or a step failed.
set -euo pipefail

VERSION=0.3.36
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${BENCH_LLAMA_DIR:-$ROOT/.cache/llama.cpp}"
BIN="$DEST/bin/llama-server"
STAMP="$DEST/bin/llama-server.version"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

# Native CPU flags, except where the CPU advertises AMX: there a native build's AMX kernels die with SIGILL at their
# first tile instruction (seen 2026-11-28 on an Intel Xeon VM with amx_tile, amx_int8 and amx_bf16), so the
# instruction sets the CPU has are named instead, AMX left out.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF)
    for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 avx512f:GGML_AVX512 \
        avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16 avx512vbmi:GGML_AVX512_VBMI; do
        grep -qw "${pair%%:*}" /proc/cpuinfo && ISA_FLAGS+=("-D${pair#*:}=ON")
    done
else
    ISA_FLAGS=(-DGGML_NATIVE=ON)
fi
CMAKE_FLAGS=(
    -G Ninja
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    "${ISA_FLAGS[@]}"
    -DGGML_CUDA=OFF
    -DGGML_METAL=OFF
    -DGGML_VULKAN=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
)
STAMP_TEXT="llama-cpp-python==$VERSION ${CMAKE_FLAGS[*]}"

say() { echo "build-llama-server: $*"; }
fail() {
    echo "build-llama-server: $*" >&2
    exit 1
}

force=0
for arg in "$@"; do
    case "$arg" in
    --force) force=1 ;;
    -h | --help)
        sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) fail "unknown argument: $arg (try --help)" ;;
    esac
done

if [[ $force == 0 && -x $BIN && -f $STAMP && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    say "already built (llama-cpp-python $VERSION's llama.cpp); --force builds it again"
    echo "$BIN"
    exit 0
fi

# The tools, all checked before anything is fetched.
PYTHON=""
for candidate in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -m pip --version >/dev/null 2>&1; then
        PYTHON="$candidate"
        break
    fi
done
missing=()
[[ -n $PYTHON ]] || missing+=("python with pip (the sources come from PyPI with pip download)")
command -v cmake >/dev/null 2>&1 || missing+=("cmake (apt-get install cmake)")
command -v ninja >/dev/null 2>&1 || missing+=("ninja (apt-get install ninja-build)")
command -v "${CC:-cc}" >/dev/null 2>&1 || missing+=("a C compiler, ${CC:-cc} (apt-get install build-essential)")
command -v "${CXX:-c++}" >/dev/null 2>&1 || missing+=("a C++ compiler, ${CXX:-c++} (apt-get install build-essential)")
command -v tar >/dev/null 2>&1 || missing+=("tar")
if ((${#missing[@]})); then
    for tool in "${missing[@]}"; do
        echo "build-llama-server: missing: $tool" >&2
    done
    fail "cannot build llama-server; bench part K will be skipped"
fi

SRC_PARENT="$DEST/src"
SDIST="$SRC_PARENT/llama_cpp_python-$VERSION.tar.gz"
SRC="$SRC_PARENT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$DEST/build"
mkdir -p "$SRC_PARENT" "$DEST/bin"

if [[ ! -f $SDIST ]]; then
    say "fetching the llama-cpp-python $VERSION sdist from PyPI"
    "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$SRC_PARENT" ||
        fail "pip download llama-cpp-python==$VERSION failed"
fi
[[ -f $SDIST ]] || fail "pip left no $SDIST"

if [[ ! -f $SRC/CMakeLists.txt ]]; then
    say "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$SRC_PARENT" || fail "cannot unpack $SDIST"
fi
[[ -f $SRC/CMakeLists.txt ]] || fail "the sdist has no vendored llama.cpp at vendor/llama.cpp"

# A build folder configured with other flags (or another version) starts over.
if [[ -f $BUILD/saker-stamp && "$(cat "$BUILD/saker-stamp")" != "$STAMP_TEXT" ]]; then
    rm -rf "$BUILD"
fi
mkdir -p "$BUILD"

started=$SECONDS
say "configuring $SRC (CPU, Release, native flags, LLAMA_CURL=OFF)"
cmake -S "$SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}" >"$BUILD/configure.log" 2>&1 ||
    {
        tail -n 30 "$BUILD/configure.log" >&2
        fail "cmake configure failed (log: $BUILD/configure.log)"
    }
echo "$STAMP_TEXT" >"$BUILD/saker-stamp"

say "building the llama-server target with $JOBS jobs (several minutes; compiler output in $BUILD/build.log)"
# ninja's progress lines only; the whole output (warnings included) goes to the log
set +e
cmake --build "$BUILD" --target llama-server -j "$JOBS" 2>&1 | tee "$BUILD/build.log" |
    grep --line-buffered -E '^\[[0-9]+/[0-9]+\]' | cut -c1-100
status=${PIPESTATUS[0]}
set -e
if [[ $status != 0 ]]; then
    tail -n 40 "$BUILD/build.log" >&2
    fail "the build failed (log: $BUILD/build.log)"
fi

built="$BUILD/bin/llama-server"
[[ -x $built ]] || fail "the build left no $built"
cp "$built" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"
echo "$STAMP_TEXT" >"$STAMP"
"$BIN" --version >/dev/null 2>&1 || fail "$BIN was built but does not run (--version failed)"

say "built in $((SECONDS - started)) s: llama-cpp-python $VERSION's llama.cpp"
echo "$BIN"
