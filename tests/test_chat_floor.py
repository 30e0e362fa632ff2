"""The chat floor's walls, measured from the code, and what it changed: one function assembles a chat turn,
no import runs in a circle or up a floor (docs/DESIGN.md, "Floors"), a schema too deep for the grammar engine
is refused naming its field, and the terminal chat shows a thinking model's thought apart from its answer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from textual.widgets import Static

from dflash_gguf.chat import ChatRequest, ChatTemplate, prepare_turn
from dflash_gguf.chat.tool_calls import ToolError
from dflash_gguf.checks import SettingError
from dflash_gguf.config import GenerationConfig
from dflash_gguf.session import Session
from dflash_gguf.tui.app import ChatApp
from dflash_gguf.tui.options import ChatOptions
from test_tui_app import run_app, send_and_wait

ROOT = Path(__file__).resolve().parent.parent
# where each installed package's files are (tui/ and convert/ install as dflash_gguf.tui and dflash_gguf.convert)
PACKAGES = ((ROOT / "dflash_gguf", "dflash_gguf"), (ROOT / "tui", "dflash_gguf.tui"), (ROOT / "convert", "dflash_gguf.convert"))
# the floors, lowest first (docs/DESIGN.md): a module may import its own floor and those below
CHAT = ("dflash_gguf.chat",)
FACE = ("dflash_gguf", "dflash_gguf.session", "dflash_gguf.result", "dflash_gguf.llama_compat")
APPS = ("dflash_gguf.server", "dflash_gguf.tui", "dflash_gguf.bench", "dflash_gguf.train", "dflash_gguf.convert",
        "dflash_gguf.cli", "dflash_gguf.cli_parser", "dflash_gguf.doctor")
# two-module circles other work removes (issue 34, items 6 and 7); this list may only shrink
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for base, package in PACKAGES:
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every product module `name` imports, anywhere in it (under TYPE_CHECKING and inside functions too)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module if not node.level else f"{base}.{node.module}" if node.module else base
            found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names}
    return {m for m in found if m in known and m != name}


def _floor(module: str) -> int:
    def within(prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)
    return 3 if within(APPS) else 2 if module in FACE else 1 if within(CHAT) else 0


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected groups of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.add(tuple(sorted(group)))
    return out


def test_no_import_runs_in_a_circle_or_up_a_floor():
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 100 and "dflash_gguf.chat.turn" in graph and "dflash_gguf.tui.app" in graph
    upward = sorted(f"{m} -> {i}" for m, imports in graph.items() for i in imports if _floor(i) > _floor(m))
    assert upward == []
    assert _cycles(graph) == KNOWN_CYCLES


def _functions_calling(names: set[str]) -> dict[str, set[str]]:
    """Each product function (module.qualname) and which of `names` (called as f() or x.f()) it calls."""
    out: dict[str, set[str]] = {}
    for module, path in _modules().items():
        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qualname = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        called = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None)
                                  for c in ast.walk(child) if isinstance(c, ast.Call)}
                        if called & names:
                            out[qualname] = called & names
                    visit(child, qualname)
        visit(ast.parse(path.read_text()), module)
    return out


def test_the_session_is_a_few_hundred_lines_of_its_own_code():
    """Issue 34's wall: session.py holds at most 350 lines, and its class has no base that brings methods from
    elsewhere (the speculation wiring, the prompt-cache link and a generation's bookkeeping are objects it
    holds, each in a module of its own)."""
    path = ROOT / "dflash_gguf" / "session.py"
    assert len(path.read_text().splitlines()) <= 350
    classes = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    assert classes["Session"].bases == []
    assert {"speculation", "prompt_cache_link", "generation", "opening", "result"} <= {
        m.rpartition(".")[2] for m in _imports("dflash_gguf.session", path, _modules())}


def test_a_chat_turn_is_assembled_in_exactly_one_function():
    """Rendering the template and tokenizing what it rendered happen together in one function, prepare_turn;
    the turn's config (grammar after the thought, the family's stops) is built only there; the Session and
    the server's engine are the only callers, and the TUI and the bench go through the Session."""
    calls = _functions_calling({"render", "tokenize", "turn_config", "prepare_turn", "render_chat", "thinking_for"})
    assemble = sorted(f for f, names in calls.items() if {"render", "tokenize"} <= names)
    assert assemble == ["dflash_gguf.chat.turn.prepare_turn"]
    assert sorted(f for f, names in calls.items() if "turn_config" in names) == ["dflash_gguf.chat.turn.prepare_turn"]
    assert sorted(f for f, names in calls.items() if "prepare_turn" in names) == [
        "dflash_gguf.server.engine.Engine._turn", "dflash_gguf.session.Session.prepare_chat"]
    assert [f for f, names in calls.items() if "render_chat" in names] == []  # the product renders through a turn
    assert sorted(f for f, names in calls.items() if "thinking_for" in names) == [
        "dflash_gguf.chat.template.ChatTemplate.thinking"]


DEEP = {"type": "object"}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"x": DEEP}}
TOOL = {"type": "function", "function": {"name": "deep", "parameters": DEEP}}


@pytest.fixture(scope="module")
def hermes(tool_targets):
    with Session(tool_targets.path("hermes"), drafter=None, lookup=False, n_ctx=512) as s:
        yield s


def test_a_schema_deeper_than_the_grammar_engine_takes_is_refused_naming_it(hermes):
    """500 levels used to be a RecursionError from Session.chat (and a 500 from the server's three APIs)."""
    ask = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ToolError, match="deeper than 128") as e:
        hermes.chat(ask, tools=[TOOL], max_tokens=4)
    assert e.value.field == "tools[0].function.parameters"
    with pytest.raises(SettingError, match="deeper than 128") as e:
        GenerationConfig(json_schema=DEEP)
    assert e.value.field == "json_schema"


def test_a_lone_surrogate_is_refused_naming_the_field(hermes):
    """JSON can carry "\\ud800"; no tokenizer can encode it (it was a UnicodeEncodeError)."""
    with pytest.raises(SettingError) as e:
        hermes.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a\ud800"}], max_tokens=4)
    assert e.value.field == "messages.1.content"


def test_the_turn_is_the_sessions_own(hermes):
    """prepare_turn over the Session's template and vocabulary is what Session.chat generates from."""
    request = ChatRequest([{"role": "user", "content": "What is 2+2?"}], settings={"max_tokens": 8, "temperature": 0.0})
    turn = prepare_turn(ChatTemplate(hermes.target.vocab.chat_template(), "", "<|im_end|>"), hermes.target.vocab, request)
    assert turn.tokens == hermes.prepare_chat(request).tokens
    assert hermes.run_turn(turn).tokens == hermes.chat(request.messages, max_tokens=8, temperature=0.0).tokens


def test_the_terminal_chat_shows_a_thought_apart_from_the_answer(tool_targets):
    """Under a thinking template the reply's thought is shown as a thought (not as the answer), and the turn
    goes back into the history with the thought as its reasoning_content (it was the content before)."""
    with Session(tool_targets.thinking(), drafter=None, lookup=False, n_ctx=512) as session:
        app = ChatApp(session, ChatOptions(generation=GenerationConfig(max_tokens=12, temperature=0.0)))

        async def scenario(pilot):
            await send_and_wait(pilot, "What is the capital of France?")
            shown = [str(w.render()) for w in app.query(".thought").results(Static)]
            turn = app.history[-1]
            assert turn["role"] == "assistant" and turn["reasoning_content"]
            assert shown == [f"💭 {turn['reasoning_content']}"]
            assert turn["content"] == ""  # SmolLM2 never closes the thought it was left in

        run_app(app, scenario)


TOY_FAMILY = '''
"""A toy call syntax: <<call>>{"name": ..., "arguments": {...}}<</call>>."""

import re

from dflash_gguf.chat.families.base import Family, args_after, lit, tool_json_rule


class Toy(Family):
    name = "toy"
    opener = "<<call>>"
    _head = re.compile(r'\\{"name": "([^"]*)", "arguments": ')

    def detect(self, template):
        return "<<call>>" in template

    def call(self, tool, extra):
        return f'{lit(chr(123) + chr(34) + "name" + chr(34) + ": " + chr(34) + tool["name"] + chr(34) + ", " + chr(34) + "arguments" + chr(34) + ": ")} {tool_json_rule(tool["parameters"])} {lit("}<</call>>")}'

    def calls(self, text, at, schemas):
        m = self._head.match(text, at + len(self.opener))
        if m is None:
            return []
        args, done, _ = args_after(text, m.end())
        return [(m.group(1), args, done)]
'''


def test_a_tool_call_family_is_one_file_and_one_registry_line(tmp_path, monkeypatch):
    """The family's module alone (written here to a file of its own), plus its line in FAMILIES: the template
    is recognised, the call's grammar compiles, and a reply's call is read back, whole and streamed."""
    import importlib.util

    from dflash_gguf.chat import families
    from dflash_gguf.chat.reply import ReplyReader
    from dflash_gguf.chat.tool_calls import detect_family, plan_tools

    (tmp_path / "toy_family.py").write_text(TOY_FAMILY)
    spec = importlib.util.spec_from_file_location("toy_family", tmp_path / "toy_family.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(families, "FAMILIES", (module.Toy(), *families.FAMILIES))  # the registry line

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<<call>>{% endif %}"
    assert detect_family(template).name == "toy"
    plan = plan_tools(template, [TOOL_SMALL], "required")
    assert plan.family.name == "toy" and plan.forced and "<<call>>" in plan.grammar
    reply = 'Sure.<<call>>{"name": "get_weather", "arguments": {"city": "Paris"}}<</call>>'
    stream = ReplyReader(None, plan)
    pieces = [p for i in range(0, len(reply), 7) for p in stream.feed(reply[i:i + 7])] + stream.finish()
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(p for p in pieces if isinstance(p, str)) == "Sure."


TOOL_SMALL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_every_package_is_listed_for_the_wheel():
    """A package missing from pyproject's `packages` is missing from a non-editable install."""
    import re

    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    listed = set(re.findall(r'"([\w.]+)"', block))
    assert {"dflash_gguf", "dflash_gguf.tui"} <= listed
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found <= listed, sorted(found - listed)
