"""The app as users run it: `serve run` of the shipped multi-replica config (two CPU replicas),
reached over HTTP. One Serve instance serves the whole module; the last test restarts it from the
shipped single-replica config on the same state dir, so it must stay last."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from loadtest import run as loadtest_run
from loadtest.launch import REPO, ServeProcess, free_port, start_serve, write_config

TOKEN = "integration-secret"
MAX_ELEMENTS = 4096
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class App:
    """The running app and where its registry lives."""

    process: ServeProcess
    tmp: Path

    @property
    def url(self) -> str:
        return self.process.url

    def start(self, config_name: str, replicas: int) -> None:
        """Start `serve run` of a shipped config on a free port, on this app's state dir."""
        port = free_port()
        config = write_config(
            REPO / "deployments" / config_name,
            self.tmp / config_name,
            port,
            {
                "backend": "cpu",
                "state_dir": str(self.tmp / "state"),
                "admin_token": TOKEN,
                "max_elements": MAX_ELEMENTS,
                "num_cpus": 0.5,
            },
        )
        self.process = start_serve(config, port, self.tmp / f"{config_name}.log")
        self.process.wait_until_up("/readyz")
        wait_for_replicas(self.url, replicas)


def wait_for_replicas(url: str, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reports = httpx.get(f"{url}/admin/replicas", headers=ADMIN, timeout=30).json()
        if len(reports["replicas"]) == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{count} replicas not up after {timeout_s} s")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    running = App(process=None, tmp=tmp_path_factory.mktemp("serve"))  # type: ignore[arg-type]
    try:
        running.start("multi.yaml", replicas=2)
        yield running
    finally:
        if running.process is not None:
            running.process.stop()


@pytest.fixture(scope="module")
def client(app: App) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.url, timeout=60) as session:
        yield session


def tensor(x: torch.Tensor) -> dict[str, Any]:
    """The JSON form of `x`: nested lists with its dtype."""
    return {"data": x.float().tolist(), "dtype": str(x.dtype).removeprefix("torch.")}


def b64(x: torch.Tensor) -> dict[str, Any]:
    """The compact form of `x`: its little-endian bytes in base64, shape and dtype."""
    raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "b64": base64.b64encode(raw).decode(),
        "shape": list(x.shape),
        "dtype": str(x.dtype).removeprefix("torch."),
    }


def output(body: dict[str, Any]) -> torch.Tensor:
    """An answer's tensor, from either encoding (b64 in its own dtype, lists as float32)."""
    out = body["output"]
    if "b64" in out:
        dtype = getattr(torch, out["dtype"])
        raw = bytearray(base64.b64decode(out["b64"], validate=True))
        return (
            torch.frombuffer(raw, dtype=dtype).reshape(out["shape"])
            if raw
            else torch.empty(out["shape"], dtype=dtype)
        )
    values = [float(v) for v in out["data"]]  # float() reads "NaN", "Infinity", "-Infinity"
    return torch.tensor(values, dtype=torch.float32).reshape(out["shape"])


def call(client: httpx.Client, op: str, *xs: torch.Tensor, **options: Any) -> httpx.Response:
    return client.post(f"/v1/ops/{op}", json={"inputs": [tensor(x) for x in xs], **options})


async def call_many(
    url: str, requests: list[tuple[str, list[torch.Tensor]]]
) -> list[httpx.Response]:
    """All `requests` at once."""
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as session:
        return await asyncio.gather(
            *(
                session.post(f"/v1/ops/{op}", json={"inputs": [tensor(x) for x in xs]})
                for op, xs in requests
            )
        )


def set_knobs(client: httpx.Client, **knobs: Any) -> None:
    response = client.put("/admin/coalescer", json=knobs, headers=ADMIN)
    assert response.status_code == 200, response.text
    assert len(response.json()["replicas"]) == 2


def totals(client: httpx.Client) -> dict[str, float]:
    return client.get("/v1/stats").json()["total"]


def test_health_readiness_and_the_operator_catalogue(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "backend": "cpu"}
    assert client.get("/readyz").json()["ready"] is True
    body = client.get("/v1/ops").json()
    ops = {op["name"]: op for op in body["ops"]}
    assert body["backend"] == "cpu"
    assert ops["softmax"]["family"] == "softmax" and ops["softmax"]["version"] == 1
    assert ops["layernorm"]["scalars"] == [{"name": "eps", "default": 1e-5}]
    assert (ops["layernorm"]["arity"], ops["layernorm"]["min_inputs"]) == (3, 1)
    assert "feed_tokens" not in ops and "tick" not in ops  # the LLM engine's own
    assert client.get("/docs").status_code == 200


def test_concurrent_requests_are_answered_correctly_in_shared_submissions(
    app: App, client: httpx.Client
) -> None:
    set_knobs(client, window_us=3000)
    try:
        before = totals(client)
        requests = [("softmax", [torch.randn(4, 32)]) for _ in range(24)] + [
            ("mul", [torch.randn(64), torch.randn(64)]) for _ in range(24)
        ]
        responses = asyncio.run(call_many(app.url, requests))
        after = totals(client)
    finally:
        set_knobs(client, window_us=200)
    for (op, xs), response in zip(requests, responses):
        assert response.status_code == 200, response.text
        want = torch.softmax(xs[0], -1) if op == "softmax" else xs[0] * xs[1]
        torch.testing.assert_close(output(response.json()), want)
    tasks, batches = after["tasks"] - before["tasks"], after["batches"] - before["batches"]
    assert tasks == len(requests)
    assert tasks / batches > 1, f"{tasks} tasks in {batches} submissions: nothing coalesced"


def test_coalescing_off_submits_each_request_alone(app: App, client: httpx.Client) -> None:
    set_knobs(client, enabled=False, window_us=3000)
    try:
        before = totals(client)
        responses = asyncio.run(call_many(app.url, [("exp", [torch.randn(8)])] * 16))
        after = totals(client)
    finally:
        set_knobs(client, enabled=True, window_us=200)
    assert all(r.status_code == 200 for r in responses)
    assert after["batches"] - before["batches"] == after["tasks"] - before["tasks"] == 16


def test_request_options_flat_data_dtypes_scalars_and_reductions(client: httpx.Client) -> None:
    x = torch.randn(3, 5)
    flat = {"inputs": [{"data": x.reshape(-1).tolist(), "shape": [3, 5]}], "out_dtype": "float16"}
    body = client.post("/v1/ops/relu", json=flat).json()
    assert body["output"]["dtype"] == "float16"
    torch.testing.assert_close(output(body), torch.relu(x).half().float())
    body = call(client, "leaky_relu", x, scalars={"negative_slope": 0.2}).json()
    torch.testing.assert_close(output(body), torch.nn.functional.leaky_relu(x, 0.2))
    body = call(client, "sum", x, dims=[1], keepdim=True).json()
    torch.testing.assert_close(output(body), x.sum(1, keepdim=True))
    half = torch.randn(2, 8).bfloat16()
    body = call(client, "softmax", half).json()
    assert body["output"]["dtype"] == "bfloat16"
    torch.testing.assert_close(output(body), torch.softmax(half.float(), -1), atol=1e-2, rtol=2e-2)


BAD_INPUTS = [  # (op, body, status, words the message must contain)
    ("add", {"inputs": [{"data": [1, 2, 3]}, {"data": [1, 2]}]}, 422, "do not broadcast"),
    ("add", {"inputs": [{"data": [1, 2]}]}, 422, "takes 2 tensor input(s), got 1"),
    ("relu", {"inputs": [{"data": [1, 2], "dtype": "int8"}]}, 422, "'float32', 'float16'"),
    ("relu", {"inputs": [{"data": [[1, 2], [3]]}]}, 422, "evenly nested lists"),
    ("relu", {"inputs": [{"data": [1, "x"]}]}, 422, "must be numbers"),
    ("relu", {"inputs": [{"data": [1, 2, 3], "shape": [2, 2]}]}, 422, "does not fit shape"),
    ("clamp", {"inputs": [{"data": [1, 2]}]}, 422, "needs the parameter 'min'"),
    ("relu", {"inputs": [{"data": [1.0]}], "scalars": {"alpha": 1}}, 422, "no parameter"),
    ("relu", {"inputs": [{"data": [1.0]}], "colour": "red"}, 422, "Extra inputs"),
    ("relu", {"inputs": [{"data": [0.5] * (MAX_ELEMENTS + 1)}]}, 413, f"more than {MAX_ELEMENTS}"),
    ("no_such_op", {"inputs": [{"data": [1.0]}]}, 404, "unknown operator 'no_such_op'"),
    # it would wait for a clock the engine's steps tick
    ("feed_tokens", {"inputs": [{"data": [-2.0]}]}, 404, "internal"),
]


@pytest.mark.parametrize(
    ("op", "body", "status", "words"),
    BAD_INPUTS,
    ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD_INPUTS)],
)
def test_bad_inputs_get_clear_errors_and_the_replica_keeps_serving(
    client: httpx.Client, op: str, body: dict[str, Any], status: int, words: str
) -> None:
    response = client.post(f"/v1/ops/{op}", json=body)
    assert response.status_code == status, response.text
    assert words in response.text
    x = torch.randn(7)
    torch.testing.assert_close(output(call(client, "neg", x).json()), -x)


@pytest.mark.parametrize("path", ["/v1/ops/mul", "/v1/batch"])
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xff\xfe{}",  # not UTF-8
        b"[" * 300 + b"]" * 300,  # nested past pydantic's limit
        b"[1, 2]",
        b'{"inputs": [{"data": [1, 2], "dtype": "float33"}]}',
        b'{"inputs": [{"data": [1, 2]}], "surprise": 1}',
        b'{"calls": [{"op": "mul", "inputs": [{"data": [1]}, {"data": [null]}]}]}',
        b'{"op": "mul", "calls": [], "inputs": [{"data": [1, 2]}, {"data": [[3], [4]]}]}',
    ],
)
def test_the_data_plane_answers_as_its_declared_routes_do(
    client: httpx.Client, path: str, body: bytes
) -> None:
    """JSON bodies to /v1/ops and /v1/batch skip FastAPI's routing (serving.routes.HotPaths);
    FastAPI's route still parses other JSON types (application/*+json). Same answers both ways."""
    fast = client.post(path, content=body, headers={"content-type": "application/json"})
    routed = client.post(path, content=body, headers={"content-type": "application/x-a+json"})
    assert fast.status_code == routed.status_code and fast.status_code != 500, fast.text
    answers = [r.json() for r in (fast, routed)]
    for answer in answers:
        answer.pop("replica", None)  # two replicas: either may answer
    assert answers[0] == answers[1]


def test_a_body_too_large_to_parse_is_refused_unread(client: httpx.Client) -> None:
    response = client.post(
        "/v1/ops/relu",
        content=b"[" + b"0," * 1_000_000 + b"0]",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413 and "request body over" in response.json()["detail"]


def test_malformed_json_is_a_422(client: httpx.Client) -> None:
    response = client.post(
        "/v1/ops/relu", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422


@pytest.mark.parametrize(
    ("headers", "status", "words"),
    [
        ({}, 401, "missing"),
        ({"Authorization": "Bearer nope"}, 403, "wrong admin token"),
        ({"Authorization": f"Basic {TOKEN}"}, 403, "wrong admin token"),
    ],
)
def test_admin_routes_need_the_bearer_token(
    client: httpx.Client, headers: dict[str, str], status: int, words: str
) -> None:
    for method, path in (("GET", "/admin/ops"), ("POST", "/admin/ops/relu/rollback")):
        response = client.request(method, path, headers=headers)
        assert response.status_code == status and words in response.json()["detail"]
    if status == 401:
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert client.get("/admin/ops", headers=ADMIN).status_code == 200


def test_register_swap_and_rollback_reach_both_replicas(app: App, client: httpx.Client) -> None:
    made = client.post(
        "/admin/ops", headers=ADMIN, json={"name": "it_affine", "expression": "A * 2 + 1"}
    )
    assert made.status_code == 201, made.text
    assert_everywhere(made.json(), "it_affine", 1)
    swapped = client.post("/admin/ops/it_affine/swap", headers=ADMIN, json={"expression": "A * 3"})
    assert swapped.status_code == 200, swapped.text
    assert_everywhere(swapped.json(), "it_affine", 2)
    assert_answers(app, "it_affine", 2, lambda x: x * 3)
    rolled = client.post("/admin/ops/it_affine/rollback", headers=ADMIN)
    assert rolled.status_code == 200, rolled.text
    assert_everywhere(rolled.json(), "it_affine", 1)
    assert_answers(app, "it_affine", 1, lambda x: x * 2 + 1)
    op = client.get("/admin/ops/it_affine", headers=ADMIN).json()
    assert [v["source"] for v in op["history"]] == ["A * 2 + 1", "A * 3"]
    assert (op["current"], op["active"]) == (1, [1])


def assert_everywhere(change: dict[str, Any], op: str, version: int) -> None:
    """The change's response shows `version` of `op` active on both replicas."""
    assert change["version"] == version and not change["unreachable"]
    assert [r["versions"][op] for r in change["replicas"]] == [version, version]
    assert len({r["registry_seq"] for r in change["replicas"]}) == 1


def assert_answers(app: App, op: str, version: int, fn: Any) -> None:
    """Concurrent calls all come from `version` and compute `fn`, until both replicas answered
    (Serve's router picks replicas by load, so one round may land on one replica only)."""
    replicas: set[str] = set()
    for _ in range(10):
        xs = [torch.randn(16) for _ in range(16)]
        bodies = [r.json() for r in asyncio.run(call_many(app.url, [(op, [x]) for x in xs]))]
        assert {b["version"] for b in bodies} == {version}
        for x, body in zip(xs, bodies):
            torch.testing.assert_close(output(body), fn(x))
        replicas |= {b["replica"] for b in bodies}
        if len(replicas) == 2:
            return
    raise AssertionError(f"only replica(s) {replicas} answered")


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/admin/ops/gelu/swap", {"expression": "A +* 2"}, 400, "position 3"),
        ("/admin/ops/gelu/swap", {"expression": "A + B"}, 400, "beyond the operator's 1 input"),
        ("/admin/ops/gelu/swap", {"expression": "A", "cuda": "return a[0];"}, 403, "raw CUDA"),
        ("/admin/ops/softmax/swap", {"expression": "A"}, 422, "only elementwise"),
        ("/admin/ops/no_such_op/swap", {"expression": "A"}, 404, "unknown operator"),
        ("/admin/ops/gelu/rollback", None, 409, "nothing to roll back to"),
        ("/admin/ops", {"name": "relu", "expression": "A"}, 409, "exists"),
        ("/admin/ops", {"name": "Bad-Name", "expression": "A"}, 422, "invalid"),
    ],
)
def test_refused_changes_say_why_and_the_old_version_keeps_serving(
    client: httpx.Client, path: str, body: dict[str, str] | None, status: int, words: str
) -> None:
    response = client.post(path, json=body, headers=ADMIN)
    assert response.status_code == status, response.text
    assert words in response.text
    if status == 400 and "position" in words:
        assert response.json()["position"] == 3
    x = torch.randn(9)
    body = call(client, "gelu", x).json()
    assert body["version"] == 1
    torch.testing.assert_close(output(body), torch.nn.functional.gelu(x))


def test_a_full_queue_is_503_with_retry_after_and_a_late_answer_504(
    app: App, client: httpx.Client
) -> None:
    set_knobs(client, max_queue=1, window_us=1_000_000, deadline_ms=3000)
    try:  # each replica holds one task for the whole window: the rest are refused
        full = asyncio.run(call_many(app.url, [("exp", [torch.randn(4)])] * 6))
        set_knobs(client, deadline_ms=100)
        late = call(client, "exp", torch.randn(4))
    finally:
        set_knobs(client, max_queue=1024, window_us=200, deadline_ms=10000)
    refused = [r for r in full if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in full)
    assert refused[0].headers["Retry-After"] == "1" and "max_queue 1" in refused[0].text
    assert late.status_code == 504 and "deadline" in late.json()["detail"]


def test_coalescer_knobs_out_of_range_are_refused(client: httpx.Client) -> None:
    response = client.put("/admin/coalescer", json={"max_batch": 0}, headers=ADMIN)
    assert response.status_code == 422 and "max_batch" in response.text
    reports = client.get("/admin/replicas", headers=ADMIN).json()["replicas"]
    assert {r["coalescer"]["max_batch"] for r in reports} == {64}


def test_a_short_swap_storm_under_load_has_no_failures(
    app: App, client: httpx.Client, tmp_path: Path
) -> None:
    code = loadtest_run.main(
        [
            "swap-storm",
            "--users",
            "6",
            "--duration",
            "5",
            "--coalescing",
            "off",
            "--warmup",
            "0",
            "--url",
            app.url,
            "--admin-token",
            TOKEN,
            "--out",
            str(tmp_path),
        ]
    )
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert code == 0 and run["failures"] == 0, run
    assert run["requests"] > 20 and run["mean_batch_size"] >= 1
    reports = client.get("/admin/replicas", headers=ADMIN).json()["replicas"]
    assert [r["coalescer"]["enabled"] for r in reports] == [True, True]  # put back as it was


MALFORMED = [  # (path, body, status, words): each once a 500
    ("/v1/ops/relu", {"inputs": [{"data": [], "shape": [2**62, 4]}]}, 422, "less than or equal"),
    ("/v1/ops/relu", b"\xff\xfe{}", 422, "invalid JSON"),
    ("/v1/ops/relu", b"[" * 100_000, 422, "recursion limit"),
    ("/v1/ops/relu", {"inputs": [{"data": [1.0, None]}]}, 422, 'send NaN as \\"NaN\\"'),
    (
        "/v1/ops/add",
        {"inputs": [{"data": [[1.0]] * 64}, {"data": [[1.0] * 256]}]},
        413,
        "the result would have shape [64, 256]",
    ),
    ("/v1/ops/relu", {"inputs": [{"data": [1.0]}], "keepdim": "yes"}, 422, "keepdim"),
    ("/admin/ops", b'{"a": ' * 100_000, 422, "recursion limit"),
    ("/v1/completions", b"\xff\xfe{}", 400, "invalid JSON"),
    ("/v1/completions", b"[" * 100_000, 400, "recursion limit"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    MALFORMED,
    ids=[f"{m[0]}-{m[2]}-{i}" for i, m in enumerate(MALFORMED)],
)
def test_malformed_input_of_any_kind_is_a_4xx_in_one_shape(
    client: httpx.Client, path: str, body: Any, status: int, words: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(
        path, content=content, headers={**ADMIN, "content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert words in response.text
    error = response.json()["error"]
    if path == "/v1/completions":  # OpenAI's shape, for OpenAI's clients
        assert set(error) == {"message", "type", "param", "code"}
    else:
        assert isinstance(error, str) and isinstance(response.json()["detail"], str)


def test_a_path_lists_every_method_it_answers(client: httpx.Client) -> None:
    response = client.request("OPTIONS", "/admin/ops", headers=ADMIN)
    assert response.status_code == 405 and response.headers["Allow"] == "GET, POST"
    assert response.json() == {"error": "MethodNotAllowed", "detail": "Method Not Allowed"}


def test_non_finite_values_travel_as_strings_and_null_is_refused(client: httpx.Client) -> None:
    body = {"inputs": [{"data": [1.0, "NaN", "Infinity", "-Infinity"]}]}
    out = client.post("/v1/ops/neg", json=body).json()["output"]
    assert out["data"] == [-1.0, "NaN", "-Infinity", "Infinity"]
    zero = client.post(
        "/v1/ops/div", json={"inputs": [{"data": [0.0, 1.0, -1.0]}, {"data": [0.0, 0.0, 0.0]}]}
    )
    assert zero.json()["output"]["data"] == ["NaN", "Infinity", "-Infinity"]
    refused = client.post("/v1/ops/neg", json={"inputs": [{"data": [[1.0, None]]}]})
    assert refused.status_code == 422 and "null is not a number" in refused.json()["detail"]


ROUND_TRIPS = [  # (op, inputs, options): each sent as lists and as b64
    ("softmax", [torch.randn(4, 32)], {}),
    ("add", [torch.randn(3, 1), torch.randn(1, 5)], {}),
    ("relu", [torch.randn(2, 6)], {"out_dtype": "float16"}),
    ("layernorm", [torch.randn(3, 16).bfloat16(), torch.randn(16).bfloat16()], {}),
    ("sum", [torch.randn(2, 3, 4)], {"dims": [1], "keepdim": True}),
    ("neg", [torch.tensor([1.0, -0.0, 3e38])], {}),
]


@pytest.mark.parametrize(("op", "xs", "options"), ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_b64_tensors_give_the_same_results_as_lists(
    client: httpx.Client, op: str, xs: list[torch.Tensor], options: dict[str, Any]
) -> None:
    as_lists = call(client, op, *xs, **options)
    compact = client.post(f"/v1/ops/{op}", json={"inputs": [b64(x) for x in xs], **options})
    assert as_lists.status_code == compact.status_code == 200, compact.text
    out = compact.json()["output"]
    assert set(out) == {"b64", "shape", "dtype"}  # answered as asked: in b64
    assert out["dtype"] == as_lists.json()["output"]["dtype"]
    torch.testing.assert_close(
        output(compact.json()).float(), output(as_lists.json()), rtol=0, atol=0, equal_nan=True
    )


def test_the_answer_encoding_can_be_chosen(client: httpx.Client) -> None:
    x = torch.randn(5)
    listed = client.post("/v1/ops/exp", json={"inputs": [b64(x)], "out_encoding": "list"}).json()
    compact = call(client, "exp", x, out_encoding="b64").json()
    mixed = client.post("/v1/ops/mul", json={"inputs": [b64(x), tensor(x)]}).json()
    assert "data" in listed["output"] and "b64" in compact["output"] and "b64" in mixed["output"]
    torch.testing.assert_close(output(listed), output(compact))
    torch.testing.assert_close(output(mixed), x * x)


def b64_body(text: Any, shape: list[int], **more: Any) -> dict[str, Any]:
    return {"inputs": [{"b64": text, "shape": shape, **more}]}


FOUR_FLOATS = base64.b64encode(bytes(16)).decode()
MALFORMED_B64 = [  # (body, status, words)
    (b64_body("@@@@", [1]), 422, "b64 is not valid base64"),
    (b64_body("AAAAA", [1]), 422, "b64 is not valid base64"),  # padding
    (b64_body("AAAA\u00e9AAA", [1]), 422, "b64 is not valid base64"),  # not ASCII
    (b64_body(FOUR_FLOATS, [3]), 422, "b64 holds 16 bytes; shape [3] of float32 needs 12"),
    (b64_body(FOUR_FLOATS, [4], dtype="float16"), 422, "needs 8 (4 elements of 2 bytes)"),
    (b64_body(FOUR_FLOATS, [4], dtype="int32"), 422, "'float32', 'float16' or 'bfloat16'"),
    (b64_body(FOUR_FLOATS, [2**31 - 1] * 3), 422, "b64 holds 16 bytes"),
    (b64_body(12, [3]), 422, "valid string"),
    (b64_body(FOUR_FLOATS, [4], data=[1, 2, 3, 4]), 422, "Extra inputs"),
    ({"inputs": [{"b64": FOUR_FLOATS}]}, 422, "shape"),
    ({**b64_body(FOUR_FLOATS, [4]), "out_encoding": "hex"}, 422, "out_encoding"),
    (
        b64_body(base64.b64encode(bytes(4 * (MAX_ELEMENTS + 1))).decode(), [MAX_ELEMENTS + 1]),
        413,
        f"more than {MAX_ELEMENTS} elements",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    MALFORMED_B64,
    ids=[f"{m[1]}-{i}" for i, m in enumerate(MALFORMED_B64)],
)
def test_malformed_b64_tensors_are_clear_4xx(
    client: httpx.Client, body: dict[str, Any], status: int, words: str
) -> None:
    response = client.post("/v1/ops/relu", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]
    assert isinstance(response.json()["error"], str)


def test_a_batch_answers_each_call_on_its_own(client: httpx.Client) -> None:
    x, y, rows = torch.randn(8), torch.randn(8), torch.randn(3, 16)
    half = MAX_ELEMENTS // 2 + 1  # the batch's inputs may have MAX_ELEMENTS in all: one fits
    calls = [
        {"op": "softmax", "inputs": [b64(rows)]},
        {"op": "no_such_op", "inputs": [tensor(x)]},
        {"op": "add", "inputs": [tensor(x), tensor(torch.randn(3))]},
        {"op": "relu", "inputs": [{"b64": "@@", "shape": [1]}]},
        {"op": "mul", "inputs": [tensor(x), b64(y)], "out_encoding": "list"},
        {"op": "neg", "inputs": [b64(torch.zeros(half))]},
        {"op": "neg", "inputs": [b64(torch.zeros(half))]},
    ]
    before = totals(client)
    response = client.post("/v1/batch", json={"calls": calls})
    after = totals(client)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200, 404, 422, 422, 200, 200, 413]
    assert [r["op"] for r in results] == [c["op"] for c in calls]
    torch.testing.assert_close(output(results[0]), torch.softmax(rows, -1))
    assert "data" in results[4]["output"]
    torch.testing.assert_close(output(results[4]), x * y)
    for failed, words in zip(
        results[1:4], ("unknown operator", "do not broadcast", "not valid base64")
    ):
        assert words in failed["detail"] and isinstance(failed["error"], str)
    assert "inputs have more than" in results[6]["detail"]
    tasks, batches = after["tasks"] - before["tasks"], after["batches"] - before["batches"]
    assert tasks == 3 and batches == 1  # the good calls, in one submission


@pytest.mark.parametrize(
    ("calls", "words"),
    [
        ([], "at least 1 item"),
        ([{"op": "neg", "inputs": [{"data": [1.0]}]}] * 257, "at most 256 items"),
        ([{"op": "neg"}], "inputs"),
    ],
)
def test_a_batch_the_schema_refuses_is_refused_whole(
    client: httpx.Client, calls: list[dict[str, Any]], words: str
) -> None:
    response = client.post("/v1/batch", json={"calls": calls})
    assert response.status_code == 422 and words in response.json()["detail"], response.text


async def oversized(total: int) -> AsyncIterator[bytes]:
    """A JSON body of `total` bytes, sent chunked (no Content-Length) as it is produced."""
    yield b'{"inputs": [{"data": ['
    for _ in range(total // 65536):
        yield b"0," * 32768
    yield b"0]}]}"


def replica_rss(client_text: str) -> dict[str, float]:
    return {
        m[0]: float(m[1])
        for m in re.findall(
            r'process_resident_memory_bytes\{replica="([^"]+)"\} (\S+)', client_text
        )
    }


def test_chunked_bodies_over_the_limit_get_413_while_others_are_served(app: App) -> None:
    """Four 50 MB bodies without Content-Length at once: each is cut off at the limit (about
    1 MB here), the replicas' memory barely moves and health checks keep answering."""

    async def main() -> tuple[list[int], list[float], float]:
        async with httpx.AsyncClient(base_url=app.url, timeout=120) as session:
            before = replica_rss((await session.get("/metrics")).text)
            uploads = [
                asyncio.create_task(
                    session.post(
                        "/v1/ops/relu",
                        content=oversized(50 << 20),
                        headers={"content-type": "application/json"},
                    )
                )
                for _ in range(4)
            ]
            latencies, peak = [], 0.0
            while not all(u.done() for u in uploads):
                started = time.perf_counter()
                assert (await session.get("/healthz")).status_code == 200
                latencies.append(time.perf_counter() - started)
                now = replica_rss((await session.get("/metrics")).text)
                peak = max([peak] + [now[r] - before.get(r, now[r]) for r in now])
            return [(await u).status_code for u in uploads], latencies, peak

    statuses, latencies, growth = asyncio.run(main())
    assert statuses == [413] * 4
    assert max(latencies) < 1.0, latencies
    assert growth < 100 * 2**20, f"a replica grew by {growth / 2**20:.0f} MB"


def test_a_swap_that_makes_nan_where_the_current_is_finite_is_refused(client: httpx.Client) -> None:
    assert (
        client.post(
            "/admin/ops", headers=ADMIN, json={"name": "it_sqrt", "expression": "A + 1"}
        ).status_code
        == 201
    )
    refused = client.post(
        "/admin/ops/it_sqrt/swap", headers=ADMIN, json={"expression": "sqrt(A) + 1"}
    )
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["error"] == "NonFiniteOutputError" and "allow_nonfinite" in body["detail"]
    assert body["cases"] and all(c["nonfinite"] > 0 for c in body["cases"])
    assert call(client, "it_sqrt", torch.tensor([-4.0])).json()["version"] == 1
    allowed = client.post(
        "/admin/ops/it_sqrt/swap",
        headers=ADMIN,
        json={"expression": "sqrt(A) + 1", "allow_nonfinite": True},
    )
    assert allowed.status_code == 200, allowed.text
    canary = allowed.json()["canary"]
    assert canary["nonfinite"] > 0 and canary["max_abs_deviation"] > 0


def test_a_swap_whose_answers_turn_nan_on_some_inputs_is_rolled_back_everywhere(
    client: httpx.Client,
) -> None:
    assert (
        client.post(
            "/admin/ops", headers=ADMIN, json={"name": "it_watch", "expression": "A * 2"}
        ).status_code
        == 201
    )
    swapped = client.post(
        "/admin/ops/it_watch/swap",
        headers=ADMIN,  # NaN at 50.5 only: 25 sigma out, past the canary's random inputs
        json={"expression": "A * 2 + 0 * log(abs(A - 50.5))"},
    )
    assert swapped.status_code == 200 and swapped.json()["canary"]["max_abs_deviation"] == 0.0
    fine = call(client, "it_watch", torch.tensor([1.0, 2.0])).json()
    assert fine["version"] == 2 and fine["output"]["data"] == [2.0, 4.0]
    nan = call(client, "it_watch", torch.tensor([1.0, 50.5])).json()
    assert nan["version"] == 2 and nan["output"]["data"] == [2.0, "NaN"]
    deadline = time.monotonic() + 60
    while (op := client.get("/admin/ops/it_watch", headers=ADMIN).json())["current"] != 1:
        assert time.monotonic() < deadline, op
        time.sleep(0.2)
    last = op["changes"][-1]
    assert (last["action"], last["by"], last["version"]) == ("rollback", "watch", 1)
    assert "NaN or infinite" in last["reason"]
    wait_for_versions(client, "it_watch", 1)
    metrics = client.get("/metrics").text
    assert re.search(
        r'gpuos_operator_auto_rollbacks_total\{op="it_watch",replica="[^"]+"\} 1', metrics
    )


def wait_for_versions(client: httpx.Client, op: str, version: int) -> None:
    """Both replicas serve `version` of `op` (a push may still be on its way)."""
    deadline = time.monotonic() + 60
    while True:
        reports = client.get("/admin/replicas", headers=ADMIN).json()["replicas"]
        if [r["versions"][op] for r in reports] == [version, version]:
            return
        assert time.monotonic() < deadline, reports
        time.sleep(0.2)


def test_metrics_on_the_serving_port_cover_every_replica(client: httpx.Client) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "gpuos_coalesced_batch_size_bucket",
        "gpuos_request_errors_total",
        "gpuos_operator_changes_total",
        "vllm:num_requests_running",
        "process_resident_memory_bytes",
    ):
        assert f"\n{name}{{" in text, name
    assert len(set(re.findall(r'process_resident_memory_bytes\{replica="([^"]+)"', text))) == 2


def test_the_registry_survives_a_restart(app: App, client: httpx.Client) -> None:
    """Last in the module: stops the shared instance and starts the shipped llm.yaml."""
    assert (
        client.post(
            "/admin/ops", headers=ADMIN, json={"name": "kept", "expression": "A - 1"}
        ).status_code
        == 201
    )
    for expression in ("A - 2", "A - 3"):
        client.post("/admin/ops/kept/swap", headers=ADMIN, json={"expression": expression})
    client.post("/admin/ops/kept/rollback", headers=ADMIN)  # active [1, 2]
    app.process.stop()
    app.start("llm.yaml", replicas=1)
    with httpx.Client(base_url=app.url, timeout=60) as fresh:
        op = fresh.get("/admin/ops/kept", headers=ADMIN).json()
        assert [v["source"] for v in op["history"]] == ["A - 1", "A - 2", "A - 3"]
        assert op["active"] == [1, 2]
        x = torch.randn(5)
        body = call(fresh, "kept", x).json()
        assert body["version"] == 2
        torch.testing.assert_close(output(body), x - 2)
        assert fresh.get("/healthz").json() == {"status": "ok", "backend": "cpu"}
