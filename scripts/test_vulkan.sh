#!/usr/bin/env bash
# The Vulkan tier: the lossless tests with every layer of target and drafter offloaded to a Vulkan device.
# On a machine without a GPU, Mesa's lavapipe (llvmpipe) is that device: a CPU implementation of Vulkan that
# runs ggml's device-buffer, offload and copy-back paths, the ones CUDA and Metal take. Speed there means
# nothing; identical greedy output and the sampled distributions are the point.
#
#   scripts/test_vulkan.sh                            build what is missing, then run the tier
#   scripts/test_vulkan.sh tests/test_vulkan.py -x    arguments replace the tier's test selection
#
# Builds llama-cpp-python with CMAKE_ARGS="-DGGML_VULKAN=on" into its own venv ($DFLASH_VULKAN_VENV,
# default .cache/vulkan/venv), reused while it imports with a Vulkan device. Debian/Ubuntu only for the
# packages; elsewhere install a Vulkan driver, loader headers >= 1.4, glslc and glslang-tools yourself.
set -euo pipefail
# every failing step says what failed (set -e alone exits with the failing command's status and no word)
step="setting up"
trap 'rc=$?; echo "test_vulkan: failed while $step: \`$BASH_COMMAND\` exited with status $rc (line $LINENO)" >&2' ERR
cd "$(dirname "$0")/.."
root="$PWD"
cache="$root/.cache/vulkan"
venv="${DFLASH_VULKAN_VENV:-$cache/venv}"
mkdir -p "$cache"
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"

# 1. the driver, lavapipe from Mesa >= 25, first (vulkan-tools would otherwise pull the distribution's Mesa).
# Debian 12's Mesa 22.3.6 crashes inside lavapipe on hybrid targets and on some flash-attention batches
# (docs/BACKENDS.md); bookworm-backports carries Mesa 25.0.7 built for Debian 12's libc, so on bookworm it
# comes from there (the other installed Mesa packages are upgraded with it).
mesa_min=25
step="checking for Mesa's Vulkan driver (mesa-vulkan-drivers >= $mesa_min)"
# empty when not installed (dpkg-query then exits 1, which pipefail would make the script's exit)
mesa_version() { { dpkg-query -W -f='${Status} ${Version}' mesa-vulkan-drivers 2>/dev/null || true; } | sed -n 's/^install ok installed //p'; }
mesa=$(mesa_version)
if [ -z "$mesa" ] || dpkg --compare-versions "$mesa" lt "$mesa_min"; then
    step="adding a package source for Mesa >= $mesa_min (installed: ${mesa:-none})"
    suite=()
    if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = bookworm ]; then
        if ! apt-cache policy | grep -q "bookworm-backports/main"; then
            echo "test_vulkan: adding Debian's bookworm-backports suite for Mesa >= $mesa_min"
            printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
                | $sudo tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
        fi
        suite=(-t bookworm-backports)
    fi
    step="installing mesa-vulkan-drivers ${suite[*]:-}"
    echo "test_vulkan: installing mesa-vulkan-drivers ${suite[*]:-} (installed: ${mesa:-none})"
    $sudo apt-get update -q
    $sudo apt-get install -y -q "${suite[@]}" mesa-vulkan-drivers
    mesa=$(mesa_version)
    dpkg --compare-versions "$mesa" ge "$mesa_min" \
        || echo "test_vulkan: warning: Mesa $mesa is older than $mesa_min; lavapipe crashes are known there (docs/BACKENDS.md)" >&2
fi

# 1b. the loader, the shader compilers and the headers ggml-vulkan's configure step checks for
step="installing the Vulkan loader, headers and shader compilers"
packages="libvulkan-dev glslc glslang-tools spirv-headers vulkan-tools"
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "test_vulkan: installing$missing"
    $sudo apt-get update -q
    $sudo apt-get install -y -q $missing
fi

# 2. Vulkan-Hpp headers new enough for the vendored ggml-vulkan (vk::LayerSettingEXT, Vulkan 1.3.261+).
# Debian 12 ships 1.3.239: take Debian 13's libvulkan-dev headers, unpacked into the cache and never
# installed (installing that package would pull trixie's libc). The trixie suite is added at pin priority
# 50, so apt never prefers any of its packages over the system's.
step="getting Vulkan-Hpp headers with vk::LayerSettingEXT (Debian trixie's libvulkan-dev, unpacked)"
include=""
if ! grep -q LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
    include="$cache/headers/usr/include"
    if ! grep -q LayerSettingEXT "$include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
        if ! apt-cache policy libvulkan-dev | grep -q " trixie/main"; then
            echo "test_vulkan: the system's Vulkan headers are too old; adding Debian trixie at pin priority 50 for newer ones"
            printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
                | $sudo tee /etc/apt/sources.list.d/trixie.sources >/dev/null
            printf 'Package: *\nPin: release n=trixie\nPin-Priority: 50\n' | $sudo tee /etc/apt/preferences.d/trixie-low >/dev/null
            $sudo apt-get update -q
        fi
        rm -rf "$cache/deb" "$cache/headers"
        mkdir -p "$cache/deb"
        (cd "$cache/deb" && apt-get download -q libvulkan-dev/trixie)
        dpkg-deb -x "$cache"/deb/libvulkan-dev_*.deb "$cache/headers"
        grep -q LayerSettingEXT "$include/vulkan/vulkan_structs.hpp"
    fi
fi

# 3. llama-cpp-python 0.3.36 built for Vulkan, in its own venv (about 20 minutes on two cores)
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"  # ggml skips CPU-type devices (lavapipe) unless named
# ggml-vulkan's f16 matrix path (batches of 9 rows and more) moves a verify batch's logits by ~0.5 from single
# steps on lavapipe, so greedy output could flip at a near tie without any bug; without f16 the difference is
# under 4e-3 (scripts/measure_vulkan_batch.py, docs/BACKENDS.md) and the same device paths run. The tier runs
# without it; tests/test_vulkan.py measures both settings. DFLASH_VULKAN_F16=on runs the tier with f16.
[ "${DFLASH_VULKAN_F16:-off}" = on ] || export GGML_VK_DISABLE_F16=1
has_vulkan() {
    "$venv/bin/python" - <<'EOF' 2>/dev/null
import ctypes, sys
from llama_cpp import llama_cpp as capi
from llama_cpp._ggml import libggml
capi.llama_backend_init()
libggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
sys.exit(0 if libggml.ggml_backend_reg_by_name(b"Vulkan") else 1)
EOF
}
if [ ! -x "$venv/bin/python" ] || ! has_vulkan; then
    step="building llama-cpp-python 0.3.36 with Vulkan into $venv"
    echo "test_vulkan: $step"
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # the no-AMX flags and the reasons for them: scripts/setup.sh
    if [ "$(uname -m)" = "x86_64" ]; then
        no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
    fi
    CMAKE_ARGS="-DGGML_VULKAN=on${include:+ -DVulkan_INCLUDE_DIR=$include}" \
        "$venv/bin/python" -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
    echo "test_vulkan: llama-cpp-python built in $(( $(date +%s) - start )) s"
    has_vulkan || { echo "test_vulkan: the build in $venv has no Vulkan backend" >&2; exit 1; }
fi
step="installing dflash-gguf and its test dependencies into $venv"
"$venv/bin/python" -m pip install -q -e ".[test]"
"$venv/bin/python" -m pip show -q dflash >/dev/null 2>&1 || "$venv/bin/python" -m pip install -q --no-deps "dflash==0.1.0"
step="fetching llama-cpp-python 0.3.36's source (the tests' upstream llama.cpp tools)"
src="$root/.cache/upstream"
if [ ! -f "$src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$src"
    "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$src"
    tar -xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
fi
export DFLASH_LLAMA_CPP_SRC="$src/llama_cpp_python-0.3.36/vendor/llama.cpp"

# 4. the tier: the lossless tests as they are, every model loaded with every layer on the device
# (tests/offload_all.py), compared with plain decoding on the same backend; then the device-only checks.
# Arguments replace the default selection: scripts/test_vulkan.sh tests/test_vulkan.py -x
step="running the tier"
tests=()
while read -r line; do tests+=("$line"); done < <(grep -Ev '^[[:space:]]*(#|$)' scripts/lossless_tier.txt)  # shared with gpu_check.sh
[ $# -eq 0 ] || tests=("$@")
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|driverName|driverInfo" || true
start=$(date +%s)
status=0
PYTHONPATH="$root/tests${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -p offload_all -q "${tests[@]}" || status=$?
echo "test_vulkan: tier ran in $(( $(date +%s) - start )) s"
exit $status
