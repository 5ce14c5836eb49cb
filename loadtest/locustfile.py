"""Locust users for gpuos-serve. Every answer's content is checked, not only its status.

    MicroOpUser  softmax over a few rows and elementwise ops (add, mul, sigmoid, tanh) on fresh
                 random inputs, checked against numpy; tensors sent as --encoding (list or b64),
                 answers checked for --check (values, or only the shape: an echo baseline)
    StormUser    calls the storm operator and checks each answer against the version it reports
    StormAdmin   (exactly one) swaps the storm operator every second; every fourth change is a
                 rollback
    CompletionUser  OpenAI completions of the served model (GET /v1/models), a --stream-fraction
                 of them streamed, checked by loadtest.completions; streams' time to first token
                 is its own entry

Run through loadtest/run.py, or by hand:
    locust -f loadtest/locustfile.py --headless -u 32 -r 32 -t 30s --host http://127.0.0.1:8000 \
        MicroOpUser
Run from the repository root (Locust puts the working directory on sys.path: loadtest.storm).
Environment: GPUOS_ADMIN_TOKEN (StormAdmin, and StormUser's look-ups of version history),
GPUOS_STORM_OP (the storm operator's name, default storm_affine), GPUOS_LOAD_MODEL (CompletionUser's
model when GET /v1/models fails; unset, that failure stops the run). CompletionUser's options:
--max-tokens (16), --stream-fraction (0.5), --tokens-out (a JSON file for the token counts).
MicroOpUser's and StormUser's: --encoding (list), --check (values). MicroOpUser's and
CompletionUser's: --shed-ok (a 503 with Retry-After or a 504 is load shed as the API promises, not
a failure: reported under its own entry, "shed 503" or "shed 504"; loadtest/soak.py uses it).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from greenlet import GreenletExit
from locust import FastHttpUser, HttpUser, between, constant, events, task
from locust.exception import StopUser
from locust.runners import STATE_CLEANUP, STATE_STOPPED, MasterRunner, WorkerRunner
from requests import RequestException  # after locust, which must patch ssl first

from loadtest.completions import (
    COMPLETION,
    MAX_TOKENS,
    PROMPTS,
    STREAM,
    STREAM_FRACTION,
    TTFT,
    CompletionStream,
    Generated,
    completion_problem,
    completion_request,
    model_id,
)
from loadtest.launch import ENCODINGS
from loadtest.statuses import shed, status_problem
from loadtest.storm import EXPRESSIONS, STORM_OP, admin_headers, affine_versions, ensure_registered

ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add,
    "mul": np.multiply,
    "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "tanh": np.tanh,
}
ARITY = {"add": 2, "mul": 2, "sigmoid": 1, "tanh": 1}
RTOL, ATOL = 1e-4, 1e-5
LOOKUPS = 5  # history look-ups before an unknown version counts as a failure
VERSIONS: dict[int, tuple[float, float]] = {}  # storm operator version → (scale, shift)
GENERATED = Generated()  # CompletionUser's tokens in checked answers, this process
rng = np.random.default_rng()


CHECKS = ("values", "shape")
WIRE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}  # answers' b64 dtypes read here


def tensor(x: np.ndarray, encoding: str = "list") -> dict[str, Any]:
    """The JSON form of a float32 array: flat data and shape, or its bytes in base64."""
    if encoding == "b64":
        raw = x.astype(WIRE["float32"]).tobytes()
        return {
            "b64": base64.b64encode(raw).decode("ascii"),
            "shape": list(x.shape),
            "dtype": "float32",
        }
    return {"data": x.reshape(-1).tolist(), "shape": list(x.shape), "dtype": "float32"}


def values(out: dict[str, Any]) -> np.ndarray:
    """The flat float32 values of an answer's tensor, in either encoding."""
    if "b64" in out:
        raw = base64.b64decode(out["b64"], validate=True)
        return np.frombuffer(raw, dtype=WIRE[out["dtype"]]).astype(np.float32)
    return np.asarray(out["data"], dtype=np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def mismatch(body: dict[str, Any], want: np.ndarray, check: str = "values") -> str | None:
    """Why `body` (an OpResponse) is not `want` (only its shape for `check` "shape"), or None
    when it matches."""
    out = body["output"]
    if out["shape"] != list(want.shape):
        return f"shape {out['shape']} != {list(want.shape)}"
    if check == "shape":
        return None
    got = values(out).reshape(want.shape)
    if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
        return f"values off by up to {float(np.max(np.abs(got - want))):.3g}"
    return None


class CheckedUser(FastHttpUser):
    """Posts operator calls and fails any answer whose content is wrong."""

    abstract = True
    wait_time = constant(0)  # closed loop: each user has one request in flight

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.encoding: str = options.encoding if options else "list"
        self.check: str = options.check if options else "values"
        self.shed_ok: bool = options.shed_ok if options else False

    def mismatch(self, body: dict[str, Any], want: np.ndarray) -> str | None:
        """`mismatch` under this run's --check."""
        return mismatch(body, want, self.check)

    def call(
        self,
        op: str,
        inputs: list[np.ndarray],
        check: Callable[[dict[str, Any]], str | None],
        name: str | None = None,
    ) -> None:
        payload = {"inputs": [tensor(x, self.encoding) for x in inputs]}
        with self.client.post(
            f"/v1/ops/{op}", json=payload, name=name or f"/v1/ops/{op}", catch_response=True
        ) as response:
            if self.shed_ok and shed(response):
                return
            if problem := status_problem(response):
                response.failure(problem)
                return
            body = response.json()
            problem = check(body) if body.get("op") == op else f"answered for {body.get('op')}"
            if problem:
                response.failure(f"{op} v{body.get('version')}: {problem}")


class MicroOpUser(CheckedUser):
    """Token-level micro-ops: softmax over 1-8 rows of 64, elementwise ops on 256 elements."""

    @task(3)
    def softmax_rows(self) -> None:
        x = rng.standard_normal((int(rng.integers(1, 9)), 64), dtype=np.float32)
        self.call("softmax", [x], lambda body: self.mismatch(body, softmax(x)))

    @task(2)
    def elementwise(self) -> None:
        op = str(rng.choice(list(ELEMENTWISE)))
        xs = [rng.standard_normal(256, dtype=np.float32) for _ in range(ARITY[op])]
        self.call(
            op,
            xs,
            lambda body: self.mismatch(body, ELEMENTWISE[op](*xs)),
            name="/v1/ops/[elementwise]",
        )


class StormUser(CheckedUser):
    """Calls the operator StormAdmin keeps swapping; checks the math of the version reported."""

    @task
    def storm(self) -> None:
        x = rng.standard_normal(64, dtype=np.float32)
        self.call(STORM_OP, [x], lambda body: self.check_version(body, x))

    def check_version(self, body: dict[str, Any], x: np.ndarray) -> str | None:
        version = int(body["version"])
        for _ in range(LOOKUPS):  # the replica asked may not have applied the swap yet
            if version in VERSIONS:
                break
            self.learn_versions()
            time.sleep(0.2)  # gevent's: other users keep running
        if version not in VERSIONS:
            return f"version {version} is not in the operator's history"
        scale, shift = VERSIONS[version]
        return self.mismatch(body, x * np.float32(scale) + np.float32(shift))

    def learn_versions(self) -> None:
        with self.client.get(
            f"/admin/ops/{STORM_OP}",
            headers=admin_headers(),
            name="/admin/ops/[storm]",
            catch_response=True,
        ) as response:
            if problem := status_problem(response):
                response.failure(problem)
                return
            VERSIONS.update(affine_versions(response.json()["history"]))


class StormAdmin(FastHttpUser):
    """Changes the storm operator once a second: three swaps, then a rollback."""

    fixed_count = 1
    wait_time = between(0.95, 1.05)

    def on_start(self) -> None:
        self.changes = 0

    @task
    def change(self) -> None:
        self.changes += 1
        if self.changes % 4 == 0:
            path, payload = f"/admin/ops/{STORM_OP}/rollback", None
        else:
            expression = EXPRESSIONS[self.changes % len(EXPRESSIONS)]
            path, payload = f"/admin/ops/{STORM_OP}/swap", {"expression": expression}
        with self.client.post(
            path,
            json=payload,
            headers=admin_headers(),
            catch_response=True,
            name=path.replace(STORM_OP, "[storm]"),
        ) as response:
            if problem := status_problem(response):
                response.failure(problem)
                return
            body = response.json()
            VERSIONS.update(affine_versions(body["op"]["history"]))
            stale = [
                r["replica"]
                for r in body["replicas"]
                if r["versions"].get(STORM_OP) != body["version"]
            ]
            if stale or body["unreachable"]:
                response.failure(f"v{body['version']} not applied on {stale + body['unreachable']}")


class CompletionUser(HttpUser):
    """OpenAI completions of the model GET /v1/models names: prompts from PROMPTS, half of them
    greedy, a --stream-fraction streamed. An HttpUser (requests), not a FastHttpUser:
    geventhttpclient reads a stream in whole buffers, which would hold the first token back."""

    wait_time = constant(0)  # closed loop: each user has one request in flight

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.max_tokens: int = options.max_tokens
        self.stream_fraction: float = options.stream_fraction
        self.shed_ok: bool = options.shed_ok
        self.model = GENERATED.model = self.find_model()

    def find_model(self) -> str:
        """The first model of GET /v1/models. If that fails (a failed request in the stats):
        $GPUOS_LOAD_MODEL, and without it the whole run stops, saying why."""
        with self.client.get("/v1/models", catch_response=True) as response:
            problem = status_problem(response)
            if not problem:
                try:
                    return model_id(response.json())
                except ValueError as error:  # not JSON, or no model in it
                    problem = str(error)
            response.failure(f"GET /v1/models: {problem}")
        if os.environ.get("GPUOS_LOAD_MODEL"):
            logging.warning("GET /v1/models failed (%s); using $GPUOS_LOAD_MODEL", problem)
            return os.environ["GPUOS_LOAD_MODEL"]
        if self.environment.runner.state in (STATE_CLEANUP, STATE_STOPPED):
            raise GreenletExit  # another user stopped the run: end quietly (StopUser logs a trace)
        logging.error(
            "GET /v1/models failed (%s): is the OpenAI API deployed? $GPUOS_LOAD_MODEL "
            "names a model to use anyway. Stopping the run.",
            problem,
        )
        self.environment.runner.quit()  # ends this user too
        raise StopUser()

    @task
    def complete(self) -> None:
        stream = bool(rng.random() < self.stream_fraction)
        body = completion_request(
            self.model,
            str(rng.choice(PROMPTS)),
            self.max_tokens,
            stream,
            greedy=bool(rng.random() < 0.5),
            seed=int(rng.integers(2**31)),
        )
        if stream:
            self.post_stream(body)
        else:
            self.post(body)

    def post(self, body: dict[str, Any]) -> None:
        """A non-streaming completion, checked; its tokens counted when it passes."""
        with self.client.post(
            "/v1/completions", json=body, name=COMPLETION, catch_response=True
        ) as response:
            if self.shed_ok and shed(response):
                return
            problem = status_problem(response)
            if not problem:
                try:
                    answer = response.json()
                    problem = completion_problem(answer, self.model, self.max_tokens)
                except ValueError:
                    problem = f"not JSON: {response.text[:200]}"
            if problem:
                response.failure(problem)
                return
        GENERATED.completion_tokens += answer["usage"]["completion_tokens"]

    def post_stream(self, body: dict[str, Any]) -> None:
        """A streamed completion, checked line by line. Its entry times the whole stream; when it
        passes, its time to the first chunk with text is reported as TTFT and its tokens counted."""
        check, first = CompletionStream(self.model, self.max_tokens), None
        start = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, name=STREAM, stream=True, catch_response=True
        ) as response:
            if self.shed_ok and shed(response):
                return
            problem = status_problem(response)
            content_type = response.headers.get("content-type", "")
            if not problem and not content_type.startswith("text/event-stream"):
                problem = f"content-type {content_type!r}, not text/event-stream"
            try:
                for line in () if problem else response.iter_lines():
                    if check.feed(line.decode("utf-8", errors="replace")) and first is None:
                        first = time.perf_counter()
            except RequestException as error:  # a failure, not an unreported task error
                problem = f"stream broken after {check.tokens} tokens: {error}"
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            problem = problem or check.verdict()
            if problem:
                response.failure(problem)
                return
        GENERATED.stream_tokens += check.tokens
        if first is not None:
            events.request.fire(
                request_type="POST",
                name=TTFT,
                response_length=0,
                exception=None,
                response_time=(first - start) * 1000,
                context={},
            )


@events.init_command_line_parser.add_listener
def completion_options(parser: Any) -> None:
    """CompletionUser's options, given on Locust's command line like its own."""
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="CompletionUser's max_tokens"
    )
    parser.add_argument(
        "--stream-fraction",
        type=float,
        default=STREAM_FRACTION,
        help="the fraction of CompletionUser's requests that stream",
    )
    parser.add_argument(
        "--tokens-out",
        default="",
        help="where CompletionUser writes its token counts (JSON) at test stop",
    )


@events.init_command_line_parser.add_listener
def micro_options(parser: Any) -> None:
    """MicroOpUser's and StormUser's options (--shed-ok: CompletionUser's too)."""
    parser.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default="list",
        help="how operator calls send their tensors: JSON lists or base64 bytes",
    )
    parser.add_argument(
        "--check",
        choices=CHECKS,
        default="values",
        help="what operator answers are checked for (shape: for an echo server)",
    )
    parser.add_argument(
        "--shed-ok",
        action="store_true",
        help="MicroOpUser, CompletionUser: a 503 with Retry-After or a 504 is no failure "
        "(its own entry, 'shed <status>')",
    )


@events.test_stop.add_listener
def write_tokens(environment: Any, **_: Any) -> None:
    """GENERATED into --tokens-out, when given (one test per Locust process, as run.py runs it).
    With --processes, each worker writes its own `<tokens-out>.<pid>` (run.py sums them) and the
    master, which runs no users, nothing."""
    options = environment.parsed_options
    if not (options and options.tokens_out) or isinstance(environment.runner, MasterRunner):
        return
    suffix = f".{os.getpid()}" if isinstance(environment.runner, WorkerRunner) else ""
    with open(options.tokens_out + suffix, "w") as sink:
        json.dump(asdict(GENERATED), sink)


@events.test_start.add_listener
def register_storm_operator(environment: Any, **_: Any) -> None:
    """Make sure the storm operator exists before users start (run.py registered it already)."""
    if any(u.__name__ in ("StormUser", "StormAdmin") for u in environment.user_classes):
        VERSIONS.update(ensure_registered(environment.host))
