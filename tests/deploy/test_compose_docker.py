"""docker-compose.yml against the Compose Specification's JSON schema (the one `docker compose config`
validates with, as vendored by check-jsonschema), plus what the schema cannot know: every service has a
memory limit and a healthcheck, the commands are real flags, files it mounts exist. Docker itself
cannot run on this machine."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import yaml
from kvstore.engine.cli import build_parser as engine_parser
from kvstore.engine.engine_args import EngineArgs
from kvstore.server.cli import build_parser as server_parser
from kvstore.server.config import load_configs

from kvstore.settings import parse_size
from tests.deploy.conftest import DEPLOY


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_file_is_valid_compose_spec() -> None:
    schema = json.loads(
        resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    jsonschema.validate(compose(), schema)
    broken = compose()
    broken["services"]["kvstore"]["healthcheck"]["interval"] = ["10s"]
    try:
        jsonschema.validate(broken, schema)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("the schema accepted a list as a healthcheck interval")


def test_every_service_has_a_memory_limit_and_a_healthcheck() -> None:
    services = compose()["services"]
    assert {"valkey", "kvstore", "engine", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert parse_size(svc["deploy"]["resources"]["limits"]["memory"].upper() + "B") > 0, name
        assert svc["healthcheck"]["test"][0] == "CMD", name
    assert parse_size("7GB") > parse_size("6GiB")  # the server's limit holds its cpu tier


def test_commands_are_real_flags() -> None:
    c = compose()
    services = c["services"]
    kv = services["kvstore"]
    assert kv["build"]["dockerfile"] == "deploy/Dockerfile" and kv["build"]["target"] == "server"
    assert "valkey" in kv["depends_on"] and kv["ports"] == ["127.0.0.1:8100:8100"]
    args = server_parser().parse_args(kv["command"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level") and v is not None}
    store, server = load_configs(**overrides)
    assert store.tiers == ["cpu", "disk", "redis"] and store.redis_url == "redis://valkey:6379/0"
    assert server.host == "0.0.0.0" and str(server.auth_token_file) == "/run/secrets/kvstore_token"
    assert server.engine_metrics == ["http://engine:8000"]
    eng = services["engine"]
    assert eng["build"]["target"] == "engine" and eng["profiles"] == ["engine"]
    ns = engine_parser().parse_args(eng["command"])
    engine = EngineArgs.from_cli_args(ns)
    assert (
        engine.kv_backend == "kvstore"
        and engine.kv_connector_extra_config["store_url"] == "http://kvstore:8100"
    )
    assert "--save" in services["valkey"]["command"]
    assert c["secrets"]["kvstore_token"]["file"] == "./secrets/kvstore_token"
    for svc in ("prometheus", "grafana"):
        for volume in services[svc]["volumes"]:
            assert (DEPLOY / volume.split(":")[0]).exists(), volume


def test_dockerfile_builds_both_images_with_the_constraints() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (DEPLOY.parent / src).exists(), src
    installs = [line for line in text.splitlines() if "pip install" in line and "--no-deps" not in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    assert '".[server]"' in text and '".[engine]"' in text
    assert 'ENTRYPOINT ["kvstore-server"]' in text and 'ENTRYPOINT ["kvstore-engine"]' in text
    assert "/healthz" in text and "/health'" in text
    assert (
        text.rstrip().splitlines()[-1].startswith("CMD")
        and "FROM base AS server" in text.split("FROM base AS engine")[1]
    )
