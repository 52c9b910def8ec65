"""Fuzz the HTTP gateway from its own OpenAPI document (schemathesis): whatever the body,
path or header, the server answers without a 5xx and keeps serving.

Runs against a real uvicorn server over its own engine (the fuzzer sets global steering
and registers vectors, so it shares no state with other tests), with an admin key so every
route is reached past auth. The number of examples is bounded to keep the run short.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error

from services.common.auth import ApiKey, ApiKeys
from services.engine.service import EngineService
from services.gateway.http_app import build_app
from services.patch_store.store import PatchStore
from tests.serving import serve_asgi

ADMIN = "fuzz-admin-" + "z" * 24
MAX_EXAMPLES = 20  # per operation


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    store = PatchStore(budget_bytes=16 * 2**20)
    # A short context bounds what any fuzzed request can cost.
    backend = EngineService.from_model(
        tiny_checkpoint("llama"),
        model_id="tiny",
        patch_store=store,
        device="cpu",
        dtype="float32",
        max_model_len=48,
        max_num_seqs=16,
    )
    app = build_app(backend, ApiKeys([ApiKey("fuzz", "admin", ADMIN)]), patch_store=store)
    with serve_asgi(app) as url:
        yield url
    backend.llm.shutdown()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case, server):
    case.call_and_validate(
        base_url=server,
        headers={"Authorization": f"Bearer {ADMIN}"},
        checks=[not_a_server_error],
        timeout=60,
    )


def test_the_server_still_serves_after_fuzzing(server):
    # module-scoped server: this runs after the fuzz cases above
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "still here", "max_tokens": 2, "temperature": 0},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["coxswain"]["token_ids"]) == 2
    metrics = httpx.get(
        f"{server}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60
    ).text
    counts = {
        (s.labels["route"], s.labels["status"]): s.value
        for f in text_string_to_metric_families(metrics)
        if f.name == "coxswain_http_requests"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert not [k for k in counts if k[1].startswith("5")]
    # the fuzzer got past auth and validation into the engine, and was refused as well
    assert counts.get(("/v1/completions", "200"), 0) > 1
    assert counts.get(("/v1/completions", "400"), 0) > 1
