"""The actors a Serve application shares across its replicas, started once and found by
name in the `coxswain` namespace: the patch store, and with a Redis URL the async controller.
The first Engine replica anywhere starts them (`EngineDeployment`); the builder has no side
effects.
"""

from __future__ import annotations

from services.gateway.app_args import AppArgs

PATCH_STORE_ACTOR = "coxswain-patch-store"
CONTROLLER_ACTOR = "coxswain-controller"


def patch_store_address() -> str | None:
    """The target of the cluster's patch store for `PatchStoreClient`: the actor, resolved
    (address and service key) again whenever it restarts. None when the cluster has none."""
    import ray

    from services.patch_store.actor import actor_target

    try:
        ray.get_actor(PATCH_STORE_ACTOR, namespace="coxswain")
    except ValueError:  # no store in this cluster
        return None
    return actor_target(PATCH_STORE_ACTOR, "coxswain")


def start_cluster_actors(a: AppArgs) -> None:
    """The actors the application shares across its replicas, started once (named,
    detached, reused when they already run): the patch store, and with `redis_url` the
    async controller. Scheduled by Ray's default strategy, never into the placement group of
    the engine replica that happens to start them: removing it would kill them."""
    from services.patch_store.actor import start_patch_store_actor

    start_patch_store_actor(
        int(a.patch_store_budget_gb * 2**30),
        keys=a.keys(),  # beside the actor's own service key
        host=a.bind_host,
        name=PATCH_STORE_ACTOR,
        namespace="coxswain",
        lifetime="detached",
        max_restarts=-1,  # restarted empty; clients re-resolve it (services/patch_store/actor.py)
        get_if_exists=True,
        scheduling_strategy="DEFAULT",
    )
    if a.redis_url:
        from services.controller.actor import start_controller_actor

        start_controller_actor(
            a.redis_url,
            name=CONTROLLER_ACTOR,
            actor_options={
                "namespace": "coxswain",
                "lifetime": "detached",
                "max_restarts": -1,
                "get_if_exists": True,  # replicas start concurrently
                "scheduling_strategy": "DEFAULT",
            },
            grpc_host=a.bind_host,
            grpc_port=a.controller_grpc_port,
            keys=a.keys(),
        )
