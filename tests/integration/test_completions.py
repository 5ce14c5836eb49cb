"""OpenAI-compatible completions as users reach them: `serve run` of the shipped
deployments/llm.yaml
(CPU backend, the default tiny model, whose directory has a chat template), then HTTP with httpx and
with the official `openai` client, unmodified: plain and streamed completions and chat completions,
models.retrieve, lists of prompts, stop strings, usage, seeds, concurrent streams batched together,
logprobs, prompt log-likelihoods (echo + logprobs, max_tokens 0) equal to transformers', and errors
in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from loadtest.launch import APP_REPLICAS, REPO, ServeProcess, replica_pids, served

openai = pytest.importorskip("openai")
ADMIN = {"Authorization": "Bearer completions-secret"}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llm")


@pytest.fixture(scope="module")
def server(tmp: Path) -> Iterator[ServeProcess]:
    with served(
        REPO / "deployments" / "llm.yaml",
        tmp,
        {
            "backend": "cpu",
            "state_dir": str(tmp / "state"),
            "num_cpus": 0.5,
            "admin_token": ADMIN["Authorization"].removeprefix("Bearer "),
        },
        ready="/v1/models",
        env={"RAY_DEDUP_LOGS": "0"},  # every replica log line in the log, as its replica wrote it
    ) as process:
        yield process


@pytest.fixture(scope="module")
def model_id(server: ServeProcess) -> str:
    listed = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    return listed["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_client_completion(client: openai.OpenAI, model_id: str) -> None:
    done = client.completions.create(
        model=model_id, prompt="Hello, world", max_tokens=8, temperature=0
    )
    assert done.object == "text_completion" and done.model == model_id
    (choice,) = done.choices
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    usage = done.usage
    assert usage.prompt_tokens == len(b"Hello, world")  # the tiny model's byte tokenizer
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.completions.create(
        model=model_id, prompt="Hello, world", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_openai_client_streaming_equals_plain(client: openai.OpenAI, model_id: str) -> None:
    args = dict(
        model=model_id, prompt="The quick brown fox", max_tokens=12, temperature=0.8, seed=5
    )
    plain = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == plain.choices[0].text  # same seed, same tokens
    assert reasons[-1] == plain.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_raw_sse_ends_with_done(server: ServeProcess, model_id: str) -> None:
    body = {"model": model_id, "prompt": "abc", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1


def test_list_of_prompts_gives_one_choice_each(client: openai.OpenAI, model_id: str) -> None:
    done = client.completions.create(
        model=model_id, prompt=["one", "two two", "ABC"], max_tokens=4, temperature=0
    )
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    assert done.usage.prompt_tokens == 3 + 7 + 3
    ids = client.completions.create(
        model=model_id, prompt=[65, 66, 67], max_tokens=4, temperature=0
    )
    assert ids.choices[0].text == next(c.text for c in done.choices if c.index == 2)


def test_stop_string_cuts_the_text(client: openai.OpenAI, model_id: str) -> None:
    args = dict(model=model_id, prompt="stop here", max_tokens=16, temperature=0)
    full = client.completions.create(**args).choices[0].text
    if len(full) < 3:
        pytest.skip(f"greedy completion {full!r} too short to cut")
    stop = full[1:3]
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_concurrent_streams_all_complete(server: ServeProcess, model_id: str) -> None:
    async def one(session: openai.AsyncOpenAI, i: int) -> str:
        stream = await session.completions.create(
            model=model_id, prompt=f"request {i}", max_tokens=10, temperature=0, stream=True
        )
        parts = [c async for c in stream]
        assert parts[-1].choices[0].finish_reason in ("stop", "length")
        return "".join(c.choices[0].text for c in parts)

    async def many() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as session:
            return await asyncio.gather(*(one(session, i) for i in range(12)))

    texts = asyncio.run(many())
    assert len(texts) == 12
    stats = httpx.get(f"{server.url}/v1/stats", timeout=30).json()
    assert stats["total"]["llm_steps"] < stats["total"]["llm_tokens"]  # requests shared steps


@pytest.mark.parametrize(
    "change,status,param",
    [
        ({"model": "gpt-9"}, 404, None),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"n": 2}, 400, "n"),
        ({"logprobs": 50}, 400, "logprobs"),
        ({"best_of": 2}, 400, "best_of"),
        ({"prompt": ""}, 400, None),
        ({"prompt": "x" * 5000}, 400, None),
        ({"prompt": [[1, 99999]]}, 400, None),
        ({"frobnicate": 1}, 400, "frobnicate"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: ServeProcess, model_id: str, change: dict, status: int, param: str | None
) -> None:
    body = {"model": model_id, "prompt": "hi", "max_tokens": 4, **change}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param, error


def _answer(server: ServeProcess, path: str, body: dict, content_type: str) -> tuple[int, object]:
    """Status and JSON of a completion answer, ids and times left out; a stream as its events."""
    headers = {"content-type": content_type}
    with httpx.stream(
        "POST", f"{server.url}{path}", content=json.dumps(body), headers=headers, timeout=60
    ) as answer:
        lines = [line.removeprefix("data: ") for line in answer.iter_lines() if line]
    parsed = [line if line == "[DONE]" else json.loads(line) for line in lines]
    for item in parsed:
        if isinstance(item, dict):
            item.pop("id", None), item.pop("created", None)
    return answer.status_code, parsed


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "change",
    [
        {},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"model": "nope"},
        {"temperature": -1},
        {"n": "many"},
    ],
    ids=["whole", "streamed", "unknown-model", "bad-value", "bad-type"],
)
def test_completions_answer_alike_past_fastapi_and_through_it(
    server: ServeProcess, model_id: str, path: str, change: dict
) -> None:
    """JSON bodies to the completion routes skip FastAPI's routing (serving.hotpaths.HotPaths);
    FastAPI's routes still parse other JSON types (application/*+json). Same answers both ways."""
    prompt = (
        {"prompt": "Hello"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hello"}]}
    )
    body = {"model": model_id, **prompt, "max_tokens": 6, "seed": 11, "temperature": 1, **change}
    fast = _answer(server, path, body, "application/json")
    routed = _answer(server, path, body, "application/x-a+json")
    assert fast == routed and fast[0] != 500, fast


def test_openai_client_raises_its_own_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="GET /v1/models"):
        client.completions.create(model="nope", prompt="hi")


def test_ops_still_served_beside_the_model(server: ServeProcess) -> None:
    answer = httpx.post(
        f"{server.url}/v1/ops/relu", json={"inputs": [{"data": [-1.0, 2.0]}]}, timeout=30
    )
    assert answer.status_code == 200 and answer.json()["output"]["data"] == [0.0, 2.0]


def test_the_default_is_the_seeded_tiny_model(model_id: str) -> None:
    assert model_id == "tiny-gpt2"


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b"[" * 100_000, b'{"prompt": "hi"} tail'])
def test_bodies_that_are_not_json_get_400_in_openai_shape(
    server: ServeProcess, body: bytes
) -> None:
    answer = httpx.post(
        f"{server.url}/v1/completions",
        content=body,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "invalid JSON" in error["message"]


def test_vllm_metrics_count_the_completions(server: ServeProcess, model_id: str) -> None:
    httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": model_id, "prompt": "count me", "max_tokens": 4, "temperature": 0},
    )
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_waiting",
    ):
        assert f'\n{name}{{model_name="{model_id}",' in text, name
    assert 'vllm:request_success_total{finished_reason="' in text


def test_nan_logits_are_a_clear_error_and_roll_the_swap_back(
    server: ServeProcess, model_id: str
) -> None:
    """gelu_tanh (the tiny GPT-2's activation) swapped to a version that is NaN for negative
    inputs: refused by default, and when forced, the next completion fails with a clear error
    (never torch's message) and the replica rolls the operator back by itself."""
    swap = f"{server.url}/admin/ops/gelu_tanh/swap"
    nan = {"expression": "sqrt(A) * 0 + A"}
    refused = httpx.post(swap, json=nan, headers=ADMIN, timeout=120)
    assert refused.status_code == 422 and refused.json()["error"] == "NonFiniteOutputError"
    forced = httpx.post(swap, json={**nan, "allow_nonfinite": True}, headers=ADMIN, timeout=120)
    assert forced.status_code == 200, forced.text
    body = {"model": model_id, "prompt": "Hello", "max_tokens": 4}
    failed = httpx.post(
        f"{server.url}/v1/completions", json={**body, "temperature": 0.7}, timeout=60
    )
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "NaN or infinite logits" in error["message"]
    assert "gelu_tanh" in error["message"] and "probability" not in error["message"]
    deadline = time.monotonic() + 60
    while (op := httpx.get(f"{server.url}/admin/ops/gelu_tanh", headers=ADMIN, timeout=30).json())[
        "current"
    ] != 1:
        assert time.monotonic() < deadline, op
        time.sleep(0.2)
    assert (op["changes"][-1]["by"], op["changes"][-1]["action"]) == ("watch", "rollback")
    again = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"


def test_models_retrieve(client: openai.OpenAI, model_id: str) -> None:
    card = client.models.retrieve(model_id)
    assert card.id == model_id and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_openai_client_chat(client: openai.OpenAI, model_id: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    args = dict(
        model=model_id, messages=messages, max_completion_tokens=10, temperature=0.7, seed=3
    )
    done = client.chat.completions.create(**args)
    assert done.object == "chat.completion" and done.model == model_id
    (choice,) = done.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    # the tiny model's template: "role: content\n" per message, then "assistant:" (bytes)
    assert done.usage.prompt_tokens == len(b"system: Be brief.\nuser: Hi!\nassistant:")
    assert 1 <= done.usage.completion_tokens <= 10
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # same seed, same tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == choice.finish_reason and all(r is None for r in finals[:-1])
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_chat_stop_max_tokens_and_logprobs(client: openai.OpenAI, model_id: str) -> None:
    args = dict(model=model_id, messages=[{"role": "user", "content": "Count."}], temperature=0)
    full = client.chat.completions.create(**args, max_tokens=12, logprobs=True, top_logprobs=3)
    choice = full.choices[0]
    content = choice.logprobs.content
    assert len(content) == full.usage.completion_tokens
    for token in content:  # greedy: the chosen token is the likeliest
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs))
    text = choice.message.content
    if len(text) >= 3:
        cut = client.chat.completions.create(**args, max_tokens=12, stop=[text[1:3]])
        assert cut.choices[0].message.content == text[: text.index(text[1:3])]


def test_chat_errors(server: ServeProcess, model_id: str) -> None:
    url = f"{server.url}/v1/chat/completions"
    for body, _param in [
        ({"messages": []}, "messages"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ]:
        answer = httpx.post(
            url,
            timeout=30,
            json={"model": model_id, "messages": [{"role": "user", "content": "x"}], **body},
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert (
        httpx.get(f"{server.url}/v1/models/nope", timeout=30).json()["error"]["code"]
        == "model_not_found"
    )
    parts = httpx.post(
        url,
        timeout=30,
        json={
            "model": model_id,
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
                }
            ],
        },
    )
    assert parts.status_code == 200, parts.text
    assert parts.json()["usage"]["prompt_tokens"] == len(b"user: Hi!\nassistant:")


def test_completion_logprobs_of_generated_tokens(client: openai.OpenAI, model_id: str) -> None:
    done = client.completions.create(
        model=model_id, prompt="Hello", max_tokens=6, temperature=0, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == done.usage.completion_tokens
    for chosen, token, top in zip(lp.token_logprobs, lp.tokens, lp.top_logprobs):
        assert top[token] == chosen and chosen == pytest.approx(max(top.values()))


def test_echo_logprobs_equal_transformers_loglikelihood(
    client: openai.OpenAI, model_id: str, tmp: Path
) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 0, logprobs."""
    transformers = pytest.importorskip("transformers")
    import torch

    tokens = list(b"The quick brown fox jumps")
    done = client.completions.create(
        model=model_id, prompt=[tokens], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    (choice,) = done.choices
    assert choice.text == "The quick brown fox jumps"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "state" / "models" / "tiny-gpt2")
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])
    assert lp.token_logprobs[1:] == pytest.approx(expected[:, 0].tolist(), abs=1e-4)
    assert done.usage.completion_tokens == 0 and done.usage.prompt_tokens == len(tokens)
    more = client.completions.create(
        model=model_id, prompt="The quick", max_tokens=3, echo=True, temperature=0
    )
    assert more.choices[0].text.startswith("The quick")


def test_a_client_that_hangs_up_stops_its_generation(server: ServeProcess, model_id: str) -> None:
    """Through the gateway too: its relay is cancelled, and the replica's engine frees the slot
    at the next step instead of making the remaining tokens for no one."""

    def tokens_made() -> int:
        return int(httpx.get(f"{server.url}/v1/stats", timeout=30).json()["total"]["llm_tokens"])

    before = tokens_made()
    body = {"model": model_id, "prompt": "Hang up", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as answer:
        assert next(line for line in answer.iter_lines() if line).startswith("data: {")
    time.sleep(3)  # the whole answer takes about as long on this model
    made = tokens_made() - before
    assert 1 <= made < 50, f"{made} of 100 tokens made after the client left"


def test_a_replica_killed_mid_answer_costs_the_clients_nothing(
    server: ServeProcess, model_id: str
) -> None:
    """Last in the module: SIGKILLs the only replica while two streams, a chat stream and a plain
    completion are in flight. The gateway (serving/gateway.py) sends each to the replica Serve
    starts in its place, and every client gets its whole answer, as it would have without the
    kill: the same text as the unbroken answer, one id, one [DONE]. The sampled stream without a
    seed is one the gateway seeded, or its replay would differ (and end with an error event)."""
    url = f"{server.url}/v1"
    seeded = {"model": model_id, "prompt": "Once upon", "max_tokens": 100, "seed": 11}
    unseeded = {"model": model_id, "prompt": "Far away", "max_tokens": 100, "temperature": 1.0}
    plain = {"model": model_id, "prompt": "Plainly", "max_tokens": 100, "temperature": 0}
    chat = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 80,
        "temperature": 0,
    }
    expected = {
        "completions": httpx.post(f"{url}/completions", json=seeded, timeout=60).json(),
        "plain": httpx.post(f"{url}/completions", json=plain, timeout=60).json(),
        "chat": httpx.post(f"{url}/chat/completions", json=chat, timeout=60).json(),
    }
    (victim,) = replica_pids(APP_REPLICAS)
    with ThreadPoolExecutor(1) as pool, ExitStack() as streams:
        opened = {
            name: streams.enter_context(
                httpx.stream("POST", f"{url}/{route}", json={**body, "stream": True}, timeout=180)
            ).iter_lines()
            for name, route, body in (
                ("completions", "completions", seeded),
                ("unseeded", "completions", unseeded),
                ("chat", "chat/completions", chat),
            )
        }
        firsts = {name: next(line for line in lines if line) for name, lines in opened.items()}
        answer = pool.submit(httpx.post, f"{url}/completions", json=plain, timeout=180)
        time.sleep(0.2)  # the plain request reaches the replica
        os.kill(victim, signal.SIGKILL)
        events = {
            name: [
                json.loads(e.removeprefix("data: ")) if e != "data: [DONE]" else None
                for e in [firsts[name], *(line for line in lines if line)]
            ]
            for name, lines in opened.items()
        }
        plain_answer = answer.result()
    assert replica_pids(APP_REPLICAS) not in ([], [victim])  # replaced
    assert plain_answer.status_code == 200, plain_answer.text
    assert plain_answer.json()["choices"] == expected["plain"]["choices"]
    for name, got in events.items():
        assert got[-1] is None and None not in got[:-1], f"{name}: one [DONE], at the end"
        chunks = got[:-1]
        assert not any("error" in c for c in chunks), f"{name}: {chunks[-1]}"
        assert len({c["id"] for c in chunks}) == 1
        if name == "chat":
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert text == expected["chat"]["choices"][0]["message"]["content"]
            continue
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons[-1] in ("stop", "length") and not any(
            reasons[:-1]
        )  # sampled: eos may end it
        if name == "completions":
            assert text == expected["completions"]["choices"][0]["text"]
    # The kill came mid-answer: the gateway said so for each of the reproducible three, whose
    # answers (their references') outlast it. The unseeded stream may draw eos before the kill.
    assert all(e["usage"]["completion_tokens"] >= 50 for e in expected.values())
    assert server.log_tail(200_000).count("its replica failed") >= 3
