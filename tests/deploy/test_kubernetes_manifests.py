"""deploy/kubernetes: every manifest loads into the official `kubernetes` client's models, and has no key a model does
not know (the client's from_dict drops unknown keys silently, so each mapping is compared with its model's
attribute_map, all the way down); the ServiceMonitor (a CRD, no model in the client) against a small schema of its own.
Then what the deployment must hold: the agent in the host's PID namespace on the NVIDIA runtime, the node's name as
its host, its database URL and secret from the Secret, and a ServiceMonitor that finds its /metrics."""

from __future__ import annotations

import re
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml

from tests.conftest import PROJECT_ROOT

MANIFESTS = PROJECT_ROOT / "deploy" / "kubernetes"
PRIMITIVE = {"str", "int", "float", "bool", "object", "datetime", "date", "bytearray"}
# the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), as much of it as a manifest here may use;
# "V1..." names are the client's models, checked the same way
SERVICE_MONITOR: dict[str, Any] = {
    "apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta",
    "spec": {
        "selector": "V1LabelSelector", "jobLabel": "str", "targetLabels": ["str"], "podTargetLabels": ["str"],
        "namespaceSelector": {"any": "bool", "matchNames": ["str"]},
        "endpoints": [{
            "port": "str", "targetPort": "object", "path": "str", "scheme": "str", "interval": "str",
            "scrapeTimeout": "str", "honorLabels": "bool", "honorTimestamps": "bool", "params": {"*": ["str"]},
            "relabelings": [{"action": "str", "sourceLabels": ["str"], "separator": "str", "targetLabel": "str",
                             "regex": "str", "modulus": "int", "replacement": "str"}],
            "metricRelabelings": [{"action": "str", "sourceLabels": ["str"], "separator": "str",
                                   "targetLabel": "str", "regex": "str", "modulus": "int", "replacement": "str"}],
        }],
    },
}


def unknown_keys(value: Any, kind: Any, path: str = "") -> list[str]:
    """Paths of the keys in `value` that its type `kind` (a client model's openapi type, or a schema above) lacks."""
    if isinstance(kind, dict):  # a schema of our own
        if not isinstance(value, dict):
            return [f"{path}: a mapping expected"]
        out = []
        for key, item in value.items():
            sub = kind.get(key, kind.get("*"))
            out += [f"{path}.{key}"] if sub is None else unknown_keys(item, sub, f"{path}.{key}")
        return out
    if isinstance(kind, list):
        if not isinstance(value, list):
            return [f"{path}: a list expected"]
        return [p for i, item in enumerate(value) for p in unknown_keys(item, kind[0], f"{path}[{i}]")]
    inner = re.fullmatch(r"(?:List\[|list\[)(.+)\]", kind)
    if inner:
        return unknown_keys(value, [inner.group(1)], path)
    inner = re.fullmatch(r"(?:Dict\[str, |dict\(str, )(.+)[\])]", kind)
    if inner:
        return unknown_keys(value, {"*": inner.group(1)}, path) if isinstance(value, dict) else \
            [f"{path}: a mapping expected"]
    if kind in PRIMITIVE:
        return []
    model = getattr(k8s, kind)
    if not isinstance(value, dict):
        return [f"{path}: a mapping expected for {kind}"]
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    out = []
    for key, item in value.items():
        if key not in by_json:
            out.append(f"{path}.{key} (not in {kind})")
        else:
            out += unknown_keys(item, model.openapi_types[by_json[key]], f"{path}.{key}")
    return out


def model_of(doc: dict[str, Any]) -> str:
    """The client's model name of a manifest: apps/v1 DaemonSet -> V1DaemonSet, v1 Service -> V1Service."""
    return doc["apiVersion"].rsplit("/", 1)[-1].capitalize() + doc["kind"]


def check(doc: dict[str, Any]) -> list[str]:
    """Problems of one manifest: unknown keys, or what its model refuses to load."""
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if doc.get("apiVersion") == "monitoring.coreos.com/v1" and doc.get("kind") == "ServiceMonitor":
        return [f"{name}{p}" for p in unknown_keys(doc, SERVICE_MONITOR)]
    kind = model_of(doc)
    if not hasattr(k8s, kind):
        return [f"{name}: no model {kind} in the kubernetes client"]
    problems = [f"{name}{p}" for p in unknown_keys(doc, kind)]
    try:
        getattr(k8s, kind).from_dict(doc)  # types and required fields, as the client checks them
    except Exception as exc:  # the client's own validation error, whatever its class
        problems.append(f"{name}: {exc}")
    return problems


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(MANIFESTS.glob("*.yaml"))}


def test_every_manifest_loads_with_no_unknown_key() -> None:
    found = manifests()
    assert set(found) == {"namespace.yaml", "secret.example.yaml", "agent-daemonset.yaml", "agent-service.yaml",
                          "servicemonitor.yaml"}
    problems = [p for docs in found.values() for doc in docs for p in check(doc)]
    assert problems == []


@pytest.mark.parametrize("typo", [("hostPID", "hostPid"), ("runtimeClassName", "runtimeClass"),
                                  ("fieldPath", "fieldpath"), ("honorLabels", "honourLabels")])
def test_a_misspelled_key_is_caught(typo: tuple[str, str]) -> None:
    right, wrong = typo
    text = "\n---\n".join((MANIFESTS / f).read_text() for f in ("agent-daemonset.yaml", "servicemonitor.yaml"))
    assert f"{right}:" in text
    docs = [d for d in yaml.safe_load_all(text.replace(f"{right}:", f"{wrong}:")) if d]
    problems = [p for doc in docs for p in check(doc)]
    # the unknown key first (a required one misspelled is also refused by its model)
    assert problems and problems[0].split(" ")[0].endswith(f".{wrong}"), problems


def test_a_missing_required_field_is_refused_by_the_model() -> None:
    doc = manifests()["agent-daemonset.yaml"][0]
    del doc["spec"]["selector"]
    assert [p for p in check(doc) if "selector" in p]


def test_the_agent_runs_as_the_deployment_needs() -> None:
    docs = {d["kind"]: d for ds in manifests().values() for d in ds}
    ds = k8s.V1DaemonSet.from_dict(docs["DaemonSet"])
    pod = ds.spec.template.spec
    assert pod.host_pid is True and pod.runtime_class_name == "nvidia"
    (agent,) = pod.containers
    env = {e.name: e for e in agent.env}
    assert env["FLEETLENS_HOST_ID"].value_from.field_ref.field_path == "spec.nodeName"
    for var, key in (("FLEETLENS_DB_URL", "db-url"), ("FLEETLENS_SECRET", "secret")):
        ref = env[var].value_from.secret_key_ref
        assert (ref.name, ref.key) == (docs["Secret"]["metadata"]["name"], key)
        assert key in docs["Secret"]["stringData"]
    assert env["NVIDIA_VISIBLE_DEVICES"].value == "all"
    assert not (agent.resources.limits or {}).get("nvidia.com/gpu")  # reads every GPU, takes none from the jobs
    assert agent.command[:2] == ["fleetlens", "agent"] and "--listen-address" in agent.command
    port = agent.ports[0]
    listen = agent.command[agent.command.index("--listen-address") + 1]
    assert listen == f":{port.container_port}" and port.name == "metrics"
    # the Service selects the agent's pods and names its port; the ServiceMonitor selects the Service and that port
    svc = k8s.V1Service.from_dict(docs["Service"])
    labels = ds.spec.template.metadata.labels
    assert svc.spec.selector.items() <= labels.items()
    assert svc.spec.ports[0].target_port == "metrics" and svc.spec.ports[0].name == "metrics"
    mon = docs["ServiceMonitor"]["spec"]
    assert mon["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    assert mon["namespaceSelector"]["matchNames"] == [svc.metadata.namespace]
    assert [e["port"] for e in mon["endpoints"]] == ["metrics"] and mon["endpoints"][0]["honorLabels"] is False
    assert {d["metadata"].get("namespace") for k, d in docs.items() if k != "Namespace"} == {
        docs["Namespace"]["metadata"]["name"]}


def test_the_agent_command_line_is_one_the_cli_accepts(capsys) -> None:
    from ui.cli import run as cli

    agent = manifests()["agent-daemonset.yaml"][0]["spec"]["template"]["spec"]["containers"][0]
    assert cli([*agent["command"][1:], "--help"]) == 0
    assert "--listen-address" in capsys.readouterr().out
