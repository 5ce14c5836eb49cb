"""The shipped Serve configs and the app builder, checked without starting Serve."""

from __future__ import annotations

import importlib
from pathlib import Path

import pydantic
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serving.app import AppArgs, Backend, GpuosIngress, build_app, replica_gpus
from serving.config import ADMIN_TOKEN_ENV, STATE_DIR_ENV, CoalescerConfig
from serving.gateway import CompletionsGateway, GatewayArgs, build_gateway

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [REPO / "deployments" / name for name in ("llm.yaml", "multi.yaml", "llm-2gpu.yaml")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_name_the_builder_its_deployment_and_valid_knobs(path: Path) -> None:
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app_schema, *gateways = schema.applications
    assert builder(app_schema.import_path) is build_app and app_schema.route_prefix == "/"
    # Serve rejects a config whose deployment names do not exist in the built app.
    (deployment,) = app_schema.deployments
    assert deployment.name == GpuosIngress.name
    AppArgs.model_validate(app_schema.args)
    CoalescerConfig.model_validate(deployment.user_config)
    # Both completion routes go through a gateway to this app's replicas.
    assert sorted(g.route_prefix for g in gateways) == ["/v1/chat/completions", "/v1/completions"]
    for gateway in gateways:
        assert builder(gateway.import_path) is build_gateway
        args = GatewayArgs.model_validate(gateway.args)
        assert (args.app, args.deployment) == (app_schema.name, GpuosIngress.name)
        (relay,) = gateway.deployments
        assert relay.name == CompletionsGateway.name and relay.ray_actor_options.num_gpus in (
            None,
            0,
        )


def builder(import_path: str) -> object:
    module_name, attr = import_path.split(":")
    return getattr(importlib.import_module(module_name), attr)


def test_the_two_gpu_config_runs_two_replicas_of_one_gpu_each_on_cuda() -> None:
    schema = ServeDeploySchema.model_validate(
        yaml.safe_load((REPO / "deployments" / "llm-2gpu.yaml").read_text())
    )
    app_schema = schema.applications[0]
    (deployment,) = app_schema.deployments
    assert deployment.num_replicas == 2
    # Serve takes a config's ray_actor_options whole, over what the app builder chose.
    assert deployment.ray_actor_options.num_gpus == 1
    assert AppArgs.model_validate(app_schema.args).backend == "cuda"


@pytest.mark.parametrize(
    "args",
    [
        {"backend": "tpu"},
        {"backend": "cpu", "bakend": "cuda"},
        {"max_elements": 0},
        {"switch_interval_ms": 0},
    ],
)
def test_build_app_rejects_bad_args(args: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        build_app(args)


@pytest.mark.parametrize(
    ("backend", "cluster_gpus", "expected"),
    [("auto", 0.0, 0), ("auto", 2.0, 1), ("cuda", 1.0, 1), ("cpu", 4.0, 0)],
)
def test_replicas_reserve_a_gpu_only_when_one_exists_and_may_be_used(
    backend: Backend, cluster_gpus: float, expected: int
) -> None:
    assert replica_gpus(backend, cluster_gpus) == expected


def test_admin_token_and_state_dir_come_from_args_then_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    assert AppArgs().resolved_admin_token() is None  # admin disabled
    assert AppArgs().resolved_state_dir() == Path.home() / ".local" / "state" / "gpuos"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert AppArgs().resolved_admin_token() == "from-env"
    assert AppArgs().resolved_state_dir() == tmp_path
    args = AppArgs(admin_token="from-args", state_dir=str(tmp_path / "args"))
    assert args.resolved_admin_token() == "from-args"
    assert args.resolved_state_dir() == tmp_path / "args"
