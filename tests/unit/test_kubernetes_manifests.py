"""deploy/kubernetes/: every manifest parses, and everything it names exists.

No cluster: the checks are what a typo would break at deploy time. Container args are parsed by
hybridq's own command line (click), after Kubernetes' ``$(VAR)`` expansion from the container's
env; probe paths are routes of the app ``hybridq serve`` builds; probe and Service ports are
container ports; volume mounts are pod volumes or claim templates, and the journal is on a claim;
Secret and ConfigMap references name objects and keys of the set; the autoscaler's metric is one
``/metrics`` emits, or is marked pending in the manifest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from hybridq.cli import cli
from hybridq.http.app import create_app
from hybridq.http.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
#: Metrics the manifests may name before hybridq emits them (each marked PENDING in its file).
PENDING_METRICS = {"hybridq_queue_latency_seconds": "issue 29 adds it to the forwarder's /metrics"}


def load() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc["_file"] = path.name
                docs.append(doc)
    return docs


DOCS = load()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} named {name}, found {len(found)}"
    return found[0]


def workloads() -> list[dict[str, Any]]:
    return of_kind("StatefulSet") + of_kind("Deployment")


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def env_value(container: dict[str, Any], name: str) -> str:
    """A container env var's value: literal, or the ConfigMap/Secret key it comes from."""
    for var in container.get("env", []):
        if var["name"] != name:
            continue
        if "value" in var:
            return str(var["value"])
        ref = var["valueFrom"].get("configMapKeyRef") or var["valueFrom"]["secretKeyRef"]
        kind = "ConfigMap" if "configMapKeyRef" in var["valueFrom"] else "Secret"
        return key_of(kind, ref["name"], ref["key"])
    raise AssertionError(f"{container['name']}: no env var {name} for $({name})")


def key_of(kind: str, name: str, key: str) -> str:
    obj = named(kind, name)
    data = {**obj.get("data", {}), **obj.get("stringData", {})}
    assert key in data, f"{kind} {name} has no key {key}"
    return str(data[key])


def expanded_args(container: dict[str, Any]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded from the container's env, as the kubelet does."""
    words = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: env_value(container, m.group(1)), str(w)) for w in words]


def parse_hybridq(words: list[str]) -> click.Context:
    assert words[0] == "hybridq", words
    with click.Context(cli) as group:
        command = cli.get_command(group, words[1])
        assert command is not None, f"no command hybridq {words[1]}"
        return command.make_context(words[1], words[2:], parent=group)


def option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def test_every_manifest_parses_and_names_itself() -> None:
    assert MANIFESTS, "deploy/kubernetes/ holds no manifest"
    kinds = {d["kind"] for d in DOCS}
    assert {"StatefulSet", "Deployment", "Service", "Secret", "ConfigMap", "HorizontalPodAutoscaler"} <= kinds
    for doc in DOCS:
        assert doc.get("apiVersion"), doc["_file"]
        assert doc["metadata"].get("name"), doc["_file"]


@pytest.mark.parametrize(("workload", "container"), containers(), ids=lambda x: x.get("name", ""))
def test_container_args_are_real_hybridq_options(workload: dict[str, Any], container: dict[str, Any]) -> None:
    del workload
    ctx = parse_hybridq(expanded_args(container))  # a wrong option or value raises here
    assert ctx.command.name in {"forward", "worker", "serve"}


def test_the_ingest_pods_journal_is_on_their_own_claim_and_the_tokens_come_from_the_secret() -> None:
    ingest = of_kind("StatefulSet")
    assert ingest, "the ingest tier is a StatefulSet"
    for sts in ingest:
        claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
        pod = sts["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            words = expanded_args(c)
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}

            def volume_of(path: str, mounts: dict[str, str] = mounts) -> str:
                under = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
                assert under, f"{path} is on no mounted volume"
                return mounts[max(under, key=len)]

            journal = option(words, "--journal")
            assert journal is not None
            assert volume_of(journal) in claims, "the journal must be on the pod's PersistentVolumeClaim"
            assert option(words, "--serve") is not None
            tokens = option(words, "--tokens-file")
            assert tokens is not None, "a non-loopback --serve needs --tokens-file"
            secret = volumes[volume_of(tokens)]["secret"]
            item = next(i for i in secret["items"] if tokens.endswith("/" + i["path"]))
            key_of("Secret", secret["secretName"], item["key"])
        assert named("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_volume_mounts_are_volumes_or_claims() -> None:
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        known = {v["name"] for v in pod.get("volumes", [])}
        known |= {c["metadata"]["name"] for c in w["spec"].get("volumeClaimTemplates", [])}
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in known, f"{c['name']}: mount {m['name']} is no volume or claim"


def test_secret_and_configmap_references_exist() -> None:
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for var in c.get("env", []):
                ref = var.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    key_of("Secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
                if "configMapKeyRef" in ref:
                    key_of("ConfigMap", ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"])
        for v in pod.get("volumes", []):
            if "secret" in v:
                for item in v["secret"].get("items", []):
                    key_of("Secret", v["secret"]["secretName"], item["key"])


def routes(tmp_path: Path) -> set[str]:
    app = create_app(ServeConfig(journal=tmp_path / "journal"))
    return {getattr(r, "path", "") for r in app.routes}


def port_of(container: dict[str, Any], port: str | int) -> int:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"{container['name']} has no port {port}")


def test_probes_name_routes_on_the_served_port(tmp_path: Path) -> None:
    paths = routes(tmp_path)
    probed = 0
    for _, c in containers():
        words = expanded_args(c)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in c:
                continue
            get = c[probe]["httpGet"]
            assert get["path"] in paths, f"{c['name']}: {probe} {get['path']} is no route of hybridq serve"
            serve = option(words, "--serve")
            assert serve is not None
            assert port_of(c, get["port"]) == int(serve.rsplit(":", 1)[1])
            probed += 1
    assert probed, "no probe on /healthz"


def test_services_select_pods_and_target_their_ports() -> None:
    for svc in of_kind("Service"):
        selected = [
            w
            for w in workloads()
            if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for w in selected:
            for p in svc["spec"]["ports"]:
                assert any(
                    p["targetPort"] in {q.get("name"), q["containerPort"]}
                    for c in w["spec"]["template"]["spec"]["containers"]
                    for q in c.get("ports", [])
                ), f"Service {svc['metadata']['name']}: no container port {p['targetPort']}"
    for _, c in containers():
        words = expanded_args(c)
        if option(words, "--metrics-port") is not None:
            assert port_of(c, "metrics") == int(option(words, "--metrics-port") or 0)


def test_the_autoscaler_scales_a_workload_of_the_set_on_a_metric_hybridq_emits() -> None:
    emitted = (ROOT / "hybridq" / "ops" / "metrics.py").read_text()
    for hpa in of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        named(ref["kind"], ref["name"])
        for metric in hpa["spec"]["metrics"]:
            name = metric[metric["type"].lower()]["metric"]["name"]
            if f'"{name}"' in emitted:
                continue
            assert name in PENDING_METRICS, f"{name} is not emitted by the forwarder's /metrics"
            text = (ROOT / "deploy" / "kubernetes" / hpa["_file"]).read_text()
            assert f"PENDING: {name}" in text, f"{hpa['_file']} must mark {name} as pending"
