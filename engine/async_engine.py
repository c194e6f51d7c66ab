"""`AsyncEngine`: one `LLMEngine` shared by every HTTP request of the OpenAI server.

The engine steps in a worker thread; an asyncio lock keeps `add_request` and `step` apart, so new
requests join the running batch between two steps (their TTFT counts from their arrival, the wait for
the running step included). Tokenization (and chat templating) runs in a
second small pool, so a huge prompt never blocks the event loop or the running streams.

Faults: a request the engine gives up on (its output carries `error`) raises `RequestFailed` in its
own generator only; a step that raises anyway fails every request in the engine, and the loop goes
on serving. On shutdown, `drain` lets in-flight requests finish for a grace period, then fails the
rest with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.engine.errors import RequestFailed
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.outputs import RequestOutput
from kvstore.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One HTTP request keeps at most this many of its prompts in the engine, so a 2,000-prompt
        # request cannot queue ahead of everything that arrives after it. Twice the batch: a full
        # batch running and the next one waiting, so the request alone still fills every step.
        self.admission_window = 2 * engine.args.max_num_seqs
        self.draining = False
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: set[str] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._tokenizer_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenizer")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work of one request (tokenizing, templating, parsing) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; give the in-flight ones `timeout` seconds, then fail them (503)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._queues:
            logger.warning("shutdown: aborting %d requests still in flight", len(self._queues))
        for rid, q in list(self._queues.items()):
            q.put_nowait(RequestFailed("the server is shutting down", status=503))
            self._aborts.add(rid)
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A step may still be running in the worker thread: let it end before touching the engine.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._executor.shutdown, True)
        await loop.run_in_executor(None, self._tokenizer_pool.shutdown, True)
        for q in list(self._queues.values()):
            q.put_nowait(RequestFailed("the server is shutting down", status=503))
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                self._abort(rid)
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._lock:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # the engine could not pin it on a request: fail them all, keep serving
                logger.exception("engine step failed")
                for rid in list(self.engine.requests):
                    self._abort(rid)
                for q in self._queues.values():
                    q.put_nowait(RequestFailed(f"the engine step failed: {e!r}"))
                continue
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out if out.error is None else RequestFailed(out.error))

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # never let one abort stop the loop that serves everyone
            logger.exception("aborting %s failed", request_id)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per new token, the last one finished. Raises InvalidRequest at once
        (before the first yield) for a bad prompt or parameters, RequestFailed when the engine gives
        up on the request."""
        if self.draining:
            raise RequestFailed("the server is shutting down", status=503)
        q: asyncio.Queue = asyncio.Queue()
        arrived = time.monotonic()  # TTFT counts the wait for a running step to end, as vLLM's does
        async with self._lock:
            self.engine.add_request(prompt_token_ids, params, request_id, arrival_time=arrived)
            self._queues[request_id] = q
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the client went away: free its blocks
                self._aborts.add(request_id)
                self._wake.set()
