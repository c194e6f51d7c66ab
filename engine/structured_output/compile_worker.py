"""Each constraint compiled in a process of its own, so that its deadline really stops the work.

xgrammar cannot interrupt a compile, and a few hundred bytes of schema can cost minutes of CPU (16
strings each with its own maxLength of ~1,000: 36 s). A compile thread abandoned at its deadline
kept running, and kept one of two compile slots the next schemas queued for. Here a helper process
per tokenizer (`python -m kvstore.engine.structured_output.compile_worker`: it imports xgrammar once, ~4 s,
started with the cache) forks one child per compile, so no compile waits for another, and kills the
child at its deadline. The child sends the compiled grammar back as JSON (~0.2 s for a 5 MB one: the
price of a compile that can be stopped). The helper is a plain subprocess, not a multiprocessing
child: those re-run the user's main script in a script without a `__main__` guard.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import xgrammar as xgr
from kvstore.engine.errors import EngineError, InvalidRequest, RequestFailed
from kvstore.engine.structured_output.params import (
    StructuredOutputOptions,
    StructuredOutputsParams,
    choice_as_grammar,
)
from kvstore.engine.structured_output.satisfiable import unproductive_rule

logger = logging.getLogger(__name__)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# Whitespace characters allowed between two JSON tokens. xgrammar's default is unbounded, and small
# models fall into whitespace loops: greedy SmolLM2 wrote 150 newlines between a key and its value on
# one of the test schemas (vLLM has the same failure). 16 is pretty printing 7 levels deep at indent 2.
JSON_MAX_WHITESPACE = 16
# Compiles running at once (each a process with its own grammar in memory, up to ~100 MB); past it a
# new one is a 503 to retry, not a wait behind the others.
MAX_RUNNING_COMPILES = 32


class CompileTimeout(Exception):
    """The compile ran past its deadline (and was stopped)."""


def compile_constraint(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """`params`' grammar, compiled; xgrammar's RuntimeError/ValueError for a bad one."""
    kind = params.kind
    if kind is StructuredOutputOptions.JSON_OBJECT:
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
    if kind is StructuredOutputOptions.CHOICE:
        return compiler.compile_grammar(choice_as_grammar(params.choice))
    if kind is StructuredOutputOptions.JSON:
        if params.disable_any_whitespace:  # as vLLM: no free whitespace and separators without spaces
            grammar = xgr.Grammar.from_json_schema(params.key[1], any_whitespace=False, separators=(",", ":"))
        else:
            grammar = xgr.Grammar.from_json_schema(
                params.key[1], any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
            )
    elif kind is StructuredOutputOptions.REGEX:
        grammar = xgr.Grammar.from_regex(params.regex)
    else:
        grammar = xgr.Grammar.from_ebnf(params.grammar)
    if (rule := unproductive_rule(grammar)) is not None:  # it would compile, then fail mid-answer
        raise ValueError(
            f"no finite text satisfies it: rule {rule!r} never completes (it only recurses, with no "
            "base case: a $ref to itself or a $ref cycle, a rule defined by itself; or it needs a "
            "character from a class that matches none, such as [^\\d\\D])"
        )
    return compiler.compile_grammar(grammar)


def invalid(params: StructuredOutputsParams, error: Exception) -> InvalidRequest:
    """xgrammar's reason, without the C++ source location it starts with."""
    message = _CPP_PREFIX.sub("", str(error).strip())
    return InvalidRequest(f"the {params.kind.value} constraint cannot be compiled: {message}")


# ---- the helper process ------------------------------------------------------------------------
@dataclass
class _Child:
    pid: int
    conn: Connection
    deadline: float


def _compile_in_child(
    compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, out: Connection
) -> None:
    try:
        out.send(("ok", compile_constraint(compiler, params).serialize_json()))
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
        out.send(("invalid", str(invalid(params, e))))


def _finish(child: _Child) -> tuple[str, object]:
    try:
        status, payload = child.conn.recv()
    except EOFError:  # it died before it answered (out of memory, a crash)
        status, payload = "died", None
    child.conn.close()
    _, code = os.waitpid(child.pid, 0)
    return (status, payload) if status != "died" else ("died", code)


def _serve(requests: Connection, results: Connection) -> None:
    """Read (id, params, timeout_s), fork a child per compile, answer (id, status, payload):
    ("ok", grammar JSON), ("invalid", reason), ("timeout", None) or ("died", exit code)."""
    info = xgr.TokenizerInfo.deserialize_json(requests.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # each child has a copy
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ, None)
    running: dict[int, _Child] = {}
    while True:
        soonest = min((c.deadline for c in running.values()), default=None)
        wait = None if soonest is None else max(0.0, soonest - time.monotonic())
        for key, _ in selector.select(wait):
            if key.data is None:
                try:
                    cid, params, timeout_s = requests.recv()
                except EOFError:  # the engine is gone
                    for child in running.values():
                        os.kill(child.pid, signal.SIGKILL)
                    return
                receiver, sender = Pipe(duplex=False)
                pid = os.fork()
                if pid == 0:  # the child: compile, answer, exit without the parent's cleanup
                    code = 0
                    try:
                        _die_with_parent()
                        receiver.close()
                        _compile_in_child(compiler, params, sender)
                    except BaseException:  # noqa: BLE001 (nothing may escape a forked child)
                        code = 1
                    finally:
                        os._exit(code)
                sender.close()
                running[cid] = _Child(pid, receiver, time.monotonic() + timeout_s)
                selector.register(receiver, selectors.EVENT_READ, cid)
            else:
                child = running.pop(key.data)
                selector.unregister(child.conn)
                results.send((key.data, *_finish(child)))
        now = time.monotonic()
        for cid in [cid for cid, c in running.items() if c.deadline <= now]:
            child = running.pop(cid)
            selector.unregister(child.conn)
            os.kill(child.pid, signal.SIGKILL)  # the deadline stops the work
            os.waitpid(child.pid, 0)
            child.conn.close()
            results.send((cid, "timeout", None))


def _die_with_parent() -> None:
    """Linux: the kernel kills this child if the helper dies (nothing else would stop its compile)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's; the helper ends with it
    requests = Connection(os.dup(0), writable=False)
    results = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray prints go to stderr, never into the answers
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _serve(requests, results)


# ---- the engine's side -------------------------------------------------------------------------
class CompileService:
    """The helper process of one tokenizer: `submit` a compile, get a future of its grammar.
    A helper that dies fails the compiles it ran and is started again by the next one."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.tokenizer_info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, tuple[StructuredOutputsParams, Future]] = {}
        self._ids = itertools.count()

    def start(self) -> None:
        """Start the helper now: its ~4 s of imports overlap whatever the engine does meanwhile."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._proc is not None:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        requests = Connection(os.dup(proc.stdin.fileno()), readable=False)
        results = Connection(os.dup(proc.stdout.fileno()), writable=False)
        proc.stdin.close()
        proc.stdout.close()
        self._proc, self._outbox, self._pending = proc, queue.SimpleQueue(), {}
        self._outbox.put(self._info_json)  # the helper reads it once its imports are done
        # one thread writes, one reads: a caller never blocks on the pipe, and never while the
        # helper waits for its answers to be read
        threading.Thread(
            target=self._send, args=(requests, self._outbox), name="grammar-requests", daemon=True
        ).start()
        threading.Thread(
            target=self._read,
            args=(proc, results, self._outbox, self._pending),
            name="grammar-results",
            daemon=True,
        ).start()

    def close(self) -> None:
        """Stop the helper (it kills the compiles it runs); a later submit starts a new one."""
        with self._lock:
            if self._proc is not None:
                self._outbox.put(None)  # its requests pipe closes: the helper sees EOF and exits
                self._proc = None

    def compile(self, params: StructuredOutputsParams, timeout_s: float) -> xgr.CompiledGrammar:
        """`params` compiled in a child of the helper, stopped after `timeout_s` (counted from when
        the helper has it): CompileTimeout then, InvalidRequest for a bad constraint."""
        future = self.submit(params, timeout_s)
        try:  # the margin covers the helper's own start
            payload = future.result(timeout=timeout_s + 120)
        except TimeoutError:
            raise CompileTimeout from None
        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def submit(self, params: StructuredOutputsParams, timeout_s: float) -> Future[str]:
        """The compile of `params` as a future of the compiled grammar's JSON."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if len(self._pending) >= MAX_RUNNING_COMPILES:
                raise RequestFailed(
                    f"{MAX_RUNNING_COMPILES} constraints are compiling already; retry later", status=503
                )
            self._start()
            cid = next(self._ids)
            self._pending[cid] = (params, future)
            self._outbox.put((cid, params, timeout_s))
        return future

    @staticmethod
    def _send(requests: Connection, outbox: queue.SimpleQueue) -> None:
        while (message := outbox.get()) is not None:
            try:
                requests.send(message)
            except OSError:  # the helper is gone: its reader fails what was pending
                break
        requests.close()

    def _read(
        self,
        proc: subprocess.Popen,
        results: Connection,
        outbox: queue.SimpleQueue,
        pending: dict[int, tuple[StructuredOutputsParams, Future]],
    ) -> None:
        """Hand each answer to its future; when the helper is gone, fail what it still had."""
        while True:
            try:
                cid, status, payload = results.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                params, future = pending.pop(cid)
            if status == "ok":
                future.set_result(payload)  # its waiter parses it: answers never queue behind a parse
            elif status == "invalid":
                future.set_exception(InvalidRequest(payload))
            elif status == "timeout":
                future.set_exception(CompileTimeout())
            else:
                future.set_exception(
                    InvalidRequest(
                        f"the {params.kind.value} constraint could not be compiled (the compiler exited "
                        f"with code {payload})"
                    )
                )
        results.close()
        outbox.put(None)
        with self._lock:
            if self._proc is proc:
                self._proc = None
            lost = list(pending.values())
            pending.clear()
        code = proc.wait()
        if lost:
            logger.warning("the grammar compiler process exited (code %s)", code)
        for _, future in lost:
            future.set_exception(EngineError("the grammar compiler process exited; retry"))


if __name__ == "__main__":
    main()
