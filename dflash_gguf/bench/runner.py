"""Run the benchmark: plain decoding and DFlash interleaved (A B A B) on one Session, then the peers.

Both modes share the target, its settings, the prompts and max_tokens; greedy, so their outputs can be
compared token for token. Every run prefills the whole prompt (the KV caches are cleared first), so TTFT
and prefill mean the same thing in both modes.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from dflash_gguf.train.prompts import Prompt

from dflash_gguf.steps import StepKind
from dflash_gguf.target import default_threads

from . import peers as peer_runs
from .kernels import kernel_advice
from .machine import machine_info
from .results import BenchResult, Generation, PeerResult, PromptResult

MODES = ("plain", "dflash")
ALL_MODES = ("plain", "lookup", "dflash", "both")  # both: lookup and DFlash in one loop, the policy choosing


@dataclass(frozen=True)
class BenchConfig:
    prompts: Sequence[Prompt]
    target: Path | None = None  # None: the embedded target
    drafter: Path | None = None  # None: the shipped drafter
    max_tokens: int = 128
    repeats: int = 2
    warmup: bool = True
    n_threads: int | None = None
    n_ctx: int = 2048
    block_size: int | None = None  # None: adaptive
    peers: tuple[str, ...] = field(default_factory=tuple)
    llama_server: Path | None = None
    reference_drafter: Path | None = None
    modes: tuple[str, ...] = MODES

    def validate(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts to benchmark")
        if "plain" not in self.modes or len(set(self.modes)) != len(self.modes) or set(self.modes) - set(ALL_MODES):
            raise ValueError(f"modes must include plain, each once, from {', '.join(ALL_MODES)}; got {list(self.modes)}")
        for name in ("max_tokens", "repeats", "n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        unknown = set(self.peers) - set(peer_runs.PEERS)
        if unknown:
            raise ValueError(f"unknown peers {sorted(unknown)}: choose from {', '.join(peer_runs.PEERS)}")
        if "llama-server" in self.peers and self.llama_server is None:
            raise ValueError("the llama-server peer needs the path of an upstream llama-server binary")


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def chat_steps(session, messages: list[dict], *, max_tokens: int, speculative: bool, block_size: int | None = None):
    """Session.stream_chat, greedy, from a clean cache so every run prefills the whole prompt."""
    session.reset()
    return session.stream_chat(
        messages, max_tokens=max_tokens, temperature=0.0, speculative=speculative, block_size=block_size
    )


def _chat_prompt(session, messages: list[dict]) -> tuple[str, list[int]]:
    """The rendered chat prompt and its tokens, for the peers (same template, same tokens)."""
    prompt, _ = session.render_chat(messages)
    return prompt, session.tokenize(prompt, add_special=False)


def timed_generation(session, messages: list[dict], mode: str, repeat: int, config: BenchConfig) -> Generation:
    """One generation, timed from the caller's side; per-cycle figures from the Steps the runtime yields.

    A cycle's wall time is the time between two Steps; what draft_s and verify_s do not cover is the
    loop's own cost (acceptance bookkeeping, KV rollback, detokenisation, stop rules, the controller).
    """
    tokens: list[int] = []
    _MODE_SETUP.get(id(session), {}).get(mode, lambda: None)()
    g = Generation(mode, repeat, tokens, prefill_s=0.0, ttft_s=0.0, decode_s=0.0)
    start = time.perf_counter()
    previous = first = start
    steps = chat_steps(
        session, messages, max_tokens=config.max_tokens, speculative=mode != "plain", block_size=config.block_size
    )
    for step in steps:
        now = time.perf_counter()
        tokens.extend(step.tokens)
        if step.kind is StepKind.PREFILL:
            first = now
            g.prefill_s = step.verify_s
            g.ttft_s = now - start
        elif step.kind is not StepKind.CONTEXT_FULL:
            g.cycles += 1
            g.draft_s += step.draft_s
            g.verify_s += step.verify_s
            g.overhead_s += max(0.0, (now - previous) - step.draft_s - step.verify_s)
            _count_cycle(g, step)
        previous = now
    g.decode_s = previous - first
    return g


_MODE_SETUP: dict[int, dict] = {}


def _setup_modes(session, modes) -> None:
    """Each mode's draft sources on one Session: plain and dflash as built; lookup and both via use_lookup.

    Each lookup mode keeps its own LookupSource (what it learns carries over between its generations, as in
    a Session of that kind). Switching swaps the Session's source list and policy before a generation.
    """
    from dflash_gguf.lookup import use_lookup

    built = (list(session._sources), session.__dict__.get("_policy"))

    def restore(sources=built[0], policy=built[1]):
        session._sources = list(sources)
        if policy is None:
            session.__dict__.pop("_policy", None)
        else:
            session._policy = policy

    setups = {"plain": restore, "dflash": restore}
    for mode in ("lookup", "both"):
        if mode in modes:
            use_lookup(session, dflash=mode == "both")
            configured = (list(session._sources), session._policy)
            setups[mode] = lambda c=configured: restore(*c)
            restore()
    _MODE_SETUP[id(session)] = setups


def _count_cycle(g: Generation, step) -> None:
    g.reasons[step.kind.value] = g.reasons.get(step.kind.value, 0) + 1
    if step.n_drafted == 0:
        g.plain_cycles += 1
        return
    g.n_drafted += step.n_drafted
    g.n_accepted += step.n_accepted
    if step.source:
        g.source_accepted[step.source] = g.source_accepted.get(step.source, 0) + step.n_accepted
    for counts, upto in (
        (g.acceptance_histogram, step.n_accepted + 1),
        (g.position_drafted, step.n_drafted),
        (g.position_accepted, step.n_accepted),
    ):
        if len(counts) < upto:
            counts.extend([0] * (upto - len(counts)))
    g.acceptance_histogram[step.n_accepted] += 1
    for k in range(step.n_drafted):
        g.position_drafted[k] += 1
    for k in range(step.n_accepted):
        g.position_accepted[k] += 1


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Every prompt in both modes, `repeats` times each, interleaved; then the requested peers."""
    from dflash_gguf.session import Session

    config.validate()
    session = Session(config.target, config.drafter, n_ctx=config.n_ctx, n_threads=config.n_threads)
    with session:
        if session.drafter is None:
            raise ValueError("no drafter: pass --drafter FILE.gguf (a dflash drafter converted for this target)")
        _setup_modes(session, config.modes)
        rss_loaded = _peak_rss_mib()
        conversations = {p.id: [{"role": "user", "content": p.prompt}] for p in config.prompts}
        if config.warmup:
            first = config.prompts[0]
            for mode in config.modes:
                timed_generation(session, conversations[first.id], mode, -1, config)
        results = []
        for i, p in enumerate(config.prompts, 1):
            runs = [
                timed_generation(session, conversations[p.id], mode, r, config)
                for r in range(config.repeats)
                for mode in config.modes
            ]
            results.append(PromptResult(p.id, p.category, runs))
            figures = ", ".join(
                f"{m} {'-' if (x := results[-1].speedup(m)) is None else f'{x:.2f}x'}" for m in config.modes if m != "plain"
            )
            progress(f"[{i}/{len(config.prompts)}] {p.id}: speedup {figures}")
        peer_prompts = [peer_runs.PeerPrompt(p.id, *_chat_prompt(session, conversations[p.id])) for p in config.prompts]
        paths = (session.target.path, session.drafter.path)
        n_threads = config.n_threads or default_threads()
        block = session.drafter.block_size
        rss_bench = _peak_rss_mib()
    peers = _run_peers(config, paths, peer_prompts, n_threads, block, progress)
    plain_tokens = {p.id: p.of("plain")[0].tokens for p in results}
    for peer in peers:
        if peer.available:
            peer.identical_to_plain = sum(1 for pid, gs in peer.runs.items() if gs and gs[0].tokens == plain_tokens[pid])
    settings = {
        "target": str(paths[0]),
        "drafter": str(paths[1]),
        "max_tokens": config.max_tokens,
        "repeats": config.repeats,
        "warmup": config.warmup,
        "n_ctx": config.n_ctx,
        "block_size": config.block_size or f"adaptive (up to {block})",
        "sampling": "greedy",
        "modes": list(config.modes),
        "order": "per prompt, each repeat: " + ", ".join(config.modes) + " (interleaved)",
    }
    advice = kernel_advice(Path(paths[0]))
    if advice:
        settings["advice"] = advice
    memory = {
        "peak_rss_after_load_mib": round(rss_loaded, 1),
        "peak_rss_after_benchmark_mib": round(rss_bench, 1),
        "peak_rss_final_mib": round(_peak_rss_mib(), 1),
        "memory_note": "getrusage ru_maxrss: peak resident memory of the whole benchmark process (both models, "
        "both modes, Python); the modes share one process, so it is not split per mode",
    }
    return BenchResult(settings, machine_info(n_threads), results, peers, memory)


def _run_peers(
    config: BenchConfig,
    paths: tuple[Path, Path],
    prompts: list[peer_runs.PeerPrompt],
    n_threads: int,
    block: int,
    progress: Callable[[str], None],
) -> list[PeerResult]:
    target, drafter = paths
    out = []
    for name in config.peers:
        progress(f"peer: {name}")
        if name in ("llama-cpp", "lookup"):
            out.append(
                peer_runs.llama_cpp_python(
                    target, prompts, max_tokens=config.max_tokens, repeats=config.repeats, n_threads=n_threads,
                    n_ctx=config.n_ctx, num_pred_tokens=10 if name == "lookup" else None,
                )
            )
        elif name == "reference":
            out.append(peer_runs.reference_tau(target, config.reference_drafter, prompts, max_tokens=config.max_tokens))
        elif name == "llama-server":
            out.append(
                peer_runs.llama_server(
                    config.llama_server, target, drafter, prompts, max_tokens=config.max_tokens,
                    repeats=config.repeats, n_threads=n_threads, n_ctx=config.n_ctx, n_draft=block - 1, log=progress,
                )
            )
    return out
