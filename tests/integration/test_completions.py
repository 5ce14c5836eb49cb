"""OpenAI-compatible completions as users reach them: `serve run` of the shipped deployments/llm.yaml
(CPU backend, the default tiny model), then HTTP with httpx and with the official `openai` client,
unmodified: plain and streamed completions, lists of prompts, stop strings, usage, seeds, concurrent
streams batched together, and errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from loadtest.launch import REPO, ServeProcess, free_port, start_serve, write_config

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("llm")
    port = free_port()
    config = write_config(REPO / "deployments" / "llm.yaml", tmp / "llm.yaml", port,
                          {"backend": "cpu", "state_dir": str(tmp / "state"), "num_cpus": 0.5})
    process = start_serve(config, port, tmp / "serve.log")
    try:
        process.wait_until_up("/v1/models")
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def model_id(server: ServeProcess) -> str:
    listed = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    return listed["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_client_completion(client: openai.OpenAI, model_id: str) -> None:
    done = client.completions.create(model=model_id, prompt="Hello, world", max_tokens=8,
                                     temperature=0)
    assert done.object == "text_completion" and done.model == model_id
    (choice,) = done.choices
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    usage = done.usage
    assert usage.prompt_tokens == len(b"Hello, world")  # the tiny model's byte tokenizer
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.completions.create(model=model_id, prompt="Hello, world", max_tokens=8,
                                      temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_openai_client_streaming_equals_plain(client: openai.OpenAI, model_id: str) -> None:
    args = dict(model=model_id, prompt="The quick brown fox", max_tokens=12, temperature=0.8,
                seed=5)
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
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
    done = client.completions.create(model=model_id, prompt=["one", "two two", "ABC"],
                                     max_tokens=4, temperature=0)
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    assert done.usage.prompt_tokens == 3 + 7 + 3
    ids = client.completions.create(model=model_id, prompt=[65, 66, 67], max_tokens=4,
                                    temperature=0)
    assert ids.choices[0].text == next(c.text for c in done.choices if c.index == 2)


def test_stop_string_cuts_the_text(client: openai.OpenAI, model_id: str) -> None:
    args = dict(model=model_id, prompt="stop here", max_tokens=16, temperature=0)
    full = client.completions.create(**args).choices[0].text
    if len(full) < 3:
        pytest.skip(f"greedy completion {full!r} too short to cut")
    stop = full[1:3]
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_concurrent_streams_all_complete(server: ServeProcess, model_id: str) -> None:
    async def one(session: openai.AsyncOpenAI, i: int) -> str:
        stream = await session.completions.create(model=model_id, prompt=f"request {i}",
                                                  max_tokens=10, temperature=0, stream=True)
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


@pytest.mark.parametrize("change,status,param", [
    ({"model": "gpt-9"}, 404, None),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"n": 2}, 400, "n"),
    ({"logprobs": 2}, 400, "logprobs"),
    ({"prompt": ""}, 400, None),
    ({"prompt": "x" * 5000}, 400, None),
    ({"prompt": [[1, 99999]]}, 400, None),
    ({"frobnicate": 1}, 400, "frobnicate"),
])
def test_bad_requests_get_openai_errors(server: ServeProcess, model_id: str, change: dict,
                                        status: int, param: str | None) -> None:
    body = {"model": model_id, "prompt": "hi", "max_tokens": 4, **change}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param, error


def test_openai_client_raises_its_own_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="GET /v1/models"):
        client.completions.create(model="nope", prompt="hi")


def test_ops_still_served_beside_the_model(server: ServeProcess) -> None:
    answer = httpx.post(f"{server.url}/v1/ops/relu", json={"inputs": [{"data": [-1.0, 2.0]}]},
                        timeout=30)
    assert answer.status_code == 200 and answer.json()["output"]["data"] == [0.0, 2.0]


def test_the_default_is_the_seeded_tiny_model(model_id: str) -> None:
    assert model_id == "tiny-gpt2"
