"""The HTTP front end in its own process, over an engine served from another.

One interpreter cannot both step an engine and render every token of a hundred streams:
the engine thread and the event loop share the GIL, so every token's HTTP work (asyncio
wake-ups, rendering, socket writes: about 100 µs) lengthens the engine's step instead of
running beside it. vLLM v1 splits its API server from its engine core for the same reason.
Here `BackendServer` serves an `EngineService` on a Unix socket, and `ProcessBackend` gives
the HTTP app (`build_app`) that service's interface in another process:

- Deltas cross in one message per engine step, however many streams the step advanced (the
  engine thread only appends to an outbox; the server's own thread pickles and sends it).
- Everything else is a call by method name (`model_card`, steering, vectors, stats, ...),
  and `patch_sweep` a stream of items.
- The socket lives in a 0700 directory and every connection proves it holds the shared key
  (`multiprocessing.connection`'s HMAC challenge, both ways) before a byte is unpickled.

Errors cross as the exceptions they are, so the front end answers with the same 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import secrets
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from services.common.errors import (
    CoxswainError,
    DuplicateRequestError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from services.engine.async_llm import DeltaStream
from services.engine.detokenizer import detokenize_here
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import RequestDelta
from services.engine.sampling_params import SamplingParams
from services.engine.service import EngineService

log = logging.getLogger(__name__)

# What the front end may call by name: the service's interface, nothing else of the object.
CALLS = frozenset(
    {
        "model_card",
        "encode_chat",
        "abort",
        "set_global_steering",
        "clear_global_steering",
        "steering_state",
        "dynamic_state",
        "submit_action",
        "register_vector",
        "import_vector",
        "list_vectors",
        "get_vector",
        "unregister_vector",
        "drop_patch_source",
        "stats",
        "health",
    }
)
STREAMS = frozenset({"patch_sweep"})


@dataclass(frozen=True)
class BackendAddress:
    """Where a `BackendServer` listens (a Unix socket's path, or a TCP (host, port)) and the
    key that opens it (pass it to the front end's process; never log the key)."""

    path: str | tuple[str, int]
    authkey: bytes = field(repr=False)

    @property
    def family(self) -> str:
        return "AF_UNIX" if isinstance(self.path, str) else "AF_INET"


class BackendServer:
    """Serves `service` to front ends in other processes until `close()`.

    Runs its own asyncio loop in a thread (the service's async methods run there) and one
    reader thread per connection. `start()` returns the address to give a `ProcessBackend`.
    """

    def __init__(
        self,
        service: EngineService,
        tcp: tuple[str, str] | None = None,
        authkey: bytes | None = None,
    ):
        """`tcp`: listen on (bind host, advertised host) at a free port instead of a Unix
        socket, for front ends on other machines (a cluster's gateway); `authkey`: the key
        they hold (default: a fresh one)."""
        self.service = service
        authkey = authkey or secrets.token_bytes(32)
        self._tcp = tcp
        self._dir = None  # the Unix socket's directory, mode 0700
        if tcp:
            self.address = BackendAddress((tcp[0], 0), authkey)
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="coxswain-backend-")
            self.address = BackendAddress(str(Path(self._dir.name) / "engine.sock"), authkey)
        self._listener: Listener | None = None
        self._loop = asyncio.new_event_loop()
        self._closed = False

    def start(self) -> BackendAddress:
        address = self.address
        self._listener = Listener(address.path, address.family, authkey=address.authkey)
        if self._tcp:  # the port the system chose, at the host peers can reach
            port = self._listener.address[1]
            self.address = BackendAddress((self._tcp[1], port), address.authkey)
        else:
            os.chmod(address.path, 0o600)
        for target, name in ((self._loop.run_forever, "loop"), (self._accept, "accept")):
            threading.Thread(target=target, name=f"backend-{name}", daemon=True).start()
        return self.address

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError) as exc:  # a wrong key: that peer is dropped
                log.warning("refused a connection to the engine backend: %s", exc)
                continue
            except OSError:
                if self._closed:
                    return
                raise
            link = _ServerLink(self.service, conn, self._loop)
            threading.Thread(target=link.serve, name="backend-conn", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._dir is not None:
            self._dir.cleanup()


class _ServerLink:
    """One front end's connection: its requests in, its deltas and replies out."""

    def __init__(self, service: EngineService, conn: Connection, loop: asyncio.AbstractEventLoop):
        self.service, self.conn, self.loop = service, conn, loop
        self._send_lock = threading.Lock()
        # (request id, delta or exception) delivered by the engine thread, sent in batches
        self._outbox: list[tuple[str, RequestDelta | BaseException]] = []
        self._outbox_lock = threading.Lock()
        self._streams: dict[int, asyncio.Task] = {}
        self._requests: set[str] = set()  # generate requests of this link still running
        self._admitting: set[str] = set()  # requests being checked and admitted now
        self._cancelled: set[str] = set()  # ... that their reader left meanwhile

    def serve(self) -> None:
        try:
            while True:
                msg = _receive(self.conn)
                if msg is not None:
                    asyncio.run_coroutine_threadsafe(self._handle(msg), self.loop)
        except (EOFError, OSError):  # the front end went away: abort what it left running
            for rid in list(self._requests):
                self.service.llm.abort_soon(rid)

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send_bytes(_dumps(msg))

    async def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            await self._generate(*msg[1:])
        elif kind == "call":
            await self._call(*msg[1:])
        elif kind == "stream":
            self._streams[msg[1]] = asyncio.create_task(self._stream(*msg[1:]))
        elif kind == "abort":  # the reader left: abort, now or once it is admitted
            rid = msg[1]
            if rid in self._admitting:
                self._cancelled.add(rid)
            else:
                self.service.llm.abort_soon(rid)
        elif kind == "close":
            task = self._streams.pop(msg[1], None)
            if task is not None:
                task.cancel()

    async def _generate(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        self._admitting.add(rid)
        try:
            text, ids = await self.service.prepare(prompt, params)
            self._requests.add(rid)
            admitted = self.service.llm.admit(rid, ids, text, params, self._deliverer(rid))
            await asyncio.wrap_future(admitted)
        except Exception as exc:  # bad input: the front end raises it before any output
            self._requests.discard(rid)
            with contextlib.suppress(OSError):
                self._send(("deltas", [(rid, _wire_error(exc))]))
        finally:
            self._admitting.discard(rid)
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            self.service.llm.abort_soon(rid)

    def _deliverer(self, rid: str):
        def deliver(item: RequestDelta | BaseException) -> None:  # the engine thread
            if isinstance(item, BaseException) or item.finished:
                self._requests.discard(rid)
            if isinstance(item, BaseException):
                item = _wire_error(item)
            with self._outbox_lock:
                first = not self._outbox
                self._outbox.append((rid, item))
            if first:  # one flush per step, whatever the number of deltas
                self.loop.call_soon_threadsafe(self._flush)

        return deliver

    def _flush(self) -> None:
        with self._outbox_lock:
            batch, self._outbox = self._outbox, []
        if batch:
            with contextlib.suppress(OSError):  # the front end is gone: its reader aborts
                self._send(("deltas", batch))

    async def _call(self, call_id: int, name: str, args: tuple, kwargs: dict) -> None:
        try:
            if name not in CALLS:
                raise InvalidRequestError(f"{name!r} is not a method a front end may call")
            method = getattr(self.service, name)
            if asyncio.iscoroutinefunction(method):
                result = await method(*args, **kwargs)
            else:  # it may wait for the engine lock: never on this loop
                result = await asyncio.to_thread(method, *args, **kwargs)
            reply = ("result", call_id, result)
        except Exception as exc:
            reply = ("error", call_id, _wire_error(exc))
        with contextlib.suppress(OSError):
            self._send(reply)

    async def _stream(self, call_id: int, name: str, args: tuple) -> None:
        try:
            if name not in STREAMS:
                raise InvalidRequestError(f"{name!r} is not a stream a front end may open")
            async with contextlib.aclosing(getattr(self.service, name)(*args)) as items:
                async for item in items:
                    self._send(("item", call_id, item))
            self._send(("end", call_id, None))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            with contextlib.suppress(OSError):
                self._send(("error", call_id, _wire_error(exc)))
        finally:
            self._streams.pop(call_id, None)


def _dumps(msg: tuple) -> bytes:
    """Plain pickle, tensors' bytes included: `Connection.send` pickles with torch's reducers,
    which pass a tensor's memory as a file descriptor that only a process of the same host
    and multiprocessing key can open (a cluster's gateway is neither)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _receive(conn: Connection) -> tuple | None:
    """The next message (None for one that does not unpickle: logged, and the connection
    reads on, since messages are framed); EOFError/OSError once the peer is gone."""
    data = conn.recv_bytes()
    try:
        return pickle.loads(data)
    except Exception:
        log.exception("dropped a message that does not unpickle (%d bytes)", len(data))
        return None


def _wire_error(exc: BaseException) -> BaseException:
    """`exc` as it may cross to the front end: ours as they are (the front end answers with
    their status and message), anything else as a bare error (a 500 without its text, as
    in process), logged here."""
    if isinstance(exc, CoxswainError):
        return exc
    log.error("engine backend call failed", exc_info=exc)
    return RuntimeError(type(exc).__name__)


class ProcessBackend:
    """`EngineService`'s interface for the HTTP app, over a `BackendServer` in another process.

    Sync methods block the calling thread until the reply (routes run them in a thread pool);
    `generate` streams deltas as `EngineService.generate` does, merging those a slow reader
    has not taken; closing it early aborts the request.
    """

    def __init__(
        self, address: BackendAddress, model_dir: str | Path | None, tokenizer: Any = None
    ):
        """`model_dir`: where the renderer reads the tokenizer (None: the caller renders).
        With a tokenizer (read from `model_dir`, or `tokenizer`), this process decodes the
        text of generations without stop strings (`detokenizer.detokenize_here`), which
        takes that work off the engine's thread; without one the engine decodes it."""
        try:
            self._conn = Client(address.path, address.family, authkey=address.authkey)
        except OSError as exc:
            raise ServiceUnavailableError(
                f"the engine at {address.path} is not reachable: {exc}"
            ) from None
        self.alive = True  # until the connection breaks
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._calls: dict[int, Future] = {}
        self._streams: dict[str, DeltaStream] = {}
        self._item_streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._reader = threading.Thread(target=self._read, name="backend-reader", daemon=True)
        self._reader.start()
        self._card = self._call("model_card")
        self.model_id: str = self._card["id"]
        # The renderer needs the tokenizer here (token texts for logprobs); the files are the
        # engine's, read from the same local checkpoint directory.
        if model_dir is not None:
            tokenizer = Tokenizer(model_dir)
            self.engine = SimpleNamespace(tokenizer=tokenizer)
        self.tokenizer = tokenizer

    @property
    def num_streams(self) -> int:
        """Generations this front end has running on the engine."""
        return len(self._streams)

    # -- the wire ----------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(_dumps(msg))
        except OSError as exc:
            raise ServiceUnavailableError(f"the engine is gone: {exc}") from None

    def _read(self) -> None:
        try:
            while True:
                msg = _receive(self._conn)
                if msg is not None:
                    self._dispatch(msg)
        except (EOFError, OSError):
            self.alive = False
            gone = ServiceUnavailableError(
                "the engine replica failed during the call (its connection closed): retry shortly"
            )
            DeltaStream.deliver_all((s, gone) for s in list(self._streams.values()))
            for call in list(self._calls.values()):
                call.set_exception(gone)
            for loop, queue in list(self._item_streams.values()):
                loop.call_soon_threadsafe(queue.put_nowait, ("error", gone))

    def _dispatch(self, msg: tuple) -> None:
        kind, key, value = msg if len(msg) == 3 else (*msg, None)
        if kind == "deltas":
            DeltaStream.deliver_all(
                (stream, item) for rid, item in key if (stream := self._streams.get(rid))
            )
        elif key in self._calls:  # a call's reply
            call = self._calls.pop(key)
            if kind == "result":
                call.set_result(value)
            else:
                call.set_exception(value)
        elif key in self._item_streams:  # a stream's item, end or error
            loop, queue = self._item_streams[key]
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._start_call(name, args, kwargs).result()

    async def _acall(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.wrap_future(self._start_call(name, args, kwargs))

    def _start_call(self, name: str, args: tuple, kwargs: dict) -> Future:
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        self._send(("call", call_id, name, args, kwargs))
        return future

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestDelta]:
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        stream = self._streams[rid] = DeltaStream(asyncio.get_running_loop())
        finished = False
        params, detokenizer = detokenize_here(params, self.tokenizer)
        try:
            self._send(("generate", rid, prompt, params))
            async for delta in stream.read():
                finished = delta.finished
                if detokenizer is not None:
                    detokenizer.fill(delta)
                yield delta
        finally:
            self._streams.pop(rid, None)
            if not finished:
                with contextlib.suppress(ServiceUnavailableError):
                    self._send(("abort", rid))

    async def abort(self, request_id: str) -> None:
        await self._acall("abort", request_id)

    async def patch_sweep(self, spec: Any) -> AsyncIterator[dict]:
        call_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._item_streams[call_id] = (asyncio.get_running_loop(), queue)
        done = False
        try:
            self._send(("stream", call_id, "patch_sweep", (spec,)))
            while True:
                kind, value = await queue.get()
                if kind == "end":
                    done = True
                    return
                if kind == "error":
                    done = True
                    raise value
                yield value
        finally:
            self._item_streams.pop(call_id, None)
            if not done:
                with contextlib.suppress(ServiceUnavailableError):
                    self._send(("close", call_id))

    # -- the rest of the service's interface --------------------------------------------------

    def model_card(self) -> dict:
        return dict(self._card)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self._call("encode_chat", messages)

    async def set_global_steering(self, spec: Any) -> dict:
        return await self._acall("set_global_steering", spec)

    async def clear_global_steering(self) -> dict:
        return await self._acall("clear_global_steering")

    def steering_state(self) -> dict:
        return self._call("steering_state")

    def dynamic_state(self) -> dict:
        return self._call("dynamic_state")

    def submit_action(self, action: Any, source: str = "api") -> bool:
        return self._call("submit_action", action, source)

    def register_vector(self, name: str, value: Any, *, overwrite: bool = False) -> dict:
        return self._call("register_vector", name, value, overwrite=overwrite)

    def import_vector(self, name: str, path: str, *, overwrite: bool = False) -> dict:
        return self._call("import_vector", name, path, overwrite=overwrite)

    def list_vectors(self) -> list[dict]:
        return self._call("list_vectors")

    def get_vector(self, name: str) -> dict:
        return self._call("get_vector", name)

    def unregister_vector(self, name: str) -> dict:
        return self._call("unregister_vector", name)

    def drop_patch_source(self, run: str) -> dict:
        return self._call("drop_patch_source", run)

    def stats(self) -> dict:
        return self._call("stats")

    def health(self) -> dict:
        return self._call("health")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()


# -- the front end's process ---------------------------------------------------------------


@contextlib.contextmanager
def http_frontend(
    address: BackendAddress,
    model_dir: str | Path,
    keys: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 1,
    timeout_s: float = 60.0,
    **app_options: Any,
) -> Iterator[str]:
    """Serve the HTTP app (`build_app` with `keys` and `app_options`, e.g. `max_body_bytes`
    and `body_timeout_s`) under uvicorn in `workers` child
    processes, over the engine a `BackendServer` at `address` serves; yields the base URL
    until the block exits. The workers accept connections from one listening socket, each
    with its own link to the engine, so HTTP work spreads over them (one event loop renders
    about 10k tokens/s). `port` 0 picks a free one."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    sock = listening_socket(host, port)
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    try:
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_frontend_main,
                args=(address, str(model_dir), keys, sock, child, app_options),
                name="coxswain-http",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            pipes.append(parent)
        for parent in pipes:
            if not parent.poll(timeout_s):
                raise ServiceUnavailableError("the HTTP front end did not start")
            kind, value = parent.recv()
            if kind == "error":
                raise ServiceUnavailableError(f"the HTTP front end failed to start: {value}")
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(timeout_s)
        sock.close()


def _frontend_main(
    address: BackendAddress,
    model_dir: str,
    keys: Any,
    sock: socket.socket,
    ready: Connection,
    app_options: dict[str, Any],
) -> None:
    import uvicorn

    from services.gateway.http_app import build_app

    try:
        app = build_app(ProcessBackend(address, model_dir), keys, **app_options)
    except Exception as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    report_started(server, lambda: ready.send(("ready", None)))
    server.run(sockets=[sock])


def listening_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on (host, port) for HTTP worker processes to share; with
    `reuse_port`, other processes of this host may listen on the same port too."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def report_started(server: Any, notify: Callable[[], None]) -> None:
    """Call `notify()` from a daemon thread once the uvicorn `server` serves."""

    def wait() -> None:
        while not server.started:
            time.sleep(0.01)
        notify()

    threading.Thread(target=wait, name="report-started", daemon=True).start()


def tcp_hosts(bind_host: str) -> tuple[str, str]:
    """(bind, advertised) host of a `BackendServer` serving other machines' front ends: the
    given interface when it is loopback (a local cluster), else every interface, reached at
    this node's address (as Ray sees it)."""
    if bind_host in ("127.0.0.1", "localhost", "::1"):
        return bind_host, bind_host
    import ray

    return "0.0.0.0", ray.util.get_node_ip_address()
