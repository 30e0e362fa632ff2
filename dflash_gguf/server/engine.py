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

from ..batching import SequenceTarget
from ..chat import ChatTemplate, Turn, prepare_turn
from ..chat.reasoning import Thinking
from ..chat.reply import ReplyReader
from ..chat.tool_calls import ToolError
from ..config import GenerationConfig, SettingError
from ..constraints import Constraint, ConstraintError
from ..session import Session
from ..stats import GenerationStats
from ..steps import Step, TokenLogprob
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
    turn: Turn | None = None  # a chat request's prepared turn (None for a raw prompt)

    @property
    def thinking(self) -> Thinking | None:
        return None if self.turn is None else self.turn.thinking

    def reader(self) -> ReplyReader | None:
        """A reader of this reply's thought and calls; None when the reply is all answer text (the thought
        stays in it where the request asked for reasoning_format "none")."""
        return None if self.turn is None else self.turn.reader()


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
    """The slots and what every route needs of the model: its vocabulary, chat template and context size, so
    that no route reaches into a slot's Session."""

    def __init__(self, sessions: list[Session], config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        metrics.prompt_cache = sessions[0].prompt_cache  # shared by every slot (None: no prompt cache)
        target = sessions[0].target
        metrics.shared_context = target.shared if isinstance(target, SequenceTarget) else None  # the slots' one context
        self.pool = SlotPool(sessions, config.max_queue)
        self.runs: set[Run] = set()
        first = sessions[0]
        self.vocab = first.target.vocab  # read-only on the loop: tokenizing, token bytes, llguidance's tokenizer
        self.token_bytes: Callable[..., bytes] = first.target.vocab.token_bytes
        self.template: ChatTemplate = first.chat_template
        self.placement = first.placement
        self.n_ctx: int = first.target.n_ctx_seq
        self.n_ctx_train: int = first.target.n_ctx_train

    @property
    def tool_family(self) -> Any:
        return self.template.family  # None: tools get a 400

    def prepare(self, job: Job) -> Prepared:
        """Render and tokenize on the loop (the vocabulary is read-only), check the context and the arguments;
        a refusal names the request's own field (its protocol's errors.Terms)."""
        with job.terms.speaking(job.origins):
            return self._prepare(job)

    def _prepare(self, job: Job) -> Prepared:
        t0 = time.perf_counter()
        settings = {"max_tokens": self.config.max_tokens, **job.gen, "stop": job.user_stops}
        turn = self._turn(job, settings) if job.messages is not None else None
        tokens = self._raw_tokens(job) if turn is None else turn.tokens
        if not tokens:
            raise APIError(400, "the prompt is empty: nothing to condition on", param="prompt", code="invalid_value")
        if len(tokens) >= self.n_ctx:
            raise APIError(400, f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} and needs room "
                           "for at least one more", param="messages" if job.messages is not None else "prompt",
                           code="context_length_exceeded")
        room = self.n_ctx - len(tokens)  # what the context has left for the reply
        try:
            config = turn.config if turn is not None else self._config(settings)
            wanted = config.max_tokens
            config = GenerationConfig.build(config, max_tokens=room if wanted is None else min(wanted, room))
        except SettingError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from None
        self._probe_constraint(config, job)
        return Prepared(job, tokens, config, lambda s: s.stream_tokens(tokens, config), t0, turn)

    def prompt(self, job: Job) -> list[int]:
        """The job's prompt tokens (count_tokens / input_tokens): its messages rendered as prepare() renders them."""
        with job.terms.speaking(job.origins):
            return self._turn(job, {}).tokens if job.messages is not None else self._raw_tokens(job)

    def _turn(self, job: Job, settings: dict[str, Any]) -> Turn:
        request = job.chat_request(settings)
        try:
            return prepare_turn(self.template, self.vocab, request, self.config.generation)
        except ToolError as e:
            raise _tool_error(e, self.tool_family is None and e.field == "tools") from None
        except SettingError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from None
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages",
                           code="invalid_messages") from None

    def _raw_tokens(self, job: Job) -> list[int]:
        return self.vocab.tokenize(job.prompt, add_special=True, parse_special=True)

    def _config(self, settings: dict[str, Any]) -> GenerationConfig:
        config = GenerationConfig.build(self.config.generation, **settings)
        config.sampling.check_vocab(self.vocab.n_vocab)
        return config

    def _probe_constraint(self, config: GenerationConfig, job: Job) -> None:
        """A grammar or schema that fails at its first token (no finite reply: unbounded recursion) refused
        now, naming the request's field, rather than during the generation in the grammar engine's words."""
        spec = config.constraint
        if spec is None:
            return
        try:
            Constraint(self.vocab.constraint_tokenizer(), spec, self.vocab.n_vocab).probe()
        except ConstraintError as e:
            param = job.constraint_field or "tools"
            why = str(e).split(": ", 1)[-1].splitlines()[0]
            raise APIError(400, f"{param}: the grammar admits no reply that can be generated (it recurses without "
                           f"end, or refuses every first token): {why}", param=param, code="invalid_value") from None

    async def start(self, prepared: Prepared, request: Request) -> "Run":
        """Admit the request (429 when the queue is full, 503 while shutting down) and return its Run at once:
        a Run whose slot is busy waits for it inside events(), so a stream's headers and first events (and its
        keep-alives) go out while it is queued, not after the wait."""
        try:
            ticket = self.pool.admit(prepared.tokens)
        except APIError as e:
            self.metrics.rejected["queue_full" if e.status == 429 else "shutting_down"] += 1
            raise
        run = Run(self, prepared, ticket, request)
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
                await asyncio.wait_for(run.done.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True


class Run:
    """One request's generation on one slot: queued until its ticket brings a slot, then generating."""

    def __init__(self, engine: Engine, prepared: Prepared, ticket: asyncio.Future[Slot], request: Request) -> None:
        self.engine, self.prepared, self._ticket = engine, prepared, ticket
        self.slot: Slot | None = None
        self.generation: Generation | None = None
        self.queue_s = 0.0
        self.keepalive_s = engine.config.keepalive_s
        self._finished = False
        self._withdrawn = False
        self._refusal: APIError | None = None  # why it never got a slot (the server is shutting down)
        self._placed = asyncio.Event()  # the generation has started, or never will
        self.done = asyncio.Event()  # the generation has ended and released its slot, or never started
        self.generation_done_callbacks: list[Callable[[], Any]] = []
        self._watch = asyncio.ensure_future(self._watch_disconnect(request))
        asyncio.ensure_future(self._live())

    def cancel(self) -> None:
        if self.generation is None:  # still queued: its place (or the slot just handed to it) goes to the next
            if not self._placed.is_set() and not self._withdrawn and self.engine.pool.withdraw(self._ticket):
                self._withdrawn = True
                self.engine.metrics.rejected["client_gone"] += 1
            return
        if not self._finished and not self.generation.cancelled:
            self.generation.cancel()
            self.engine.metrics.cancelled += 1

    async def _live(self) -> None:
        """Wait for the slot, run the generation on it, then tell whoever waits for the end."""
        try:
            slot = await asyncio.shield(self._ticket)
            if not self._withdrawn:  # (a slot handed over just as the client left was passed on by withdraw)
                self.slot = slot
                slot.prompt = self.prepared.tokens  # what the slot will hold: a retry of this request is routed to it
                self.queue_s = time.perf_counter() - self.prepared.t0
                self.engine.metrics.queue_seconds += self.queue_s
                self.generation = Generation(self.engine.pool, slot, self.prepared.start).start()
        except APIError as e:  # the queue was closed: the server is shutting down
            self._refusal = e
            self.engine.metrics.rejected["shutting_down"] += 1
        except asyncio.CancelledError:  # withdrawn while queued
            pass
        self._placed.set()
        if self.generation is not None:
            await self.generation.done.wait()
        self._watch.cancel()
        for callback in self.generation_done_callbacks:
            callback()
        self.engine.runs.discard(self)
        self.done.set()

    async def _watch_disconnect(self, request: Request) -> None:
        try:
            while not self.done.is_set():
                if await request.is_disconnected():
                    self.cancel()
                    return
                await asyncio.sleep(DISCONNECT_POLL_S)
        except Exception:
            return

    async def events(self) -> AsyncIterator[Step | Finished]:
        """The Steps as they commit, then one Finished; raises APIError if the Session failed."""
        blocks = BlockSizes()
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        first = True
        finish: str | None = None
        stop: str | None = None  # the stop string that ended the reply (the turn's reader found it)
        try:
            await self._placed.wait()  # queued: the stream's keep-alives go out meanwhile
            generation, slot = self.generation, self.slot
            if generation is None or slot is None:
                if self._refusal is not None:
                    raise self._refusal
                return
            async for event in generation.events():
                if isinstance(event, Step):
                    blocks.add(event)
                    text.append(event.text)
                    tokens += event.tokens
                    logprobs += event.logprobs
                    finish = event.finish_reason or finish
                    stop = event.stop_sequence or stop
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
                self.engine.metrics.count_generation(stats, time.perf_counter() - generation.started)
                finish = finish or "stop"
                yield Finished(
                    text="".join(text), tokens=tokens, finish_reason=finish,
                    stop_sequence=stop if stop in self.prepared.job.user_stops else None,
                    n_prompt=len(self.prepared.tokens), stats=stats, timings=llama_timings(stats),
                    dflash=dflash_figures(stats, blocks, slot=slot.id, queue_ms=self.queue_s * 1000.0),
                    logprobs=tuple(logprobs),
                    context_full=finish == "length" and len(self.prepared.tokens) + len(tokens) >= self.engine.n_ctx,
                )
        finally:
            self.cancel()  # the consumer stopped early (a closed stream): stop at the next cycle


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
