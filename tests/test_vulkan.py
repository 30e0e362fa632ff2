"""Checks that only mean something on a device backend; scripts/test_vulkan.sh runs them with `-p offload_all`.

The tier's other tests are the ordinary lossless ones, unchanged: the plugin puts every model on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp import llama_cpp as capi

from dflash_gguf import Session
from dflash_gguf.defaults import embedded_drafter


@pytest.fixture(autouse=True)
def _offloading(request):
    if not request.config.pluginmanager.has_plugin("offload_all"):
        pytest.skip("device checks: run with -p offload_all on a GPU build (scripts/test_vulkan.sh)")


def test_target_and_drafter_have_every_layer_on_the_device(embedded_target):
    """The drafter follows the target onto the GPU (n_gpu_layers=None), and libllama offloads all of both."""
    from offload_all import LOADED

    before = len(LOADED)
    with Session(embedded_target, embedded_drafter(), n_ctx=256, n_gpu_layers=-1) as s:
        n_target, n_drafter = s.target.n_layer, capi.llama_model_n_layer(s.drafter._model)
    loaded = {Path(p).name: counts for p, counts in LOADED[before:]}
    assert loaded[Path(embedded_target).name] == f"{n_target + 1}/{n_target + 1}"  # the repeating layers + the output
    assert loaded[embedded_drafter().name] == f"{n_drafter + 1}/{n_drafter + 1}"
