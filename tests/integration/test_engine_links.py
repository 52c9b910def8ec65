"""The gateway's direct links to engine replicas (`services/gateway/engine_links.py`) over
real engines served on TCP `BackendServer`s and the in-memory cluster state: which replicas
a gateway links to, which one a generation takes, and what it gets back."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from services.cluster.stores import ClusterState
from services.engine import SamplingParams
from services.engine.service import EngineService
from services.gateway.engine_links import EngineLinks
from services.gateway.process_backend import BackendServer

KEY = secrets.token_bytes(32)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    """Two engine replicas with delta servers on loopback, and one whose key differs."""
    services = [EngineService.from_model(tiny_checkpoint("llama"), device="cpu") for _ in range(3)]
    keys = [KEY, KEY, secrets.token_bytes(32)]
    servers = [
        BackendServer(s, ("127.0.0.1", "127.0.0.1"), k) for s, k in zip(services, keys, strict=True)
    ]
    addresses = [list(server.start().path) for server in servers]
    yield services, addresses
    for server in servers:
        server.close()
    for service in services:
        asyncio.run(service.shutdown())


def _report(state: ClusterState, replica: str, app: str, backend: list, ttl_s: float = 60):
    state.report(replica, {"app": app, "backend": backend, "version": 0}, ttl_s)


async def _tokens(source, prompt: str) -> list[int]:
    """Greedy tokens of `prompt` from a link or an EngineService (the same interface)."""
    out = []
    async for delta in source.generate(prompt, GREEDY):
        for sample in delta.samples:
            out.extend(sample.token_ids)
    return out


def test_links_to_its_applications_replicas_only_and_generates_through_them(replicas):
    services, addresses = replicas
    state = ClusterState()
    _report(state, "a", "app", addresses[0])
    _report(state, "b", "other-app", addresses[1])  # another application sharing the store
    _report(state, "c", "app", addresses[2])  # its key is not this application's
    links = EngineLinks(state, KEY, "app", refresh_s=3600)
    try:
        assert len(links) == 1  # not b (another app), not c (refused the challenge)
        got = asyncio.run(_tokens(links.pick(), "the quick brown fox"))
        direct = asyncio.run(_tokens(services[1], "the quick brown fox"))  # the same weights
        assert got == direct and len(got) == 6
    finally:
        links.close()


def test_picks_the_least_loaded_replica_and_drops_one_whose_report_expired(replicas):
    _, addresses = replicas
    state = ClusterState()
    _report(state, "a", "app", addresses[0])
    _report(state, "b", "app", addresses[1], ttl_s=1.0)
    links = EngineLinks(state, KEY, "app", refresh_s=3600)
    try:
        assert len(links) == 2

        async def busy_then_pick():
            first = links.pick()
            stream = first.generate("once upon a time", SamplingParams(max_tokens=400))
            await anext(stream)  # running on `first`
            second = links.pick()
            await stream.aclose()  # aborts it
            return first, second

        first, second = asyncio.run(busy_then_pick())
        assert first is not second
        time.sleep(1.2)  # b's report expires: it is taken for dead
        _report(state, "a", "app", addresses[0])
        links.refresh()
        assert len(links) == 1
    finally:
        links.close()


def test_links_with_the_tokenizer_decode_the_text_the_engine_would_have(replicas):
    """Given the model's tokenizer (as the gateway fetches it), a link sends generations
    without stop strings undecoded and fills in their text here: the replica's own text."""
    services, addresses = replicas
    state = ClusterState()
    _report(state, "a", "app", addresses[0])
    tokenizer = services[0].llm.engine.tokenizer
    links = EngineLinks(state, KEY, "app", refresh_s=3600, tokenizer=tokenizer)
    engine_text: list[str] = []

    def listen(deltas: list) -> None:
        engine_text.extend(s.text for d in deltas for s in d.samples)

    async def text(source) -> str:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return "".join(
            [s.text async for d in source.generate("once upon a time", params) for s in d.samples]
        )

    services[0].llm.add_listener(listen)
    try:
        got = asyncio.run(text(links.pick()))
        assert engine_text and not "".join(engine_text)  # the replica decoded nothing
        assert got and got == asyncio.run(text(services[1]))  # the same weights' text
    finally:
        services[0].llm.remove_listener(listen)
        links.close()
