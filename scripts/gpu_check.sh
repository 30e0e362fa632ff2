#!/usr/bin/env bash
# CUDA or Metal, checked: build llama-cpp-python 0.3.36 for this machine's GPU into its own venv, run the
# lossless tier with every layer of target and drafter on the GPU, benchmark the embedded pair and a hybrid
# fixture on it, and write every result into one JSON.
#
#   scripts/gpu_check.sh                           CUDA (Linux, Windows under bash) or Metal (macOS)
#   scripts/gpu_check.sh --cpu                     the same steps on ggml's CPU backend: a check of this script
#   scripts/gpu_check.sh -- tests/test_vulkan.py   arguments after -- replace the tier's test selection
#
# Options: --out FILE (default .cache/gpu-check/<backend>/gpu-check.json), --venv DIR (default
# .cache/gpu-check/<backend>/venv; reused while it imports llama-cpp-python 0.3.36 with the backend),
# --skip-tier, --skip-bench, --bench-limit N (prompts per category, default 1), --max-tokens N (default 64).
# The build takes CMAKE_ARGS="-DGGML_CUDA=on" (CUDA toolkit: nvcc on PATH or CUDACXX) or "-DGGML_METAL=on";
# extra flags can be appended with GPU_CHECK_CMAKE_ARGS (e.g. "-DCMAKE_CUDA_ARCHITECTURES=89").
# Exit status: 0 when the tier passed and both benchmarks ran, 1 otherwise (the JSON is written either way,
# once the build is in place), 2 for bad arguments or a missing CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

backend=cuda
[ "$(uname -s)" = Darwin ] && backend=metal
out="" venv="" skip_tier=0 skip_bench=0 bench_limit=1 max_tokens=64
selection=()
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) backend=cpu ;;
        --out) out="$2"; shift ;;
        --venv) venv="$2"; shift ;;
        --skip-tier) skip_tier=1 ;;
        --skip-bench) skip_bench=1 ;;
        --bench-limit) bench_limit="$2"; shift ;;
        --max-tokens) max_tokens="$2"; shift ;;
        --) shift; selection=("$@"); break ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$backend" in
    cuda) cmake_args="-DGGML_CUDA=on" reg=CUDA ngl=-1 ;;
    metal) cmake_args="-DGGML_METAL=on" reg=MTL ngl=-1 ;;  # ggml-metal registers as MTL
    cpu) cmake_args="" reg=CPU ngl=0 ;;
esac
cmake_args="$cmake_args${GPU_CHECK_CMAKE_ARGS:+ $GPU_CHECK_CMAKE_ARGS}"
work="$root/.cache/gpu-check/$backend"
venv="${venv:-$work/venv}"
out="${out:-$work/gpu-check.json}"
mkdir -p "$work" "$(dirname "$out")"
py="$venv/bin/python"
[ -x "$py" ] || py="$venv/Scripts/python.exe"  # a venv made by Windows' Python

if [ "$backend" = cuda ] && ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDACXX:-}" ]; then
    echo "gpu_check: no nvcc on PATH and no CUDACXX: install the CUDA toolkit (nvcc) before building with -DGGML_CUDA=on" >&2
    exit 2
fi

# 1. llama-cpp-python 0.3.36 built for the backend, in its own venv
has_backend() {
    "$py" - "$reg" <<'EOF' 2>/dev/null
import ctypes, sys
import llama_cpp
from llama_cpp import llama_cpp as capi
from llama_cpp._ggml import libggml
capi.llama_backend_init()
find = libggml["ggml_backend_reg_by_name"]
find.argtypes, find.restype = [ctypes.c_char_p], ctypes.c_void_p
sys.exit(0 if llama_cpp.__version__ == "0.3.36" and find(sys.argv[1].encode()) else 1)
EOF
}
build_s=null
if [ ! -x "$py" ] || ! has_backend; then
    echo "gpu_check: building llama-cpp-python 0.3.36 with CMAKE_ARGS=\"$cmake_args\" into $venv"
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    py="$venv/bin/python"
    [ -x "$py" ] || py="$venv/Scripts/python.exe"
    "$py" -m pip install -q --upgrade pip
    if [ "$(uname -m)" = "x86_64" ]; then  # the no-AMX flags and the reasons for them: scripts/setup.sh
        no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
    fi
    CMAKE_ARGS="$cmake_args" "$py" -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
    build_s=$(( $(date +%s) - start ))
    echo "gpu_check: llama-cpp-python built in $build_s s"
    has_backend || { echo "gpu_check: the build in $venv has no $reg backend" >&2; exit 1; }
fi

# 2. the project and its test extras (torch from the CPU wheel index on Linux: the tests need no CUDA torch),
# z-lab's reference package, and upstream's sources (their converter builds the hybrid fixtures)
export PYTHONPATH="$root:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import dflash_gguf.server.app, dflash_gguf.bench.cli, pytest, torch, transformers, dflash" 2>/dev/null; then
    if [ "$(uname -s)" = Linux ]; then
        "$py" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
    "$py" -m pip install -q -e ".[test]"
    "$py" -m pip install -q --no-deps "dflash==0.1.0"
fi
src="$root/.cache/upstream"
if [ ! -f "$src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$src"
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$src"
    tar -xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
fi
export DFLASH_LLAMA_CPP_SRC="$src/llama_cpp_python-0.3.36/vendor/llama.cpp"
export DFLASH_CALIBRATION_DIR="$work/calibration"  # measured fresh for this build, kept apart from the user's

# 3. the lossless tier (scripts/lossless_tier.txt, as scripts/test_vulkan.sh runs it), every model on the GPU
if [ ${#selection[@]} -eq 0 ]; then
    while read -r line; do selection+=("$line"); done < <(grep -Ev '^[[:space:]]*(#|$)' scripts/lossless_tier.txt)
fi
plugin=(-p offload_all)
[ "$backend" = cpu ] && plugin=()  # the CPU path: the same tests, nothing to offload
tier_status=null tier_s=null
rm -f "$work/tier.xml"
if [ "$skip_tier" = 0 ]; then
    start=$(date +%s)
    tier_status=0
    "$py" -m pytest ${plugin[@]+"${plugin[@]}"} -q --junitxml="$work/tier.xml" "${selection[@]}" || tier_status=$?
    tier_s=$(( $(date +%s) - start ))
    echo "gpu_check: tier ran in $tier_s s (exit status $tier_status)"
fi

# 4. dflash-bench on the embedded pair and on a hybrid fixture (qwen35, the bench-sized one), every layer offloaded
bench=(-m dflash_gguf.bench.cli --n-gpu-layers "$ngl" --limit "$bench_limit" --max-tokens "$max_tokens" --out "$work/bench")
embedded_status=null hybrid_status=null hybrid_target="" hybrid_drafter=""
rm -f "$work/bench/embedded.json" "$work/bench/hybrid-qwen35.json"
if [ "$skip_bench" = 0 ]; then
    embedded_status=0
    # the tree mode (issue 36) in lockstep beside plain and linear DFlash: whether the controller turns trees on here
    "$py" "${bench[@]}" --name embedded --modes dflash tree || embedded_status=$?
    hybrid_status=0
    rm -rf "$work/hybrid"  # built afresh (seconds): the converter refuses to overwrite a drafter
    if fixture=$("$py" tests/hybrid_fixtures.py "$work/hybrid" --bench --archs qwen35 | tail -n 1); then
        read -r hybrid_target _ hybrid_drafter <<<"$fixture"
        "$py" "${bench[@]}" --name hybrid-qwen35 --target "$hybrid_target" --drafter "$hybrid_drafter" || hybrid_status=$?
    else
        hybrid_status=1
        echo "gpu_check: building the hybrid fixture failed" >&2
    fi
fi

# 4b. draft trees (issue 36): this device's verify cost of a linear block and of a tree of n rows, and the
# speedup the embedded pair's exact acceptances on the built-in prompts project under that curve
tree_status=null
if [ "$skip_bench" = 0 ]; then
    tree_status=0
    mkdir -p "$work/tree"
    { "$py" scripts/measure_tree.py curve --n-gpu-layers "$ngl" --out "$work/tree/verify_curve.json" &&
      "$py" scripts/measure_tree.py collect --n-gpu-layers "$ngl" --per-category 3 --max-tokens "$max_tokens" \
          --out "$work/tree/drafts.npz" &&
      "$py" scripts/measure_tree.py project "$work/tree/drafts.npz" --curve "$work/tree/verify_curve.json" \
          | tee "$work/tree/projection.md"; } || tree_status=$?
fi

# 5. one JSON: the build, the devices, the tier's counts and failures, each benchmark's summary
"$py" - "$out" "$backend" "$cmake_args" "$build_s" "$tier_status" "$tier_s" "$work" "$embedded_status" "$hybrid_status" \
    "$hybrid_target" "$hybrid_drafter" "$tree_status" ${selection[@]+"${selection[@]}"} <<'EOF'
import json, os, platform, shutil, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, backend, cmake_args, build_s, tier_status, tier_s, work, emb, hyb, hyb_target, hyb_drafter, trees = sys.argv[1:13]
selection = sys.argv[13:]
num = lambda s: None if s == "null" else int(s)
from dflash_gguf.backends import build, gpu_devices

def tier():
    xml = Path(work, "tier.xml")
    if not xml.is_file():
        return None
    counts, failures = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}, []
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            for bad in case.findall("failure") + case.findall("error"):
                message = (bad.get("message") or "").strip()
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                 "message": message.splitlines()[0][:300] if message else ""})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures}

def bench(name, status):
    path = Path(work, "bench", f"{name}.json")
    if not path.is_file():
        return None if status == "null" else {"exit_status": num(status), "result": None}
    d = json.loads(path.read_text())
    overall = d["summary"]["all"]
    pick = lambda m: {k: m.get(k) for k in ("loop_tokens_per_s", "tau", "acceptance_rate", "draft_ms_per_cycle",
                                               "verify_ms_per_cycle")}
    # where the Sessions' layers were, as their stats say: the GPU, or the check did not check it
    devices = sorted({r["stats"]["device"] for p in d["prompts"] for r in p["runs"] if r.get("stats")})
    return {"exit_status": num(status), "result": str(path), "devices": devices, "prompts": overall["prompts"],
            "median_speedup": overall["median_speedup"], "min_speedup": overall["min_speedup"],
            "outputs_identical": overall["outputs_identical"], "plain": pick(overall["plain"]),
            "dflash": pick(overall["dflash"])}

gpu = None
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True)
    gpu = q.stdout.strip().splitlines() if q.returncode == 0 else None
report = {
    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "backend": backend, "cmake_args": cmake_args, "build_s": num(build_s),
    "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                "nvidia_smi": gpu},
    "libllama": build(), "gpu_devices": [d.as_dict() for d in gpu_devices()],
    "tier": {"selection": selection, "offloaded": backend != "cpu", "exit_status": num(tier_status),
             "seconds": num(tier_s), "results": tier()},
    "bench": {"embedded": bench("embedded", emb),
              "hybrid_qwen35": {"target": hyb_target or None, "drafter": hyb_drafter or None,
                                **(bench("hybrid-qwen35", hyb) or {})}},
    "trees": None if trees == "null" else {
        "exit_status": num(trees),
        "verify_curve": json.loads(Path(work, "tree", "verify_curve.json").read_text())
        if Path(work, "tree", "verify_curve.json").is_file() else None,
        "projection": Path(work, "tree", "projection.md").read_text()
        if Path(work, "tree", "projection.md").is_file() else None},
}
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), prefix=".gpu-check.", suffix=".tmp")
with os.fdopen(fd, "w") as f:
    json.dump(report, f, indent=1)
os.replace(tmp, out)
print(f"gpu_check: results in {out}")
EOF
ok=1
[ "$tier_status" = null ] || [ "$tier_status" = 0 ] || ok=0
for s in "$embedded_status" "$hybrid_status" "$tree_status"; do [ "$s" = null ] || [ "$s" = 0 ] || ok=0; done
[ "$ok" = 1 ]
