"""Real agent programs complete a turn against dflash-serve, started as docs/SERVER.md's agent recipe starts it.

The programs are the pinned releases scripts/install_agents.sh installs: Claude Code and Codex (npm), Aider,
`llm` and the openai-agents SDK (PyPI). Each runs as a user runs it, in its own home and a scratch project
with one file, against one `dflash-serve` process serving the embedded pair under a Hermes tool template.

Bounded so that the whole module runs in CI's time on two cores: the server caps replies at --max-tokens 48
and each program's prompt is cut to about 0.5-3k tokens by its own options (Claude Code: --bare, a one-line
--system-prompt and the Read tool only; Codex: a one-line model_instructions_file and its goals, sub-agent,
image and web-search tools off; Aider: no repository map; OpenCode is not run here: its smallest agent
prompt is 7.7k tokens, minutes of prefill on this CPU). What a default run sends (17-23k tokens) is checked
without a prefill by tests/test_agent_door.py's recorded requests. The model is SmolLM2-135M: what is asserted
is that each program gets well-formed answers and ends its turn, not what the answer says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_gguf import defaults

ROOT = Path(__file__).resolve().parents[1]
NPM_BIN = ROOT / "tests" / "agents" / "node_modules" / ".bin"
AIDER = ROOT / ".venv-agents" / "aider" / "bin" / "aider"
CLIENTS_PY = ROOT / ".venv-agents" / "clients" / "bin" / "python"
LLM = ROOT / ".venv-agents" / "clients" / "bin" / "llm"
KEY = "sk-agents"
MODEL = "dflash"
TURN_TIMEOUT_S = 900  # a bounded prompt's prefill is about a minute here; a loaded CI machine is slower
ASK = "What does hello.py print? Answer in one line."

pytestmark = pytest.mark.slow  # a server process and real agent programs, each a turn of prefill


def _installed(path: Path, what: str) -> Path:
    if not path.exists():
        pytest.skip(f"{what} is not installed: run scripts/install_agents.sh (scripts/test.sh does)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tool_targets, tmp_path_factory):
    """dflash-serve as the agent recipe starts it (a tool template, any model name answered, a key), in its own
    process; yields (base url, log path). Its log must hold no traceback when the module ends."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = _free_port()
    cmd = [sys.executable, "-m", "dflash_gguf.server.cli", "--target", str(tool_targets.path("hermes")),
           "--drafter", str(defaults.embedded_drafter()), "--port", str(port), "--api-key", KEY,
           "--n-ctx", "8192", "--max-tokens", "48", "--threads", "1"]  # 8192: the model's own; a 3-turn Claude Code prompt reached 4120
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=out, env={**os.environ, "DFLASH_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]


@pytest.fixture
def project(tmp_path):
    """A scratch project (one file) and a home of its own, as a new user's."""
    work, home = tmp_path / "project", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "hello.py").write_text("print('hello from dflash')\n")
    return work, home


def _run(cmd: list[str], cwd: Path, env: dict[str, str], *, check: bool = True) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "OPENCODE"))}
    # PWD too: OpenCode takes its project directory from $PWD, not from the working directory it was given
    done = subprocess.run(cmd, cwd=cwd, env={**base, "PWD": str(cwd), **env}, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 or not check, f"{cmd[0]} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _requests_answered(url: str) -> dict[tuple[str, str], float]:
    """dflash_requests_total by (route, status), from /metrics."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("dflash_requests_total{"):
            labels, value = line[len("dflash_requests_total{"):].split("} ")
            fields = dict(part.split("=", 1) for part in labels.split(","))
            out[(fields["route"].strip('"'), fields["status"].strip('"'))] = float(value)
    return out


def _answered_ok(before: dict, after: dict) -> int:
    """Requests answered 200 between two /metrics reads (the reads excepted); none refused."""
    new = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    refused = {k: v for k, v in new.items() if k[1] != "200"}
    assert not refused, refused
    return int(sum(v for (route, _), v in new.items() if route != "/metrics"))


def test_claude_code_completes_a_turn(server, project):
    url, _ = server
    claude = _installed(NPM_BIN / "claude", "Claude Code")
    work, home = project
    before = _requests_answered(url)
    done = _run([str(claude), "-p", ASK, "--bare", "--system-prompt", "You are a coding agent. Be brief.",
                 "--tools", "Read", "--max-turns", "3", "--output-format", "json", "--model", "claude-opus-4-8"],
                work, {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY,
                       "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert _answered_ok(before, _requests_answered(url)) >= 1


def test_codex_completes_a_turn(server, project):
    url, _ = server
    codex = _installed(NPM_BIN / "codex", "Codex")
    work, home = project
    (home / ".codex").mkdir()
    (home / "instructions.md").write_text("You are a coding agent. Be brief.\n")
    (home / ".codex" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "dflash"\nmodel_instructions_file = "{home / "instructions.md"}"\n'
        'web_search = "disabled"\n\n[model_providers.dflash]\nname = "dflash"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "DFLASH_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    before = _requests_answered(url)
    done = _run([str(codex), "exec", "--skip-git-repo-check", "--json", "--disable", "goals", "--disable", "multi_agent",
                 "--disable", "view_image", "--disable", "image_generation", "--disable", "skill_search", ASK],
                work, {"HOME": str(home), "DFLASH_KEY": KEY}, check=False)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # Codex sends no temperature (the Responses default, 1.0: a sampled reply) and calls a reply the server cut
    # at this module's --max-tokens 48 a failed turn; the turn must end, completed or at that bound alone
    failed = [e["error"]["message"] for e in events if e.get("type") == "turn.failed"]
    completed = any(e.get("type") == "turn.completed" for e in events)
    assert completed or (failed and all(m.endswith("reason: max_output_tokens") for m in failed)), done.stdout[-3000:]
    assert done.returncode == (0 if completed else 1), done.stderr[-3000:]
    assert _answered_ok(before, _requests_answered(url)) >= 1


def test_llm_completes_a_turn(server, project):
    url, _ = server
    llm = _installed(LLM, "llm")
    work, home = project
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: {MODEL}\n  model_name: {MODEL}\n  api_base: \"{url}/v1\"\n  api_key_name: dflash\n")
    (home / "keys.json").write_text(json.dumps({"dflash": KEY}))
    before = _requests_answered(url)
    done = _run([str(llm), "-m", MODEL, "-o", "max_tokens", "24", ASK], work, {"LLM_USER_PATH": str(home)})
    assert done.stdout.strip()
    assert _answered_ok(before, _requests_answered(url)) == 1


def opencode_config(url: str, bounded: bool) -> dict:
    """docs/SERVER.md's OpenCode provider (@ai-sdk/openai-compatible on /v1), its small model too (titles: else
    OpenCode asks its own hosted models, and the turn fails offline). Bounded: its build agent's prompt is
    one line and its one tool is read (its default prompt and ten tools are 7.7k tokens)."""
    config = {"$schema": "https://opencode.ai/config.json", "model": f"dflash/{MODEL}", "small_model": f"dflash/{MODEL}",
              "provider": {"dflash": {"npm": "@ai-sdk/openai-compatible", "name": "dflash-serve",
                                      "options": {"baseURL": f"{url}/v1", "apiKey": "{env:DFLASH_KEY}"},
                                      "models": {MODEL: {"name": MODEL}}}}}
    if bounded:
        off = ["bash", "edit", "glob", "grep", "skill", "task", "todowrite", "webfetch", "write"]
        config["agent"] = {"build": {"prompt": "You are a coding agent. Be brief.", "tools": {t: False for t in off}}}
    return config


def test_opencode_completes_a_turn(server, project):
    url, _ = server
    opencode = _installed(NPM_BIN / "opencode", "OpenCode")
    work, home = project
    (work / "opencode.json").write_text(json.dumps(opencode_config(url, bounded=True)))
    before = _requests_answered(url)
    done = _run([str(opencode), "run", "--format", "json", ASK], work,
                {"HOME": str(home), "DFLASH_KEY": KEY, "OPENCODE_DISABLE_AUTOUPDATE": "1"})
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events and not [e for e in events if e.get("type") == "error"], done.stdout[-3000:]
    assert _answered_ok(before, _requests_answered(url)) >= 1  # its title request and its turn


AGENTS_SDK_SCRIPT = """
import asyncio, sys
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
calls = []

@function_tool
def get_weather(city: str) -> str:
    \"\"\"The current weather in a city.\"\"\"
    calls.append(city)
    return "18 degrees and sunny"

client = AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key=sys.argv[2], max_retries=0)
# the first turn must call the tool; the SDK then resets tool_choice, so the second answers from its result
agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
              model=OpenAIResponsesModel(model="dflash", openai_client=client),
              model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=200))
result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
print(len(calls), repr(result.final_output))
"""


def test_the_openai_agents_sdk_round_trips_a_tool_result(server, project):
    """The openai-agents SDK over the Responses API: a forced call, the SDK runs the tool, sends its output back
    (a function_call_output item) and the model answers: the tool result round-trips."""
    url, _ = server
    python = _installed(CLIENTS_PY, "the openai-agents SDK")
    work, _ = project
    before = _requests_answered(url)
    done = _run([str(python), "-c", AGENTS_SDK_SCRIPT, url, KEY], work, {})
    n_calls = int(done.stdout.split()[0])
    assert n_calls >= 1
    assert _answered_ok(before, _requests_answered(url)) >= 2  # the call, then the answer


def test_aider_completes_a_turn(server, project):
    url, _ = server
    aider = _installed(AIDER, "Aider")
    work, home = project
    before = _requests_answered(url)
    _run([str(aider), "--model", f"openai/{MODEL}", "--openai-api-base", f"{url}/v1", "--openai-api-key", KEY,
          "--no-git", "--yes-always", "--no-check-update", "--no-show-model-warnings", "--no-analytics",
          "--map-tokens", "0", "--no-stream", "--no-pretty", "--no-fancy-input", "--chat-mode", "ask",
          "--message", ASK, "hello.py"],
         work, {"HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_CHECK_UPDATE": "false"})
    assert _answered_ok(before, _requests_answered(url)) >= 1
