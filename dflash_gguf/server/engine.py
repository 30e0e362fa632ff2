"""From a Job to a running generation on a slot: prompt tokens, the context check, the queue, the thread.

The routes only format: they get Steps and one Finished from Run.events(). A Run is cancelled when
its consumer stops reading (a closed stream) or when the client disconnects (watched while queued and
while generating), and the cancellation reaches the Session at its next cycle.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

import jinja2
from starlette.requests import Request

from ..config import GenerationConfig, SettingError
from ..reasoning import Thinking, thinking_for
from ..reply import ReplyReader
from ..session import Session
from ..stats import GenerationStats
from ..steps import Step, TokenLogprob
from ..tool_calls import ToolError, ToolPlan, detect_family
from .config import ServerConfig
from .errors import APIError
from .metrics import Metrics
from .schemas import Job
from .slots import Slot, SlotPool
from .timings import BlockSizes, dflash_figures, llama_timings
from .worker import Generation

DISCONNECT_POLL_S = 0.25


@dataclass
class Prepared:
    job: Job
    tokens: list[int]
    config: GenerationConfig
    start: Callable[[Session], Iterator[Step]]
    t0: float
    tools: ToolPlan | None = None  # the request's tools: the routes read the calls out of the reply with it
    thinking: Thinking | None = None  # how the reply reasons, for a thinking template

    def reader(self) -> ReplyReader | None:
        """The reader of this reply's thought and calls; None when the reply is all answer text (the thought
        stays in it where the request asked for reasoning_format "none")."""
        thinking = self.thinking if self.job.split_thought else None
        if thinking is None and (self.tools is None or not self.tools.parses):
            return None
        return ReplyReader(thinking, self.tools)


@dataclass
class Finished:
    """The end of a generation, with every figure the responses carry."""

    text: str
    tokens: list[int]
    finish_reason: str
    stop_sequence: str | None
    n_prompt: int
    stats: GenerationStats
    timings: dict[str, Any]
    dflash: dict[str, Any]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for logprobs
    context_full: bool = False  # the reply ended because the context had no room left (finish_reason "length")


class Engine:
    def __init__(self, sessions: list[Session], config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        metrics.prompt_cache = sessions[0].prompt_cache  # shared by every slot (None: no prompt cache)
        self.pool = SlotPool(sessions, config.max_queue)
        self.runs: set[Run] = set()
        self.tool_family = detect_family(sessions[0].target.chat_template())  # None: tools get a 400

    @property
    def n_ctx(self) -> int:
        return self.pool.slots[0].session.target.n_ctx_seq

    @property
    def n_ctx_train(self) -> int:
        return self.pool.slots[0].session.target.n_ctx_train

    def prepare(self, job: Job) -> Prepared:
        """Render and tokenize on the loop (the vocabulary is read-only), check the context and the arguments."""
        t0 = time.perf_counter()
        session = self.pool.slots[0].session
        target = session.target
        tokens, template_stops, plan, thinking = self.prompt(job)
        if len(tokens) >= self.n_ctx:
            raise APIError(400, f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} and needs room "
                           "for at least one more", param="messages" if job.messages is not None else "prompt",
                           code="context_length_exceeded")
        room = self.n_ctx - len(tokens)  # what the context has left for the reply
        gen = {"max_tokens": self.config.max_tokens, **job.gen}
        gen["max_tokens"] = room if gen["max_tokens"] is None else min(gen["max_tokens"], room)
        try:  # checked here, before a slot is taken; the request's own field names are the config's
            config = GenerationConfig.build(self.config.generation, **gen, stop=job.user_stops)
            config.sampling.check_vocab(target.n_vocab)
        except SettingError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from None
        try:
            config = session.chat_config(config, plan, thinking).with_stops(template_stops)
        except ToolError as e:
            raise _tool_error(e, False) from None
        return Prepared(job, tokens, config, lambda s: s.stream_tokens(tokens, config), t0, plan, thinking)

    def prompt(self, job: Job) -> tuple[list[int], list[str], ToolPlan | None, Thinking | None]:
        """The job's prompt tokens (its messages rendered with the tools and template variables it declares),
        the template's stop strings, the checked tools and how the reply reasons (None: no thought to split)."""
        session = self.pool.slots[0].session
        target = session.target
        template_stops: list[str] = []
        plan = thinking = None
        if job.messages is not None:
            try:
                plan = session.tool_plan(job.tools, job.tool_choice, job.parallel_tool_calls)
                text, template_stops = session.render_chat(job.messages, tools=None if plan is None else plan.tools,
                                                           chat_template_kwargs=job.chat_template_kwargs)
            except ToolError as e:
                raise _tool_error(e, self.tool_family is None and e.field == "tools") from None
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                raise APIError(400, f"the chat template refused the messages: {e}", param="messages",
                               code="invalid_messages") from None
            tokens = target.tokenize(text, add_special=False, parse_special=True)
            thinking = thinking_for(target.chat_template(), text)
        else:
            tokens = target.tokenize(job.prompt, add_special=True, parse_special=True)
        if not tokens:
            raise APIError(400, "the prompt is empty: nothing to condition on", param="prompt", code="invalid_value")
        return tokens, template_stops, plan, thinking

    async def start(self, prepared: Prepared, request: Request) -> "Run":
        """Wait for a slot (429 when the queue is full), then start the generation in its thread."""
        acquire = asyncio.ensure_future(self.pool.acquire(prepared.tokens))
        try:
            while True:
                done, _ = await asyncio.wait({acquire}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    acquire.cancel()
                    self.metrics.rejected["client_gone"] += 1
                    raise APIError(400, "the client disconnected while queued", code="client_disconnected")
            slot = acquire.result()
        except APIError as e:
            if e.status in (429, 503):
                self.metrics.rejected["queue_full" if e.status == 429 else "shutting_down"] += 1
            raise
        except BaseException:
            acquire.cancel()
            raise
        queue_s = time.perf_counter() - prepared.t0
        self.metrics.queue_seconds += queue_s
        run = Run(self, prepared, slot, request, queue_s)
        self.runs.add(run)
        return run

    def begin_shutdown(self) -> None:
        """The server is stopping: queued and new requests get 503, streams end at their next cycle.

        Non-streamed generations run on (uvicorn waits for them up to its graceful timeout; the app's
        lifespan then cancels whatever is left)."""
        self.pool.close()
        for run in list(self.runs):
            if run.prepared.job.stream:
                run.cancel()

    def cancel_all(self) -> None:
        for run in list(self.runs):
            run.cancel()

    async def drain(self, timeout: float) -> bool:
        """Wait for every running generation to end; True when all did."""
        deadline = time.monotonic() + timeout
        for run in list(self.runs):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(run.generation.done.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True


class Run:
    """One generation on one slot."""

    def __init__(self, engine: Engine, prepared: Prepared, slot: Slot, request: Request, queue_s: float) -> None:
        self.engine, self.prepared, self.slot, self.queue_s = engine, prepared, slot, queue_s
        self.generation = Generation(engine.pool, slot, prepared.start).start()
        self._finished = False
        self.generation_done_callbacks: list[Callable[[], Any]] = []
        self._watch = asyncio.ensure_future(self._watch_disconnect(request))
        asyncio.ensure_future(self._forget_when_done())

    def cancel(self) -> None:
        if not self._finished and not self.generation.cancelled:
            self.generation.cancel()
            self.engine.metrics.cancelled += 1

    async def _watch_disconnect(self, request: Request) -> None:
        try:
            while not self.generation.done.is_set():
                if await request.is_disconnected():
                    self.cancel()
                    return
                await asyncio.sleep(DISCONNECT_POLL_S)
        except Exception:
            return

    async def _forget_when_done(self) -> None:
        await self.generation.done.wait()
        self._watch.cancel()
        for callback in self.generation_done_callbacks:
            callback()
        self.engine.runs.discard(self)

    async def events(self) -> AsyncIterator[Step | Finished]:
        """The Steps as they commit, then one Finished; raises APIError if the Session failed."""
        blocks = BlockSizes()
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        first = True
        finish: str | None = None
        try:
            async for event in self.generation.events():
                if isinstance(event, Step):
                    blocks.add(event)
                    text.append(event.text)
                    tokens += event.tokens
                    logprobs += event.logprobs
                    finish = event.finish_reason or finish
                    if first and (event.tokens or event.finish_reason):
                        first = False
                        self.engine.metrics.count_ttft(time.perf_counter() - self.prepared.t0)
                    yield event
                    continue
                if event.error is not None:
                    self._finished = True
                    raise _api_error(event.error)
                if event.cancelled or event.stats is None:
                    return
                self._finished = True
                stats = event.stats
                self.engine.metrics.count_generation(stats, time.perf_counter() - self.generation.started)
                finish = finish or "stop"
                yield Finished(
                    text="".join(text), tokens=tokens, finish_reason=finish,
                    stop_sequence=self._stop_sequence(tokens, finish),
                    n_prompt=len(self.prepared.tokens), stats=stats, timings=llama_timings(stats),
                    dflash=dflash_figures(stats, blocks, slot=self.slot.id, queue_ms=self.queue_s * 1000.0),
                    logprobs=tuple(logprobs),
                    context_full=finish == "length" and len(self.prepared.tokens) + len(tokens) >= self.engine.n_ctx,
                )
        finally:
            self.cancel()  # the consumer stopped early (a closed stream): stop at the next cycle

    def _stop_sequence(self, tokens: list[int], finish: str) -> str | None:
        """Which of the caller's stop strings ended the reply (the stream hides it), if one did."""
        stops = self.prepared.job.user_stops
        if finish != "stop" or not stops:
            return None
        target = self.slot.session.target
        full = b"".join(target.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")
        found = [(full.find(s), s) for s in stops if s in full]
        return min(found)[1] if found else None


def _tool_error(e: ToolError, unsupported: bool) -> APIError:
    """A ToolError as a 400 naming the request's field (messages.1.tool_call_id, as the other fields are named)."""
    param = re.sub(r"\[(\d+)\]", r".\1", e.field)
    return APIError(400, f"{param}: {e.problem}", param=param, code="tools_unsupported" if unsupported else "invalid_value")


def _api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, code="invalid_value")
    return APIError(500, f"the generation failed ({type(e).__name__})", code="generation_failed")
