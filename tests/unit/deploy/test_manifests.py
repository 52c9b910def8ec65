"""The deploy manifests: what `serve deploy` and `kubectl apply` would accept and wire up.

The Serve configs are checked with Ray's own schema and by building the application the
way Serve does from `import_path` and `args`; the KubeRay manifests for the wiring between
them (the embedded Serve config, GPUs, the Secrets, the PVCs, Redis and its password, the
gRPC Service).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlparse

import pytest
import ray
import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from services.common.auth import ApiKeys
from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.gateway.serve_app import AppArgs

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
KUBERAY = DEPLOY / "kuberay"
GATEWAY_RESOURCE = "coxswain_gateway"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def secret(name: str) -> dict:
    (found,) = [
        d
        for d in documents(KUBERAY / "secret.example.yaml")
        if d["kind"] == "Secret" and d["metadata"]["name"] == name
    ]
    return found


def rayservice() -> dict:
    return only(documents(KUBERAY / "rayservice.yaml"), "RayService")


def embedded_config() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


SERVE_CONFIGS = {
    "serve_config.yaml": lambda: documents(DEPLOY / "serve_config.yaml")[0],
    "serve_config.cpu.yaml": lambda: documents(DEPLOY / "serve_config.cpu.yaml")[0],
    "rayservice.yaml serveConfigV2": embedded_config,
}
GPU_CONFIGS = ("serve_config.yaml", "rayservice.yaml serveConfigV2")


@pytest.fixture(params=list(SERVE_CONFIGS))
def config(request) -> dict:
    return SERVE_CONFIGS[request.param]()


def app_of(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def deployment(config: dict, name: str) -> dict:
    (d,) = [d for d in app_of(config)["deployments"] if d["name"] == name]
    return d


def unknown_keys(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """Keys of `data` that `model` (recursively) has no field for. Ray's schemas ignore
    unknown keys, so a misspelt option would otherwise be dropped without a word."""
    if not isinstance(data, dict):
        return []
    fields = {}
    for name, f in model.model_fields.items():
        fields[name] = f
        if f.alias:
            fields[f.alias] = f
    out = []
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            out.append(f"{where}{key}")
            continue
        for sub in _models_in(f.annotation):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                out += unknown_keys(sub, item, f"{where}{key}[{i}].")
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def built_deployments(config: dict) -> tuple[str, dict[str, Any]]:
    """Build the application as Serve does for a config: import the builder, call it with
    `args`, walk the bound graph. Returns the ingress name and the deployments by name."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    try:
        from ray._common.utils import import_attr
    except ImportError:  # older Ray
        from ray._private.utils import import_attr

    app = app_of(config)
    bound = call_user_app_builder_with_args_if_necessary(
        import_attr(app["import_path"]), app["args"]
    )
    built = build_app(bound, name=app["name"])
    return built.ingress_deployment_name, {d.name: d for d in built.deployments}


# -- the Serve configs -------------------------------------------------------------------------


def test_serve_config_validates_with_rays_schema(config):
    schema = ServeDeploySchema.model_validate(config)
    assert unknown_keys(ServeDeploySchema, config) == []
    (app,) = schema.applications
    assert app.name == "coxswain"
    assert app.route_prefix == "/"
    assert app.import_path == "services.gateway.serve_app:build_app"
    assert {d.name for d in app.deployments} == {"Gateway", "Engine"}


def test_application_builds_with_the_configured_deployments(config):
    ingress, deployments = built_deployments(config)
    assert ingress == "Gateway"
    assert set(deployments) == {d["name"] for d in app_of(config)["deployments"]}
    for d in app_of(config)["deployments"]:
        options = {k: v for k, v in d.items() if k != "name"}
        deployments[d["name"]].options(**options)  # Ray checks every value here


def test_args_are_the_apps_own(config):
    args = AppArgs.model_validate(app_of(config)["args"])
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(args.engine) <= names, set(args.engine) - names
    EngineConfig(**args.engine)  # its own range checks


@pytest.mark.parametrize(
    "engine,said",
    [
        ({"max_num_seq": 8}, "engine max_num_seq: EngineConfig has no such field"),
        ({"max_num_seqs": "8"}, "engine max_num_seqs='8': expected int | None"),
        ({"gpu_memory_utilization": 1.5}, "engine: gpu_memory_utilization must be in (0, 1]"),
        ({"dtype": "float16"}, "engine dtype: set it with args.dtype"),
    ],
)
def test_engine_settings_a_replica_could_not_take_fail_the_args(engine, said):
    """A Serve config's `engine:` is checked with the args, not when a replica's engine
    fails to start."""
    with pytest.raises(ValidationError, match=re.escape(said)):
        AppArgs.model_validate({"engine": engine})
    assert AppArgs.model_validate({"engine": {"graph_steering_sites": ["post_block"]}})


def test_engine_autoscales_and_gateway_is_fixed(config):
    engine = deployment(config, "Engine")
    assert "num_replicas" not in engine
    scaling = AutoscalingConfig.model_validate(engine["autoscaling_config"])
    assert 1 <= scaling.min_replicas <= scaling.initial_replicas <= scaling.max_replicas
    assert scaling.max_replicas > scaling.min_replicas  # else it never scales
    # Scale out before a replica is full: the target sits below what Serve sends a replica,
    # which in turn covers the engine's batch.
    max_num_seqs = AppArgs.model_validate(app_of(config)["args"]).engine["max_num_seqs"]
    assert scaling.target_ongoing_requests < max_num_seqs <= engine["max_ongoing_requests"]
    assert engine["health_check_period_s"] > 0

    gateway = deployment(config, "Gateway")
    assert "autoscaling_config" not in gateway
    if app_of(config)["args"]["grpc_port"] is not None and gateway["num_replicas"] > 1:
        # every replica binds the gRPC port on its node
        assert gateway["max_replicas_per_node"] == 1


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_give_every_engine_rank_a_gpu(name):
    config = SERVE_CONFIGS[name]()
    args = AppArgs.model_validate(app_of(config)["args"])
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    assert args.num_gpus_per_rank == 1
    engine = deployment(config, "Engine")
    engine_gpus = engine["ray_actor_options"].get("num_gpus", 0)
    if args.tp * args.pp == 1:  # the Serve replica runs the engine itself, on its own GPU
        assert engine_gpus == 1 and "placement_group_bundles" not in engine
    else:  # rank actors hold the GPUs, one bundle each after the replica's, on one node
        assert engine_gpus == 0
        assert engine["placement_group_bundles"][1:] == [{"GPU": 1}] * (args.tp * args.pp)
        assert engine["placement_group_strategy"] == "STRICT_PACK"
    assert deployment(config, "Gateway")["ray_actor_options"].get("num_gpus", 0) == 0


def test_cpu_config_asks_for_no_gpu():
    config = SERVE_CONFIGS["serve_config.cpu.yaml"]()
    args = AppArgs.model_validate(app_of(config)["args"])
    assert (args.model, args.device, args.dtype) == ("tiny", "cpu", "float32")
    for d in app_of(config)["deployments"]:
        assert d["ray_actor_options"].get("num_gpus", 0) == 0
    # One machine: gRPC on loopback, like its HTTP.
    assert args.bind_host == config["http_options"]["host"] == "127.0.0.1"


# -- KubeRay -----------------------------------------------------------------------------------


def groups() -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def mount_for(group: dict, volume: str) -> str:
    (m,) = [m for m in container(group)["volumeMounts"] if m["name"] == volume]
    return m["mountPath"]


def test_rayservice_embeds_serve_config_yaml():
    rs = rayservice()
    assert rs["apiVersion"] == "ray.io/v1"
    # The embedded config is serve_config.yaml plus one thing: Gateway replicas need the
    # resource that only the gateway group's pods offer.
    embedded = embedded_config()
    pinned = copy.deepcopy(embedded)
    gateway_options = deployment(pinned, "Gateway")["ray_actor_options"]
    assert gateway_options.pop("resources") == {GATEWAY_RESOURCE: 1}
    assert pinned == SERVE_CONFIGS["serve_config.yaml"]()


def test_rayservice_gpu_group_requests_gpus():
    spec = rayservice()["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == ray.__version__  # the Ray whose schema checked the config
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # nothing on the head
    for g in groups().values():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]

    gpu = groups()["gpu"]
    res = container(gpu)["resources"]
    gpus_per_pod = int(res["limits"]["nvidia.com/gpu"])
    assert gpus_per_pod >= 1
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    tolerated = {t["key"] for t in gpu["template"]["spec"].get("tolerations", [])}
    assert "nvidia.com/gpu" in tolerated
    assert all("nvidia.com/gpu" not in container(g)["resources"]["limits"]
               for name, g in groups().items() if name != "gpu")  # fmt: skip

    # Serve can only reach max_replicas if the group can grow to hold them.
    config = embedded_config()
    args = AppArgs.model_validate(app_of(config)["args"])
    scaling = deployment(config, "Engine")["autoscaling_config"]
    assert scaling["max_replicas"] * args.tp * args.pp <= gpu["maxReplicas"] * gpus_per_pod


def test_rayservice_gateway_group_holds_the_gateways_with_keys():
    config = embedded_config()
    gateway = deployment(config, "Gateway")
    group = groups()["gateway"]
    offered = json.loads(json.loads(group["rayStartParams"]["resources"]))  # '"{...}"'
    assert offered == {GATEWAY_RESOURCE: 1}  # one Gateway replica per pod
    assert group["replicas"] == group["minReplicas"] == gateway["num_replicas"]

    # The API keys file the app reads is the Secret of secret.example.yaml, mounted.
    keys = secret("coxswain-api-keys")
    (volume,) = [
        v for v in group["template"]["spec"]["volumes"] if "secret" in v and v["name"] == "api-keys"
    ]
    assert volume["secret"]["secretName"] == keys["metadata"]["name"]
    assert volume["secret"].get("optional", False) is False  # no Secret, no pod: never keyless
    keys_file = Path(app_of(config)["args"]["api_keys_file"])
    assert keys_file.parent == Path(mount_for(group, "api-keys"))
    assert keys_file.name in keys["stringData"]
    env = {e["name"]: e.get("value") for e in container(group)["env"]}
    assert env["COXSWAIN_API_KEYS_FILE"] == str(keys_file)


def test_rayservice_wires_models_grpc_and_redis():
    config = embedded_config()
    args = AppArgs.model_validate(app_of(config)["args"])

    gpu = groups()["gpu"]
    (models,) = [v for v in gpu["template"]["spec"]["volumes"] if v["name"] == "models"]
    pvc = only(documents(KUBERAY / "models-pvc.yaml"), "PersistentVolumeClaim")
    assert models["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert Path(args.model).is_relative_to(mount_for(gpu, "models"))

    grpc = only(documents(KUBERAY / "rayservice.yaml"), "Service")
    labels = groups()["gateway"]["template"]["metadata"]["labels"]
    assert grpc["spec"]["selector"].items() <= labels.items()
    (port,) = grpc["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in container(groups()["gateway"])["ports"]}
    assert port["port"] == named[port["targetPort"]] == args.grpc_port
    # Other pods reach the gRPC servers through Services: they listen on every interface.
    assert args.bind_host == "0.0.0.0"


def expanded_env(c: dict, secrets: dict[str, dict]) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: values from Secrets, and
    `$(NAME)` replaced by variables defined earlier in the list."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def test_no_serve_config_holds_the_redis_password(config):
    # The URL carries the password, so it comes from the environment (a Secret), never
    # from a config that is checked in or stored in the RayService.
    assert "redis_url" not in app_of(config)["args"]


def test_every_ray_pod_gets_the_redis_url_with_the_secrets_password(monkeypatch):
    password = "0123456789abcdef" * 3
    secrets = {"coxswain-redis": {"stringData": {"password": password}}}
    redis = only(documents(KUBERAY / "redis.yaml"), "Service")
    spec = rayservice()["spec"]["rayClusterConfig"]
    pods = {"head": spec["headGroupSpec"], **groups()}
    for name, group in pods.items():
        env = expanded_env(container(group), secrets)
        url = urlparse(env["COXSWAIN_REDIS_URL"])
        assert (url.scheme, url.password) == ("redis", password), name
        assert url.hostname == redis["metadata"]["name"]
        assert url.port == redis["spec"]["ports"][0]["port"]
        # The app reads it because the embedded Serve config names no redis_url.
        monkeypatch.setenv("COXSWAIN_REDIS_URL", env["COXSWAIN_REDIS_URL"])
        args = AppArgs.model_validate(app_of(embedded_config())["args"])
        assert args.redis_url == env["COXSWAIN_REDIS_URL"]


def test_redis_requires_the_password_of_the_secret():
    redis_secret = secret("coxswain-redis")
    password = "fedcba9876543210" * 3
    secrets = {"coxswain-redis": {"stringData": {"password": password}}}
    dep = only(documents(KUBERAY / "redis.yaml"), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = expanded_env(c, secrets)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    assert args[args.index("--requirepass") + 1] == password
    assert env["REDISCLI_AUTH"] == password  # the readiness probe's redis-cli authenticates
    refs = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e]
    assert all(r["name"] == redis_secret["metadata"]["name"] for r in refs)
    assert all(r["key"] in redis_secret["stringData"] for r in refs)


def test_redis_manifest_is_a_persistent_deployment_and_service():
    docs = documents(KUBERAY / "redis.yaml")
    assert sorted(d["kind"] for d in docs) == ["Deployment", "PersistentVolumeClaim", "Service"]
    dep, svc, pvc = (only(docs, k) for k in ("Deployment", "Service", "PersistentVolumeClaim"))
    assert dep["apiVersion"] == "apps/v1"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()

    (c,) = dep["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named[svc["spec"]["ports"][0]["targetPort"]] == 6379
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    flags = dict(zip(c["args"][1::2], c["args"][2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--maxmemory-policy"] == "noeviction"  # never drop queued actions
    (data,) = dep["spec"]["template"]["spec"]["volumes"]
    assert data["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {flags["--dir"]}


def test_secret_example_cannot_be_applied_unedited():
    text = secret("coxswain-api-keys")["stringData"]["api-keys"]
    with pytest.raises(InvalidRequestError, match="shorter than 16"):
        ApiKeys.parse(text)
    # With real secrets put in, it is an admin and a read-only key.
    edited = "\n".join(line.replace("CHANGE-ME", "x" * 32) for line in text.splitlines())
    assert sorted(k.scope for k in ApiKeys.parse(edited).keys) == ["admin", "read"]
