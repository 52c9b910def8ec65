"""Python clients of the engine's gRPC services (`coxswain.v1` Engine, Sweep, Steering).

`CoxswainClient` blocks; `AsyncCoxswainClient` is the same API for asyncio. Both take the
engine's own Python values — `SamplingParams` fields, `SweepSpec` fields, tensors — and give
back its own results (`RequestDelta` streams, `RequestOutput`, `Cell`, `SweepResult`), so
code written against the in-process engine moves to a remote one by swapping the object.
Requests are checked here with the engine's schema before they leave, and again by the
server.

Errors come back as the exception class the server raised (`InvalidRequestError`,
`NotFoundError`, `PermissionDeniedError`, ...; `services.common.errors`); an unreachable
or slow server raises `ServiceUnavailableError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import CoxswainError, InvalidRequestError, error_from_rpc
from services.common.grpc_client import GrpcClient, bearer_metadata, channel_options
from services.engine.interventions.spec import parse_steering
from services.engine.outputs import OutputAccumulator, RequestDelta, RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sweep import Cell, SweepResult, SweepSpec
from services.gateway import grpc_convert as convert
from services.proto.coxswain.v1 import engine_pb2 as pb
from services.proto.coxswain.v1 import engine_pb2_grpc as pb_grpc
from services.proto.coxswain.v1 import steering_pb2 as steering_pb
from services.proto.coxswain.v1 import steering_pb2_grpc as steering_grpc
from services.proto.coxswain.v1 import sweep_pb2_grpc as sweep_grpc

PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]]  # text, token ids, or a chat


def _generate_request(
    prompt: PromptLike,
    params: SamplingParams | None,
    sampling: dict[str, Any],
    request_id: str | None,
) -> pb.GenerateRequest:
    if params is not None and sampling:
        raise InvalidRequestError("give either params or sampling keyword arguments, not both")
    params = params if params is not None else SamplingParams(**sampling)
    return pb.GenerateRequest(
        prompt=convert.prompt_to_proto(prompt),
        params=convert.sampling_params_to_proto(params),
        request_id=request_id or "",
    )


def _sweep_request(spec: SweepSpec | None, fields: dict[str, Any]) -> Any:
    if spec is not None and fields:
        raise InvalidRequestError("give either a SweepSpec or its fields, not both")
    try:
        spec = spec if spec is not None else SweepSpec(**fields)
    except TypeError as e:  # an unknown or missing field
        raise InvalidRequestError(f"bad sweep spec: {e}") from None
    return convert.sweep_spec_to_proto(spec)


def _steering_spec(spec: Any) -> pb.SteeringSpec:
    parsed = parse_steering(spec)
    if parsed is None:
        raise InvalidRequestError(
            "set_global_steering got an empty spec; call clear_global_steering to clear"
        )
    return convert.steering_to_proto(parsed)


class CoxswainClient(GrpcClient):
    """A blocking client of one engine replica's gRPC services at `target` (`host:port`).

    `api_key` travels as `authorization: Bearer <key>` metadata; `credentials` (e.g.
    `grpc.ssl_channel_credentials()`) make the channel TLS, which a key should travel over
    outside a trusted network. Unary calls wait at most `timeout_s`; streams have no
    deadline unless `stream_timeout_s` is set.
    """

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        stream_timeout_s: float | None = None,
        max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(
            target,
            service="engine",
            api_key=api_key,
            credentials=credentials,
            timeout_s=timeout_s,
            max_message_bytes=max_message_bytes,
        )
        self.stream_timeout_s = stream_timeout_s
        self._engine = pb_grpc.EngineStub(self._channel)
        self._sweep = sweep_grpc.SweepStub(self._channel)
        self._steering = steering_grpc.SteeringStub(self._channel)

    # -- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompt: PromptLike,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        **sampling: Any,
    ) -> Iterator[RequestDelta]:
        """Stream a request: a `RequestDelta` with what each engine step that advanced it added
        (`OutputAccumulator` adds them up); the last has `finished=True`. `prompt` is text,
        token ids, or a chat (`[{"role", "content"}, ...]`); settings come as `params` or
        `SamplingParams` keyword arguments. Bad input raises here; closing the iterator
        early aborts the request on the server."""
        request = _generate_request(prompt, params, sampling, request_id)
        return self._stream_outputs(request)

    def complete(
        self,
        prompt: PromptLike,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        **sampling: Any,
    ) -> RequestOutput:
        """Run a request to the end and return its whole output."""
        return _total(self.generate(prompt, params, request_id=request_id, **sampling))

    def _stream_outputs(self, request: pb.GenerateRequest) -> Iterator[RequestDelta]:
        call = self._engine.Generate(
            request, metadata=self._metadata, timeout=self.stream_timeout_s
        )
        try:
            for msg in call:
                yield convert.delta_from_proto(msg)
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()  # nothing once the stream has ended; else the server aborts

    def abort(self, request_id: str) -> None:
        """Stop a request now (nothing happens if it already finished)."""
        self._call(self._engine.Abort, pb.AbortRequest(request_id=request_id))

    def model_info(self) -> dict[str, Any]:
        """id, max_model_len, num_layers, hidden_size, vocab_size, sites, dtype, device."""
        return convert.model_card_from_proto(
            self._call(self._engine.ModelInfo, pb.ModelInfoRequest())
        )

    def stats(self) -> dict[str, Any]:
        """Engine counters, throughput, prefix-cache hit rate, requests running/waiting."""
        return convert.json_from_proto(self._call(self._engine.Stats, pb.EngineStatsRequest()))

    # -- sweeps ---------------------------------------------------------------------------

    def sweep(self, spec: SweepSpec | None = None, **fields: Any) -> Iterator[Cell | SweepResult]:
        """Stream a causal-tracing sweep (a `SweepSpec`, or its fields as keyword arguments):
        each `Cell` as it finishes, then the `SweepResult`. Closing early aborts the sweep."""
        return self._stream_sweep(_sweep_request(spec, fields))

    def sweep_result(self, spec: SweepSpec | None = None, **fields: Any) -> SweepResult:
        """Run a sweep to the end and return its `SweepResult`."""
        *_, result = self.sweep(spec, **fields)
        assert isinstance(result, SweepResult)
        return result

    def _stream_sweep(self, request: Any) -> Iterator[Cell | SweepResult]:
        call = self._sweep.Run(request, metadata=self._metadata, timeout=self.stream_timeout_s)
        cells: list[Cell] = []
        try:
            for event in call:
                if event.HasField("summary"):
                    yield convert.sweep_result_from_proto(event.summary, cells)
                    return
                cells.append(convert.sweep_cell_from_proto(event.cell))
                yield cells[-1]
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()
        raise CoxswainError("the Sweep stream ended without a summary")

    # -- steering -------------------------------------------------------------------------

    def set_global_steering(self, spec: Any) -> dict[str, Any]:
        """Steer every request with `spec` (`{"vectors": [...]}`, as per-request steering)
        from the next step on, replacing any global spec. Admin. Returns the steering state."""
        return convert.json_from_proto(self._call(self._steering.SetGlobal, _steering_spec(spec)))

    def clear_global_steering(self) -> dict[str, Any]:
        """Remove engine-wide steering from the next step on. Admin."""
        request = steering_pb.ClearGlobalRequest()
        return convert.json_from_proto(self._call(self._steering.ClearGlobal, request))

    def steering_state(self) -> dict[str, Any]:
        """Queue counters, pool use, tiers, monitors, consumers, and `global_spec`."""
        request = steering_pb.GetSteeringStateRequest()
        return convert.json_from_proto(self._call(self._steering.GetState, request))

    def dynamic_state(self) -> dict[str, Any]:
        """The closed loop's view: dynamic tier, monitors, override pool, queue, aborts."""
        request = steering_pb.GetDynamicStateRequest()
        return convert.json_from_proto(self._call(self._steering.GetDynamic, request))

    # -- the vector registry --------------------------------------------------------------

    def register_vector(self, name: str, value: Any, *, overwrite: bool = False) -> dict[str, Any]:
        """Register `value` as `name`: `[H]` (every layer), `[num_layers, H]` (row i for layer
        i), or `{layer: [H]}`; a tensor, float lists or packed. Admin. Returns its metadata."""
        request = convert.register_vector_to_proto(name, value, overwrite)
        return convert.vector_info_from_proto(self._call(self._steering.RegisterVector, request))

    def import_vector(self, name: str, path: str, *, overwrite: bool = False) -> dict[str, Any]:
        """Register `name` from a `.gguf` or `.safetensors` file on the engine's host. Admin."""
        request = steering_pb.RegisterVectorRequest(name=name, path=path, overwrite=overwrite)
        return convert.vector_info_from_proto(self._call(self._steering.RegisterVector, request))

    def list_vectors(self) -> list[dict[str, Any]]:
        """Metadata of every registered vector, sorted by name."""
        response = self._call(self._steering.ListVectors, steering_pb.ListVectorsRequest())
        return [convert.vector_info_from_proto(v) for v in response.vectors]

    def get_vector(self, name: str) -> dict[str, Any]:
        """Metadata plus `value`, a tensor: `[H]`, or `[len(layers), H]` in `layers` order."""
        request = steering_pb.GetVectorRequest(name=name)
        return convert.named_vector_from_proto(self._call(self._steering.GetVector, request))

    def unregister_vector(self, name: str) -> dict[str, Any]:
        """Remove `name`; its metadata. Admin."""
        request = steering_pb.UnregisterVectorRequest(name=name)
        return convert.vector_info_from_proto(self._call(self._steering.UnregisterVector, request))

    def drop_patch_source(self, run: str) -> dict[str, Any]:
        """Drop a run from the engine's patch-source store now, leased or not. Admin."""
        request = steering_pb.DropPatchSourceRequest(run=run)
        response = self._call(self._steering.DropPatchSource, request)
        return {"run": response.run, "dropped": True, "bytes_freed": response.bytes_freed}


class AsyncCoxswainClient:
    """`CoxswainClient` for asyncio: the same methods, awaited (streams are async
    iterators). Create it inside the event loop that uses it."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        stream_timeout_s: float | None = None,
        max_message_bytes: int = convert.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._where = f"engine at {target}"
        self.stream_timeout_s = stream_timeout_s
        options = channel_options(max_message_bytes)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._metadata = bearer_metadata(api_key)
        self._engine = pb_grpc.EngineStub(self._channel)
        self._sweep = sweep_grpc.SweepStub(self._channel)
        self._steering = steering_grpc.SteeringStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self,
        prompt: PromptLike,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[RequestDelta]:
        """See `CoxswainClient.generate`; closing the iterator (`aclose`) aborts."""
        request = _generate_request(prompt, params, sampling, request_id)
        return self._stream_outputs(request)

    async def complete(
        self,
        prompt: PromptLike,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        **sampling: Any,
    ) -> RequestOutput:
        totals, total = OutputAccumulator(), None
        async for delta in self.generate(prompt, params, request_id=request_id, **sampling):
            total = totals.add(delta)
        return _finished(total)

    async def _stream_outputs(self, request: pb.GenerateRequest) -> AsyncIterator[RequestDelta]:
        call = self._engine.Generate(
            request, metadata=self._metadata, timeout=self.stream_timeout_s
        )
        try:
            async for msg in call:
                yield convert.delta_from_proto(msg)
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> None:
        await self._call(self._engine.Abort, pb.AbortRequest(request_id=request_id))

    async def model_info(self) -> dict[str, Any]:
        response = await self._call(self._engine.ModelInfo, pb.ModelInfoRequest())
        return convert.model_card_from_proto(response)

    async def stats(self) -> dict[str, Any]:
        response = await self._call(self._engine.Stats, pb.EngineStatsRequest())
        return convert.json_from_proto(response)

    def sweep(
        self, spec: SweepSpec | None = None, **fields: Any
    ) -> AsyncIterator[Cell | SweepResult]:
        """See `CoxswainClient.sweep`."""
        return self._stream_sweep(_sweep_request(spec, fields))

    async def sweep_result(self, spec: SweepSpec | None = None, **fields: Any) -> SweepResult:
        result = None
        async for event in self.sweep(spec, **fields):
            result = event
        assert isinstance(result, SweepResult)
        return result

    async def _stream_sweep(self, request: Any) -> AsyncIterator[Cell | SweepResult]:
        call = self._sweep.Run(request, metadata=self._metadata, timeout=self.stream_timeout_s)
        cells: list[Cell] = []
        try:
            async for event in call:
                if event.HasField("summary"):
                    yield convert.sweep_result_from_proto(event.summary, cells)
                    return
                cells.append(convert.sweep_cell_from_proto(event.cell))
                yield cells[-1]
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()
        raise CoxswainError("the Sweep stream ended without a summary")

    async def set_global_steering(self, spec: Any) -> dict[str, Any]:
        response = await self._call(self._steering.SetGlobal, _steering_spec(spec))
        return convert.json_from_proto(response)

    async def clear_global_steering(self) -> dict[str, Any]:
        request = steering_pb.ClearGlobalRequest()
        return convert.json_from_proto(await self._call(self._steering.ClearGlobal, request))

    async def steering_state(self) -> dict[str, Any]:
        request = steering_pb.GetSteeringStateRequest()
        return convert.json_from_proto(await self._call(self._steering.GetState, request))

    async def dynamic_state(self) -> dict[str, Any]:
        request = steering_pb.GetDynamicStateRequest()
        return convert.json_from_proto(await self._call(self._steering.GetDynamic, request))

    async def register_vector(
        self, name: str, value: Any, *, overwrite: bool = False
    ) -> dict[str, Any]:
        request = convert.register_vector_to_proto(name, value, overwrite)
        response = await self._call(self._steering.RegisterVector, request)
        return convert.vector_info_from_proto(response)

    async def import_vector(
        self, name: str, path: str, *, overwrite: bool = False
    ) -> dict[str, Any]:
        request = steering_pb.RegisterVectorRequest(name=name, path=path, overwrite=overwrite)
        response = await self._call(self._steering.RegisterVector, request)
        return convert.vector_info_from_proto(response)

    async def list_vectors(self) -> list[dict[str, Any]]:
        response = await self._call(self._steering.ListVectors, steering_pb.ListVectorsRequest())
        return [convert.vector_info_from_proto(v) for v in response.vectors]

    async def get_vector(self, name: str) -> dict[str, Any]:
        request = steering_pb.GetVectorRequest(name=name)
        return convert.named_vector_from_proto(await self._call(self._steering.GetVector, request))

    async def unregister_vector(self, name: str) -> dict[str, Any]:
        request = steering_pb.UnregisterVectorRequest(name=name)
        response = await self._call(self._steering.UnregisterVector, request)
        return convert.vector_info_from_proto(response)

    async def drop_patch_source(self, run: str) -> dict[str, Any]:
        request = steering_pb.DropPatchSourceRequest(run=run)
        response = await self._call(self._steering.DropPatchSource, request)
        return {"run": response.run, "dropped": True, "bytes_freed": response.bytes_freed}

    async def health(self, service: str = "") -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        status = (await self._call(self._health.Check, request)).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncCoxswainClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _error(self, e: grpc.RpcError) -> CoxswainError:
        return error_from_rpc(e, self._where)

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise self._error(e) from None


def _finished(total: RequestOutput | None) -> RequestOutput:
    if total is None or not total.finished:
        raise CoxswainError("the Generate stream ended before the request finished")
    return total


def _total(deltas: Iterator[RequestDelta]) -> RequestOutput:
    """The whole output of a Generate stream."""
    totals, total = OutputAccumulator(), None
    for delta in deltas:
        total = totals.add(delta)
    return _finished(total)
