#!/usr/bin/env bash
# llama.cpp's RPC backend for dflash-gguf: a libllama built with -DGGML_RPC=on in its own venv, and ggml's
# rpc-server built from the same vendored source, so `--rpc host:port` / Session(rpc_servers=[...]) work.
#
#   scripts/build_rpc.sh                 build what is missing (about 25 minutes on two cores), print where it is
#   scripts/build_rpc.sh pytest ARGS     then run pytest in that venv (tests/test_rpc.py needs it)
#
# The venv ($DFLASH_RPC_VENV, default .venv-rpc) holds only llama-cpp-python 0.3.36 built with RPC and the
# editable project; everything else (numpy, textual, torch, ...) comes from the project's .venv
# (scripts/setup.sh), which a .pth file puts behind it on sys.path: the RPC build's llama_cpp shadows the
# default one, nothing is downloaded twice. CMAKE_ARGS is honoured (-DGGML_CUDA=on etc.), RPC is added to it.
#
# rpc-server (bin/ggml-rpc-server in the venv) is tools/rpc/rpc-server.cpp of the vendored llama.cpp, linked
# against the venv's own libggml, so client and server speak one RPC protocol version. Run it on every
# machine that lends its device: ggml-rpc-server -H 0.0.0.0 -p 50052 (never on an open network: it has no
# authentication; upstream's tools/rpc/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="${DFLASH_RPC_VENV:-$root/.venv-rpc}"
base="$root/.venv"
version="0.3.36"
src="$root/.cache/upstream"
llama_src="$src/llama_cpp_python-$version/vendor/llama.cpp"

[ -x "$base/bin/python" ] || bash scripts/setup.sh test
if [ ! -f "$src/llama_cpp_python-$version.tar.gz" ] || [ ! -f "$llama_src/tools/rpc/rpc-server.cpp" ]; then
    mkdir -p "$src"
    "$base/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$src"
    tar -xzf "$src/llama_cpp_python-$version.tar.gz" -C "$src"
fi

has_rpc() {
    "$venv/bin/python" - <<'EOF' 2>/dev/null
import sys
from llama_cpp import llama_cpp as capi
sys.exit(0 if capi.llama_supports_rpc() else 1)
EOF
}

if [ ! -x "$venv/bin/python" ] || ! has_rpc; then
    echo "build_rpc: building llama-cpp-python $version with -DGGML_RPC=on into $venv"
    start=$(date +%s)
    rm -rf "$venv"
    "$base/bin/python" -m venv "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # the project's packages, behind this venv's own (addsitedir also runs their .pth files: the editable install)
    echo "import site; site.addsitedir('$base_site')" > "$site/zz_dflash_base_venv.pth"
    # the no-AMX flags and the reasons for them: scripts/setup.sh
    if [ "$(uname -m)" = "x86_64" ]; then
        no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
    fi
    CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=on" "$venv/bin/python" -m pip install -q --no-cache-dir --no-deps \
        "$src/llama_cpp_python-$version.tar.gz"
    echo "build_rpc: llama-cpp-python built in $(( $(date +%s) - start )) s"
    has_rpc || { echo "build_rpc: the build in $venv has no RPC backend" >&2; exit 1; }
fi
# the project itself, editable, for its console scripts (dflash-serve, ...) in $venv/bin
[ -x "$venv/bin/dflash-serve" ] || "$venv/bin/python" -m pip install -q --no-deps -e "$root"

server="$venv/bin/ggml-rpc-server"
if [ ! -x "$server" ]; then
    lib=$("$venv/bin/python" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')
    echo "build_rpc: building ggml-rpc-server from $llama_src/tools/rpc"
    start=$(date +%s)
    "${CXX:-c++}" -O2 -std=c++17 -I"$llama_src/ggml/include" "$llama_src/tools/rpc/rpc-server.cpp" \
        -L"$lib" -lggml -lggml-base -Wl,-rpath,"$lib" -pthread -o "$server.tmp"
    mv "$server.tmp" "$server"
    echo "build_rpc: ggml-rpc-server built in $(( $(date +%s) - start )) s"
fi
echo "build_rpc: $venv (python: $venv/bin/python, rpc-server: $server)"

if [ "${1:-}" = pytest ]; then
    shift
    export DFLASH_LLAMA_CPP_SRC="$llama_src"
    exec "$venv/bin/python" -m pytest "$@"
fi
