"""Where the layers are, named from libllama's own device lists: the build's devices, a model's placement,
and the same names in Session stats, the chat's title and the server's /health (issue 24)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from dflash_gguf import Session
from dflash_gguf.backends import backends, build, devices, gpu_devices, placement
from dflash_gguf.server.app import create_app
from dflash_gguf.target import Target
from dflash_gguf.tui.app import ChatApp


def test_the_build_lists_its_devices_and_the_cpu_is_one():
    found = devices()
    cpu = [d for d in found if d.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and cpu[0].backend == "CPU" and cpu[0].label == "CPU"
    assert "CPU" in backends().split(", ")
    info = build()
    assert info["devices"] == [d.as_dict() for d in found] and info["llama_cpp_python"]
    assert all(d.kind in ("gpu", "igpu") for d in gpu_devices())


@pytest.mark.parametrize("n_gpu_layers", [0, -1, 5])
def test_a_models_placement_follows_its_devices_and_n_gpu_layers(embedded_target, n_gpu_layers):
    """n_gpu_layers=0 is the CPU on any build; more offloads onto the build's GPUs, where it has any."""
    with Target.open(embedded_target, n_ctx=64, n_batch=8, n_threads=1, n_gpu_layers=n_gpu_layers) as t:
        where = placement(t.model, t.n_gpu_layers)
    assert where.n_layers == t.n_layer + 1
    if n_gpu_layers == 0 or not gpu_devices():
        assert (where.backend, where.device, where.n_offloaded, where.gpus) == ("CPU", "CPU", 0, ())
    else:
        assert where.gpus and where.device.startswith(where.gpus[0].label)
        assert where.n_offloaded == (where.n_layers if n_gpu_layers == -1 else n_gpu_layers)
        assert where.backend.endswith(", CPU") == (where.n_offloaded < where.n_layers)
    assert where.as_dict()["layers_offloaded"] == f"{where.n_offloaded}/{where.n_layers}"


@pytest.fixture(scope="module")
def session(dflash_gguf_path):
    """n_gpu_layers=0 (the default): the CPU on any build, a GPU one included."""
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=8, n_threads=1, lookup=False) as s:
        yield s


def test_stats_name_the_cpu(session):
    r = session.generate("The capital of France is", max_tokens=4, block_size=4)
    assert (r.stats.backend, r.stats.device, r.stats.drafter_device) == ("CPU", "CPU", "CPU")
    assert r.stats.as_dict()["device"] == "CPU"
    assert session.placement.as_dict() == {"backend": "CPU", "device": "CPU", "layers_offloaded": "0/31", "devices": []}


def test_the_servers_health_names_the_backend_and_device(session):
    with TestClient(create_app([session])) as client:
        body = client.get("/health").json()
    assert body["status"] == "ok"
    assert (body["backend"], body["device"]) == ("CPU", "CPU")


def test_the_chats_title_names_the_device(session):
    app = ChatApp(session)

    async def main() -> None:
        async with app.run_test(size=(110, 36)) as pilot:
            await pilot.pause()
            assert app.title == "dflash-chat · CPU"

    asyncio.run(main())
