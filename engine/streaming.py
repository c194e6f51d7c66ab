"""Server-sent events for the OpenAI server: text deltas and one stream's life, errors included.

Until the first token the stream has not started, so an error there is an ordinary JSON response.
After it, an error is an SSE `error` event (`{"error": {...}}`, which the `openai` client raises as
`APIError`) followed by `[DONE]`: never a second HTTP response written into the open stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from aiohttp import web

from engine.errors import error_body
from engine.outputs import RequestOutput

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


class SSEStream:
    """`head` payloads, then `render(out, delta)` per output (None: nothing to send), then
    `usage(last_out)` when given, then `[DONE]`."""

    def __init__(
        self,
        request: web.Request,
        delta: Delta,
        render: Callable[[RequestOutput, str], dict | None],
        usage: Callable[[RequestOutput], dict] | None = None,
        head: list[dict] | None = None,
    ) -> None:
        self.request = request
        self.delta = delta
        self.render = render
        self.usage = usage
        self.head = head or []
        self.resp: web.StreamResponse | None = None

    async def _send(self, payload: dict | str, event: str | None = None) -> None:
        assert self.resp is not None
        data = payload if isinstance(payload, str) else json.dumps(payload)
        prefix = f"event: {event}\n" if event else ""
        await self.resp.write(f"{prefix}data: {data}\n\n".encode())

    async def run(self, gen: AsyncIterator[RequestOutput]) -> web.StreamResponse:
        async with aclosing(gen):
            out = await anext(gen)  # a bad request or an early failure raises here, before the stream
            self.resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.resp.prepare(self.request)
            self.request[STREAM_KEY] = self.resp
            try:
                for payload in self.head:
                    await self._send(payload)
                while True:
                    payload = self.render(out, self.delta(out))
                    if payload is not None:
                        await self._send(payload)
                    if out.finished:
                        break
                    out = await anext(gen)
                if self.usage is not None:
                    await self._send(self.usage(out))
            except ConnectionError:
                raise  # the client is gone: nothing more to write; aclosing aborts the request
            except Exception as e:
                logger.warning("stream %s failed after it started: %r", self.request.path, e)
                status = getattr(e, "status", 500)
                await self._send(error_body(status, str(e) or repr(e)), event="error")
            await self._send("[DONE]")
            await self.resp.write_eof()
            return self.resp
