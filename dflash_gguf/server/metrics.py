"""Prometheus text for GET /metrics: counters that only grow, gauges read at scrape time.

Written by hand (the format is a few lines of text) so the server needs no client library.
"""

from __future__ import annotations

from collections import Counter

from ..batching import SharedContext
from ..prompt_cache import PromptCache
from ..stats import GenerationStats

KNOWN_ROUTES = ("/", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                "/v1/responses", "/v1/responses/input_tokens", "/health", "/metrics")
STORED_RESPONSE_ROUTE = "/v1/responses/{response_id}"  # GET / DELETE of one stored response, counted as one route
# a prompt-cache lookup's result: the slot's live context held more of the prompt than any entry ("live"), an
# entry was restored from a tier, or nothing was reused
LOOKUP_RESULTS = ("live", "ram", "disk", "miss")


def route_of(path: str) -> str:
    """The route a path is counted under (ids folded into one label; unknown paths as "other")."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/responses/") and path.count("/") == 3:
        return STORED_RESPONSE_ROUTE
    return "other"


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status)
        self.rejected: Counter[str] = Counter()  # reason
        self.cancelled = 0
        self.generations = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.cycles = 0
        self.committed = 0.0  # sum of tau x cycles: tokens committed by decoding cycles
        self.drafted = 0
        self.accepted = 0
        self.generation_seconds = 0.0
        self.ttft_seconds = 0.0
        self.ttft_count = 0
        self.queue_seconds = 0.0
        self.prompt_cache: PromptCache | None = None  # the slots' shared cache: its sizes are read at scrape time
        self.shared_context: SharedContext | None = None  # the slots' one target context, where they share one
        self.cache_lookups: Counter[str] = Counter()  # "ram", "disk", "miss": finished generations' lookups
        self.cache_restored_tokens = 0
        self.cache_restore_seconds = 0.0
        self.cache_stores = 0

    def count_request(self, path: str, status: int) -> None:
        self.requests[(route_of(path), status)] += 1

    def count_generation(self, stats: GenerationStats, seconds: float) -> None:
        self.generations += 1
        self.prompt_tokens += stats.n_prompt_tokens
        self.cached_tokens += stats.n_cached_tokens
        self.completion_tokens += stats.n_tokens
        self.cycles += stats.cycles
        self.committed += stats.acceptance_length * stats.cycles
        self.drafted += stats.n_drafted
        self.accepted += stats.n_accepted
        self.generation_seconds += seconds
        event = stats.prompt_cache
        if event is not None:
            live = event.tier is None and stats.n_cached_tokens > 0  # the slot's own context was the hit
            self.cache_lookups[event.tier or ("live" if live else "miss")] += 1
            self.cache_restored_tokens += event.n_restored
            self.cache_restore_seconds += event.restore_ms / 1000.0
            self.cache_stores += event.stored

    def count_ttft(self, seconds: float) -> None:
        self.ttft_seconds += seconds
        self.ttft_count += 1

    def render(self, *, queue_depth: int, slots_busy: int, slots: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_num(value)}")

        metric("dflash_requests_total", "counter", "HTTP requests answered, by route and status code.",
               [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())]
               or [('{route="/v1/chat/completions",status="200"}', 0)])
        metric("dflash_requests_rejected_total", "counter", "Requests refused before generation, by reason.",
               [(f'{{reason="{r}"}}', n) for r, n in sorted(self.rejected.items())] or [('{reason="queue_full"}', 0)])
        metric("dflash_requests_cancelled_total", "counter", "Generations stopped early (client gone, shutdown).",
               [("", self.cancelled)])
        metric("dflash_generations_total", "counter", "Generations that ran to their end.", [("", self.generations)])
        metric("dflash_prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [("", self.prompt_tokens)])
        metric("dflash_prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's KV cache.",
               [("", self.cached_tokens)])
        metric("dflash_completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
        metric("dflash_cycles_total", "counter", "Decoding cycles (one target verification each).", [("", self.cycles)])
        metric("dflash_committed_tokens_total", "counter", "Tokens committed by decoding cycles (tau x cycles).",
               [("", self.committed)])
        metric("dflash_drafted_tokens_total", "counter", "Draft tokens proposed.", [("", self.drafted)])
        metric("dflash_accepted_tokens_total", "counter", "Draft tokens the target accepted.", [("", self.accepted)])
        metric("dflash_acceptance_length", "gauge", "tau over the server's life: committed tokens per cycle.",
               [("", self.committed / self.cycles if self.cycles else 0.0)])
        metric("dflash_generation_seconds_total", "counter", "Wall time of finished generations.",
               [("", self.generation_seconds)])
        metric("dflash_queue_seconds_total", "counter", "Time requests spent waiting for a slot.",
               [("", self.queue_seconds)])
        metric("dflash_time_to_first_token_seconds", "summary", "From request to its first token.",
               [("_sum", self.ttft_seconds), ("_count", self.ttft_count)])
        if self.prompt_cache is not None:
            self._render_prompt_cache(metric, self.prompt_cache)
        if self.shared_context is not None:
            c = self.shared_context
            metric("dflash_batches_total", "counter", "Target decodes of the slots' shared context.", [("", c.batches)])
            metric("dflash_batches_shared_total", "counter", "Those holding rows of two slots or more.",
                   [("", c.shared_batches)])
            metric("dflash_batch_rows_total", "counter", "Rows of those decodes.", [("", c.batched_rows)])
            metric("dflash_batch_seconds_total", "counter", "Time in those decodes.", [("", c.decode_s)])
        metric("dflash_queue_depth", "gauge", "Requests waiting for a slot.", [("", queue_depth)])
        metric("dflash_slots_busy", "gauge", "Slots generating now.", [("", slots_busy)])
        metric("dflash_slots", "gauge", "Slots (--parallel).", [("", slots)])
        return "\n".join(lines) + "\n"

    def _render_prompt_cache(self, metric, cache: PromptCache) -> None:
        metric("dflash_prompt_cache_lookups_total", "counter", "Prompt-cache lookups of finished generations, by result (live: the slot's own context held the most).",
               [(f'{{result="{r}"}}', self.cache_lookups[r]) for r in LOOKUP_RESULTS])
        metric("dflash_prompt_cache_restored_tokens_total", "counter", "Prompt tokens restored from the prompt cache.",
               [("", self.cache_restored_tokens)])
        metric("dflash_prompt_cache_restore_seconds_total", "counter", "Time spent finding and restoring entries.",
               [("", self.cache_restore_seconds)])
        metric("dflash_prompt_cache_stores_total", "counter", "Generations whose end state was stored.",
               [("", self.cache_stores)])
        metric("dflash_prompt_cache_bytes", "gauge", "Bytes held by each tier.",
               [('{tier="ram"}', cache.ram_used), ('{tier="disk"}', cache.disk_used)])
        metric("dflash_prompt_cache_budget_bytes", "gauge", "Each tier's budget.",
               [('{tier="ram"}', cache.ram_bytes), ('{tier="disk"}', cache.disk_bytes)])
        entries = cache.entries
        metric("dflash_prompt_cache_entries", "gauge", "Entries held by each tier.",
               [('{tier="ram"}', entries["ram"]), ('{tier="disk"}', entries["disk"])])
        metric("dflash_prompt_cache_evictions_total", "counter", "Entries evicted to stay in budget, by tier.",
               [(f'{{tier="{t}"}}', n) for t, n in sorted(cache.counters.evictions.items())])
        metric("dflash_prompt_cache_rejected_files_total", "counter",
               "Disk entries that failed their checks (corrupt, truncated, foreign): each a miss and a warning.",
               [("", cache.counters.rejected_files)])


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
