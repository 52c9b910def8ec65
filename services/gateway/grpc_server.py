"""The engine's gRPC front: the `coxswain.v1` Engine, Sweep and Steering services over one
`EngineService`, with Health, reflection and bearer-key auth, on grpc.aio.

Every RPC converts its message (`grpc_convert`), awaits the service, and converts back. The
service's blocking calls (those that wait for the engine lock, read files or copy tensors)
run in worker threads, so a model forward never stalls the event loop. A `CoxswainError`
becomes its status (`grpc_abort_args`) with the class name in trailing metadata; anything
else is INTERNAL and logged. Either way the server keeps serving. Every request's
identifiers are bounded (`check_field_lengths`) before any work, so an oversized id is
INVALID_ARGUMENT, not a reply too large for gRPC's metadata.

The Engine servicer knows the Generate calls it is streaming: a second Generate with an
in-flight request id is refused without touching the first, and `Abort` ends the first's
stream with a last message whose samples finish with "abort", whatever the backend does to
an aborted stream (a remote replica's stream is cancelled, which ends it with an error).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services.common.auth import ApiKeys, Scope
from services.common.errors import (
    CoxswainError,
    DuplicateRequestError,
    InvalidRequestError,
    grpc_abort_args,
)
from services.common.grpc_serving import check_field_lengths
from services.engine.interventions.spec import parse_global_steering
from services.engine.outputs import CompletionDelta, RequestDelta
from services.engine.sampling_params import SamplingParams
from services.engine.service import EngineService
from services.gateway import grpc_convert as convert
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import engine_pb2_grpc as pb_grpc
from services.proto.coxswain.v1 import steering_pb2 as steering_pb
from services.proto.coxswain.v1 import steering_pb2_grpc as steering_grpc
from services.proto.coxswain.v1 import sweep_pb2 as sweep_pb
from services.proto.coxswain.v1 import sweep_pb2_grpc as sweep_grpc

log = logging.getLogger(__name__)

ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name  # coxswain.v1.Engine
SWEEP_SERVICE = sweep_pb.DESCRIPTOR.services_by_name["Sweep"].full_name
STEERING_SERVICE = steering_pb.DESCRIPTOR.services_by_name["Steering"].full_name
SERVICE_NAMES = (ENGINE_SERVICE, SWEEP_SERVICE, STEERING_SERVICE)
# Initial metadata of a Generate stream: the request id, before the first token exists.
REQUEST_ID_METADATA_KEY = "coxswain-request-id"

# Methods that change what every request gets: admin keys only. The rest need read scope,
# except Health and reflection, which need no key (load balancers and grpcurl probe them).
ADMIN_METHODS = frozenset(
    f"/{STEERING_SERVICE}/{m}"
    for m in ("SetGlobal", "ClearGlobal", "RegisterVector", "UnregisterVector", "DropPatchSource")
)
PUBLIC_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})

_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, details, trailing = grpc_abort_args(exc)
    await context.abort(code, details, trailing_metadata=trailing)


def _rpc(method: _Method) -> _Method:
    """Check the request's field lengths, then map the method's exceptions to statuses.
    Cancellation (the client went away) is not an exception here: it propagates, and the
    method's cleanup aborts its request."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            check_field_lengths(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method ended the call itself
        except CoxswainError as e:
            await _abort(context, e)
        except Exception as e:
            log.exception("gRPC %s failed", method.__qualname__)
            await _abort(context, e)

    return wrapper  # type: ignore[return-value]


@dataclass
class _Streaming:
    """A Generate call in flight: where each sample stands, and whether Abort ended it."""

    n: int
    num_tokens: dict[int, int] = field(default_factory=dict)  # sample -> tokens sent
    ended: set[int] = field(default_factory=set)  # samples whose finish was sent
    finished: bool = False
    aborted: bool = False

    def sent(self, delta: RequestDelta) -> None:
        for d in delta.samples:
            self.num_tokens[d.index] = d.token_offset + len(d.token_ids)
            if d.finished:
                self.ended.add(d.index)
        self.finished = delta.finished

    def aborted_delta(self, rid: str) -> RequestDelta:
        """The last delta of an aborted request: every sample not yet ended ends "abort"."""
        samples = [
            CompletionDelta(i, self.num_tokens.get(i, 0), [], "", finish_reason="abort")
            for i in range(self.n)
            if i not in self.ended
        ]
        return RequestDelta(rid, samples, finished=True)


class EngineServicer(pb_grpc.EngineServicer):
    """`coxswain.v1.Engine`: Generate (streamed deltas), Abort, ModelInfo, Stats."""

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self._streaming: dict[str, _Streaming] = {}  # request id -> its Generate call

    @_rpc
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # Off the loop: decoding vectors is CPU work, and a chat prompt may be encoded by a
        # remote engine replica (the gateway's backend).
        params, prompt = await asyncio.to_thread(self._decode, request)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if rid in self._streaming:  # refused here, so the first call's entry stays intact
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        streaming = self._streaming[rid] = _Streaming(n=params.n)
        try:
            await self._stream(prompt, params, rid, streaming, context)
        finally:
            del self._streaming[rid]

    async def _stream(
        self,
        prompt: convert.EnginePrompt,
        params: SamplingParams,
        rid: str,
        streaming: _Streaming,
        context: grpc.aio.ServicerContext,
    ) -> None:
        await context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, rid),))
        try:
            # aclosing: when the client cancels, CancelledError lands in an await below and
            # closing the stream aborts the request (its KV blocks are freed at once).
            async with aclosing(self.service.generate(prompt, params, rid)) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    streaming.sent(delta)
                    await context.write(convert.delta_to_proto(delta))
        except (Exception, asyncio.CancelledError):
            # An Abort may end the backend's stream with an error (a cancelled remote
            # stream): the caller asked for that, so it gets the aborted output instead.
            current = asyncio.current_task()
            if not streaming.aborted or (current is not None and current.cancelling()):
                raise
        if streaming.aborted and not streaming.finished:
            await context.write(convert.delta_to_proto(streaming.aborted_delta(rid)))

    def _decode(self, request: pb.GenerateRequest) -> tuple[SamplingParams, convert.EnginePrompt]:
        params = convert.sampling_params_from_proto(request.params)
        return params, convert.prompt_from_proto(request.prompt, self.service.encode_chat)

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidRequestError("Abort needs a request_id")
        streaming = self._streaming.get(request.request_id)
        if streaming is not None:
            streaming.aborted = True
        await self.service.abort(request.request_id)
        return pb.AbortResponse()

    @_rpc
    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext):
        return convert.model_card_to_proto(self.service.model_card())

    @_rpc
    async def Stats(self, request: pb.EngineStatsRequest, context: grpc.aio.ServicerContext):
        return convert.json_to_proto(await asyncio.to_thread(self.service.stats))


class SweepServicer(sweep_grpc.SweepServicer):
    """`coxswain.v1.Sweep`: a causal-tracing sweep streamed cell by cell, then a summary."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    @_rpc
    async def Run(self, request: sweep_pb.SweepRequest, context: grpc.aio.ServicerContext):
        spec = await asyncio.to_thread(
            convert.sweep_spec_from_proto, request, self.service.encode_chat
        )
        async with aclosing(self.service.patch_sweep(spec)) as events:  # type: ignore[type-var]
            async for event in events:
                await context.write(convert.sweep_event_to_proto(event))


class SteeringServicer(steering_grpc.SteeringServicer):
    """`coxswain.v1.Steering`: global steering, the vector registry, closed-loop state."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    @_rpc
    async def SetGlobal(self, request: pb.SteeringSpec, context: grpc.aio.ServicerContext):
        spec = await asyncio.to_thread(convert.steering_from_proto, request)
        state = await self.service.set_global_steering(parse_global_steering(spec))
        return convert.json_to_proto(state)

    @_rpc
    async def ClearGlobal(self, request, context):
        return convert.json_to_proto(await self.service.clear_global_steering())

    @_rpc
    async def GetState(self, request, context):
        return convert.json_to_proto(await asyncio.to_thread(self.service.steering_state))

    @_rpc
    async def GetDynamic(self, request, context):
        return convert.json_to_proto(await asyncio.to_thread(self.service.dynamic_state))

    @_rpc
    async def RegisterVector(
        self, request: steering_pb.RegisterVectorRequest, context: grpc.aio.ServicerContext
    ):
        kind, value = convert.register_vector_from_proto(request)
        register = self.service.import_vector if kind == "path" else self.service.register_vector
        info = await asyncio.to_thread(register, request.name, value, overwrite=request.overwrite)
        return convert.vector_info_to_proto(info)

    @_rpc
    async def ListVectors(self, request, context):
        infos = await asyncio.to_thread(self.service.list_vectors)
        return steering_pb.ListVectorsResponse(
            vectors=[convert.vector_info_to_proto(i) for i in infos]
        )

    @_rpc
    async def GetVector(self, request: steering_pb.GetVectorRequest, context):
        entry = await asyncio.to_thread(self.service.get_vector, request.name)
        return convert.named_vector_to_proto(entry)

    @_rpc
    async def UnregisterVector(self, request: steering_pb.UnregisterVectorRequest, context):
        info = await asyncio.to_thread(self.service.unregister_vector, request.name)
        return convert.vector_info_to_proto(info)

    @_rpc
    async def DropPatchSource(self, request: steering_pb.DropPatchSourceRequest, context):
        if not request.run:
            raise InvalidRequestError("DropPatchSource needs a run id")
        result = await asyncio.to_thread(self.service.drop_patch_source, request.run)
        return steering_pb.DropPatchSourceResponse(
            run=result["run"], bytes_freed=result["bytes_freed"]
        )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <key>` metadata with `ApiKeys.check` before a call
    reaches its servicer: admin scope for `ADMIN_METHODS`, read for the rest, none for
    `PUBLIC_SERVICES`. A refused call ends with the error's status and class name."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = details.method.lstrip("/").split("/", 1)[0]
        if not self.keys.enabled or service in PUBLIC_SERVICES:
            return await continuation(details)
        scope: Scope = "admin" if details.method in ADMIN_METHODS else "read"
        authorization = next(
            (v for k, v in details.invocation_metadata or () if k == "authorization"), None
        )
        try:
            self.keys.check(authorization, scope)
        except CoxswainError as e:
            return _refusal(await continuation(details), e)
        return await continuation(details)


def _refusal(handler: grpc.RpcMethodHandler | None, exc: CoxswainError) -> Any:
    """A handler of `handler`'s kind that ends the call with `exc`'s status."""
    if handler is None:
        return None  # an unknown method: gRPC answers UNIMPLEMENTED

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort(context, exc)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


@dataclass
class EngineGrpcServer:
    """A started server: the grpc.aio server, its bound address, and its health servicer."""

    server: grpc.aio.Server
    host: str
    port: int
    health: health_aio.HealthServicer

    @property
    def address(self) -> str:
        """`host:port` for `CoxswainClient` (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self, grace_s: float | None = 2.0) -> None:
        """Report NOT_SERVING, let calls in flight finish for `grace_s`, then stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait(self) -> None:
        """Until the server stops."""
        await self.server.wait_for_termination()


async def serve_engine_grpc(
    service: EngineService,
    keys: ApiKeys,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[EngineGrpcServer, int]:
    """Start serving `service` (an `EngineService`, or anything with its interface, such as
    the gateway's `RemoteEngine`) on `host:port` (port 0: any free port) in the running event
    loop, with Health, reflection and `keys` (no keys: auth off). Returns the server and
    the port it bound. Messages over `max_message_bytes` are refused (RESOURCE_EXHAUSTED)."""
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(keys)],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
        ],
    )
    pb_grpc.add_EngineServicer_to_server(EngineServicer(service), server)
    sweep_grpc.add_SweepServicer_to_server(SweepServicer(service), server)
    steering_grpc.add_SteeringServicer_to_server(SteeringServicer(service), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises when it cannot bind
        raise CoxswainError(f"engine gRPC cannot listen on {address}: {e}") from None
    if bound == 0:
        raise CoxswainError(f"engine gRPC cannot listen on {address}")
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("engine gRPC serving %s on %s:%d", service.model_id, host, bound)
    return EngineGrpcServer(server=server, host=host, port=bound, health=health_servicer), bound
