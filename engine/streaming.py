"""Server-sent events for the OpenAI server: text deltas and one stream's life, errors included.

Until the first token the stream has not started, so an error there is an ordinary JSON response.
After it, an error is an SSE `error` event (`{"error": {...}}`, which the `openai` client raises as
`APIError`) followed by `[DONE]`: never a second HTTP response written into the open stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from aiohttp import web
from kvstore.engine.errors import error_body
from kvstore.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
STREAM_KEY = web.RequestKey("sse_stream", web.StreamResponse)


class Delta:
    """Turns cumulative text into stream deltas, holding back what a stop string may still cut off
    and a trailing incomplete UTF-8 character."""

    def __init__(self, stop: list[str]) -> None:
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def __call__(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        end = len(text) if out.finished else max(self.sent, len(text) - self.hold)
        if not out.finished and text[self.sent : end].endswith("\ufffd"):
            end -= 1
        delta, self.sent = text[self.sent : end], max(self.sent, end)
        return delta


async def merged(
    gens: list[AsyncIterator[RequestOutput]], window: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests' streams as they come, at most `window` of the
    requests in the engine at a time. The first failure ends it with that error; closing it closes
    every stream (which aborts their requests)."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    admitted = asyncio.Semaphore(window)

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(gen), admitted:
                async for out in gen:
                    queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                running -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEStream:
    """`head` payloads, then `render(index, out, delta)` per output of each choice (None: nothing to
    send), then `usage(last outputs, by index)` when given, then `[DONE]`."""

    def __init__(
        self,
        request: web.Request,
        deltas: list[Delta],
        render: Callable[[int, RequestOutput, str], dict | None],
        usage: Callable[[list[RequestOutput]], dict] | None = None,
        head: list[dict] | None = None,
        window: int = 1,
    ) -> None:
        self.request = request
        self.deltas = deltas
        self.render = render
        self.usage = usage
        self.head = head or []
        self.window = window
        self.resp: web.StreamResponse | None = None

    async def _send(self, payload: dict | str, event: str | None = None) -> None:
        assert self.resp is not None
        data = payload if isinstance(payload, str) else json.dumps(payload)
        prefix = f"event: {event}\n" if event else ""
        await self.resp.write(f"{prefix}data: {data}\n\n".encode())

    async def run(self, gens: list[AsyncIterator[RequestOutput]]) -> web.StreamResponse:
        assert len(gens) == len(self.deltas)
        outs = merged(gens, self.window)
        async with aclosing(outs):
            i, out = await anext(outs)  # a bad request or an early failure raises here, before the stream
            self.resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.resp.prepare(self.request)
            self.request[STREAM_KEY] = self.resp
            last: dict[int, RequestOutput] = {}
            try:
                for payload in self.head:
                    await self._send(payload)
                while True:
                    last[i] = out
                    payload = self.render(i, out, self.deltas[i](out))
                    if payload is not None:
                        await self._send(payload)
                    if len(last) == len(gens) and all(o.finished for o in last.values()):
                        break
                    i, out = await anext(outs)
                if self.usage is not None:
                    await self._send(self.usage([last[k] for k in range(len(gens))]))
            except ConnectionError:
                raise  # the client is gone: nothing more to write; aclosing aborts the requests
            except Exception as e:
                logger.warning("stream %s failed after it started: %r", self.request.path, e)
                status = getattr(e, "status", 500)
                await self._send(error_body(status, str(e) or repr(e)), event="error")
            await self._send("[DONE]")
            await self.resp.write_eof()
            return self.resp
