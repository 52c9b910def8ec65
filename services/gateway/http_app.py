"""The gateway's HTTP app: the OpenAI-compatible API plus Coxswain's routes, over one
`EngineService`.

`build_app(backend, keys)` takes everything it serves as arguments (no globals), so the
same app runs under uvicorn in a test, or as a Ray Serve deployment's ingress. Every route
needs `Authorization: Bearer <key>`, checked before the body is read (`AuthBeforeBody`):
read scope for generation and state, admin scope for global steering, registry writes and
patch-source deletion. Public, because they hold no data: `/health`, the dashboard page
and its assets (its data route needs a key), and the OpenAPI document with its viewers
(`/openapi.json`, `/docs`, `/redoc`), which describe the API as vLLM's server leaves open.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.auth import ApiKeys
from services.common.errors import NotFoundError
from services.engine.interventions.spec import parse_global_steering
from services.engine.service import EngineService
from services.gateway.coxswain_api import (
    ErrorBody,
    Health,
    PatchSourceDropped,
    State,
    SteeringState,
    SweepRequest,
    VectorData,
    VectorInfo,
    VectorList,
    VectorPut,
    VectorRemoved,
)
from services.gateway.dashboard import ASSETS, dashboard_router
from services.gateway.http_auth import AuthBeforeBody, require
from services.gateway.http_errors import install_error_handlers
from services.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from services.gateway.metrics import EngineCollector, RequestMetrics
from services.gateway.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    ModelList,
    Renderer,
    StrictSteering,
    chat_messages,
    check_texts,
    prompts_of,
    sampling_params,
)
from services.gateway.streaming import EngineRequests, completion_events, sse, sweep_events

DESCRIPTION = """\
Serve a language model under activation-level control.

* **OpenAI-compatible**: `/v1/completions`, `/v1/chat/completions` (streaming with SSE or not),
  `/v1/models`. Extra body fields `steering`, `capture`, `patch`, `readouts`,
  `logprob_token_ids` and `conversation_id` steer, read and patch the residual stream per
  request; what they produced comes back in a `coxswain` object per choice and per response.
* **Steering control**: engine-wide steering (`/v1/steering/set`, `/v1/steering/clear`), its
  state (`/v1/steering`, `/v1/steering/dynamic`) and the named vector registry (`/v1/vectors`).
* **Patching**: batched causal-tracing sweeps streamed cell by cell (`/v1/patch_sweep`), and
  deletion of stored clean runs (`/v1/patch_source/{run}`).

Authenticate with `Authorization: Bearer <key>`. Read keys may generate and read state;
admin keys may also change global steering, the vector registry and the patch store.
`/health`, the dashboard page and this document need no key.
Errors are `{"error": {"message", "type", "code"}}` with a 4xx status for bad input; a
body over the server's size limit is a 413, and one not all sent within the server's body
timeout a 408 (the connection is closed).
"""

TAGS = [
    {"name": "openai", "description": "The OpenAI-compatible API, with Coxswain's extras."},
    {"name": "steering", "description": "Engine-wide steering and its observability."},
    {"name": "vectors", "description": "The named vector registry."},
    {"name": "patching", "description": "Causal-tracing sweeps and stored clean runs."},
    {"name": "service", "description": "Health, statistics and Prometheus metrics."},
]

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "Invalid request"),
        (401, "Missing or unknown API key"),
        (403, "API key lacks the admin scope"),
        (404, "Not found"),
        (408, "The request body did not all arrive within the server's body timeout"),
        (413, "Request body or prompt over the configured limit"),
    )
}
# Routes that need no key: liveness, and the dashboard page with its assets (the page asks
# for a key and sends it with every poll of its data route).
PUBLIC_ROUTES = ("/health", "/dashboard", *(f"/dashboard/{name}" for name in ASSETS))

SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events (`data: [DONE]` last).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def build_app(
    backend: EngineService,
    keys: ApiKeys,
    *,
    patch_store: Any = None,
    title: str = "Coxswain",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """The HTTP app serving `backend`, authenticating with `keys`. `patch_store`, when given,
    is the store patch-source deletion acts on (default: the backend's) and is reported in
    `/metrics`. `max_body_bytes`: the largest request body accepted (413 beyond);
    `body_timeout_s`: how long after its headers a request's body may take to arrive (408
    beyond, and the connection closed)."""
    app = FastAPI(
        title=title,
        version="0.1.0",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        responses=ERRORS,
    )
    install_error_handlers(app)
    app.add_middleware(
        AuthBeforeBody,
        keys=keys,
        public=public_paths(app),
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
    )
    registry = CollectorRegistry()
    app.add_middleware(RequestMetrics, registry=registry)  # outermost: counts 401s and 413s
    registry.register(EngineCollector(backend, patch_store))
    app.state.backend = backend
    app.state.registry = registry

    read, admin = require(keys, "read"), require(keys, "admin")
    openai = APIRouter(tags=["openai"], dependencies=[read])
    steering = APIRouter(tags=["steering"])
    vectors = APIRouter(tags=["vectors"])
    patching = APIRouter(tags=["patching"])
    service = APIRouter(tags=["service"])
    created = int(time.time())
    tokenizer = backend.engine.tokenizer

    def served_model(name: str | None) -> str:
        if name is not None and name != backend.model_id:
            raise NotFoundError(
                f"the model '{name}' does not exist; this server serves '{backend.model_id}'"
            )
        return backend.model_id

    async def generate(
        body: GenerationRequest, prompts: list[str | list[int]], renderer: Renderer
    ) -> Response:
        params = renderer.params
        rid = renderer.id
        requests = EngineRequests(
            [backend.generate(p, params, f"{rid}-{i}") for i, p in enumerate(prompts)]
        )
        await requests.open()
        if not body.stream:
            return JSONResponse(renderer.response(await requests.finals()))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse(
            completion_events(
                requests,
                renderer.chunk,
                renderer.first_chunk(len(prompts)),
                lambda finals: renderer.last_chunk(finals, include_usage),
            )
        )

    # -- OpenAI-compatible -------------------------------------------------------------------

    @openai.get("/v1/models", response_model=ModelList, summary="The served model")
    def list_models() -> dict:
        card = backend.model_card()
        return {
            "object": "list",
            "data": [{"id": card["id"], "created": created, "coxswain": card}],
        }

    @openai.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=SSE,
        summary="Complete prompts",
    )
    async def completions(body: CompletionRequest) -> Response:
        model = served_model(body.model)
        params = sampling_params(body)
        prompts = prompts_of(body)
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        renderer = Renderer(
            "completions", model, tokenizer, params, body.n, echo, id=f"cmpl-{uuid.uuid4().hex}"
        )
        return await generate(body, prompts, renderer)

    @openai.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=SSE,
        summary="Answer a conversation",
    )
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        model = served_model(body.model)
        params = sampling_params(body)
        prompt = await run_in_threadpool(backend.encode_chat, chat_messages(body))
        renderer = Renderer(
            "chat", model, tokenizer, params, body.n, id=f"chatcmpl-{uuid.uuid4().hex}"
        )
        return await generate(body, [prompt], renderer)

    # -- steering ----------------------------------------------------------------------------

    @steering.post(
        "/v1/steering/set",
        response_model=SteeringState,
        dependencies=[admin],
        summary="Set engine-wide steering",
        description="Steer every request with these vectors (each `phase`: prefill, decode or "
        "both) from the next engine step on, replacing any global steering. Checked now; "
        "returns the steering state, whose `global_spec` is this spec. An empty spec is a "
        "400: clear with `/v1/steering/clear`.",
    )
    async def set_steering(body: StrictSteering) -> dict:
        check_texts(body.model_dump())  # as every other body is: no lone surrogates
        return await backend.set_global_steering(parse_global_steering(body))

    @steering.post(
        "/v1/steering/clear",
        response_model=SteeringState,
        dependencies=[admin],
        summary="Clear engine-wide steering",
    )
    async def clear_steering() -> dict:
        return await backend.clear_global_steering()

    @steering.get(
        "/v1/steering",
        response_model=SteeringState,
        dependencies=[read],
        summary="Steering state",
        description="Action-queue counters per source, row-pool use, the global and dynamic "
        "tiers, monitors, sync-consumer timing and `global_spec` (the last accepted global "
        "spec, or null).",
    )
    def get_steering() -> dict:
        return backend.steering_state()

    @steering.get(
        "/v1/steering/dynamic",
        response_model=State,
        dependencies=[read],
        summary="Closed-loop steering state",
        description="The dynamic tier (gain, sites), installed monitors, the override pool, "
        "the action queue, probe aborts and sequences whose gates latched.",
    )
    def get_dynamic() -> dict:
        return backend.dynamic_state()

    # -- vectors -----------------------------------------------------------------------------

    @vectors.get(
        "/v1/vectors", response_model=VectorList, dependencies=[read], summary="List vectors"
    )
    def list_vectors() -> dict:
        return {"data": backend.list_vectors()}

    @vectors.get(
        "/v1/vectors/{name:path}",
        response_model=VectorData,
        dependencies=[read],
        summary="A vector with its values",
    )
    def get_vector(name: str) -> dict:
        return backend.get_vector(name)

    @vectors.put(
        "/v1/vectors/{name:path}",
        response_model=VectorInfo,
        dependencies=[admin],
        summary="Register a vector",
        description='Requests name it as a steering vector or probe (`"vector": "<name>"`) '
        "once registered. An existing name needs `overwrite: true`.",
    )
    def put_vector(name: str, body: VectorPut) -> dict:
        return backend.register_vector(name, body.value, overwrite=body.overwrite)

    @vectors.delete(
        "/v1/vectors/{name:path}",
        response_model=VectorRemoved,
        dependencies=[admin],
        summary="Unregister a vector",
    )
    def delete_vector(name: str) -> dict:
        return backend.unregister_vector(name)

    # -- patching ----------------------------------------------------------------------------

    @patching.post(
        "/v1/patch_sweep",
        dependencies=[read],
        summary="Run a causal-tracing sweep",
        description="Patch the clean run into the corrupt prompt once per (site, layer, "
        "position) cell, all cells in one continuous batch alongside other traffic. Server-"
        "sent events: `event: cell` per cell as it finishes, then `event: summary` with the "
        "grid `[site][layer][position]` (null: skipped or void) and the baselines.",
        responses={
            200: {
                "description": "`cell` events, then one `summary` event.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            }
        },
        response_class=Response,
    )
    async def patch_sweep(body: SweepRequest) -> Response:
        events = backend.patch_sweep(body.to_spec())
        try:
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        return sse(sweep_events(first, events))

    @patching.delete(
        "/v1/patch_source/{run}",
        response_model=PatchSourceDropped,
        dependencies=[admin],
        summary="Drop a stored clean run",
        description="Removes the run now, even if leased (the owner's action).",
    )
    def drop_patch_source(run: str) -> dict:
        if patch_store is not None:
            return {"run": run, "dropped": True, "bytes_freed": patch_store.drop_run(run)}
        return backend.drop_patch_source(run)

    # -- service -----------------------------------------------------------------------------

    @service.get("/health", response_model=Health, summary="Liveness (no key needed)")
    def health() -> dict:
        return backend.health()

    @service.get(
        "/v1/stats",
        response_model=State,
        dependencies=[read],
        summary="Engine statistics",
        description="Engine counters, generated and prompt tokens per second over a sliding "
        "window, prefix-cache hit rate, requests running and waiting.",
    )
    def stats() -> dict:
        out = backend.stats()
        if patch_store is not None:
            out["patch_store"] = patch_store.stats()
        return out

    @service.get(
        "/metrics",
        dependencies=[read],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    )
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    for router in (openai, steering, vectors, patching, service):
        app.include_router(router)
    app.include_router(dashboard_router(backend, keys, patch_store=patch_store))
    return app


def public_paths(app: FastAPI) -> frozenset[str]:
    """The paths `app` serves without a key: `PUBLIC_ROUTES` and the OpenAPI document with
    its viewers. The document describes the API and holds no data (vLLM's server leaves it
    open too), and clients and tools read it to build requests."""
    docs = (app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url)
    return frozenset([*PUBLIC_ROUTES, *(path for path in docs if path)])
