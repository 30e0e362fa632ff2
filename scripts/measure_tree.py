"""τ of draft trees against a linear block at equal verify rows, with the embedded pair, on held-out prompts (issue 36).

Two passes. `collect` answers each prompt greedily with plain decoding (the target's own continuation, which
greedy verification reproduces), capturing the target's features, then runs the drafter at every position of
the answer with exactly the features a cycle there would have injected, and keeps each slot's top-k
candidates. `replay` then runs the loop for any shape on those drafts: a cycle at position p verifies a tree
(or a block) and commits the longest path whose tokens are the target's continuation, plus the bonus; the
acceptance model learns online from those outcomes only (what a live loop sees), in prompt order.

    python scripts/measure_tree.py collect --prompts ../shared/data/train_prompts.jsonl --out /tmp/tree_drafts.npz
    python scripts/measure_tree.py replay /tmp/tree_drafts.npz
    python scripts/measure_tree.py project /tmp/tree_drafts.npz --curve scripts/verify_curves/batched_bench_llama7b_f16.json
        (fixed shapes, and the runtime's controller choosing plain, blocks or trees per cycle under that curve)
    python scripts/measure_tree.py curve --out /tmp/curve.json [--n-gpu-layers -1]   # this machine's t(n)
    python scripts/measure_tree.py live --prompts ../shared/data/train_prompts.jsonl   # τ through the Session
    python scripts/measure_tree.py live --per-category 6 --max-tokens 96   # every benchmark prompt: τ, replies = plain
    python scripts/measure_tree.py live --drafter DSPARK.gguf   # another drafter kind; --lookup: lookup alone
The prompts: `train_prompts.jsonl`'s held-out split (seed 0, 40 per category, the benchmark prompts excluded,
as docs/TRAINING.md trained the embedded drafter), taken after the 8 per category the training evaluated on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_gguf.kinds.head import top
from dflash_gguf.tree import AcceptanceModel, CalibratedAcceptance, build_tree, target_ranks, walk_greedy


def held_out(prompts_file: Path, per_category: int, skip: int) -> list:
    from dflash_gguf.bench.suite import builtin_suite_path
    from dflash_gguf.train.prompts import load_prompts, split_prompts

    bench = {p.id for p in load_prompts(builtin_suite_path())}
    _, test = split_prompts(load_prompts(prompts_file), 40, 0, bench)
    out, taken = [], {}
    for p in test:
        if p.id in bench:
            continue
        i = taken.get(p.category, 0)
        taken[p.category] = i + 1
        if skip <= i < skip + per_category:
            out.append(p)
    return out


def collect(args: argparse.Namespace) -> None:
    from dflash_gguf import Session

    k, slots = args.k, None
    records = []
    if args.prompts is None:  # the built-in benchmark suite's math, code and chat prompts: never trained on either
        from dflash_gguf.bench.suite import load_suite

        prompts = load_suite(categories=("math", "code", "chat"), limit=args.per_category)
    else:
        prompts = held_out(args.prompts, args.per_category, args.skip)
    with Session(n_ctx=2048, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers, lookup=False) as s:
        target, drafter = s.target, s.drafter
        slots = drafter.max_draft
        for n, p in enumerate(prompts):
            text, _ = s.render_chat([{"role": "user", "content": p.prompt}])
            seq = s.tokenize(text, add_special=False)[: args.max_prompt]
            n_prompt = len(seq)
            target.clear()
            feats = []
            for a in range(0, n_prompt, target.n_batch):
                b = min(n_prompt, a + target.n_batch)
                target.decode(seq[a:b], a, logits="last" if b == n_prompt else False)
                feats.append(target.features(b - a))
            for _ in range(args.max_tokens):  # plain greedy decoding: the target's own continuation
                tok = int(np.argmax(target.output_logits()[-1]))
                seq.append(tok)
                if target.vocab.is_eog(tok) or len(seq) >= target.n_ctx_seq - slots - 2:
                    break
                target.decode([tok], len(seq) - 1, logits=True)
                feats.append(target.features(1))
            features = np.concatenate(feats)  # rows 0..len(seq)-2: every token but the last has been decoded
            drafter.clear()
            drafter.inject(features[:n_prompt], 0)
            ids = np.zeros((len(seq), slots, k), np.int32)
            logq = np.zeros((len(seq), slots, k), np.float32)
            for pos in range(n_prompt, len(seq) - 1):  # a cycle with `last` = seq[pos]
                if pos > n_prompt:
                    drafter.inject(features[pos - 1 : pos], pos - 1)
                ids[pos], q = top(drafter.draft(seq[pos], pos, slots), k)
                with np.errstate(divide="ignore"):
                    logq[pos] = np.log(q)
            records.append((p, seq, n_prompt, ids, logq))
            print(f"{n + 1}: {p.category} {p.id}: {n_prompt} prompt + {len(seq) - n_prompt} reply tokens", flush=True)
        s.reset()
    np.savez_compressed(
        args.out,
        meta=json.dumps([{"id": p.id, "category": p.category, "n_prompt": n_prompt, "n": len(seq)}
                         for p, seq, n_prompt, _, _ in records]),
        **{f"seq{i}": np.asarray(r[1], np.int32) for i, r in enumerate(records)},
        **{f"ids{i}": r[3] for i, r in enumerate(records)},
        **{f"logq{i}": r[4] for i, r in enumerate(records)},
    )
    print(f"wrote {args.out}")


def replay_shape(data, budget: int, scoring: str, k: int, cost=None, draft_s: float = 0.0) -> dict:
    """Replay the loop with trees of `budget` rows (scoring 'linear': the top-1 block of that many rows).

    cost: seconds of a verify of n rows (a controller.CostTable); with it the replay also sums each cycle's
    time, draft_s + cost(rows).
    """
    meta = json.loads(str(data["meta"]))
    slots = data["ids0"].shape[1]
    model = AcceptanceModel(slots, k)
    calibrated = CalibratedAcceptance(slots)
    by_cat: dict[str, list[int]] = {}
    seconds = rows = 0.0
    for i, m in enumerate(meta):
        seq, ids, logq = data[f"seq{i}"], data[f"ids{i}"][:, :, :k], data[f"logq{i}"][:, :, :k]
        pos, n = m["n_prompt"], m["n"]
        cycles = committed = 0
        while pos < n - 1:
            if scoring == "linear":
                accept = np.zeros((slots, k))
                accept[:, 0] = 1.0  # a chain of the top-1 candidates
            elif scoring == "drafter":
                accept = np.exp(logq[pos].astype(np.float64))
            elif scoring == "calibrated":
                accept = calibrated.accept(np.exp(logq[pos].astype(np.float64)))
            else:
                accept = model.table()
            tree = build_tree(int(seq[pos]), ids[pos], accept, budget)
            cont = seq[pos + 1 :]
            path, _ = walk_greedy(tree, lambda row: int(cont[tree.depths[row]]) if tree.depths[row] < len(cont) else -1)
            a = len(path) - 1
            ranks = target_ranks(ids[pos], cont[: a + 1])
            model.observe(ranks)
            calibrated.observe(np.exp(logq[pos].astype(np.float64)), ranks)
            step = min(a + 1, n - 1 - pos)
            cycles += 1
            committed += step
            pos += step
            rows += len(tree)
            if cost is not None:
                seconds += draft_s + cost.seconds(len(tree))
        c = by_cat.setdefault(m["category"], [0, 0])
        c[0] += cycles
        c[1] += committed
    cyc = sum(c[0] for c in by_cat.values())
    tok = sum(c[1] for c in by_cat.values())
    out = {"tau": tok / cyc, "rows": rows / cyc, **{cat: c[1] / c[0] for cat, c in sorted(by_cat.items())}}
    if cost is not None:
        out["speedup"] = (tok / seconds) * cost.seconds(1)  # against plain decoding, one row per token
    return out


def replay(args: argparse.Namespace) -> None:
    data = np.load(args.drafts)
    meta = json.loads(str(data["meta"]))
    print(f"{len(meta)} prompts, {sum(m['n'] - m['n_prompt'] for m in meta)} reply tokens")
    rows = [("linear", 16, "linear")]
    rows += [(f"tree ({sc})", b, sc) for b in args.budgets for sc in ("learned", "drafter", "calibrated")]
    print("| shape | verify rows | τ | " + " | ".join(c for c in sorted({m["category"] for m in meta})) + " |")
    for name, budget, sc in rows:
        r = replay_shape(data, budget, sc, args.k)
        cats = " | ".join(f"{v:.2f}" for key, v in r.items() if key not in ("tau", "rows"))
        print(f"| {name} | {budget} | {r['tau']:.2f} | {cats} |", flush=True)


def replay_controller(data, cost: "CostModel", budget: int, k: int) -> dict:
    """Replay the loop as the runtime runs it: each cycle the BlockController (cost model `cost`, which does
    not learn here) chooses plain, a block or a tree and its size; trees are shaped by a TreeShaper (budget:
    the largest; 0: blocks only), and both learn from the replayed outcomes only. Sums each cycle's priced time."""
    from dflash_gguf.controller import BlockController
    from dflash_gguf.tree import TreeShaper

    meta = json.loads(str(data["meta"]))
    slots = data["ids0"].shape[1]
    controller = BlockController(slots, cost)
    shaper = None
    if budget:
        shaper = TreeShaper(slots, budget, k=k)
        controller.attach_trees(shaper)
    cycles = tokens = tree_cycles = rows = 0
    seconds = 0.0
    for i, m in enumerate(meta):
        seq, ids, logq = data[f"seq{i}"], data[f"ids{i}"][:, :, :k], data[f"logq{i}"][:, :, :k]
        pos, n = m["n_prompt"], m["n"]
        while pos < n - 1:
            cont = seq[pos + 1 :]
            anchor = int(seq[pos])
            choice = controller.choose()
            d = min(choice.n_draft, n - 1 - pos)
            tree_rows = controller.tree_rows_now()
            if d == 0:
                path_tokens, verified, cost_s = [], 1, cost.plain_s
            elif tree_rows:
                tree = shaper.shape_candidates(anchor, pos, ids[pos][:d], np.exp(logq[pos][:d].astype(np.float64)),
                                               tree_rows, cost if controller.sized_now() else None)
                path, _ = walk_greedy(tree, lambda row: int(cont[tree.depths[row]]) if tree.depths[row] < len(cont) else -1)
                path_tokens = [tree.tokens[r] for r in path[1:]]
                verified = len(tree) if not tree.is_path else tree.first_leaf + 1
                cost_s = cost.draft_s(d + 1) + (cost.verify_s(verified) if tree.is_path else cost.tree_verify_s(verified))
                tree_cycles += not tree.is_path
            else:
                chain = ids[pos][:d, 0]
                a = 0
                while a < d and chain[a] == cont[a]:
                    a += 1
                path_tokens, verified, cost_s = list(chain[:a]), d + 1, cost.draft_s(d + 1) + cost.verify_s(d + 1)
            if shaper is not None:
                shaper.observe(pos, [anchor, *path_tokens])
            if d:
                controller.observe(d, len(path_tokens), verified)
            step = min(len(path_tokens) + 1, n - 1 - pos)
            cycles += 1
            tokens += step
            rows += verified
            seconds += cost_s
            pos += step
    return {"tau": tokens / cycles, "rows": rows / cycles, "tree_share": tree_cycles / cycles,
            "speedup": (tokens / seconds) * cost.plain_s}


def project(args: argparse.Namespace) -> None:
    """Projected speedup over plain decoding under a verify cost curve read from a file: a projection from
    this drafter's exact acceptances, not a measurement on that machine."""
    from dflash_gguf.controller import CostModel, CostTable

    data = np.load(args.drafts)
    spec = json.loads(args.curve.read_text())
    points = {int(n): float(t) for n, t in spec["seconds"].items()}
    cost = CostTable(points)
    draft_s = args.draft_ratio * cost.seconds(1)
    print(f"curve: {spec['label']} ({spec['source']}); draft pass = {args.draft_ratio} x a one-row step")
    print("| shape | mean rows | τ | tree cycles | projected speedup |")
    best = max((replay_shape(data, n, "linear", args.k, cost, draft_s) | {"n": n} for n in range(2, 17)),
               key=lambda r: r["speedup"])
    print(f"| linear block, best fixed length ({best['n']} rows) | {best['rows']:.1f} | {best['tau']:.2f} | 0 | "
          f"{best['speedup']:.2f} |")
    for budget in (16, 32, 64):
        r = replay_shape(data, budget, "calibrated", args.k, cost, draft_s)
        print(f"| tree, {budget} rows | {r['rows']:.1f} | {r['tau']:.2f} | all | {r['speedup']:.2f} |")
    for budget in (0, 16, 64):
        model = CostModel(points, {1: max(draft_s, 1e-9)}, smoothing=1.0)  # held fixed: the replay observes no timing
        r = replay_controller(data, model, budget, args.k)
        name = "the controller, blocks only" if not budget else f"the controller, blocks or trees <= {budget} rows"
        print(f"| {name} | {r['rows']:.1f} | {r['tau']:.2f} | {r['tree_share']:.0%} | **{r['speedup']:.2f}** |",
              flush=True)


def curve(args: argparse.Namespace) -> None:
    """Time one verify of n rows on this machine, a linear block and a tree of n rows (its verify, the prefix
    shared and the kept path restored), after a 256-token prefix: the cost curve `project` reads."""
    import platform
    import statistics
    import time

    from dflash_gguf.defaults import embedded_target
    from dflash_gguf.target import Target, system_info
    from dflash_gguf.tree import keep_path, share_prefix

    rows = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= args.max_rows]
    with Target.open(embedded_target(), n_ctx=1024, n_batch=256, n_seq_max=max(1, max(rows) - 1),
                     kv_unified=True, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads) as t:
        prefix = (t.vocab.tokenize("The quick brown fox jumps over the lazy dog. ") * 32)[:256]
        t.decode(prefix[:-1], 0, logits=False)
        n_past = len(prefix) - 1
        words = [t.vocab.tokenize(w, add_special=False)[0] for w in (" the", " a", " it", " he", " we", " to", " of", " in")]
        ids = np.array([words] * 15)

        def median(step) -> float:
            times = []
            for _ in range(args.repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                step()
                t.output_logits()
                times.append(time.perf_counter() - t0)
                t.remove(0, n_past)
            return statistics.median(times[1:])

        linear, tree_s = {}, {}
        for n in rows:
            block = [prefix[-1]] + words[:1] * (n - 1)
            linear[n] = median(lambda: t.decode(block, n_past, logits=True))
            tree = build_tree(prefix[-1], ids, np.tile([0.4, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01], (15, 1)), n)

            def verify_tree(tree=tree):
                share_prefix(t, tree)
                t.decode_tree(tree.tokens, [n_past + d for d in tree.depths], tree.seq_ranges)
                keep_path(t, tree, n_past, tree.path(tree.leaves[-1]))  # the dearer keep: a path off the chain

            tree_s[n] = median(verify_tree)
            print(f"{n} rows: linear {linear[n] * 1e3:.2f} ms, tree {tree_s[n] * 1e3:.2f} ms", flush=True)
    out = {"label": f"the embedded target, measured on {platform.node()} (n_gpu_layers {args.n_gpu_layers})",
           "source": f"scripts/measure_tree.py curve; {system_info()[:200]}",
           "seconds": {str(n): tree_s[n] for n in rows}, "linear_seconds": {str(n): linear[n] for n in rows}}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


def live(args: argparse.Namespace) -> None:
    """τ through the Session itself, a 16-row tree against the 16-token block, fixed shapes, greedy, on the
    same held-out prompts: the loop's own figure next to the replay's. Also how many replies of each shape are
    plain decoding's token for token (tests/test_tree.py checks three prompts; this, every prompt given).
    --drafter: another drafter of the embedded target (any kind: DFlash 2, DSpark); --lookup: no drafter,
    lookup alone (its trees are the continuations' trie); --text: raw prompts (no chat template) instead."""
    from dflash_gguf import Session
    from dflash_gguf.defaults import embedded_target

    if args.lookup and args.drafter is not None:
        raise SystemExit("measure_tree.py live: --lookup measures lookup alone, without --drafter")
    pair = (str(embedded_target()), None) if args.lookup else (
        (None, None) if args.drafter is None else (str(embedded_target()), str(args.drafter)))

    if args.text:
        prompts = args.text
    elif args.prompts is None:  # the built-in benchmark suite's math, code and chat prompts, as collect
        from dflash_gguf.bench.suite import load_suite

        prompts = load_suite(categories=("math", "code", "chat"), limit=args.per_category)
    else:
        prompts = held_out(args.prompts, args.per_category, args.skip)

    def answer(s: "Session", prompt, **settings):
        if args.text:
            return s.generate(prompt, max_tokens=args.max_tokens, **settings)
        return s.chat([{"role": "user", "content": prompt.prompt}], max_tokens=args.max_tokens, **settings)

    plain: list[list[int]] = []
    for nodes in (0, args.tree_nodes):
        committed = cycles = identical = 0
        with Session(*pair, n_ctx=2048, n_threads=args.threads, lookup=args.lookup, tree_nodes=nodes) as s:
            for i, p in enumerate(prompts):
                if nodes == 0:
                    s.reset()
                    plain.append(list(answer(s, p, speculative=False).tokens))
                s.reset()
                r = answer(s, p, block_size=16)
                drafted = r.stats.cycles - r.stats.plain_cycles
                committed += r.stats.n_accepted + drafted
                cycles += drafted
                identical += list(r.tokens) == plain[i]
        name = "linear block 16" if nodes == 0 else f"tree of {nodes} rows"
        if not cycles:
            print(f"{name}: no drafting cycle over {len(prompts)} prompts")
            continue
        print(f"{name}: τ {committed / cycles:.2f} over {cycles} cycles, {len(prompts)} prompts, "
              f"{identical} of {len(prompts)} replies identical to plain decoding", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--prompts", type=Path, help="train_prompts.jsonl, whose held-out split is used "
                   "(default: the built-in benchmark suite, also held out from training)")
    c.add_argument("--n-gpu-layers", type=int, default=0)
    c.add_argument("--per-category", type=int, default=8)
    c.add_argument("--skip", type=int, default=8, help="held-out prompts per category to pass over (the training's evaluation set)")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--max-prompt", type=int, default=1024)
    c.add_argument("--k", type=int, default=8, help="candidates kept per slot")
    c.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("replay")
    r.add_argument("drafts", type=Path)
    r.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    r.add_argument("--k", type=int, default=8)
    j = sub.add_parser("project")
    j.add_argument("drafts", type=Path)
    j.add_argument("--curve", type=Path, required=True, help="JSON: label, source, seconds {rows: verify seconds}")
    j.add_argument("--draft-ratio", type=float, default=0.0, help="a drafter pass, in one-row target steps")
    j.add_argument("--k", type=int, default=8)
    lv = sub.add_parser("live")
    lv.add_argument("--prompts", type=Path, help="train_prompts.jsonl, whose held-out split is used "
                    "(default: the built-in benchmark suite's math, code and chat prompts)")
    lv.add_argument("--per-category", type=int, default=3)
    lv.add_argument("--skip", type=int, default=8)
    lv.add_argument("--max-tokens", type=int, default=128)
    lv.add_argument("--tree-nodes", type=int, default=16)
    lv.add_argument("--threads", type=int, default=1)
    lv.add_argument("--drafter", type=Path, help="a drafter GGUF for the embedded target (default: the shipped one)")
    lv.add_argument("--lookup", action="store_true", help="no drafter: lookup drafts alone")
    lv.add_argument("--text", action="append", help="a raw prompt (no chat template), instead of --prompts; repeatable")
    v = sub.add_parser("curve")
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--n-gpu-layers", type=int, default=0)
    v.add_argument("--threads", type=int, default=None)
    v.add_argument("--max-rows", type=int, default=64)
    v.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    {"collect": collect, "replay": replay, "project": project, "curve": curve, "live": live}[args.cmd](args)


if __name__ == "__main__":
    main()
