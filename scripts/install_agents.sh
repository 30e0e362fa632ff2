#!/usr/bin/env bash
# The real agent programs tests/test_agents.py runs against dflash-serve, at pinned versions:
# Claude Code, Codex and OpenCode from npm (tests/agents/package-lock.json, into tests/agents/node_modules),
# Aider, llm and the openai-agents SDK from PyPI (into .venv-agents/: Aider pins its own dependencies).
# Without node/npm the npm clients are skipped, said here and by the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v npm >/dev/null 2>&1; then
    if [ ! -x tests/agents/node_modules/.bin/codex ] || [ tests/agents/package-lock.json -nt tests/agents/node_modules ]; then
        # npm install, not npm ci: the lock pins every version, but opencode-ai lists one optional package per
        # platform and a registry that lacks another platform's (macOS, Windows) makes npm ci refuse the lock as
        # "out of sync"; npm install takes the lock's versions and skips the optional packages it cannot fetch
        npm install --prefix tests/agents --no-save --no-audit --no-fund --loglevel=error \
            || { echo "install_agents.sh: npm install in tests/agents failed" >&2; exit 1; }
        touch tests/agents/node_modules
    fi
else
    echo "install_agents.sh: npm not found: Claude Code, Codex and OpenCode are not installed; their tests will skip" >&2
fi
# two venvs: Aider pins versions (openai among them) that llm 0.36 cannot share
install() {  # install VENV PACKAGE...
    local venv=$1; shift
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip show -q "${@%%==*}" >/dev/null 2>&1 && return
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$@" || { echo "install_agents.sh: pip install $* into $venv failed" >&2; exit 1; }
}
install .venv-agents/aider "aider-chat==0.86.2"
install .venv-agents/clients "llm==0.36" "openai-agents==0.24.0"
