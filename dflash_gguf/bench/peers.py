"""Other decoders on the same prompts: llama-cpp-python's own loop (plain, and with prompt lookup), upstream
llama-server's DFlash, and the z-lab reference implementation for τ. Each is run only where it is
available; otherwise the report says why not.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dflash_gguf.defaults import FLASH_ATTN
from dflash_gguf.stats import SourceStats
from dflash_gguf.steps import Step, StepKind

from .results import Generation, PeerResult

# llama-cpp: llama_cpp.Llama plain; lookup: the same with LlamaPromptLookupDecoding; reference: z-lab τ;
# llama-server: upstream DFlash
PEERS = ("llama-cpp", "lookup", "reference", "llama-server")
SERVER_START_TIMEOUT_S = 120.0
SERVER_REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PeerPrompt:
    """One benchmark prompt as every peer gets it: the chat-formatted text and its target tokens."""

    id: str
    text: str
    tokens: list[int]


def llama_cpp_python(
    target: Path,
    prompts: Sequence[PeerPrompt],
    *,
    max_tokens: int,
    repeats: int,
    n_threads: int,
    n_ctx: int,
    num_pred_tokens: int | None = None,
) -> PeerResult:
    """llama_cpp.Llama's own generate loop, greedy: plain, or with LlamaPromptLookupDecoding (n-gram drafts
    from the prompt) when num_pred_tokens is given. Flash attention on, as the Session opens its target.

    The plain run is the baseline a llama-cpp-python user has today, next to the bench's own plain mode.
    """
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = num_pred_tokens is not None
    name = "llama-cpp-python LlamaPromptLookupDecoding" if lookup else "llama-cpp-python Llama (plain)"
    llm = Llama(
        model_path=str(target),
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        flash_attn=FLASH_ATTN,  # as our target: the same kernels
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if lookup else None,
        verbose=False,
    )
    try:
        eos = llm.token_eos()
        mode = "lookup" if lookup else "llama-cpp"
        detail = f"num_pred_tokens={num_pred_tokens}, greedy (top_k=1)" if lookup else "greedy (top_k=1)"
        result = PeerResult(name, True, detail)
        for p in prompts:
            _llama_generation(llm, p, max_tokens, eos, mode)  # warm-up
            result.runs[p.id] = [_llama_generation(llm, p, max_tokens, eos, mode, repeat=r) for r in range(repeats)]
        return result
    finally:
        llm.close()


def _llama_generation(llm, prompt: PeerPrompt, max_tokens: int, eos: int, mode: str, repeat: int = -1) -> Generation:
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    first = start
    for token in llm.generate(prompt.tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            first = time.perf_counter()
        if token == eos:
            break
        tokens.append(token)
        if len(tokens) >= max_tokens:
            break
    end = time.perf_counter()
    return Generation(mode, repeat, tokens, prefill_s=first - start, ttft_s=first - start, decode_s=end - first)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_healthy(base: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"llama-server was not ready within {timeout:.0f} s")


def llama_server(
    binary: Path,
    target: Path,
    drafter: Path,
    prompts: Sequence[PeerPrompt],
    *,
    max_tokens: int,
    repeats: int,
    n_threads: int,
    n_ctx: int,
    n_draft: int,
    log: Callable[[str], None] = lambda _: None,
) -> PeerResult:
    """Upstream llama-server with --spec-type draft-dflash on the same two GGUFs, on loopback only.

    Requests are bounded (n_predict, timeouts), prompt caching is off so every run prefills, and the
    server is always terminated, killed if it does not stop.
    """
    name = "llama-server --spec-type draft-dflash"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        str(binary), "-m", str(target), "-md", str(drafter), "--spec-type", "draft-dflash",
        "--spec-draft-n-max", str(n_draft), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(n_threads), "-tb", str(n_threads), "-c", str(n_ctx), "-np", "1", "--no-webui",
    ]
    log("starting " + " ".join(command))
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            _wait_healthy(base, process, SERVER_START_TIMEOUT_S)
        except RuntimeError as e:
            stderr = _stop(process)
            tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
            return PeerResult(name, False, f"{e}; last line: {tail}")
        result = PeerResult(name, True, f"{binary} (--spec-draft-n-max {n_draft}, {n_threads} threads)")
        for p in prompts:
            body = {
                "prompt": p.tokens, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "stream": False, "return_tokens": True,
            }
            _post(f"{base}/completion", body, SERVER_REQUEST_TIMEOUT_S)  # warm-up
            result.runs[p.id] = [_server_generation(base, body, r) for r in range(repeats)]
        return result
    finally:
        _stop(process)


def _server_generation(base: str, body: dict, repeat: int) -> Generation:
    reply = _post(f"{base}/completion", body, SERVER_REQUEST_TIMEOUT_S)
    timings = reply.get("timings", {})
    n = int(timings.get("predicted_n", 0))
    decode_s = float(timings.get("predicted_ms", 0.0)) / 1e3
    prefill_s = float(timings.get("prompt_ms", 0.0)) / 1e3
    drafted = int(timings.get("draft_n", 0))
    accepted = int(timings.get("draft_n_accepted", 0))
    tokens = [int(t) for t in reply.get("tokens", [])] or [0] * n
    # llama-server times n generated tokens over predicted_ms (the first one included): keep that rate
    return Generation(
        "llama-server", repeat, tokens, prefill_s=prefill_s, ttft_s=prefill_s,
        decode_s=decode_s * (n - 1) / n if n else 0.0, reported=SourceStats(n_drafted=drafted, n_accepted=accepted),
    )


def _stop(process: subprocess.Popen) -> str:
    """Terminate (then kill) the server; returns what it wrote to stderr."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    try:
        return process.stderr.read() if process.stderr else ""
    except ValueError:
        return ""


def reference_tau(
    target: Path,
    reference_drafter: Path | None,
    prompts: Sequence[PeerPrompt],
    *,
    max_tokens: int,
) -> PeerResult:
    """τ of z-lab's `dflash_generate` (greedy) on a transformers copy of the target, dequantized from the GGUF.

    The reference times itself with torch.cuda.synchronize, which a CPU build lacks: it is called without
    timing stats and τ is counted from its acceptance lengths through a perf_counter clock.
    """
    name = "z-lab dflash_generate (reference)"
    if reference_drafter is None:
        return PeerResult(name, False, "needs --reference-drafter DIR (the drafter's z-lab checkpoint directory)")
    if not (reference_drafter / "config.json").is_file():
        return PeerResult(name, False, f"{reference_drafter}: no config.json (not a z-lab checkpoint directory)")
    try:
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
        import torch
        import transformers
        from dflash import model as zlab
    except ImportError as e:
        return PeerResult(name, False, f"needs torch, transformers, accelerate and the dflash package ({e.name} is missing)")
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(
        str(target.parent), gguf_file=target.name, dtype=torch.float32
    ).eval()
    cls = getattr(zlab, _architecture(reference_drafter), zlab.DFlashDraftModel)  # z-lab's class of that name
    drafter = cls.from_pretrained(str(reference_drafter), dtype=torch.float32).eval()
    stop = [t for t in (hf_target.config.eos_token_id,) if t is not None]
    what = f"transformers {transformers.__version__}, float32 on CPU, target dequantized from {target.name}"
    result = PeerResult(name, True, what)
    original_clock = zlab._cuda_time
    zlab._cuda_time = time.perf_counter
    try:
        for p in prompts:
            start = time.perf_counter()
            out = zlab.dflash_generate(
                drafter, hf_target, torch.tensor([p.tokens]), max_tokens, stop, temperature=0.0, return_stats=True
            )
            end = time.perf_counter()
            generated = out.output_ids[0, out.num_input_tokens :].tolist()
            result.runs[p.id] = [
                Generation(
                    "reference", 0, generated, prefill_s=out.time_to_first_token, ttft_s=out.time_to_first_token,
                    decode_s=end - start - out.time_to_first_token,
                    steps=_reference_steps(generated, out.acceptance_lengths, drafter.block_size),
                )
            ]
    finally:
        zlab._cuda_time = original_clock
    return result


def _reference_steps(generated: list[int], acceptance_lengths: Sequence[int], block_size: int) -> list[Step]:
    """The reference's cycles as Steps for the stats model: each committed `length` tokens (bonus included)
    after drafting block_size - 1; the first generated token came from the prompt."""
    steps = [Step(kind=StepKind.PREFILL, tokens=generated[:1], text="")]
    at = 1
    for length in acceptance_lengths:
        tokens = generated[at : at + int(length)]
        at += int(length)
        steps.append(Step(kind=StepKind.DRAFT, tokens=tokens, text="", source="reference", n_drafted=block_size - 1,
                          n_accepted=int(length) - 1, block_size=block_size))
    return steps


def _architecture(checkpoint: Path) -> str:
    """The checkpoint's config.json architecture: z-lab names its model classes so."""
    config = json.loads((checkpoint / "config.json").read_text())
    return (config.get("architectures") or ["DFlashDraftModel"])[0]
