"""How a target batch of n tokens costs against one decode step, per quantization, on this machine.

Speculative decoding pays only if verifying a block costs little more than one step. llama.cpp's batched
CPU kernels differ a lot by weight type, so the shipped Q4_1 target is measured next to one-time local
requantizations (Q4_0, Q8_0), interleaved so machine load hits every variant alike.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np

from dflash_gguf.config import GenerationConfig
from dflash_gguf.convert.writer import atomic_output
from dflash_gguf.defaults import FLASH_ATTN
from dflash_gguf.memory import TargetMemory, memory_for, rs_seq_for
from dflash_gguf.target import Target, check_gguf_file, quantize, system_info
from dflash_gguf.timing import time_batch as timing_batch

# llama_ftype values of the requantizations compared (llama.h enum llama_ftype)
REQUANT_FTYPES = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
DEFAULT_SIZES = (1, 2, 4, 8, 12, 16)
CONTEXT_TOKENS = 64  # verification happens after a prompt, not at position 0

def requantize(src: Path, dst: Path, quant: str, *, n_threads: int = 2) -> Path:
    """Requantize a GGUF to `quant` (Q4_0 or Q8_0) once, keeping the Q8_0 token embedding / tied LM head.

    Written to a temporary file beside `dst` and renamed into place, so no half-written model remains.
    """
    if quant not in REQUANT_FTYPES:
        raise ValueError(f"quantization must be one of {', '.join(REQUANT_FTYPES)}, got {quant!r}")
    src = check_gguf_file(src)
    with atomic_output(dst, force=True) as tmp:
        quantize(src, tmp, REQUANT_FTYPES[quant], n_threads=n_threads)
    return dst


@dataclass
class VariantCosts:
    """One quantization's measured batch costs per batch size: wall and process CPU seconds, per repeat.

    On a shared machine wall time depends on what else runs; with one thread, the process CPU time of a
    decode does not (no other thread to wait for), so its median is the steadiest figure.
    """

    name: str
    path: str
    file_bytes: int
    seconds: dict[int, list[float]] = field(default_factory=dict)
    cpu_seconds: dict[int, list[float]] = field(default_factory=dict)
    argmax_agreement: float | None = None  # share of positions whose argmax matches the reference variant
    plain_tokens_per_s: list[float] = field(default_factory=list)  # greedy plain generations, decode only
    plain_cpu_ms_per_token: list[float] = field(default_factory=list)
    step_alone_cpu_ms: float | None = None  # median CPU time of consecutive 1-token decodes, this model only
    memory: str = "kv"  # how a verify batch is rolled back on this target (memory.memory_for)
    n_rs_seq: int = 0  # recurrent-state snapshots the timed context keeps (hybrid targets)
    rollback_seconds: dict[int, list[float]] = field(default_factory=dict)  # keeping 1 of n tokens, per repeat

    def best_s(self, n: int) -> float:
        """The fastest repeat: the one least disturbed by other processes."""
        return min(self.seconds[n])

    def cpu_s(self, n: int) -> float:
        return statistics.median(self.cpu_seconds[n])

    def ratio(self, n: int) -> float:
        """t(n)/t(1), wall time of the fastest repeats."""
        return self.best_s(n) / self.best_s(1)

    def cpu_ratio(self, n: int) -> float:
        """t(n)/t(1), median process CPU time."""
        return self.cpu_s(n) / self.cpu_s(1)


@dataclass
class KernelReport:
    variants: list[VariantCosts]
    sizes: list[int]
    repeats: int
    n_threads: int
    flash_attn: bool
    system_info: str
    load_average: tuple[float, float, float]
    # the first variant against itself with flash attention flipped: the agreement that kernel rounding alone gives
    flash_attn_flip_agreement: float | None = None
    drafter_cpu_ms: dict[str, float] = field(default_factory=dict)  # inject / draft passes, first variant

    def to_dict(self) -> dict:
        out = asdict(self)
        for v, d in zip(self.variants, out["variants"]):
            d["best_ms"] = {n: v.best_s(n) * 1e3 for n in self.sizes}
            d["cpu_ms"] = {n: v.cpu_s(n) * 1e3 for n in self.sizes}
            d["ratio"] = {n: v.ratio(n) for n in self.sizes}
            d["cpu_ratio"] = {n: v.cpu_ratio(n) for n in self.sizes}
            d["plain_tokens_per_s_median"] = statistics.median(v.plain_tokens_per_s) if v.plain_tokens_per_s else None
            d["plain_cpu_ms_per_token_median"] = (
                statistics.median(v.plain_cpu_ms_per_token) if v.plain_cpu_ms_per_token else None
            )
            d["rollback_ms_median"] = {n: 1e3 * statistics.median(r) for n, r in v.rollback_seconds.items() if r}
        return out


def measure(
    variants: dict[str, Path],
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 10,
    n_threads: int = 2,
    flash_attn: bool = FLASH_ATTN,
    generate_tokens: int = 64,
    drafter: Path | None = None,
) -> KernelReport:
    """Time a target batch of each size (all rows output logits, as verification needs) for each variant.

    Every repeat visits every variant and size in a rotating order; a warm-up pass comes first.
    flash_attn defaults to defaults.FLASH_ATTN, as the Session opens its target. Then, unless generate_tokens is 0, greedy
    plain generations of that many tokens through the Session (repeats // 10 interleaved rounds), and with
    a drafter, what its feature injection and draft passes cost next to the first variant.
    """
    if not variants:
        raise ValueError("no model variants to measure")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sizes = sorted(set(int(n) for n in sizes) | {1})
    if sizes[0] < 1:
        raise ValueError("batch sizes must be >= 1")
    n_batch = max(max(sizes), 512)  # each agreement prompt goes in one batch
    # as the Session opens a hybrid target: snapshots for the longest batch timed (ignored by other targets)
    n_rs_seq = rs_seq_for(max(sizes), n_batch)
    targets: dict[str, Target] = {}
    try:
        for name, path in variants.items():
            targets[name] = Target.open(path, n_ctx=1024, n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn,
                                        n_rs_seq=n_rs_seq)
        memories = {name: _timing_memory(target) for name, target in targets.items()}
        results = {
            name: VariantCosts(
                name, str(path), Path(path).stat().st_size, {n: [] for n in sizes}, {n: [] for n in sizes},
                memory=memories[name].name, n_rs_seq=targets[name].n_rs_seq, rollback_seconds={n: [] for n in sizes},
            )
            for name, path in variants.items()
        }
        context = context_tokens(next(iter(targets.values())))
        for name, target in targets.items():
            target.decode(context, 0, logits=False)
            memories[name].end_of_turn(len(context))  # hybrid: the state every timed batch rolls back to
        names = list(targets)
        for rep in range(repeats + 1):  # rep 0 is the warm-up
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                for n in sizes:
                    timing = timing_batch(targets[name], _batch(context, n), len(context), memories[name])
                    if rep:
                        results[name].seconds[n].append(timing.wall_s)
                        results[name].cpu_seconds[n].append(timing.cpu_s)
                        results[name].rollback_seconds[n].append(timing.rollback_s)
        for name, target in targets.items():
            results[name].step_alone_cpu_ms = _step_alone_cpu_ms(target, context, memories[name])
        _argmax_agreement(targets, results)
        first_path = next(iter(variants.values()))
        flip_agreement = _flash_attn_flip_agreement(targets[names[0]], first_path, n_threads, not flash_attn)
    finally:
        for target in targets.values():
            target.close()
    drafter_ms = _drafter_costs(first_path, drafter, n_threads, flash_attn, repeats) if drafter is not None else {}
    if generate_tokens:
        rounds = max(1, repeats // 10)
        plain_generation(
            variants, list(results.values()), max_tokens=generate_tokens, repeats=rounds, n_threads=n_threads
        )
    info = system_info()
    return KernelReport(
        list(results.values()), sizes, repeats, n_threads, flash_attn, info, os.getloadavg(),
        flip_agreement, drafter_ms,
    )


def _timing_memory(target: Target) -> TargetMemory:
    """The rollback the Session would use on this target; a target that has none cannot be timed as a verify."""
    memory = memory_for(target)
    if not memory.can_rollback:
        raise ValueError(f"{target.path}: {memory.reason or 'this target cannot roll back a verify batch'}; "
                         "its batch costs cannot be measured as verifies")
    return memory


def _batch(context: list[int], n: int) -> list[int]:
    return [context[i % len(context)] for i in range(n)]


def _step_alone_cpu_ms(target: Target, context: list[int], memory: TargetMemory, n: int = 20) -> float:
    """Median CPU ms of n consecutive 1-token decodes of one model, nothing else in between."""
    samples = [timing_batch(target, _batch(context, 1), len(context), memory).cpu_s for _ in range(n)]
    return 1e3 * statistics.median(samples)


def _flash_attn_flip_agreement(reference: Target, path: Path, n_threads: int, flash_attn: bool) -> float:
    """Argmax agreement of the same file with flash attention flipped: the floor kernel rounding sets."""
    with Target.open(
        path, n_ctx=reference.n_ctx, n_batch=reference.n_batch, n_threads=n_threads, flash_attn=flash_attn
    ) as flipped:
        tops = [_teacher_forced_argmax(t, text) for text in _agreement_texts() for t in (reference, flipped)]
    return float(np.mean(np.concatenate(tops[0::2]) == np.concatenate(tops[1::2])))


def _teacher_forced_argmax(target: Target, text: str) -> np.ndarray:
    tokens = target.vocab.tokenize(text)[: target.n_batch]
    target.clear()
    target.decode(tokens, 0, logits=True)
    tops = np.argmax(target.output_logits(), axis=1)
    target.clear()
    return tops


def _drafter_costs(
    target_path: Path, drafter_path: Path, n_threads: int, flash_attn: bool, repeats: int
) -> dict[str, float]:
    """Median CPU ms of injecting 1 and 8 feature rows, and of draft passes over blocks of 2, 4, 8, 16 tokens."""
    from dflash_gguf.drafter import Drafter

    out: dict[str, list[float]] = {}
    with Target.open(target_path, n_ctx=1024, n_batch=64, n_threads=n_threads, flash_attn=flash_attn) as target:
        memory = _timing_memory(target)
        with Drafter(drafter_path, target) as drafter:
            context = context_tokens(target)
            target.decode(context, 0, logits=False)
            drafter.inject(target.features(len(context)), 0)
            pos = len(context)
            blocks = [b for b in (2, 4, 8, 16) if b <= drafter.block_size]
            for rep in range(repeats + 1):
                for rows in (1, 8):
                    memory.before_verify(pos, rows, keep_min=0)  # the rows are dropped again below
                    target.decode(context[:rows], pos, logits=False)
                    features = target.features(rows)
                    memory.keep(pos, context[:rows], 0)
                    start = time.process_time()
                    drafter.inject(features, pos)
                    if rep:
                        out.setdefault(f"inject {rows} row(s)", []).append(time.process_time() - start)
                    drafter.remove(pos)
                for block in blocks:
                    start = time.process_time()
                    drafter.draft(context[-1], pos, block - 1)
                    if rep:
                        out.setdefault(f"draft block {block}", []).append(time.process_time() - start)
    return {key: 1e3 * statistics.median(v) for key, v in out.items()}


def plain_generation(
    variants: dict[str, Path], results: Sequence[VariantCosts], *, max_tokens: int, repeats: int, n_threads: int
) -> None:
    """Greedy plain decoding through the Session, one chat prompt per built-in category, interleaved by variant.

    What a user sees without speculation: decode tok/s (wall) and process CPU ms per generated token.
    """
    from dflash_gguf.session import Session

    from .chat import chat_steps
    from .suite import load_suite

    conversations = [[{"role": "user", "content": p.prompt}] for p in load_suite(limit=1)]
    sessions = [Session(path, None, n_ctx=1024, n_threads=n_threads) for path in variants.values()]
    try:
        for rep in range(repeats + 1):  # rep 0 is the warm-up
            for messages in conversations:
                for session, result in zip(sessions, results):
                    steps = chat_steps(session, messages, GenerationConfig(max_tokens=max_tokens, speculative=False))
                    next(steps)  # prefill, not timed
                    start, start_cpu, n = time.perf_counter(), time.process_time(), 0
                    for step in steps:
                        n += len(step.tokens)
                    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    if rep and n:
                        result.plain_tokens_per_s.append(n / wall)
                        result.plain_cpu_ms_per_token.append(1e3 * cpu / n)
    finally:
        for session in sessions:
            session.close()


def _agreement_texts() -> list[str]:
    """The built-in benchmark prompts: teacher-forced text for the argmax-agreement check."""
    from .suite import load_suite

    return [p.prompt for p in load_suite()]


def context_tokens(target: Target) -> list[int]:
    tokens = [t for text in _agreement_texts() for t in target.vocab.tokenize(text)]
    return tokens[:CONTEXT_TOKENS]


def time_batch(target: Target, context: list[int], n: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of one decode of n tokens after the context, then rolled back (KV targets)."""
    timing = timing_batch(target, _batch(context, n), len(context))
    return timing.wall_s, timing.cpu_s


def _argmax_agreement(targets: dict[str, Target], results: dict[str, VariantCosts]) -> None:
    """Share of teacher-forced next-token argmaxes (over the built-in prompts) equal to the first variant's."""
    texts = _agreement_texts()
    argmax = {name: np.concatenate([_teacher_forced_argmax(t, text) for text in texts]) for name, t in targets.items()}
    reference = argmax[next(iter(targets))]
    for name, tops in argmax.items():
        results[name].argmax_agreement = float(np.mean(tops == reference))


# file types whose weights have no repacked CPU GEMV/GEMM kernel in this ggml (repack.cpp)
_NO_REPACK_FTYPES = {
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1: "Q4_1",
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0: "Q5_0",
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1: "Q5_1",
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_S: "Q3_K_S",
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M: "Q3_K_M",
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_L: "Q3_K_L",
}


def kernel_advice(target: Path) -> str | None:
    """A note for targets whose weight type makes batched verification expensive on CPU, else None."""
    from dflash_gguf.target_gguf import field_value, open_gguf

    ftype = field_value(open_gguf(target), "general.file_type")
    name = _NO_REPACK_FTYPES.get(int(ftype)) if ftype is not None else None
    if name is None:
        return None
    return (
        f"{target.name} is {name}: ggml has no repacked CPU kernels for it, so verifying a block costs close to "
        "one decode step per token; a one-time Q8_0 requantization keeps the model and makes blocks cheaper "
        "(measure with dflash-bench --kernels --target FILE)"
    )


def prepare_variants(
    source: Path, workdir: Path, quants: Sequence[str] = ("Q4_0", "Q8_0"), *, n_threads: int = 2
) -> dict[str, Path]:
    """The source file plus one requantization per name in `quants`, made in `workdir` unless already there."""
    source = check_gguf_file(source)
    variants = {f"{_file_type(source)} (as shipped)": source}
    for quant in quants:
        dst = workdir / f"{source.stem}.requant-{quant}.gguf"
        if not dst.is_file():
            requantize(source, dst, quant, n_threads=n_threads)
        variants[f"{quant} (requantized)"] = dst
    return variants


def _file_type(path: Path) -> str:
    """The quantization named in the file name (`...Q4_1.gguf`), else 'source'."""
    suffix = path.stem.rsplit(".", 1)[-1]
    return suffix if suffix[:1] in ("Q", "F", "B") else "source"


def to_markdown(report: KernelReport) -> str:
    """The side-by-side tables docs/BENCHMARKS.md quotes: wall time (fastest repeat) and CPU time (median)."""
    rows = []
    first = report.variants[0]
    for title, step, ratio in (
        ("wall time, fastest repeat", VariantCosts.best_s, VariantCosts.ratio),
        ("process CPU time, median", VariantCosts.cpu_s, VariantCosts.cpu_ratio),
    ):
        rows.append(f"{title}:")
        rows.append("")
        head = "| variant | file MiB | 1-token step ms | " + " | ".join(f"t({n})/t(1)" for n in report.sizes[1:])
        rows.append(head + " | step speed vs first | argmax agreement |")
        rows.append("|" + "---|" * (5 + len(report.sizes) - 1))
        for v in report.variants:
            ratios = " | ".join(f"{ratio(v, n):.2f}x" for n in report.sizes[1:])
            agreement = "-" if v.argmax_agreement is None else f"{v.argmax_agreement * 100:.1f}%"
            rows.append(
                f"| {v.name} | {v.file_bytes / 2**20:.1f} | {step(v, 1) * 1e3:.2f} | {ratios} | "
                f"{step(first, 1) / step(v, 1):.2f}x | {agreement} |"
            )
        rows.append("")
    if any(v.plain_tokens_per_s for v in report.variants):
        rows.append("plain greedy generation through the Session (decode only, medians):")
        rows.append("")
        rows.append("| variant | decode tok/s | CPU ms per token | speed vs first (CPU) |")
        rows.append("|---|---|---|---|")
        first_cpu = statistics.median(first.plain_cpu_ms_per_token)
        for v in report.variants:
            cpu = statistics.median(v.plain_cpu_ms_per_token)
            tps = statistics.median(v.plain_tokens_per_s)
            rows.append(f"| {v.name} | {tps:.1f} | {cpu:.2f} | {first_cpu / cpu:.2f}x |")
        rows.append("")
    hybrid = [v for v in report.variants if v.memory != "kv"]
    for v in hybrid:
        largest = max(report.sizes)
        rollback = statistics.median(v.rollback_seconds[largest])
        rows += [f"{v.name}: recurrent target, rolled back by {v.memory} (n_rs_seq={v.n_rs_seq}); keeping 1 of "
                 f"{largest} tokens costs {rollback * 1e3:.2f} ms, {rollback / v.best_s(1):.2f}x a 1-token step.", ""]
    alone = ", ".join(f"{v.name} {v.step_alone_cpu_ms:.2f} ms" for v in report.variants if v.step_alone_cpu_ms)
    if alone:
        rows += [f"1-token step alone (20 consecutive decodes of one model, median CPU): {alone}.", ""]
    if report.flash_attn_flip_agreement is not None:
        rows += [
            f"{first.name} against itself with flash attention flipped: "
            f"{report.flash_attn_flip_agreement * 100:.1f}% argmax agreement (what kernel rounding alone gives).",
            "",
        ]
    if report.drafter_cpu_ms:
        costs = ", ".join(f"{k} {v:.2f} ms" for k, v in report.drafter_cpu_ms.items())
        rows += [f"drafter next to {first.name} (median CPU): {costs}.", ""]
    load = ", ".join(f"{x:.1f}" for x in report.load_average)
    rows.append(
        f"{report.repeats} interleaved repeats, n_threads={report.n_threads}, flash attention "
        f"{'on' if report.flash_attn else 'off'}, load average at the end {load}. Batches at positions "
        f"{CONTEXT_TOKENS}.., every row outputs logits (as verification needs)."
    )
    return "\n".join(rows) + "\n"
