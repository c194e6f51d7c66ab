"""Compiling constraints with xgrammar, once: an LRU of compiled grammars keyed by the tokenizer and
the constraint, shared by every engine of the process that has the same tokenizer.

xgrammar's own compiler cache is off: this one is the only cache, it is bounded in bytes and counts
its hits. A constraint costs only its own request: every compile runs in a child process of its own
(`compile_worker`), with nothing to queue behind, and one that runs past `timeout_s` (a regex whose
automaton explodes, a schema of many long strings: minutes of CPU) is killed there and is a 400.
Failures are remembered (up to 256), so a resent bad or slow constraint costs nothing the second
time.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import xgrammar as xgr
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.structured_output import compile_worker
from kvstore.engine.structured_output.compile_worker import (
    JSON_MAX_WHITESPACE,
    CompileTimeout,
    compile_constraint,
    invalid,
)
from kvstore.engine.structured_output.params import StructuredOutputsParams

__all__ = ["JSON_MAX_WHITESPACE", "CacheStats", "GrammarCache", "grammar_cache_for"]
logger = logging.getLogger(__name__)
Key = tuple[str, str, bool]
_MAX_ERRORS = 256


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # summed over misses
    bytes: int = 0
    entries: int = 0


class GrammarCache:
    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        fingerprint: str,
        limit_bytes: int = 256 * 2**20,
        timeout_s: float = 30.0,
        isolate: bool = True,
    ) -> None:
        """`isolate=False` compiles in threads of this process instead (one past its deadline then
        finishes in the background)."""
        self.tokenizer_info = tokenizer_info
        self.fingerprint = fingerprint
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self.isolate = isolate
        self._service = compile_worker.CompileService(tokenizer_info) if self.isolate else None
        self._compiler: xgr.GrammarCompiler | None = None  # in-process compiles only
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[Key, Future] = {}
        self._errors: OrderedDict[Key, InvalidRequest] = OrderedDict()
        self.stats = CacheStats()
        if self._service is not None:
            self._service.start()
            weakref.finalize(self, self._service.close)  # a dropped cache leaves no helper behind

    def close(self) -> None:
        """Stop the compile helper process (a later compile starts it again)."""
        if self._service is not None:
            self._service.close()

    def get(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar for `params`; InvalidRequest when it cannot be compiled in time."""
        future = self.future(params)
        try:  # an isolated compile ends by its deadline; only an in-process one can outlive it
            return future.result(timeout=None if self.isolate else self.timeout_s)
        except TimeoutError:
            raise self._timeout(params) from None

    def cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key in self._entries

    def future(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compile of `params` as a future (done when cached), for callers that wait without
        holding a thread (the server awaits it). Concurrent requests for one new constraint share it."""
        key = params.key
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                done: Future = Future()
                done.set_result(compiled)
                return done
            error = self._errors.get(key)
            if error is not None:
                failed: Future = Future()
                failed.set_exception(InvalidRequest(str(error)))
                return failed
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                future.set_running_or_notify_cancel()  # one waiter going away cannot cancel the others' compile
                threading.Thread(
                    target=self._work, args=(key, params, future), name="grammar-compile", daemon=True
                ).start()  # daemon: an in-process compile abandoned at its deadline must not hold up exit
            return future

    def _timeout(self, params: StructuredOutputsParams) -> InvalidRequest:
        return InvalidRequest(
            f"the {params.kind.value} constraint did not compile within {self.timeout_s:g} s; simplify it"
        )

    def _work(self, key: Key, params: StructuredOutputsParams, future: Future) -> None:
        start = time.perf_counter()
        try:
            compiled = self._compile(params)
        except (InvalidRequest, CompileTimeout) as e:
            error = self._timeout(params) if isinstance(e, CompileTimeout) else e
            with self._lock:
                self._pending.pop(key, None)
                self._errors[key] = error  # a resent bad or slow constraint costs nothing the second time
                while len(self._errors) > _MAX_ERRORS:
                    self._errors.popitem(last=False)
            future.set_exception(error)
            return
        except Exception as e:  # handed to the waiting requests
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(e)
            return
        elapsed = time.perf_counter() - start
        size = compiled.memory_size_bytes
        with self._lock:
            self._pending.pop(key, None)
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self._entries[key] = compiled
            self.stats.bytes += size
            while self.stats.bytes > self.limit_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self.stats.bytes -= old.memory_size_bytes
            self.stats.entries = len(self._entries)
        future.set_result(compiled)
        logger.debug("compiled a %s constraint in %.1f ms (%d bytes)", params.kind.value, elapsed * 1e3, size)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._service is not None:
            return self._service.compile(params, self.timeout_s)
        with self._lock:
            if self._compiler is None:  # one xgrammar thread: more contend with the engine's step
                self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        try:
            return compile_constraint(self._compiler, params)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
            raise invalid(params, e) from None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._errors.clear()
            self.stats = CacheStats()


_CACHES: dict[str, GrammarCache] = {}
_CACHES_LOCK = threading.Lock()


def grammar_cache_for(tokenizer_info: xgr.TokenizerInfo, fingerprint: str) -> GrammarCache:
    """The process's cache for this tokenizer (engines with the same tokenizer share compiles)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(fingerprint)
        if cache is None:
            cache = _CACHES[fingerprint] = GrammarCache(tokenizer_info, fingerprint)
        return cache
