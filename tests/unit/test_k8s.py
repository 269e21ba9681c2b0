"""deploy/k8s: every core object is valid against Kubernetes' own schemas (kubernetes-validate, strict: an unknown
field is an error) for the oldest and the newest version it ships; the custom resources (InferencePool,
HTTPRoute, ScaledObject), for which it has no schema and says so, are checked against small schemas of the fields
this repository uses (written from the projects' API references, unknown fields refused) and by hand against the
Deployment: the selector matches its pods, the port is its container's, the autoscalers scale it and read metrics
that saker really exports."""

from __future__ import annotations

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servers import ROOT

kv = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt (kubernetes-validate)")

K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.29.0", kv.latest_version())
CUSTOM = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


def objects() -> list[tuple[str, dict]]:
    return [
        (path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]


def one(kind: str) -> dict:
    (found,) = [doc for _, doc in objects() if doc["kind"] == kind]
    return found


def container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container()["env"]}


def test_every_file_and_kind():
    assert {(name, doc["kind"]) for name, doc in objects()} == {
        ("saker.yaml", "PersistentVolumeClaim"),
        ("saker.yaml", "Deployment"),
        ("saker.yaml", "Service"),
        ("saker-gateway.yaml", "InferencePool"),
        ("saker-gateway.yaml", "HTTPRoute"),
        ("saker-keda.yaml", "ScaledObject"),
        ("saker-hpa.yaml", "HorizontalPodAutoscaler"),
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_core_objects_pass_the_kubernetes_schemas(version):
    for _, doc in objects():
        if (doc["apiVersion"], doc["kind"]) in CUSTOM:
            # no schema for a CRD: kubernetes-validate says so (the CLI warns and passes); checked below instead
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(doc, version, strict=True)
        else:
            kv.validate(doc, version, strict=True)  # raises ValidationError with the path of the fault


# -- the custom resources: the fields used here, as their API references define them ---------------------------------
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}  # Gateway API's Duration


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_META = _object(
    {"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}, "annotations": {"type": "object"}}, ["name"]
)
SCHEMAS = {
    # inference.networking.k8s.io/v1 InferencePool (Gateway API Inference Extension v1.x)
    "InferencePool": _object(
        {
            "apiVersion": {"const": "inference.networking.k8s.io/v1"},
            "kind": {"const": "InferencePool"},
            "metadata": _META,
            "spec": _object(
                {
                    "selector": _object(
                        {
                            "matchLabels": {
                                "type": "object",
                                "minProperties": 1,
                                "additionalProperties": {"type": "string"},
                            }
                        },
                        ["matchLabels"],
                    ),
                    "targetPorts": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 8,
                        "items": _object({"number": _PORT}, ["number"]),
                    },
                    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                    "endpointPickerRef": _object(
                        {
                            "group": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                            "port": _object({"number": _PORT}, ["number"]),
                            "failureMode": {"enum": ["FailOpen", "FailClose"]},
                        },
                        ["name"],
                    ),
                },
                ["selector", "targetPorts"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # gateway.networking.k8s.io/v1 HTTPRoute (the parts used)
    "HTTPRoute": _object(
        {
            "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
            "kind": {"const": "HTTPRoute"},
            "metadata": _META,
            "spec": _object(
                {
                    "parentRefs": {
                        "type": "array",
                        "minItems": 1,
                        "items": _object(
                            {
                                "group": {"type": "string"},
                                "kind": {"type": "string"},
                                "name": _NAME,
                                "namespace": _NAME,
                                "sectionName": _NAME,
                            },
                            ["name"],
                        ),
                    },
                    "hostnames": {"type": "array"},
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": _object(
                            {
                                "matches": {
                                    "type": "array",
                                    "items": _object(
                                        {
                                            "path": _object(
                                                {
                                                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                    "value": {"type": "string", "pattern": "^/"},
                                                },
                                                ["value"],
                                            )
                                        },
                                        [],
                                    ),
                                },
                                "backendRefs": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": _object(
                                        {
                                            "group": {"type": "string"},
                                            "kind": {"type": "string"},
                                            "name": _NAME,
                                            "port": _PORT,
                                            "weight": {"type": "integer"},
                                        },
                                        ["name"],
                                    ),
                                },
                                "timeouts": _object({"request": _DURATION, "backendRequest": _DURATION}, []),
                            },
                            [],
                        ),
                    },
                },
                ["parentRefs", "rules"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    # keda.sh/v1alpha1 ScaledObject (KEDA 2.x)
    "ScaledObject": _object(
        {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _META,
            "spec": _object(
                {
                    "scaleTargetRef": _object(
                        {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME}, ["name"]
                    ),
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "advanced": _object(
                        {"horizontalPodAutoscalerConfig": _object({"name": _NAME, "behavior": {"type": "object"}}, [])},
                        [],
                    ),
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": _object(
                            {
                                "type": {"type": "string"},
                                "name": _NAME,
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                            ["type", "metadata"],
                        ),
                    },
                },
                ["scaleTargetRef", "triggers"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
}


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_custom_resources_have_the_documented_shape(kind):
    import jsonschema

    jsonschema.validate(one(kind), SCHEMAS[kind])


def test_the_schemas_catch_old_field_names():
    """v1alpha2's ``targetPortNumber`` and ``extensionRef`` are not v1's fields."""
    import jsonschema

    old = yaml.safe_load("""
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: saker}
spec: {selector: {matchLabels: {app: saker}}, targetPortNumber: 8000, extensionRef: {name: saker-epp}}
""")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(old, SCHEMAS["InferencePool"])


# -- everything fits the Deployment ---------------------------------------------------------------------------------
def test_inference_pool_selects_the_deployments_pods_on_their_port():
    pool, route, deployment = one("InferencePool"), one("HTTPRoute"), one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = pool["spec"]["targetPorts"]
    assert port["number"] == container()["ports"][0]["containerPort"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["number"])  # the EPP scrapes /metrics there too
    assert pool["spec"]["endpointPickerRef"]["name"] == pool["metadata"]["name"] + "-epp"  # the chart's naming
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_probes_and_drain():
    c, spec = container(), one("Deployment")["spec"]["template"]["spec"]
    values = env()
    drain, graceful = float(values["SAKER_DRAIN_SECONDS"]), int(values["SAKER_GRACEFUL_TIMEOUT"])
    assert drain == 10
    assert spec["terminationGracePeriodSeconds"] > drain + graceful
    ready = c["readinessProbe"]
    # the probe has seen the 503 (and the endpoints dropped the pod) well before the replica stops accepting
    assert ready["periodSeconds"] * ready["failureThreshold"] <= drain
    assert "lifecycle" not in c  # no preStop sleep: the drain is the pause
    from app.settings import Settings

    assert "drain_seconds" in Settings.model_fields


def test_autoscalers_scale_the_deployment_on_metrics_saker_exports(gpt2_client):
    deployment, keda, hpa = one("Deployment"), one("ScaledObject"), one("HorizontalPodAutoscaler")
    name = deployment["metadata"]["name"]
    for scaler in (keda, hpa):
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", name)
    assert keda["spec"]["minReplicaCount"] >= 1 and hpa["spec"]["minReplicas"] >= 1  # no scale to zero
    assert keda["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    served = env()["SAKER_SERVED_MODEL_NAME"]
    assert "vllm:num_requests_waiting" in query and "vllm:num_requests_running" in query
    assert query.count(f'model_name="{served}"') == 2
    hpa_metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert hpa_metrics == {"saker_queue_depth", "saker_requests_running"}
    # those names are on a real /metrics (the vLLM ones with their model_name label)
    text = gpt2_client.get("/metrics").get_data(as_text=True)
    exported = {
        (s.name, s.labels.get("model_name")) for family in text_string_to_metric_families(text) for s in family.samples
    }
    for metric in hpa_metrics:
        assert (metric, None) in exported, metric
    for metric in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert (metric, "tiny-gpt2") in exported, metric
