"""The controller's gRPC server: the `coxswain.v1.Controller` service over one `Controller`,
with the standard Health and reflection services beside it.

Auth is the gateway's: bearer API keys (`services.common.auth.ApiKeys`) in the `authorization`
metadata; ListPolicies and Status need read scope, SetPolicies and RemovePolicy admin. Health
and reflection stay open, as probes need them.

    python -m services.controller.server --redis redis://127.0.0.1:6379/0 --port 50071 \
        [--policies policies.json] [--group coxswain-controller] [--consumer NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import signal
import threading
from pathlib import Path

import services.controller.convert as convert
from services.common.auth import ApiKeys
from services.common.grpc_serving import GrpcServer, authenticated_rpc, start_grpc_server
from services.controller.controller import Controller
from services.proto.coxswain.v1 import controller_pb2 as pb
from services.proto.coxswain.v1 import controller_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Controller"].full_name  # coxswain.v1.Controller

_rpc = functools.partial(authenticated_rpc, "controller")


class ControllerServicer(pb_grpc.ControllerServicer):
    """The `coxswain.v1.Controller` service: each RPC converts, calls the controller, converts
    back."""

    def __init__(self, controller: Controller, keys: ApiKeys | None = None) -> None:
        self.controller = controller
        self.keys = keys or ApiKeys()

    @_rpc("admin")
    def SetPolicies(self, request, context):
        configs = [convert.policy_from_proto(p) for p in request.policies]
        active = self.controller.set_policies(configs, replace=request.replace_all)
        return convert.policies_to_proto(active)

    @_rpc("read")
    def ListPolicies(self, request, context):
        return convert.policies_to_proto(self.controller.list_policies())

    @_rpc("admin")
    def RemovePolicy(self, request, context):
        self.controller.remove_policy(request.name)
        return convert.policies_to_proto(self.controller.list_policies())

    @_rpc("read")
    def Status(self, request, context):
        return convert.status_to_proto(self.controller.status())


ControllerServer = GrpcServer  # what `serve` returns: `address`, `stop()`, `wait()`


def serve(
    controller: Controller,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    keys: ApiKeys | None = None,
    max_workers: int = 4,
) -> ControllerServer:
    """Serve `controller` on `host:port` (port 0: any free port) with Health and reflection.
    `keys` (default: none, auth off) are checked on every Controller call."""
    return start_grpc_server(
        "controller",
        SERVICE_NAME,
        lambda server: pb_grpc.add_ControllerServicer_to_server(
            ControllerServicer(controller, keys), server
        ),
        host,
        port,
        max_workers=max_workers,
    )


def main(argv: list[str] | None = None) -> None:
    """Run a controller and its gRPC server until SIGINT/SIGTERM."""
    ap = argparse.ArgumentParser(description="Coxswain async steering controller")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50071)
    ap.add_argument("--policies", type=Path, help="a JSON list of policy configs")
    ap.add_argument("--group", default="coxswain-controller")
    ap.add_argument("--consumer", default=None)
    ap.add_argument("--max-queue-len", type=int, default=1024)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    policies = json.loads(args.policies.read_text()) if args.policies else []
    controller = Controller(
        args.redis,
        policies,
        group=args.group,
        consumer=args.consumer,
        max_queue_len=args.max_queue_len,
    ).start()
    server = serve(controller, args.host, args.port, keys=ApiKeys.from_env())
    print(f"controller gRPC on {server.address}, reading {args.redis}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    controller.stop()


if __name__ == "__main__":
    main()
