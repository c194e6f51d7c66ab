"""The OpenAI-compatible server on the real SmolLM2: completions, chat, SSE streaming, metrics,
bad input as 400 JSON while the server keeps serving, aborts on client disconnect."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvstore.engine.async_engine import AsyncEngine
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.server import build_app
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until_async

pytestmark = pytest.mark.slow
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(smollm2_dir), max_model_len=256, kv_cache_memory="48MiB"))


@pytest.fixture
async def base_url(engine: LLMEngine):
    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line and not line.startswith("event: "):  # `event: error` precedes a mid-stream error
            assert line.startswith("data: ")
            events.append(line.removeprefix("data: "))
    return events


async def test_models_and_health(base_url: str, http: aiohttp.ClientSession, engine: LLMEngine) -> None:
    async with http.get(f"{base_url}/health") as r:
        assert r.status == 200
    async with http.get(f"{base_url}/v1/models") as r:
        body = await r.json()
    assert body["object"] == "list" and body["data"][0]["id"] == engine.model_name


async def test_completion_and_its_stream_agree(base_url: str, http: aiohttp.ClientSession) -> None:
    req = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    async with http.post(f"{base_url}/v1/completions", json=req) as r:
        assert r.status == 200
        body = await r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and "Paris" in choice["text"]
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 12 and body["usage"]["prompt_tokens"] > 0
    async with http.post(f"{base_url}/v1/completions", json={**req, "stream": True}) as r:
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_completion_and_stream(base_url: str, http: aiohttp.ClientSession) -> None:
    req = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    async with http.post(f"{base_url}/v1/chat/completions", json=req) as r:
        assert r.status == 200
        body = await r.json()
    message = body["choices"][0]["message"]
    assert (
        body["object"] == "chat.completion"
        and message["role"] == "assistant"
        and "Paris" in message["content"]
    )
    stream_req = {**req, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{base_url}/v1/chat/completions", json=stream_req) as r:
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == message["content"]
    )
    usage = chunks[-1]["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    assert cached >= 16, (
        "the same prompt again: the prefix cache served its full blocks (vLLM's cached_tokens)"
    )


async def test_concurrent_requests_batch_and_match_sequential(
    base_url: str, http: aiohttp.ClientSession
) -> None:
    prompts = ["def fibonacci(n):", "The three primary colors are", "Once upon a time"]

    async def complete(p: str) -> str:
        req = {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        async with http.post(f"{base_url}/v1/completions", json=req) as r:
            assert r.status == 200
            return (await r.json())["choices"][0]["text"]

    together = await asyncio.gather(*(complete(p) for p in prompts))
    alone = [await complete(p) for p in prompts]
    assert together == alone


@pytest.mark.parametrize(
    ("path", "body", "status", "match"),
    [
        ("/v1/completions", {"prompt": "word " * 400, "max_tokens": 4}, 400, "at most 255"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n must be in [1, 128]"),
        ("/v1/completions", {"prompt": ["a"] * 1025, "n": 2, "max_tokens": 1}, 400, "prompts x n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 2**63 - 1},
            400,
            "seed",
        ),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "word " * 400, "stream": True}, 400, "at most 255"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ],
)
async def test_bad_requests_get_4xx_json_and_server_keeps_serving(
    base_url: str, http: aiohttp.ClientSession, path: str, body: dict, status: int, match: str
) -> None:
    async with http.post(f"{base_url}{path}", json=body) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert match in err["message"] and err["code"] == status
    async with http.post(f"{base_url}/v1/completions", data=b"{not json") as r:
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
    async with http.post(f"{base_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}) as r:
        assert r.status == 200


async def test_client_disconnect_aborts_and_frees_blocks(
    base_url: str, http: aiohttp.ClientSession, engine: LLMEngine
) -> None:
    req = {"prompt": "Count from one to one hundred:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with http.post(f"{base_url}/v1/completions", json=req) as r:
        await r.content.readline()  # the first token arrived; hang up
    await wait_until_async(lambda: not engine.has_unfinished_requests(), timeout=10)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def test_metrics_parse_and_carry_vllm_names(base_url: str, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{base_url}/v1/completions", json={"prompt": "Hello there", "max_tokens": 3}) as r:
        assert r.status == 200
    async with http.get(f"{base_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert VLLM_NAMES <= families.keys()

    def value(name: str, sample: str) -> float:
        return sum(s.value for s in families[name].samples if s.name == sample)

    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 3
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") >= 2
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") >= 1
    assert value("vllm:num_requests_running", "vllm:num_requests_running") == 0


async def test_ttft_counts_the_wait_for_a_running_step(engine: LLMEngine) -> None:
    """A request that arrives while a step runs joins the batch after it; its TTFT (the engine's
    histogram and its output's metrics) counts from its arrival, as vLLM's does, not from the join."""
    aengine = AsyncEngine(engine)
    await aengine.start()
    hist = "vllm:time_to_first_token_seconds_sum"
    before = sum(s.value for f in text_string_to_metric_families(engine.render_metrics().decode())
                 for s in f.samples if s.name == hist)  # fmt: skip
    try:
        outs = []

        async def one() -> None:
            async for out in aengine.generate([1, 2, 3, 4], SamplingParams(max_tokens=2), "late"):
                outs.append(out)

        async with aengine._lock:  # the running step: it holds the engine for 0.5 s
            task = asyncio.create_task(one())
            await asyncio.sleep(0.5)
        await asyncio.wait_for(task, 60)
    finally:
        await aengine.stop()
    after = sum(s.value for f in text_string_to_metric_families(engine.render_metrics().decode())
                for s in f.samples if s.name == hist)  # fmt: skip
    assert outs[-1].finished and outs[-1].metrics["time_to_first_token"] >= 0.5
    assert after - before >= 0.5


async def test_sigterm_drains_then_fails_what_is_left_and_exits(smollm2_dir: Path, tmp_path: Path) -> None:
    """`kvstore-engine serve` on SIGTERM: no new requests; in-flight ones get --shutdown-timeout, then a
    503 (JSON, or an SSE error event and [DONE] for a stream that started); the process exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.engine", "serve", "--model", str(smollm2_dir), "--port", str(port),
         "--max-model-len", "1024", "--kv-cache-memory", "48MiB", "--shutdown-timeout", "1"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr", "wb"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            for _ in range(600):
                try:
                    async with http.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
                    await asyncio.sleep(0.2)
            long = {"prompt": "Count from one to one thousand:", "max_tokens": 900, "ignore_eos": True}
            plain = asyncio.create_task(http.post(f"{url}/v1/completions", json=long))
            async with http.post(f"{url}/v1/completions", json={**long, "stream": True}) as r:
                assert (await r.content.readline()).startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                events = await sse_events(r)
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == 503 and "shutting down" in err["message"]
            assert len(events) < 900, "the stream was cut short, not run to its end"
            r = await plain
            assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_vllm_sampling_extras_through_the_openai_client(base_url: str, engine: LLMEngine) -> None:
    """repetition_penalty, min_p, logit_bias, include_stop_str_in_output, cached_tokens and the
    max_model_len check, as the official client sends them (extra_body for vLLM's own fields)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    name, q = engine.model_name, "The capital of France is"

    async def text(prompt: str, **kw) -> str:
        out = await client.completions.create(model=name, prompt=prompt, temperature=0, **kw)
        return out.choices[0].text

    hello = "Repeat after me: hello hello hello hello hello"
    assert (await text(hello, max_tokens=16)).count("hello") == 16
    assert (await text(hello, max_tokens=16, extra_body={"repetition_penalty": 1.5})).count("hello") < 3
    greedy = await text(q, max_tokens=12)
    only_top = await client.completions.create(model=name, prompt=q, max_tokens=12, temperature=1.0, seed=1,
                                               extra_body={"min_p": 1.0})  # fmt: skip
    assert only_top.choices[0].text == greedy, "min_p=1 keeps only the most likely token"
    lyon = engine.tokenizer.encode(" Lyon")
    assert await text(q, max_tokens=1, logit_bias={str(lyon[0]): 100}) == " Lyon"
    kept = await client.completions.create(model=name, prompt=q, max_tokens=12, temperature=0, stop=["."],
                                           extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text == " Paris." and kept.choices[0].finish_reason == "stop"
    assert await text(q, max_tokens=12, stop=["."]) == " Paris"
    chat = {"model": name, "messages": [{"role": "user", "content": "Name three primary colors, please."}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    await client.chat.completions.create(**chat)
    again = await client.chat.completions.create(**chat)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        await client.chat.completions.create(**{**chat, "max_tokens": 250})
    await client.close()


async def test_n_choices_are_the_seeded_requests_seed_plus_i(base_url: str, engine: LLMEngine) -> None:
    """n > 1 (vLLM's rule): choice i of a seeded request is the n=1 request with seed + i; the prompt
    counts once in usage; with several prompts, choice index = prompt index * n + i."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "Tell me a colour."}],
            "max_tokens": 8, "temperature": 1.0}  # fmt: skip
    many = await client.chat.completions.create(**chat, n=3, seed=11)
    alone = [await client.chat.completions.create(**chat, seed=11 + i) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in many.choices}) > 1, "the choices are sampled apart"
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    prompts = ["The sky is", "Water is"]
    cmpl = await client.completions.create(model=engine.model_name, prompt=prompts, n=2, max_tokens=4,
                                           temperature=0.8, seed=5)  # fmt: skip
    assert [c.index for c in cmpl.choices] == [0, 1, 2, 3]
    for j, p in enumerate(prompts):
        for i in range(2):
            one = await client.completions.create(model=engine.model_name, prompt=p, max_tokens=4,
                                                  temperature=0.8, seed=5 + i)  # fmt: skip
            assert cmpl.choices[j * 2 + i].text == one.choices[0].text
    greedy = await client.completions.create(model=engine.model_name, prompt="The sky is", n=2, max_tokens=4,
                                             temperature=0)  # fmt: skip
    assert greedy.choices[0].text == greedy.choices[1].text
    await client.close()


async def test_logprobs_in_chat_and_completions_streamed_or_not(base_url: str, engine: LLMEngine) -> None:
    """OpenAI's two logprobs shapes through the official client: one entry per output token whose texts
    make the answer, greedy tokens are their own top-1, a stream carries the same entries."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    r = await client.chat.completions.create(**chat)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token and e.logprob <= 0
        assert (
            e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        )
        assert bytes(e.bytes).decode() == e.token
    streamed = []
    async for ch in await client.chat.completions.create(**chat, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = await client.chat.completions.create(**{**chat, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None

    kw = {"model": engine.model_name, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
          "logprobs": 2}  # fmt: skip
    c = (await client.completions.create(**kw)).choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == len(lp.token_logprobs) == 6
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == value and len(top) == 2 and max(top.values()) == value
    chunks = [ch.choices[0].logprobs async for ch in await client.completions.create(**kw, stream=True)]
    assert sum((ch.tokens for ch in chunks), []) == lp.tokens
    assert sum((ch.text_offset for ch in chunks), []) == lp.text_offset
    await client.close()


async def test_echo_with_logprobs_scores_the_prompt_like_lm_eval_asks(
    base_url: str, engine: LLMEngine
) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1, temperature 0): the text is
    prompt + answer, the first prompt token has no logprob, each later one is its log-probability
    given what precedes it (as fp32 transformers scores it, to bf16 precision)."""
    import openai
    import torch

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    prompt = "The capital of France is Paris"
    r = await client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                        logprobs=1, echo=True)  # fmt: skip
    c = r.choices[0]
    ids = engine.tokenize(prompt)
    assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 1
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None and r.usage.prompt_tokens == len(ids)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32)
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    want = [theirs[i, t].item() for i, t in enumerate(ids[1:])]
    # this server's engine runs bf16 weights (the exact fp32 scores: test_llm_e2e)
    assert c.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=0.15)
    assert all(lp < 0 for lp in want) and min(want) < -5, "a real score, not a constant"
    plain = (
        await client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=2, echo=True)
    ).choices[0]
    assert plain.text.startswith(prompt) and plain.logprobs is None
    await client.close()


async def test_tokenize_and_detokenize_like_vllm(
    base_url: str, http: aiohttp.ClientSession, engine: LLMEngine
) -> None:
    async with http.post(f"{base_url}/tokenize", json={"prompt": "Hello world"}) as r:
        body = await r.json()
    assert r.status == 200 and body["tokens"] == engine.tokenize("Hello world") and body["count"] == 2
    assert body["max_model_len"] == engine.max_model_len
    messages = [{"role": "user", "content": "Hi"}]
    async with http.post(f"{base_url}/tokenize", json={"messages": messages}) as r:
        chat_ids = (await r.json())["tokens"]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat_ids == engine.tokenize(text, add_special_tokens=False)
    async with http.post(f"{base_url}/detokenize", json={"tokens": chat_ids}) as r:
        assert (await r.json())["prompt"] == engine.tokenizer.decode(chat_ids)
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens")):  # fmt: skip
        async with http.post(f"{base_url}{path}", json=bad) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    base_url: str, http: aiohttp.ClientSession, path: str
) -> None:
    prompt = (
        {"prompt": "Count: one, two,"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "Count"}]}
    )
    body = {**prompt, "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    async with http.post(f"{base_url}{path}", json=body) as r:
        events = [json.loads(e) for e in (await sse_events(r))[:-1]]
    assert events and all("usage" in e for e in events)
    completion = [e["usage"]["completion_tokens"] for e in events]
    assert completion == sorted(completion) and completion[-1] == 6
    assert len({e["usage"]["prompt_tokens"] for e in events}) == 1 and events[-1]["choices"] == []
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}  # needs include_usage
    async with http.post(f"{base_url}{path}", json=body) as r:
        assert not any("usage" in json.loads(e) for e in (await sse_events(r))[:-1])


async def test_streams_of_several_choices_equal_their_non_streamed_answers(
    base_url: str, engine: LLMEngine
) -> None:
    """n > 1 and several prompts stream too (as in vLLM): chunks of every choice interleave, each
    choice's deltas join into its non-streamed text, every choice finishes, usage counts a prompt once."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    name = engine.model_name
    kw = {"model": name, "prompt": ["The sky is", "Water is"], "n": 2, "max_tokens": 6, "temperature": 0.8,
          "seed": 3, "logprobs": 1}  # fmt: skip
    whole = await client.completions.create(**kw)
    texts, tokens, finished, usage = {}, {}, set(), None
    async for ch in await client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3} and [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert [tokens[i] for i in range(4)] == [c.logprobs.tokens for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 24

    chat = {"model": name, "messages": [{"role": "user", "content": "A colour?"}], "n": 3, "max_tokens": 5,
            "temperature": 1.0, "seed": 9}  # fmt: skip
    whole_chat = await client.chat.completions.create(**chat)
    parts, roles = {}, set()
    async for ch in await client.chat.completions.create(**chat, stream=True):
        for c in ch.choices:
            if c.delta.role:
                roles.add(c.index)
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1, 2}
    assert [parts[i] for i in range(3)] == [c.message.content for c in whole_chat.choices]
    await client.close()


async def test_a_client_gone_mid_stream_aborts_every_choice(
    base_url: str, http: aiohttp.ClientSession, engine: LLMEngine
) -> None:
    body = {"prompt": "Once upon a time", "n": 3, "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readline()
    await wait_until_async(lambda: not engine.has_unfinished_requests(), timeout=5)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def test_vllm_prompt_logprobs_field_with_ranks(base_url: str, engine: LLMEngine) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    prompt = "The capital of France is Paris"
    ids = engine.tokenize(prompt)
    r = await client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                        logprobs=1, echo=True, extra_body={"prompt_logprobs": 2})  # fmt: skip
    c = r.model_dump()["choices"][0]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos, scores in enumerate(plp[1:], start=1):
        own = scores[str(ids[pos])]
        assert own["decoded_token"] == c["logprobs"]["tokens"][pos]
        assert own["logprob"] == pytest.approx(c["logprobs"]["token_logprobs"][pos], abs=1e-4)
        assert sorted(v["rank"] for v in scores.values())[:2] == [1, 2] and len(scores) in (2, 3)
        assert (own["rank"] == 1) == (own["logprob"] == max(v["logprob"] for v in scores.values()))
    assert any(s[str(ids[p])]["rank"] > 2 for p, s in enumerate(plp[1:], start=1)), (
        "some prompt token is unlikely"
    )
    chat = await client.chat.completions.create(model=engine.model_name, max_tokens=1,
                                                messages=[{"role": "user", "content": "Hi"}],
                                                extra_body={"prompt_logprobs": 0})  # fmt: skip
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == chat.usage.prompt_tokens and body["prompt_logprobs"][0] is None
    assert all(len(s) == 1 for s in body["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.completions.create(model=engine.model_name, prompt="x", stream=True,
                                        extra_body={"prompt_logprobs": 1})  # fmt: skip
    await client.close()
