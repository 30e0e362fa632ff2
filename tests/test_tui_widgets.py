"""dflash-chat's token view on its own: long replies are drawn in bounded chunks, text kept exactly."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from dflash_gguf.tui.provenance import Provenance
from dflash_gguf.tui.widgets import CHUNK_CHARS, TokenChunk, TokenStream


class StreamApp(App[None]):
    def compose(self) -> ComposeResult:
        yield TokenStream()


def test_a_long_reply_is_split_into_bounded_chunks_at_newlines() -> None:
    # 600 lines of 40 characters, streamed a few tokens per cycle as the chat does
    line = ["word "] * 7 + ["end.\n"]
    pieces = [(text, Provenance.BONUS if i % 3 == 0 else Provenance.DRAFT) for i, text in enumerate(line * 600)]
    line_length = len("".join(line))
    expected = "".join(text for text, _ in pieces)

    async def scenario() -> None:
        app = StreamApp()
        async with app.run_test() as pilot:
            stream = app.query_one(TokenStream)
            for start in range(0, len(pieces), 5):
                stream.append(pieces[start : start + 5])
            await pilot.pause()
            chunks = list(stream.query(TokenChunk))
            assert stream.text == expected
            assert len(chunks) >= len(expected) // (CHUNK_CHARS + line_length)
            # a chunk closes at the first newline after CHUNK_CHARS: no chunk outgrows that by a line
            assert max(chunk.length for chunk in chunks) < CHUNK_CHARS + line_length
            # provenance survives the split
            kinds = {p for chunk in chunks for _, p in chunk.pieces}
            assert kinds == {Provenance.DRAFT, Provenance.BONUS}

    asyncio.run(scenario())


def test_text_without_newlines_stays_in_one_chunk() -> None:
    async def scenario() -> None:
        app = StreamApp()
        async with app.run_test() as pilot:
            stream = app.query_one(TokenStream)
            stream.append([("x" * 100, Provenance.PLAIN)] * 30)
            await pilot.pause()
            assert len(stream.query(TokenChunk)) == 1
            assert stream.text == "x" * 3000

    asyncio.run(scenario())
