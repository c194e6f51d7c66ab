"""deploy/k8s against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict: unknown fields are
errors), plus what a schema cannot see: selectors match pod labels, probes hit real ports and paths,
commands are real flags, the ConfigMap is a valid kvstore config, scrape annotations are set."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from kvstore.engine.cli import build_parser as engine_parser
from kvstore.engine.engine_args import EngineArgs
from kvstore.server.cli import build_parser as server_parser
from kvstore.server.config import load_configs

from tests.deploy.conftest import DEPLOY

K8S = DEPLOY / "k8s"
VERSION = "1.30.0"


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_every_manifest_validates_against_the_kubernetes_schema() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "StatefulSet", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)
    bad = json.loads(json.dumps(by_kind("Deployment")["kvstore-server"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_kustomization_lists_every_file() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def workloads() -> dict[str, dict]:
    return {**by_kind("Deployment"), **by_kind("StatefulSet")}


def test_services_select_pods_and_probes_hit_container_ports() -> None:
    pods = {name: w["spec"]["template"] for name, w in workloads().items()}
    for name, svc in by_kind("Service").items():
        matched = [
            p for p in pods.values() if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()
        ]
        assert matched, f"service {name} selects no pod"
        ports = {port["name"] for p in matched for c in p["spec"]["containers"] for port in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)
    for name, w in workloads().items():
        assert (
            w["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )
        for c in w["spec"]["template"]["spec"]["containers"]:
            names = {p["name"] for p in c["ports"]}
            assert c["resources"]["limits"]["memory"], (name, c["name"])
            for probe in ("readinessProbe", "livenessProbe"):
                spec = c[probe]
                action = spec.get("httpGet") or spec.get("tcpSocket")
                if action is not None:
                    assert action["port"] in names, (name, probe)
                if "httpGet" in spec:
                    assert spec["httpGet"]["path"] in ("/healthz", "/health"), (name, probe)


def test_the_server_config_and_engine_commands_are_real(tmp_path) -> None:
    config = by_kind("ConfigMap")["kvstore-server"]["data"]["kvstore.yaml"]
    server = by_kind("Deployment")["kvstore-server"]["spec"]["template"]
    (container,) = server["spec"]["containers"]
    args = server_parser().parse_args(container["args"])
    assert args.config == "/etc/kvstore/kvstore.yaml"
    path = tmp_path / "kvstore.yaml"
    path.write_text(config)
    store, srv = load_configs(path)
    assert store.tiers == ["cpu", "disk", "redis"] and store.redis_url.startswith("redis://valkey-0.valkey:")
    assert srv.host == "0.0.0.0" and srv.port == 8100 and srv.engine_metrics
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/etc/kvstore" in mounts and str(srv.auth_token_file).rsplit("/", 1)[0] in mounts
    assert server["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    roles = {}
    for name in ("kvstore-prefill", "kvstore-decode"):
        pod = by_kind("Deployment")[name]["spec"]["template"]
        (engine,) = pod["spec"]["containers"]
        ns = engine_parser().parse_args(engine["args"])
        engine_args = EngineArgs.from_cli_args(ns)
        roles[name] = engine_args.kv_role
        assert engine_args.kv_connector_extra_config["store_url"] == "http://kvstore-server:8100"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert roles == {"kvstore-prefill": "kv_producer", "kvstore-decode": "kv_consumer"}
    (proxy,) = by_kind("Deployment")["kvstore-proxy"]["spec"]["template"]["spec"]["containers"]
    ns = engine_parser().parse_args(proxy["args"])
    assert ns.prefill == ["http://kvstore-prefill:8000"] and ns.decode == ["http://kvstore-decode:8000"]
    valkey = by_kind("StatefulSet")["valkey"]
    assert (
        valkey["spec"]["serviceName"] == "valkey"
        and by_kind("Service")["valkey"]["spec"]["clusterIP"] == "None"
    )
