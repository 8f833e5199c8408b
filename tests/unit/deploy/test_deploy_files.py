"""deploy/rayservice.yaml against KubeRay's RayService CRD schema (and strict field
validation), its Serve config against what build_app takes, GPUs = tp and ports = the servers';
deploy/ray-cluster.yaml against Ray's cluster-launcher schema and Ray's own config checks; the
deploy README names only files that exist and every deployment file there."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, REPO, crd_schema, validate_builtin, validate_crd

from swaserve.cluster.defaults import DEFAULT_HTTP_PORT, DEFAULT_SERVE_GRPC_PORT

DEPLOY = REPO / "deploy"
README = DEPLOY / "README.md"
GPU = "nvidia.com/gpu"


def rayservice() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def serve_args() -> dict[str, Any]:
    (app,) = serve_config()["applications"]
    return app["args"]


def pod_templates() -> list[dict[str, Any]]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"] for group in groups]


def unknown_fields(doc: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """Paths in `doc` that `schema` does not declare: what `kubectl apply` (strict field
    validation, its default) refuses, though the CRD schema alone, lacking
    additionalProperties: false, lets them through."""
    found = []
    if isinstance(doc, dict) and "properties" in schema:
        for key, value in doc.items():
            if key not in schema["properties"]:
                found.append(f"{at}.{key}")
            else:
                found += unknown_fields(value, schema["properties"][key], f"{at}.{key}")
    elif isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            found += unknown_fields(item, schema["items"], f"{at}[{i}]")
    return found


def test_rayservice_validates_against_the_crd() -> None:
    doc = rayservice()
    validate_crd(doc)
    assert unknown_fields(doc, crd_schema("RayService")) == []
    for template in pod_templates():  # the pod templates as Pods, strictly (built-in schema)
        validate_builtin(
            {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], **template}
        )


def test_unknown_fields_finds_a_typo() -> None:
    doc = rayservice()
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    assert unknown_fields(doc, crd_schema("RayService")) == [
        ".spec.rayClusterConfig.workerGroupSpecs[0].replica"
    ]


def test_rayservice_gpus_per_worker_pod_equal_tp() -> None:
    args = serve_args()
    cluster = rayservice()["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert (args["tp_size"], args["replicas"]) == (2, 2)
    assert container["resources"]["limits"][GPU] == args["tp_size"]
    assert container["resources"]["requests"][GPU] == args["tp_size"]
    assert group["rayStartParams"]["num-gpus"] == str(args["tp_size"])
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == args["replicas"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert GPU not in json.dumps(head["resources"])


def test_rayservice_ports_are_the_servers() -> None:
    config = serve_config()
    assert config["http_options"]["port"] == DEFAULT_HTTP_PORT
    assert config["grpc_options"]["port"] == DEFAULT_SERVE_GRPC_PORT
    serve_yaml = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    assert (
        config["grpc_options"]["grpc_servicer_functions"]
        == serve_yaml["grpc_options"]["grpc_servicer_functions"]
    )
    service = rayservice()["spec"]["serveService"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {
        "http": (DEFAULT_HTTP_PORT, DEFAULT_HTTP_PORT),
        "grpc": (DEFAULT_SERVE_GRPC_PORT, DEFAULT_SERVE_GRPC_PORT),
    }
    (head,) = pod_templates()[0]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (container_ports["serve"], container_ports["grpc"]) == (
        DEFAULT_HTTP_PORT,
        DEFAULT_SERVE_GRPC_PORT,
    )


def test_rayservice_mounts_the_model_pvc_at_one_path_everywhere() -> None:
    model = serve_args()["model"]
    assert model == "/models/gpt-oss-120b"
    for template in pod_templates():
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "swaserve-models", "readOnly": True}
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
        assert model.startswith(mount["mountPath"] + "/")


def test_rayservice_image_and_ray_are_the_shipped_ones() -> None:
    build = (DEPLOY / "Dockerfile").read_text().splitlines()[0]
    words = shlex.split(build.lstrip("# ").split(": ", 1)[1])
    tag = words[words.index("-t") + 1]
    for template in pod_templates():
        (container,) = template["spec"]["containers"]
        assert container["image"] == tag == "swaserve:0.1.0"
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == chart_values["rayVersion"]


def test_rayservice_args_follow_serve_yaml() -> None:
    """The engine, router and Serve knobs of deploy/serve.yaml, with the PVC's model and the
    GPU worker groups of this file."""
    (app,) = serve_config()["applications"]
    assert app["import_path"] == "swaserve.cluster.serve:build_app"
    assert (app["name"], app["route_prefix"]) == ("swaserve", "/")
    (shipped,) = yaml.safe_load((DEPLOY / "serve.yaml").read_text())["applications"]
    knobs = {k: v for k, v in shipped["args"].items() if k not in ("replicas", "tp_size")}
    assert {k: app["args"][k] for k in knobs} == knobs
    assert set(app["args"]) - set(knobs) == {"model", "replicas", "tp_size", "use_gpu", "device"}


@pytest.mark.slow  # imports Ray Serve (about 30 s cold)
def test_rayservice_args_are_what_build_app_takes() -> None:
    from swaserve.cluster.serve import ServeAppArgs

    parsed = ServeAppArgs(**serve_args())
    parsed.check_extra()
    engine = parsed.engine_config()
    router = parsed.router_config()
    assert (parsed.replicas, parsed.use_gpu, parsed.max_ongoing_requests) == (2, True, 256)
    assert (engine.model, engine.tp_size, engine.device) == ("/models/gpt-oss-120b", 2, "cuda")
    assert (engine.chunked_prefill_size, engine.max_running_requests) == (2048, 256)
    assert (router.policy, router.max_queue_len, router.queue_timeout_s) == ("ttft", 1024, 30)


def ray_cluster() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())


def ray_schema_path() -> Path | None:
    """Ray's cluster-launcher schema in the installed `ray` (found without importing Ray)."""
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
    return path if path.is_file() else None


def test_ray_cluster_validates_against_rays_schema() -> None:
    import jsonschema

    config = ray_cluster()
    path = ray_schema_path()
    if path is None:  # an install without the schema: the launcher's keys at least
        assert {"cluster_name", "max_workers", "provider", "available_node_types"} <= set(config)
        assert config["head_node_type"] in config["available_node_types"]
        return
    jsonschema.Draft7Validator(json.loads(path.read_text())).validate(config)


def test_ray_cluster_schema_refuses_a_typo() -> None:
    import jsonschema

    path = ray_schema_path()
    if path is None:
        pytest.skip("the installed ray ships no autoscaler/ray-schema.json")
    config = ray_cluster()
    config["available_node_types"]["ray_gpu_worker"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        jsonschema.Draft7Validator(json.loads(path.read_text())).validate(config)


@pytest.mark.slow  # imports Ray
def test_ray_cluster_passes_ray_ups_own_checks() -> None:
    """What `ray up` does before it launches anything: merge the provider's defaults, check
    the node types, validate against the schema."""
    pytest.importorskip("ray")
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(ray_cluster())
    validate_config(config)
    assert config["provider"]["type"] == "gcp"
    assert config["head_node_type"] == "ray_head"
    assert config["available_node_types"]["ray_head"]["max_workers"] == 0


def ray_start_argv(commands: list[str]) -> list[str]:
    """The words after `ray start` in one of the start command lists."""
    (argv,) = [
        shlex.split(part)[2:]
        for command in commands
        for part in command.split(";")
        if shlex.split(part)[:2] == ["ray", "start"]
    ]
    return argv


@pytest.mark.slow  # imports Ray
def test_ray_start_commands_parse_with_rays_cli() -> None:
    pytest.importorskip("ray")
    from ray.scripts.scripts import start

    config = ray_cluster()
    head = start.make_context("start", ray_start_argv(config["head_start_ray_commands"])).params
    worker = start.make_context("start", ray_start_argv(config["worker_start_ray_commands"])).params
    assert (head["head"], head["port"], head["num_gpus"]) == (True, 6379, 0)
    assert head["autoscaling_config"] == "~/ray_bootstrap_config.yaml"
    assert head["dashboard_host"] == "0.0.0.0"
    assert (worker["head"], worker["address"]) == (False, f"$RAY_HEAD_IP:{head['port']}")


def test_ray_cluster_gpu_workers_hold_serve_yamls_worker_groups() -> None:
    config = ray_cluster()
    head = config["available_node_types"][config["head_node_type"]]
    (worker,) = [t for name, t in config["available_node_types"].items() if "min_workers" in t]
    (app,) = yaml.safe_load((DEPLOY / "serve.yaml").read_text())["applications"]
    tp, replicas = app["args"]["tp_size"], app["args"]["replicas"]
    groups_per_node = worker["resources"]["GPU"] // tp  # a TP group is STRICT_PACK: one node
    assert (head["resources"]["GPU"], worker["resources"]["GPU"], groups_per_node) == (0, 2, 2)
    assert groups_per_node * worker["min_workers"] >= replicas
    assert worker["max_workers"] <= config["max_workers"]


def test_ray_cluster_installs_this_checkout_with_the_gpu_extra() -> None:
    config = ray_cluster()
    assert config["file_mounts"] == {"~/swaserve": "."}
    assert '~/swaserve-venv/bin/pip install "$HOME/swaserve[gpu]"' in config["setup_commands"]


# `deploy/...` anywhere; in inline code, file names (a known extension, or Dockerfile*) and
# folders (a trailing /), relative to the repo or to deploy/. Not: `nvidia.com/gpu`, globs,
# URLs, absolute or home paths.
DEPLOY_PATH = re.compile(r"(?<![\w./~-])deploy/[\w.-]+(?:/[\w.-]+)*/?")
INLINE = re.compile(r"`([\w.-]+(?:/[\w.-]+)*/?)`")
FILE = re.compile(r"(?:.*/)?(?:Dockerfile[\w.]*|[\w.-]+\.(?:ya?ml|json|md|py|toml|tpl|txt))|.*/")


def named_paths(text: str) -> set[str]:
    """Files and folders the README names: repo paths (`deploy/...`, `helm/...`, `tests/...`)
    and names inside deploy/ (`serve.yaml`, `Dockerfile.cpu`, `grafana/...json`)."""
    names = {m.rstrip(".") for m in DEPLOY_PATH.findall(text)}
    names |= {token for token in INLINE.findall(text) if FILE.fullmatch(token)}
    return names


def test_readme_names_only_files_that_exist() -> None:
    names = named_paths(README.read_text())
    assert {"deploy/rayservice.yaml", "deploy/ray-cluster.yaml", "helm/swaserve/README.md"} <= names
    missing = [n for n in names if not (REPO / n).exists() and not (DEPLOY / n).exists()]
    assert missing == []


def test_readme_path_check_catches_a_missing_file() -> None:
    text = "Run `deploy/nope.yaml`, see `Dockerfile.gpu`, `helm/x/` and deploy/x/y.json."
    names = named_paths(text + " Ask for `nvidia.com/gpu`, mount `/dev/shm`.")
    assert names == {"deploy/nope.yaml", "Dockerfile.gpu", "helm/x/", "deploy/x/y.json"}


def test_readme_mentions_every_deployment_file() -> None:
    text = README.read_text()
    files = sorted(
        p.relative_to(DEPLOY).as_posix()
        for p in DEPLOY.rglob("*")
        if p.suffix in (".yaml", ".yml") or p.name.startswith("Dockerfile")
    )
    assert {"Dockerfile", "Dockerfile.cpu", "serve.yaml", "rayservice.yaml"} <= set(files)
    assert [f for f in files if f"deploy/{f}" not in text] == []
