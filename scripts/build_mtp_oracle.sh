#!/usr/bin/env bash
# Build scripts/mtp_oracle.cpp: upstream's MTP draft driver (common/speculative.cpp) as llama-server runs it.
# Compiled against the vendored sdist's headers ($DFLASH_LLAMA_CPP_SRC) and linked with the libllama and
# libllama-common that pip built from that same sdist (llama-cpp-python 0.3.36 installs both), so no
# llama.cpp build is needed: a few seconds.   usage: scripts/build_mtp_oracle.sh [OUT]  (prints OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
src="${DFLASH_LLAMA_CPP_SRC:-$PWD/.cache/upstream/llama_cpp_python-0.3.36/vendor/llama.cpp}"
out="${1:-$PWD/.cache/mtp_oracle}"
python=${PYTHON:-python}
site=$("$python" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent.parent)')
llama_lib="$site/llama_cpp/lib"
common_lib="$site/lib"
for f in "$src/common/speculative.h" "$llama_lib/libllama.so" "$common_lib/libllama-common.so"; do
    [ -e "$f" ] || { echo "build_mtp_oracle: missing $f" >&2; exit 1; }
done
tmp="$out.tmp.$$"
${CXX:-c++} -std=c++17 -O1 -w -I"$src/include" -I"$src/common" -I"$src/ggml/include" \
    scripts/mtp_oracle.cpp -o "$tmp" \
    -L"$common_lib" -L"$llama_lib" -lllama-common -lllama -lggml -lggml-base \
    -Wl,--disable-new-dtags -Wl,-rpath,"$common_lib" -Wl,-rpath,"$llama_lib"  # RPATH: libllama-common finds ggml too
mv "$tmp" "$out"
echo "$out"
