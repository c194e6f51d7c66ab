"""Compiling constraints with xgrammar, once: an LRU of compiled grammars keyed by the tokenizer and
the constraint, shared by every engine of the process that has the same tokenizer.

xgrammar's own compiler cache is off: this one is the only cache, it is bounded in bytes and counts
its hits. A compile runs in a worker thread with a deadline, so a pathological constraint (a regex
whose automaton explodes, a schema nested 5,000 deep: minutes of CPU) is a 400 after `timeout_s`,
never a stalled engine; the abandoned compile finishes in the background (at most two run at once).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import xgrammar as xgr

from engine.errors import InvalidRequest
from engine.structured_output.params import (
    StructuredOutputOptions,
    StructuredOutputsParams,
    choice_as_grammar,
)
from engine.structured_output.satisfiable import unproductive_root

logger = logging.getLogger(__name__)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
Key = tuple[str, str, bool]
_MAX_ERRORS = 256
# Whitespace characters allowed between two JSON tokens. xgrammar's default is unbounded, and small
# models fall into whitespace loops: greedy SmolLM2 wrote 150 newlines between a key and its value on
# one of the test schemas (vLLM has the same failure). 16 is pretty printing 7 levels deep at indent 2.
JSON_MAX_WHITESPACE = 16


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # summed over misses
    bytes: int = 0
    entries: int = 0


def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = params.kind
    if kind is StructuredOutputOptions.JSON_OBJECT:
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
    if kind is StructuredOutputOptions.REGEX:
        return compiler.compile_regex(params.regex)
    if kind is StructuredOutputOptions.CHOICE:
        return compiler.compile_grammar(choice_as_grammar(params.choice))
    if kind is StructuredOutputOptions.JSON:
        if params.disable_any_whitespace:  # as vLLM: no free whitespace and separators without spaces
            grammar = xgr.Grammar.from_json_schema(params.key[1], any_whitespace=False, separators=(",", ":"))
        else:
            grammar = xgr.Grammar.from_json_schema(
                params.key[1], any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
            )
    else:
        grammar = xgr.Grammar.from_ebnf(params.grammar)
    if (rule := unproductive_root(grammar)) is not None:  # it would compile, then fail mid-answer
        raise ValueError(
            f"no finite text satisfies it: rule {rule!r} never completes (it only recurses, with no "
            "base case: a $ref to itself or a $ref cycle, a rule defined by itself)"
        )
    return compiler.compile_grammar(grammar)


class GrammarCache:
    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        fingerprint: str,
        limit_bytes: int = 256 * 2**20,
        timeout_s: float = 30.0,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.fingerprint = fingerprint
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        # One xgrammar thread: on a small shared box more threads contend with the engine's step.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._slots = threading.BoundedSemaphore(2)  # compiles running at once
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[Key, Future] = {}
        self._errors: OrderedDict[Key, InvalidRequest] = OrderedDict()
        self.stats = CacheStats()

    def get(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar for `params`; InvalidRequest when it cannot be compiled in time."""
        key = params.key
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return compiled
            error = self._errors.get(key)
            if error is not None:
                raise InvalidRequest(str(error))
            future = self._pending.get(key)
            if future is None:  # concurrent requests for one new constraint share one compile
                future = self._pending[key] = self._submit(key, params)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise InvalidRequest(
                f"the {params.kind.value} constraint did not compile within {self.timeout_s:g} s; simplify it"
            ) from None

    def _submit(self, key: Key, params: StructuredOutputsParams) -> Future:
        """Compile in a daemon thread: one abandoned after its deadline must not hold up process exit."""
        future: Future = Future()

        def work() -> None:
            with self._slots:
                try:
                    future.set_result(self._compile_and_store(key, params))
                except Exception as e:  # handed to the waiting requests
                    with self._lock:
                        self._pending.pop(key, None)
                    future.set_exception(e)

        threading.Thread(target=work, name="grammar-compile", daemon=True).start()
        return future

    def _compile_and_store(self, key: Key, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = _compile(self._compiler, params)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
            message = _CPP_PREFIX.sub("", str(e).strip())
            error = InvalidRequest(f"the {params.kind.value} constraint cannot be compiled: {message}")
            with self._lock:
                self._pending.pop(key, None)
                self._errors[key] = error  # a resent bad constraint costs nothing the second time
                while len(self._errors) > _MAX_ERRORS:
                    self._errors.popitem(last=False)
            raise error from None
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
        logger.debug("compiled a %s constraint in %.1f ms (%d bytes)", params.kind.value, elapsed * 1e3, size)
        return compiled

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
