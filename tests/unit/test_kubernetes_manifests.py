"""deploy/kubernetes/: every manifest parses, and everything it names exists.

No cluster: the checks are what a typo would break at deploy time. Container args are parsed by
hybridq's own command line (click), after Kubernetes' ``$(VAR)`` expansion from the container's
env; probe paths are routes of the app ``hybridq serve`` builds; probe and Service ports are
container ports; volume mounts are pod volumes or claim templates, and the journal is on a claim;
Secret and ConfigMap references name objects and keys of the set; the autoscaler's metric is one
``/metrics`` emits, or is marked pending in the manifest.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from hybridq.cli import cli
from hybridq.http.app import create_app
from hybridq.http.config import ServeConfig
from hybridq.journal.paths import ensure_journal_dir, open_journal_dir

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
#: Metrics the manifests may name before hybridq emits them (each marked PENDING in its file).
PENDING_METRICS: dict[str, str] = {}


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
            assert volume_of(tokens) in volumes, "the tokens file is on a pod volume"
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


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def test_the_init_container_leaves_a_journal_directory_hybridq_opens(tmp_path: Path) -> None:
    """Emulate the kubelet, then run the init container's script and the forwarder's own checks.

    The kubelet mounts the claim's root group-writable (``fsGroup`` makes it 2775), and a
    Secret volume's files are root's. hybridq refuses a journal in a directory others may write
    (docs/security.md): the pod's init container must leave the journal directory user 999's,
    0700, under a root that only its owner writes, and the secrets 999's own 0400 files.
    """
    root = os.geteuid() == 0
    for sts in of_kind("StatefulSet"):
        pod = pod_of(sts)
        assert "fsGroup" not in pod.get("securityContext", {}), (
            "fsGroup makes the journal's volume group-writable"
        )
        ingest = next(c for c in pod["containers"] if option(expanded_args(c), "--journal"))
        journal = option(expanded_args(ingest), "--journal")
        assert journal is not None
        user = pod["securityContext"]["runAsUser"]
        # The paths of the pod, under tmp_path; the claim's root as fsGroup leaves it.
        mounts = {m["mountPath"] for c in [*pod.get("initContainers", []), ingest] for m in c["volumeMounts"]}
        for mount in mounts:
            (tmp_path / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
        claim = next(
            m["mountPath"] for m in ingest["volumeMounts"] if journal.startswith(m["mountPath"] + "/")
        )
        os.chmod(tmp_path / claim.lstrip("/"), 0o2775)
        secret_in = [v["secret"] for v in pod["volumes"] if "secret" in v]
        for c in pod.get("initContainers", []):
            for m in c["volumeMounts"]:
                for secret in secret_in:
                    if any(v["name"] == m["name"] and "secret" in v for v in pod["volumes"]):
                        for item in secret.get("items", []):
                            f = tmp_path / m["mountPath"].lstrip("/") / item["path"]
                            f.write_text(key_of("Secret", secret["secretName"], item["key"]))
                            f.chmod(0o400)
            script = c["command"][-1]
            pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
            script = re.sub(f"(?<![\\w/])({pattern})", lambda m: str(tmp_path) + m.group(1), script)
            if not root:  # run as this user: its own uid stands for root's and 999's
                script = script.replace("0:0", f"{os.getuid()}:{os.getgid()}")
                script = script.replace(f"{user}:{user}", f"{os.getuid()}:{os.getgid()}")
            subprocess.run(["sh", "-c", script], check=True)
        full = ensure_journal_dir(tmp_path / journal.lstrip("/"))  # the forwarder's checks
        os.close(open_journal_dir(full))
        st = os.stat(full)
        assert stat.S_IMODE(st.st_mode) == 0o700
        if root:
            assert st.st_uid == user
        for name in ("--tokens-file",):
            path = option(expanded_args(ingest), name)
            assert path is not None
            f = os.stat(tmp_path / path.lstrip("/"))
            assert stat.S_IMODE(f.st_mode) == 0o400
            assert not root or f.st_uid == user


def test_the_ingest_pod_has_a_startup_probe_for_its_journal_recovery() -> None:
    """/healthz answers once the journal is open, which checksums it: liveness waits for that."""
    for sts in of_kind("StatefulSet"):
        for c in pod_of(sts)["containers"]:
            probe = c.get("startupProbe")
            assert probe is not None, f"{c['name']}: no startupProbe (liveness would kill a long recovery)"
            budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
            assert budget >= 600, f"{c['name']}: the startup probe allows {budget} s, not 10 minutes"


def test_every_pod_and_container_runs_without_privileges() -> None:
    for w in workloads():
        pod = pod_of(w)
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert set(sc["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER"}, c["name"]
        for c in pod["containers"]:
            assert "runAsUser" not in c["securityContext"], f"{c['name']} runs as the pod's user"


def test_the_redis_password_comes_from_a_file_never_from_env() -> None:
    for _, c in containers():
        url = env_value(c, "HYBRIDQ_REDIS_URL")
        assert urllib.parse.urlsplit(url).password is None, f"{c['name']}: a password in the URL"
        password_file = next(v["value"] for v in c["env"] if v["name"] == "HYBRIDQ_REDIS_PASSWORD_FILE")
        assert any(password_file.startswith(m["mountPath"] + "/") for m in c["volumeMounts"])
        assert all("secretKeyRef" not in v.get("valueFrom", {}) for v in c["env"]), c["name"]


def test_the_ingest_tier_is_spread_and_drained_one_pod_at_a_time() -> None:
    for sts in of_kind("StatefulSet"):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        spread = pod_of(sts)["topologySpreadConstraints"]
        assert any(t["labelSelector"]["matchLabels"].items() <= labels.items() for t in spread)
        budgets = [
            b
            for b in of_kind("PodDisruptionBudget")
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(budgets) == 1, f"{sts['metadata']['name']}: no PodDisruptionBudget"
        assert budgets[0]["spec"].get("maxUnavailable") == 1


def test_a_workload_the_autoscaler_owns_sets_no_replicas() -> None:
    """``replicas`` in the manifest would reset the autoscaler's count at every ``kubectl apply``."""
    for hpa in of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert "replicas" not in named(ref["kind"], ref["name"])["spec"]
