"""The Helm chart rendered by Helm's library for the defaults and a table of value sets:
lint, strict validation of every built-in manifest, KubeRay CRD schemas, the values schema,
GPUs = tp, ports and probes = the servers' defaults, the Serve args = what build_app takes."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    REPO,
    by_kind,
    notes,
    render,
    validate_builtin,
    validate_crd,
)

from swaserve.cluster.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_SERVE_GRPC_PORT

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's library) missing")

GPU_TYPES = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "NVIDIA-L4"]
PLAIN_TLS = {
    "mode": "plain",
    "tls": {"enabled": True, "secretName": "swaserve-tls"},
    "auth": {"tokenSecret": {"name": "swaserve-token"}, "apiKeySecret": {"name": "swaserve-key"}},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{f"tp{tp}": {"tensorParallelSize": tp} for tp in (1, 2, 4, 8)},
    **{f"replicas{n}": {"replicas": n, "tensorParallelSize": 2} for n in (1, 3, 16)},
    **{f"gpu-{g}": {"gpu": {"product": g}, "tensorParallelSize": 8} for g in GPU_TYPES},
    "amd": {"gpu": {"resourceName": "amd.com/gpu"}, "tensorParallelSize": 4},
    "demo": {"demo": {"enabled": True}, "replicas": 2, "tensorParallelSize": 2},
    "demo-plain": {"mode": "plain", "demo": {"enabled": True}},
    "plain-tp4": {"mode": "plain", "tensorParallelSize": 4, "replicas": 2},
    "plain-tls": PLAIN_TLS,
    "plain-mtls": {**PLAIN_TLS, "tls": {**PLAIN_TLS["tls"], "mutual": True}},
    "servicemonitor": {
        "serviceMonitor": {"enabled": True},
        "grafana": {"dashboard": {"enabled": True}},
    },
    "plain-servicemonitor": {**PLAIN_TLS, "serviceMonitor": {"enabled": True}},
    "uri": {
        "model": {"source": "uri", "uri": ":s3,env_auth=true:models/gpt-oss-20b"},
        "engine": {"kv_cache_bytes": 80_000_000_000, "swa_full_tokens_ratio": 0.5},
    },
    "hostpath": {"model": {"source": "hostPath", "hostPath": {"path": "/data/gpt-oss-120b"}}},
    "knobs": {
        "engine": {
            "page_size": 16,
            "max_total_tokens": 1_000_000,
            "chunked_prefill_size": 8192,
            "swa_full_tokens_ratio": 1,
            "enable_prefix_cache": False,
            "schedule_policy": "lpm",
            "speculative_method": "ngram",
            "num_speculative_tokens": 4,
        },
        "router": {"policy": "least_load", "prefix_load_weight": 0.5, "queue_timeout_s": 2.5},
        "limits": {"requests_per_second": 2.5, "burst": 10, "max_tokens": 4096, "max_n": 4},
    },
}


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = by_kind(docs, "RayService")
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def serve_args(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (app,) = serve_config(docs)["applications"]
    return app["args"]


def worker_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(replicas, pod spec) of the worker pods, whichever the mode."""
    services = by_kind(docs, "RayService")
    if services:
        groups = services[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        return [{"replicas": g["replicas"], "spec": g["template"]["spec"]} for g in groups]
    (deploy,) = [
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-worker")
    ]
    return [{"replicas": deploy["spec"]["replicas"], "spec": deploy["spec"]["template"]["spec"]}]


def plain_serve_argv(docs: list[dict[str, Any]]) -> list[str]:
    """The `swaserve serve ...` argv of the plain head's shell command."""
    (head,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-head")]
    (container,) = head["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/bash", "-ec"]
    words = shlex.split(container["args"][0])
    start = words.index("swaserve")
    return words[start:]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_renders_and_validates(name: str) -> None:
    docs = render(VALUE_SETS[name])
    kinds = {d["kind"] for d in docs}
    assert kinds & {"RayService", "Deployment"}
    for doc in docs:
        if doc["kind"] in ("RayService", "RayCluster"):
            validate_crd(doc)
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a Prometheus-operator CRD: checked in test_service_monitor_scrapes_http
        else:
            validate_builtin(doc)


def test_lint_reports_no_errors() -> None:
    for values in (None, VALUE_SETS["plain-tls"], VALUE_SETS["demo"]):
        report = helm.lint(str(CHART), values, strict=False)
        errors = [m for m in report["messages"] if m["severity"] >= 3]
        assert report["errors"] == [] and errors == [], report


@pytest.mark.parametrize(
    "bad",
    [
        {"tensorParallelSize": 0},
        {"replicas": -1},
        {"replicas": 0},
        {"engine": {"swa_full_tokens_ratio": 0}},
        {"engine": {"swa_full_tokens_ratio": 1.5}},
        {"engine": {"swa_full_tokens_ratio": "half"}},
        {"router": {"policy": "random"}},
        {"ports": {"http": 70000}},
        {"ports": {"grpc": 0}},
        {"mode": "docker"},
        {"engine": {"no_such_knob": 1}},
        {"tensorParalelSize": 2},
    ],
)
def test_values_schema_rejects_nonsense(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)
        with pytest.raises(helm.HelmValuesError):
            chart.render(values=bad, name="sw")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["rayservice", "plain"])
def test_gpus_per_worker_pod_equal_tp(tp: int, mode: str) -> None:
    docs = render({"mode": mode, "tensorParallelSize": tp, "replicas": 3})
    (group,) = worker_pods(docs)
    assert group["replicas"] == 3
    (container,) = group["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
    if mode == "rayservice":
        args = serve_args(docs)
        assert (args["tp_size"], args["replicas"], args["use_gpu"]) == (tp, 3, True)
    else:
        assert f"--num-gpus={tp}" in container["args"][0].split()
        argv = plain_serve_argv(docs)
        assert argv[argv.index("--tp-size") + 1] == str(tp)


def test_gpu_product_pins_the_workers_only() -> None:
    docs = render({"gpu": {"product": "NVIDIA-H100-80GB-HBM3"}})
    (group,) = worker_pods(docs)
    assert group["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    (service,) = by_kind(docs, "RayService")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert "nodeSelector" not in head["template"]["spec"]
    assert head["rayStartParams"]["num-gpus"] == "0"


@pytest.mark.parametrize("mode", ["rayservice", "plain"])
def test_demo_requests_no_gpu(mode: str) -> None:
    docs = render({"mode": mode, "demo": {"enabled": True}, "tensorParallelSize": 2})
    text = json.dumps(docs)
    assert "nvidia.com/gpu" not in text
    (group,) = worker_pods(docs)
    (container,) = group["spec"]["containers"]
    assert container["image"] == "swaserve:0.1.0-cpu"
    if mode == "rayservice":
        args = serve_args(docs)
        assert "model" not in args and args["device"] == "cpu" and args["use_gpu"] is False
    else:
        assert "--model" not in plain_serve_argv(docs)


def test_rayservice_ports_are_the_servers() -> None:
    docs = render()
    config = serve_config(docs)
    assert config["http_options"]["port"] == DEFAULT_HTTP_PORT
    assert config["grpc_options"]["port"] == DEFAULT_SERVE_GRPC_PORT
    serve_yaml = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    assert (
        config["grpc_options"]["grpc_servicer_functions"]
        == serve_yaml["grpc_options"]["grpc_servicer_functions"]
    )
    assert serve_yaml["http_options"]["port"] == DEFAULT_HTTP_PORT
    assert serve_yaml["grpc_options"]["port"] == DEFAULT_SERVE_GRPC_PORT
    (service,) = by_kind(docs, "RayService")
    ports = {p["name"]: p["port"] for p in service["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"http": DEFAULT_HTTP_PORT, "grpc": DEFAULT_SERVE_GRPC_PORT}
    (head,) = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert container_ports["serve"] == DEFAULT_HTTP_PORT
    assert container_ports["grpc"] == DEFAULT_SERVE_GRPC_PORT
    # KubeRay's own probes stay (raylet / GCS; Serve's /-/healthz on workers): none set here
    assert "readinessProbe" not in head and "livenessProbe" not in head


def test_plain_ports_and_probes_are_the_servers() -> None:
    docs = render({"mode": "plain"})
    argv = plain_serve_argv(docs)
    assert argv[argv.index("--grpc-port") + 1] == str(DEFAULT_GRPC_PORT)
    assert argv[argv.index("--http-port") + 1] == str(DEFAULT_HTTP_PORT)
    (head,) = [
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "sw-swaserve-head"
    ]
    (container,) = head["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http"]) == (DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": DEFAULT_GRPC_PORT}
    service = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "sw-swaserve")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": DEFAULT_GRPC_PORT,
        "http": DEFAULT_HTTP_PORT,
    }


def test_plain_tls_probes_http_health_and_mounts_the_secret() -> None:
    docs = render(PLAIN_TLS)
    argv = plain_serve_argv(docs)
    head = next(
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "sw-swaserve-head"
    )
    spec = head["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert argv[argv.index("--tls-cert-file") + 1] == "/etc/swaserve/tls/tls.crt"
    assert argv[argv.index("--tls-key-file") + 1] == "/etc/swaserve/tls/tls.key"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert (
        mount["mountPath"] == "/etc/swaserve/tls"
        and volume["secret"]["secretName"] == "swaserve-tls"
    )
    # kubelet's grpc probe speaks no TLS: /health over HTTPS (the HTTP API is TLS only too)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert env == {
        "SWASERVE_AUTH_TOKEN": {"name": "swaserve-token", "key": "token"},
        "SWASERVE_API_KEY": {"name": "swaserve-key", "key": "api-key"},
    }


def test_plain_mutual_tls_asks_client_certificates_and_probes_with_the_pods_own() -> None:
    """kubelet's probes present no client certificate: with mutual TLS they exec `swaserve
    client --health` with the pod's certificate, checking the server's against the Service's
    DNS name (or tls.serverName)."""
    from swaserve.cluster.cli import build_parser

    for server_name, want in (("", "sw-swaserve.serving.svc"), ("api.example", "api.example")):
        tls = {**PLAIN_TLS["tls"], "mutual": True, "serverName": server_name}
        docs = render({**PLAIN_TLS, "tls": tls})
        argv = plain_serve_argv(docs)
        assert argv[argv.index("--tls-ca-file") + 1] == "/etc/swaserve/tls/ca.crt"
        head = next(
            d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "sw-swaserve-head"
        )
        (container,) = head["spec"]["template"]["spec"]["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            server = f"127.0.0.1:{DEFAULT_GRPC_PORT}"
            assert command[:5] == ["swaserve", "client", "--server", server, "--health"]
            flags = dict(zip(command[5::2], command[6::2], strict=True))
            assert flags == {
                "--timeout-s": str(container[probe]["timeoutSeconds"] - 1),
                "--tls-ca-file": "/etc/swaserve/tls/ca.crt",
                "--tls-cert-file": "/etc/swaserve/tls/tls.crt",
                "--tls-key-file": "/etc/swaserve/tls/tls.key",
                "--tls-server-name": want,
            }
            args = build_parser().parse_args(command[1:])  # the probe is the CLI's command
            assert args.health and args.tls_server_name == want
    assert "--tls-ca-file" not in plain_serve_argv(render(PLAIN_TLS))


@pytest.mark.parametrize(
    "values",
    [{"tls": {"enabled": True, "secretName": "t"}}, {"auth": {"tokenSecret": {"name": "t"}}}],
)
def test_rayservice_refuses_what_serve_cannot_do(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError, match="mode=plain"):
        render(values)


def test_rayservice_takes_the_api_key_from_a_secret_in_every_pods_environment() -> None:
    """The Serve app reads $SWASERVE_API_KEY (`ServeAppArgs.resolved_api_key`) wherever its
    ingress replica runs: every pod gets it from the Secret, the RayService never holds it."""
    docs = render({"auth": {"apiKeySecret": {"name": "swaserve-key"}}})
    (service,) = by_kind(docs, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]
    ]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["SWASERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "swaserve-key",
            "key": "api-key",
        }
    assert "api_key" not in serve_args(docs)
    assert "swaserve-key" not in service["spec"]["serveConfigV2"]


@pytest.mark.parametrize("name", ["servicemonitor", "plain-servicemonitor"])
def test_service_monitor_scrapes_http(name: str) -> None:
    docs = render(VALUE_SETS[name])
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = [
        d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "sw-swaserve-metrics"
    ]
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert port["targetPort"] == DEFAULT_HTTP_PORT
    labels = service["metadata"]["labels"]
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    if name == "plain-servicemonitor":  # the API key guards /metrics too
        assert endpoint["authorization"]["credentials"] == {
            "name": "swaserve-key",
            "key": "api-key",
        }


def test_dashboard_configmap_is_the_deploy_dashboard() -> None:
    docs = render(VALUE_SETS["servicemonitor"])
    (config_map,) = by_kind(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "swaserve-dashboard.json").read_text())
    assert json.loads(config_map["data"]["swaserve-dashboard.json"]) == shipped


def test_pdb_selects_the_worker_pods() -> None:
    for mode in ("rayservice", "plain"):
        docs = render({"mode": mode})
        (pdb,) = by_kind(docs, "PodDisruptionBudget")
        (group,) = worker_pods(docs)
        del group
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == "worker"
        assert pdb["spec"]["maxUnavailable"] == 1


def test_uri_source_downloads_into_the_cache_claim() -> None:
    docs = render(VALUE_SETS["uri"])
    (claim,) = by_kind(docs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "sw-swaserve-model-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (group,) = worker_pods(docs)
    (init,) = group["spec"]["initContainers"]
    assert init["env"] == [{"name": "MODEL_URI", "value": ":s3,env_auth=true:models/gpt-oss-20b"}]
    assert 'dest="/models/model"' in init["args"][0]
    volume = next(v for v in group["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "sw-swaserve-model-cache"}
    args = serve_args(docs)
    assert args["model"] == "/models/model"
    assert args["kv_cache_bytes"] == 80_000_000_000  # an int, not 8e+10
    assert args["swa_full_tokens_ratio"] == 0.5


def test_notes_tell_how_to_reach_the_service() -> None:
    text = notes()
    assert "svc/sw-swaserve-serve 8000:8000 9000:9000" in text
    assert "application: swaserve" in text
    plain = notes({"mode": "plain"})
    assert "svc/sw-swaserve 50051:50051 8000:8000" in plain
    assert "swaserve client --server 127.0.0.1:50051" in plain


def test_values_defaults_match_the_servers() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["ports"] == {
        "http": DEFAULT_HTTP_PORT,
        "grpc": DEFAULT_GRPC_PORT,
        "serveGrpc": DEFAULT_SERVE_GRPC_PORT,
    }
    assert set(values) >= {"replicas", "tensorParallelSize"}


def test_engine_and_router_values_are_derived_from_the_config_models() -> None:
    """The chart's schema sections are what `knobs.helm_values_schema` makes of the configs
    (`python -m swaserve.cluster.knobs` rewrites them), and values.yaml lists every knob."""
    from swaserve.cluster.ingress_limits import IngressLimits
    from swaserve.cluster.knobs import (
        HELM_ENGINE_VALUES,
        LIMIT_FLAGS,
        ROUTER_FLAGS,
        helm_values_schema,
    )
    from swaserve.router import RouterConfig
    from swaserve.worker import EngineConfig

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert schema["engine"] == helm_values_schema(EngineConfig, HELM_ENGINE_VALUES)
    assert schema["router"] == helm_values_schema(RouterConfig, ROUTER_FLAGS)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["engine"]) == set(HELM_ENGINE_VALUES)
    assert set(HELM_ENGINE_VALUES) == set(EngineConfig.model_fields) - {
        "model",
        "tp_size",
        "device",
    }
    assert set(values["router"]) == set(RouterConfig.model_fields)
    assert schema["limits"] == helm_values_schema(IngressLimits, LIMIT_FLAGS)
    assert set(values["limits"]) == set(IngressLimits.model_fields)


def schema_choices(prop: dict[str, object]) -> set[object]:
    """The values a schema property allows when it is a choice (enum, const, boolean)."""
    out: set[object] = set()
    for option in prop.get("anyOf", [prop]):  # type: ignore[union-attr]
        out |= set(option.get("enum", ()))
        if "const" in option:
            out.add(option["const"])
        if option.get("type") == "boolean":
            out |= {True, False}
    return out


def test_the_chart_schema_offers_the_choices_the_code_has() -> None:
    """Every choice of the engine and router values is the code's own list (the routing
    policies are `POLICIES`; `test_values_schema_rejects_nonsense` tries values outside)."""
    from swaserve.router import POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert schema_choices(schema["router"]["properties"]["policy"]) == set(POLICIES)
    engine = schema["engine"]["properties"]
    assert schema_choices(engine["compile"]) == {True, False, "auto"}
    assert schema_choices(engine["dtype"]) == {"auto", "float32", "bfloat16", "float16"}
    assert schema_choices(engine["attention_backend"]) == {"auto", "torch", "flash"}


@pytest.mark.parametrize("name", ["defaults", "plain-tp4", "plain-tls", "knobs", "demo-plain"])
def test_plain_serve_command_parses_with_the_cli(name: str) -> None:
    from swaserve.cluster.cli import build_parser
    from swaserve.cluster.ingress_limits import IngressLimits
    from swaserve.cluster.knobs import ENGINE_FLAGS, LIMIT_FLAGS, ROUTER_FLAGS, config_overrides
    from swaserve.router import RouterConfig
    from swaserve.worker import EngineConfig

    values = {**VALUE_SETS[name], "mode": "plain"}
    argv = plain_serve_argv(render(values))
    args: argparse.Namespace = build_parser().parse_args(argv[1:])
    assert args.ray_address == "auto" and args.host == "0.0.0.0"
    engine = EngineConfig(model=args.model or "/models", **config_overrides(args, ENGINE_FLAGS))
    router = RouterConfig(**config_overrides(args, ROUTER_FLAGS, prefix="router_"))
    limits = IngressLimits(**config_overrides(args, LIMIT_FLAGS, prefix="limit_"))
    assert engine.tp_size == values.get("tensorParallelSize", 1)
    assert limits == IngressLimits(**values.get("limits", {}))
    if name == "knobs":
        assert (engine.page_size, engine.max_total_tokens, engine.enable_prefix_cache) == (
            16,
            1_000_000,
            False,
        )
        assert (engine.speculative_method, engine.num_speculative_tokens) == ("ngram", 4)
        assert (router.policy, router.prefix_load_weight, router.queue_timeout_s) == (
            "least_load",
            0.5,
            2.5,
        )


@pytest.mark.slow  # imports Ray Serve (about 15 s cold)
@pytest.mark.parametrize("name", ["defaults", "tp8", "demo", "uri", "knobs"])
def test_serve_config_is_what_build_app_takes(name: str, tmp_path, monkeypatch) -> None:
    from swaserve.cluster.ingress_limits import IngressLimits
    from swaserve.cluster.serve import ServeAppArgs

    monkeypatch.setenv("SWASERVE_CACHE_DIR", str(tmp_path))  # the demo model, if made
    config = serve_config(render(VALUE_SETS[name]))
    (app,) = config["applications"]
    assert app["import_path"] == "swaserve.cluster.serve:build_app"
    parsed = ServeAppArgs(**app["args"])
    parsed.check_extra()
    engine = parsed.engine_config()
    router = parsed.router_config()
    assert engine.tp_size == VALUE_SETS[name].get("tensorParallelSize", 1)
    assert router.policy == VALUE_SETS[name].get("router", {}).get("policy", "ttft")
    spec = VALUE_SETS[name].get("engine", {}).get("speculative_method")
    assert engine.speculative_method == spec  # Helm values → Serve app args → the engine
    assert parsed.limits().model_dump() == {
        **IngressLimits().model_dump(),
        **VALUE_SETS[name].get("limits", {}),
    }
