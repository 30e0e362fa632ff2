"""Session fixtures shared by every test module: the embedded target and real converted drafters.

Each reference checkpoint is built and converted once per session (tens of MB each). torch, transformers and
z-lab's reference load inside the fixtures that build checkpoints, so a test that needs none of them never imports them.
"""

from __future__ import annotations

import os

# Before anything loads libllama (libgomp reads it once): OpenMP threads that wait for work sleep instead of
# spinning. With spinning, a model's idle thread burns a core whenever another process (a second test
# worker, a spawned server, another job on a shared machine) wants it, and a test that decodes with two
# threads took 5-20 times longer on a loaded 2-core machine. Results are the same either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from dflash_gguf.convert import convert_checkpoint  # noqa: E402
from dflash_gguf.calibration_store import ENV_DIR as CALIBRATION_DIR  # noqa: E402
from dflash_gguf.defaults import embedded_target as _embedded_target  # noqa: E402


@pytest.fixture(autouse=True)
def _own_calibration_dir(tmp_path_factory, monkeypatch) -> None:
    """Each test saves and reuses calibration in a folder of its own: none reads another test's costs
    (or the user's cache), so what a test measures does not depend on the order tests ran in."""
    monkeypatch.setenv(CALIBRATION_DIR, str(tmp_path_factory.mktemp("calibration")))


@pytest.fixture(scope="session")
def embedded_target() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped with the package."""
    return _embedded_target()


@pytest.fixture(scope="session")
def embedded_session():
    """The embedded pair loaded once for the server tests: each module forks it for its slots and references."""
    from dflash_gguf import Session

    with Session() as s:
        yield s


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory) -> Path:
    """A 1-layer random-weight DFlash checkpoint directory (bf16), built by the reference package."""
    from checkpoints import make_reference_checkpoint

    return make_reference_checkpoint(tmp_path_factory.mktemp("dflash_ckpt"), kind="dflash")


@pytest.fixture(scope="session")
def reference_checkpoint_dflash2(tmp_path_factory) -> Path:
    """A 1-layer random-weight DFlash2 checkpoint directory (bf16), built by the reference package."""
    from checkpoints import make_reference_checkpoint

    return make_reference_checkpoint(tmp_path_factory.mktemp("dflash2_ckpt"), kind="dflash2")


@pytest.fixture(scope="session")
def dflash_gguf_path(reference_checkpoint, embedded_target, tmp_path_factory) -> Path:
    """`reference_checkpoint` converted with --target embedded_target (bf16 kept)."""
    out = tmp_path_factory.mktemp("dflash_gguf") / "drafter.gguf"
    return convert_checkpoint(reference_checkpoint, out, target=embedded_target, progress=False)


@pytest.fixture(scope="session")
def dflash2_gguf_path(reference_checkpoint_dflash2, embedded_target, tmp_path_factory) -> Path:
    """`reference_checkpoint_dflash2` converted with --target embedded_target (bf16 kept)."""
    out = tmp_path_factory.mktemp("dflash2_gguf") / "drafter2.gguf"
    return convert_checkpoint(reference_checkpoint_dflash2, out, target=embedded_target, progress=False)


# --- hybrid targets (issue 10) -------------------------------------------------


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory, embedded_target):
    """Tiny random qwen35 / lfm2 / qwen3next target GGUFs and their drafters, each built on first use.

    `hybrid_models.target("qwen35")`, `hybrid_models.drafter("lfm2", "dflash2")`: see tests/hybrid_fixtures.py.
    """
    from hybrid_fixtures import HybridModels

    return HybridModels(tmp_path_factory.mktemp("hybrid"), embedded_target)


@pytest.fixture(scope="session")
def mtp_target(tmp_path_factory, embedded_target) -> Path:
    """The hybrid qwen35 fixture with one random MTP head (nextn tensors), converted by upstream, and beside it
    mtp-qwen35.gguf, the head alone (`mtp_target.parent / "mtp-qwen35.gguf"`): tests/mtp_fixtures.py."""
    from mtp_fixtures import build_mtp_target

    return build_mtp_target(tmp_path_factory.mktemp("mtp"), embedded_target, heads=True)


@pytest.fixture(scope="session")
def dspark(tmp_path_factory, embedded_target):
    """DSpark checkpoints and GGUFs per variant of test_dspark.VARIANTS, built on first use: `dspark("anchor")`."""
    from test_dspark import Built

    return Built(tmp_path_factory.mktemp("dspark"), embedded_target)


# --- tool calling (issue 22) -----------------------------------------------------


@pytest.fixture(scope="session")
def tool_targets(tmp_path_factory, embedded_target):
    """Copies of the embedded target carrying each tool family's chat template: `tool_targets.path("hermes")`."""
    from tool_fixtures import ToolTargets

    return ToolTargets(tmp_path_factory.mktemp("tool_targets"), embedded_target)


# --- a test module's server, through the official clients ---------------------------


@pytest.fixture(scope="module")
def oai(url, request):
    """The openai client for the module's `url` fixture, with the module's KEY."""
    from test_server import sdk_clients

    return sdk_clients(url, request.module.KEY)[0]


@pytest.fixture(scope="module")
def claude(url, request):
    """The anthropic client for the module's `url` fixture, with the module's KEY."""
    from test_server import sdk_clients

    return sdk_clients(url, request.module.KEY)[1]


# --- the order the workers take files in ------------------------------------------------------------


_DURATIONS = Path(__file__).with_name("durations.json")


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist's --dist loadfile, files go to whichever worker asks next, in collection order (not
    re-sorted by how many tests each holds), so the order below decides how evenly the workers end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: only the tests that run count
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest file first (the files' tests' recorded seconds, tests/durations.json; one not recorded there, a new one or one under 5 ms, counts 0.1 s):
    the last file a worker takes is then a short one, and neither worker idles while the other finishes a
    long one. Only the order of whole files changes; the tests of a file keep theirs (its fixtures too)."""
    import json

    seconds = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
    weight: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        weight[module] = weight.get(module, 0.0) + seconds.get(item.nodeid, 0.1)
    first = {module: i for i, module in enumerate(weight)}
    items.sort(key=lambda item: (-weight[item.nodeid.split("::", 1)[0]], first[item.nodeid.split("::", 1)[0]]))
