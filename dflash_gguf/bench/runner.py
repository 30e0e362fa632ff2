"""Run the benchmark: plain decoding and DFlash (and lookup, both) in lockstep per prompt, then the peers.

Every mode shares the target file, its settings, the prompts and max_tokens; greedy, so outputs can be
compared token for token. plain runs on the drafter's Session and dflash on a fork of it (one copy of the
weights); lookup and both on the Sessions users open for them (drafter-free, and lookup=True). The modes of
a repeat advance in lockstep, one cycle each in turn, so a drifting machine speed cancels out of their
ratios. Every run prefills the whole prompt (the caches are cleared first), so TTFT and prefill mean the
same thing in every mode. Per-cycle figures are views of the stats model (dflash_gguf.stats) over the
Steps each run yielded, and every speedup is stats.speedup.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from dflash_gguf.train.prompts import Prompt

from dflash_gguf.chat import ChatRequest
from dflash_gguf.config import GenerationConfig, SessionOptions
from dflash_gguf.lockstep import lockstep, order
from dflash_gguf.target import default_threads

from . import peers as peer_runs
from .chat import chat_steps
from .kernels import kernel_advice
from .machine import machine_info
from .results import BenchResult, Generation, PeerResult, PromptResult

MODES = ("plain", "dflash")
# both: lookup and DFlash in one loop, the policy choosing; mtp: the target's own MTP heads alone; tree: DFlash
# whose cycles may verify draft trees
ALL_MODES = ("plain", "lookup", "dflash", "both", "mtp", "tree")


# greedy, so that every mode's output can be compared with plain decoding's token for token
BENCH_GENERATION = GenerationConfig(max_tokens=128)
BENCH_SESSION = SessionOptions(n_ctx=2048)


@dataclass(frozen=True)
class BenchConfig:
    prompts: Sequence[Prompt]
    target: Path | None = None  # None: the embedded target
    drafter: Path | None = None  # None: the shipped drafter
    generation: GenerationConfig = BENCH_GENERATION  # speculative is set per mode
    session: SessionOptions = BENCH_SESSION  # every mode's Session; lookup and mtp are set per mode
    repeats: int = 2
    warmup: bool = True
    peers: tuple[str, ...] = field(default_factory=tuple)
    llama_server: Path | None = None
    reference_drafter: Path | None = None
    modes: tuple[str, ...] = MODES
    tree_nodes: int = 16  # the tree mode's Session: trees of up to this many rows (SessionOptions.tree_nodes)

    def validate(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts to benchmark")
        if "plain" not in self.modes or len(set(self.modes)) != len(self.modes) or set(self.modes) - set(ALL_MODES):
            raise ValueError(f"modes must include plain, each once, from {', '.join(ALL_MODES)}; got {list(self.modes)}")
        if "tree" in self.modes:
            replace(self.session, tree_nodes=self.tree_nodes)  # a SettingError naming tree_nodes where it cannot be
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be a positive integer, got {self.repeats!r}")
        if not self.generation.sampling.greedy:
            raise ValueError("generation.temperature must be 0: the bench compares greedy outputs token for token")
        unknown = set(self.peers) - set(peer_runs.PEERS)
        if unknown:
            raise ValueError(f"unknown peers {sorted(unknown)}: choose from {', '.join(peer_runs.PEERS)}")
        if "llama-server" in self.peers and self.llama_server is None:
            raise ValueError("the llama-server peer needs the path of an upstream llama-server binary")


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _chat_prompt(session, messages: list[dict]) -> tuple[str, list[int]]:
    """The rendered chat prompt and its tokens, for the peers (same template, same tokens): the chat floor's turn."""
    turn = session.prepare_chat(ChatRequest(messages))
    return turn.prompt, turn.tokens


def lockstep_generations(sessions: dict, messages: list[dict], modes: Sequence[str], repeat: int,
                         config: BenchConfig, schema: dict | None = None) -> list[Generation]:
    """One generation per mode, each on its own Session, advanced one cycle at a time in turn.

    Modes take turns every few milliseconds, so a machine whose speed drifts (a shared or throttled CPU
    changes 10-20% between identical one-second runs) slows them alike, and their ratio keeps only what
    the modes really cost. Each mode is timed over its own turns only: TTFT, decode span; every per-cycle
    figure is a view of the stats model over the Steps it yielded, and `stats` is its Session's own.
    A prompt's schema constrains every mode alike (plain constrained against speculative constrained).
    """
    base = config.generation if schema is None else replace(config.generation, json_schema=schema)
    runs = lockstep({m: iter(chat_steps(sessions[m], messages, replace(base, speculative=m != "plain"))) for m in modes})
    out = []
    for mode in modes:
        stats, run = sessions[mode].last_stats, runs[mode]
        out.append(Generation(mode, repeat, run.tokens, prefill_s=stats.prefill_s, ttft_s=run.ttft_s,
                              decode_s=run.spent_s - run.ttft_s, steps=run.steps, stats=stats))
    return out


def open_mode_sessions(session, modes: Sequence[str], config: BenchConfig) -> dict:
    """The Session each mode runs on: plain on the drafter's Session, dflash on a fork of it (same weights,
    its own contexts: the modes run side by side), lookup on a drafter-free Session (lookup is on by
    default there), both on Session(..., lookup=True), mtp on a drafter-free Session with the target's MTP
    heads and no lookup, tree on Session(..., tree_nodes=N) (its target opened for trees: a unified cache, a
    sequence per leaf): the paths users run. Only the mtp mode loads MTP heads (`session` was opened
    without), so dflash, lookup, both and tree measure what they name on a target that ships heads too."""
    from dflash_gguf.mtp import mtp_unusable_reason
    from dflash_gguf.session import Session

    target, drafter = session.target.path, session.drafter.path
    without_mtp = replace(config.session, mtp=False)
    opened = {"plain": session}
    try:
        opened["dflash"] = session.fork()
        if "lookup" in modes:
            opened["lookup"] = Session(target, None, without_mtp, lookup=True)
        if "both" in modes:
            opened["both"] = Session(target, drafter, without_mtp, lookup=True)
        if "mtp" in modes:
            opened["mtp"] = mtp = Session(target, None, replace(config.session, mtp=True), lookup=False)
            if not mtp.mtp:
                raise ValueError(f"mode mtp: {mtp.speculative_disabled_reason or mtp_unusable_reason(mtp.target)}")
        if "tree" in modes:
            opened["tree"] = Session(target, drafter, replace(without_mtp, tree_nodes=config.tree_nodes), lookup=False)
    except BaseException:
        close_mode_sessions(opened, session)
        raise
    return opened


def close_mode_sessions(sessions: dict, keep) -> None:
    for s in {id(s): s for s in sessions.values()}.values():
        if s is not keep:
            s.close()


def memory_figures(session, runs: Sequence[Generation]) -> dict:
    """How the target rolls back and what that costs in memory (issue 10): mechanism, snapshots, state bytes."""
    extra = [g.stats.memory_extra_bytes for g in runs if g.stats is not None]
    return {
        "target_memory": session.memory.name,
        "n_rs_seq": session.target.n_rs_seq,
        "recurrent_state_bytes": getattr(session.memory, "state_bytes", 0),
        "memory_extra_bytes_max": max(extra, default=0),
        "speculative_disabled_reason": session.speculative_disabled_reason,
    }


def drafter_figures(session) -> dict:
    """Which drafter kind ran, and whether it predicts its own acceptance (a DSpark confidence head)."""
    drafter = session.drafter
    return {"drafter_kind": drafter.kind, "confidence_head": bool(getattr(drafter, "has_confidence_head", False))}


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchResult:
    """Every prompt in both modes, `repeats` times each, interleaved; then the requested peers."""
    from dflash_gguf.session import Session

    config.validate()
    session = Session(config.target, config.drafter, replace(config.session, mtp=False), lookup=False)
    with session:
        if session.drafter is None:
            raise ValueError(
                session.speculative_disabled_reason
                or "no drafter: pass --drafter FILE.gguf (a dflash drafter converted for this target)"
            )
        sessions = open_mode_sessions(session, config.modes, config)
        rss_loaded = _peak_rss_mib()
        try:
            results = _run_prompts(sessions, config, progress)
        finally:
            close_mode_sessions(sessions, session)
        peer_prompts = [peer_runs.PeerPrompt(p.id, *_chat_prompt(session, _conversation(p))) for p in config.prompts]
        paths = (session.target.path, session.drafter.path)
        n_threads = config.session.n_threads or default_threads()
        block = session.drafter.block_size
        rss_bench = _peak_rss_mib()
        target_memory = memory_figures(session, [g for p in results for g in p.runs])
        drafter_info = drafter_figures(session)
    peers = _run_peers(config, paths, peer_prompts, n_threads, block, progress)
    plain_tokens = {p.id: p.of("plain")[0].tokens for p in results}
    for peer in peers:
        if peer.available:
            peer.identical_to_plain = sum(1 for pid, gs in peer.runs.items() if gs and gs[0].tokens == plain_tokens[pid])
    settings = {
        "target": str(paths[0]),
        "drafter": str(paths[1]),
        **drafter_info,
        "max_tokens": config.generation.max_tokens,
        "repeats": config.repeats,
        "warmup": config.warmup,
        "n_ctx": config.session.n_ctx,
        "block_size": config.generation.block_size or f"adaptive (up to {block})",
        **({"tree_nodes": config.tree_nodes} if "tree" in config.modes else {}),
        "sampling": "greedy",
        "modes": list(config.modes),
        "order": "per prompt, each repeat: " + ", ".join(config.modes) + " in lockstep (one cycle each in turn, "
        "each on its own context), the next repeat in reverse turn order",
        "speedup": "per prompt: the median over repeats of each run's loop rate over the plain run of its repeat",
    }
    advice = kernel_advice(Path(paths[0]))
    if advice:
        settings["advice"] = advice
    memory = {
        **target_memory,
        "peak_rss_after_load_mib": round(rss_loaded, 1),
        "peak_rss_after_benchmark_mib": round(rss_bench, 1),
        "peak_rss_final_mib": round(_peak_rss_mib(), 1),
        "memory_note": "getrusage ru_maxrss: peak resident memory of the whole benchmark process (both models, "
        "every mode's Session, Python); the modes share one process, so it is not split per mode",
    }
    return BenchResult(settings, machine_info(n_threads), results, peers, memory)


def _conversation(p: Prompt) -> list[dict]:
    return [{"role": "user", "content": p.prompt}]


def _run_prompts(sessions: dict, config: BenchConfig, progress: Callable[[str], None]) -> list[PromptResult]:
    """Every prompt in every mode, `repeats` times, each repeat's modes in lockstep; a warm-up first."""
    if config.warmup:
        lockstep_generations(sessions, _conversation(config.prompts[0]), config.modes, -1, config)
    results = []
    for i, p in enumerate(config.prompts, 1):
        runs = [
            g for r in range(config.repeats)
            for g in lockstep_generations(sessions, _conversation(p), order(tuple(config.modes), r), r, config, p.schema)
        ]
        results.append(PromptResult(p.id, p.category, runs))
        figures = ", ".join(
            f"{m} {'-' if (x := results[-1].speedup(m)) is None else f'{x:.2f}x'}" for m in config.modes if m != "plain"
        )
        progress(f"[{i}/{len(config.prompts)}] {p.id}: speedup {figures}")
    return results


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
                    target, prompts, max_tokens=config.generation.max_tokens, repeats=config.repeats, n_threads=n_threads,
                    n_ctx=config.session.n_ctx, num_pred_tokens=10 if name == "lookup" else None,
                )
            )
        elif name == "reference":
            out.append(peer_runs.reference_tau(target, config.reference_drafter, prompts, max_tokens=config.generation.max_tokens))
        elif name == "llama-server":
            out.append(
                peer_runs.llama_server(
                    config.llama_server, target, drafter, prompts, max_tokens=config.generation.max_tokens,
                    repeats=config.repeats, n_threads=n_threads, n_ctx=config.session.n_ctx, n_draft=block - 1, log=progress,
                )
            )
    return out
