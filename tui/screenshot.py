"""Write docs/dflash-chat.svg: the real app, a real reply and its plain-decoding compare run, saved with
App.save_screenshot.

`python -m dflash_gguf.tui.screenshot OUT.svg [--drafter D.gguf]` — regenerates the README picture
from an actual run rather than a mock-up.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from textual.widgets import Collapsible

from dflash_gguf.tui.app import ChatApp
from dflash_gguf.config import GenerationConfig
from dflash_gguf.tui.options import ChatOptions
from dflash_gguf.tui.widgets import AssistantMessage

PROMPT = "Give three short tips for writing clear code, as a list."
SIZE = (120, 40)
WAIT_S = 300.0


async def capture(app: ChatApp, out: Path, prompt: str) -> None:
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + WAIT_S

        async def until(condition) -> None:
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError("the app did not finish the reply in time")
                await pilot.pause(0.05)

        app.query_one("#prompt").focus()
        await pilot.press(*prompt)
        for key in ("enter", "ctrl+g"):  # the reply, then the same prompt decoded plainly
            n_replies = len(app.query(AssistantMessage))
            await pilot.press(key)
            await until(lambda: len(app.query(AssistantMessage)) > n_replies and not app.busy)
        # show the first reply's tokens in their provenance colours under its Markdown
        app.query(AssistantMessage).first().query_one(Collapsible).collapsed = False
        app.query_one("#prompt").cursor_blink = False
        await pilot.pause(0.3)
        tmp = out.with_name(out.name + ".tmp")
        app.save_screenshot(tmp.name, path=str(tmp.parent))
        tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_gguf.tui.screenshot")
    parser.add_argument("out", type=Path)
    parser.add_argument("--drafter", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--n-threads", type=int, default=2)
    args = parser.parse_args()
    from dflash_gguf.session import Session

    options = ChatOptions(generation=GenerationConfig(max_tokens=args.max_tokens, block_size=args.block_size))
    with Session(None, args.drafter, n_ctx=2048, n_threads=args.n_threads) as session:
        asyncio.run(capture(ChatApp(session, options), args.out, PROMPT))
    print(args.out)


if __name__ == "__main__":
    main()
