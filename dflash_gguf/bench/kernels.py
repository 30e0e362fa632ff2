"""How a target batch of n tokens costs against one decode step, per quantization, on this machine.

Speculative decoding pays only if verifying a block costs little more than one step. llama.cpp's batched
CPU kernels differ a lot by weight type, so the shipped Q4_1 target is measured next to one-time local
requantizations (Q4_0, Q8_0), interleaved so machine load hits every variant alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np

from dflash_gguf.convert.writer import atomic_output
from dflash_gguf.target import Target, check_gguf_file, init_backend

# llama_ftype values of the requantizations compared (llama.h enum llama_ftype)
REQUANT_FTYPES = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
DEFAULT_SIZES = (1, 2, 4, 8, 12, 16)
CONTEXT_TOKENS = 64  # verification happens after a prompt, not at position 0

# teacher-forced text for the argmax-agreement check between quantizations (written for this project)
AGREEMENT_TEXT = (
    "To compute the area of a circle, square the radius and multiply by pi. For a radius of three "
    "centimetres this gives about 28.27 square centimetres. In Python, a function that returns the area "
    "takes the radius as an argument: def area(r): return math.pi * r ** 2. Calling area(3) prints the "
    "same value. A kind reply to a friend who asks for help moving house might be: of course, I can come "
    "on Saturday morning and bring some boxes."
)


def requantize(src: Path, dst: Path, quant: str, *, n_threads: int = 2) -> Path:
    """Requantize a GGUF to `quant` (Q4_0 or Q8_0) once, keeping the Q8_0 token embedding / tied LM head.

    Written to a temporary file beside `dst` and renamed into place, so no half-written model remains.
    """
    if quant not in REQUANT_FTYPES:
        raise ValueError(f"quantization must be one of {', '.join(REQUANT_FTYPES)}, got {quant!r}")
    src = check_gguf_file(src)
    init_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = n_threads
    params.ftype = REQUANT_FTYPES[quant]
    params.allow_requantize = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
    params.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0
    with atomic_output(dst, force=True) as tmp:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src.name} -> {quant}) failed with code {rc}")
    return dst


@dataclass
class VariantCosts:
    """One quantization's measured batch costs: seconds per repeat for each batch size."""

    name: str
    path: str
    file_bytes: int
    seconds: dict[int, list[float]] = field(default_factory=dict)
    argmax_agreement: float | None = None  # share of positions whose argmax matches the reference variant

    def best_s(self, n: int) -> float:
        """The fastest repeat: the one least disturbed by other processes on a shared machine."""
        return min(self.seconds[n])

    def median_s(self, n: int) -> float:
        return statistics.median(self.seconds[n])

    def ratio(self, n: int) -> float:
        """t(n)/t(1) from the fastest repeats."""
        return self.best_s(n) / self.best_s(1)

    def median_ratio(self, n: int) -> float:
        """Median over repeats of t(n)/t(1) within a repeat (both timings from the same moment)."""
        return statistics.median(tn / t1 for tn, t1 in zip(self.seconds[n], self.seconds[1]))


@dataclass
class KernelReport:
    variants: list[VariantCosts]
    sizes: list[int]
    repeats: int
    n_threads: int
    system_info: str

    def to_dict(self) -> dict:
        out = asdict(self)
        for v, d in zip(self.variants, out["variants"]):
            d["best_ms"] = {n: v.best_s(n) * 1e3 for n in self.sizes}
            d["median_ms"] = {n: v.median_s(n) * 1e3 for n in self.sizes}
            d["ratio"] = {n: v.ratio(n) for n in self.sizes}
            d["median_ratio"] = {n: v.median_ratio(n) for n in self.sizes}
        return out


def measure(
    variants: dict[str, Path],
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 10,
    n_threads: int = 2,
) -> KernelReport:
    """Time a target batch of each size (all rows output logits, as verification needs) for each variant.

    Every repeat visits every variant and size in a rotating order; a warm-up pass comes first.
    """
    if not variants:
        raise ValueError("no model variants to measure")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sizes = sorted(set(int(n) for n in sizes) | {1})
    if sizes[0] < 1:
        raise ValueError("batch sizes must be >= 1")
    n_batch = max(max(sizes), 512)  # the agreement text goes in one batch
    targets = {
        name: Target.open(path, n_ctx=1024, n_batch=n_batch, n_threads=n_threads) for name, path in variants.items()
    }
    try:
        results = {
            name: VariantCosts(name, str(path), Path(path).stat().st_size, {n: [] for n in sizes})
            for name, path in variants.items()
        }
        context = _context_tokens(next(iter(targets.values())))
        for target in targets.values():
            target.decode(context, 0, logits=False)
        names = list(targets)
        for rep in range(repeats + 1):  # rep 0 is the warm-up
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                for n in sizes:
                    seconds = _time_batch(targets[name], context, n)
                    if rep:
                        results[name].seconds[n].append(seconds)
        _argmax_agreement(targets, results)
    finally:
        for target in targets.values():
            target.close()
    return KernelReport(list(results.values()), sizes, repeats, n_threads, llama_cpp.llama_print_system_info().decode())


def _context_tokens(target: Target) -> list[int]:
    tokens = target.tokenize(AGREEMENT_TEXT)
    return (tokens * (CONTEXT_TOKENS // len(tokens) + 1))[:CONTEXT_TOKENS]


def _time_batch(target: Target, context: list[int], n: int) -> float:
    tokens = [context[i % len(context)] for i in range(n)]
    start = time.perf_counter()
    target.decode(tokens, len(context), logits=True)
    seconds = time.perf_counter() - start
    target.remove(0, len(context), -1)
    return seconds


def _argmax_agreement(targets: dict[str, Target], results: dict[str, VariantCosts]) -> None:
    """Teacher-forced next-token argmax of every variant against the first one (the shipped file)."""
    argmax = {}
    for name, target in targets.items():
        tokens = target.tokenize(AGREEMENT_TEXT)
        target.clear()
        target.decode(tokens, 0, logits=True)
        argmax[name] = np.argmax(target.output_logits(), axis=1)
        target.clear()
    reference = argmax[next(iter(targets))]
    for name, tops in argmax.items():
        results[name].argmax_agreement = float(np.mean(tops == reference))


def prepare_variants(source: Path, workdir: Path, quants: Sequence[str] = ("Q4_0", "Q8_0"), *, n_threads: int = 2) -> dict[str, Path]:
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
    """The side-by-side table docs/BENCHMARKS.md quotes: fastest repeats, with medians in brackets."""
    head = "| variant | file MiB | 1-token step ms | " + " | ".join(f"t({n})/t(1)" for n in report.sizes[1:])
    head += " | step speed vs first | argmax agreement |"
    rule = "|" + "---|" * (5 + len(report.sizes) - 1)
    rows = [head, rule]
    first = report.variants[0]
    for v in report.variants:
        ratios = " | ".join(f"{v.ratio(n):.2f}x ({v.median_ratio(n):.2f}x)" for n in report.sizes[1:])
        agreement = "-" if v.argmax_agreement is None else f"{v.argmax_agreement * 100:.1f}%"
        rows.append(
            f"| {v.name} | {v.file_bytes / 2**20:.1f} | {v.best_s(1) * 1e3:.2f} ({v.median_s(1) * 1e3:.2f}) | {ratios} | "
            f"{first.best_s(1) / v.best_s(1):.2f}x | {agreement} |"
        )
    rows.append("")
    rows.append(
        f"Fastest of {report.repeats} interleaved repeats (median in brackets), n_threads={report.n_threads}. "
        f"Batches at positions {CONTEXT_TOKENS}.., every row outputs logits (as verification needs)."
    )
    return "\n".join(rows) + "\n"
