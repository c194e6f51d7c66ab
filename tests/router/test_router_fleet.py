"""Three real SmolLM2 engines and a kvstore-server behind `kvstore-engine router` (policy ttft): a
multi-turn conversation's turns land on the engine that holds its history, answer token for token as a
single engine does, and a router killed and started again routes the next turn there too (its index
comes back from the publishers' replay buffers). The turns name the model as a client would: the
router's `--model` ("smollm2", an alias), then the engines' served name, which the router lists in its
/v1/models; a name neither is the router's own 404."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from urllib.request import urlopen

import pytest
from kvstore.engine import LLM, SamplingParams
from prometheus_client.parser import text_string_to_metric_families

from tests.router.fleet import post, router_state, start_engine, start_router, start_store, wait_healthy
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "48MiB")
SYSTEM = (
    "You are the archivist of the northern lighthouses. Every evening the keeper climbed the stairs, "
    "trimmed the wick, wound the clockwork that turned the lens, and wrote the weather into a leather "
    "book. Answer briefly, in plain words, and only about the lighthouse and its keeper. " * 3
)
TURNS = ("What did the keeper do each evening?", "What did he write down?", "Why did the lens turn?",
         "Say it all again in one line.")  # fmt: skip
MAX_TOKENS = 8
SERVED = "SmolLM2-135M-Instruct"  # what `kvstore-engine serve --model smollm2` serves


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    store, store_cfg = start_store(tmp)
    engines = []
    try:
        engines = [start_engine(tmp, f"e{i}", store.url, *ENGINE_ARGS) for i in range(3)]
        for proc, url, _ in engines:
            wait_healthy(url, proc)
        yield store_cfg, [(url, cfg) for _, url, cfg in engines]
    finally:
        for proc, _, _ in engines:
            proc.stop()
        store.stop()


def _blocks(router: str, engine: str) -> int:
    return router_state(router)["index"]["engines"].get(engine, 0)


def _turn(router: str, messages: list[dict], model: str) -> tuple[str, str]:
    before = {e: _blocks(router, e) for e in router_state(router)["engines"]}
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer, headers = post(router, "/v1/chat/completions", body)
    assert answer["model"] == SERVED, answer["model"]
    engine = headers["X-KVStore-Engine"]
    with contextlib.suppress(AssertionError):  # the engine's BlockStored events reach the router's index
        wait_until(lambda: _blocks(router, engine) > before[engine], timeout=10)
    return engine, answer["choices"][0]["message"]["content"]


def _local_tokens(router: str) -> float:
    text = urlopen(router + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvstore_router_prompt_tokens_total" and s.labels.get("source") == "local")  # fmt: skip


def test_turns_follow_their_history_token_identical_and_after_a_router_restart(fleet) -> None:
    store_cfg, engines = fleet
    single = LLM("smollm2", max_model_len=1024, kv_cache_memory="48MiB", num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    router_proc, router = start_router(engines, store_cfg)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    served = []
    try:
        for i, question in enumerate(TURNS):
            if i == len(TURNS) - 1:  # the router dies and comes back before the last turn
                router_proc.proc.kill()
                router_proc.proc.wait(10)
                router_proc, router = start_router(engines, store_cfg)
                assert _blocks(router, served[0]) > 0, "the replay rebuilt the index"
            messages.append({"role": "user", "content": question})
            engine, text = _turn(router, messages, "smollm2" if i % 2 == 0 else SERVED)
            (want,) = single.chat([messages], greedy)
            assert text == want.outputs[0].text, f"turn {i} differs from a single engine"
            served.append(engine)
            messages.append({"role": "assistant", "content": text})
        assert served == [served[0]] * len(TURNS), served
        assert _local_tokens(router) > 0, "the restarted router routed the last turn on a local prefix"
        models = json.loads(urlopen(router + "/v1/models", timeout=10).read())
        assert [c["id"] for c in models["data"]] == [SERVED]
        bad = {"model": "nope", "messages": messages[:2], "max_tokens": 1}
        with pytest.raises(urllib.error.HTTPError) as e:
            post(router, "/v1/chat/completions", bad)
        assert e.value.code == 404 and "X-KVStore-Engine" not in e.value.headers
        assert json.loads(e.value.read())["error"]["param"] == "model"
    finally:
        router_proc.stop()
        single.engine.shutdown()
