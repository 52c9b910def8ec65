"""`coxswain demo --cluster`: a tour of a running local cluster over HTTP and gRPC."""

from __future__ import annotations

import json
from typing import Any

import httpx
import torch

from services.common.wire import unpack_tensor


def _vector(hidden: int, seed: int, norm: float = 8.0) -> list[float]:
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return (v / v.norm() * norm).tolist()


def run_demo(info: dict[str, Any]) -> None:
    key = (info.get("api_keys") or {}).get("admin")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=info["http"], headers=headers, timeout=300) as http:
        card = http.get("/v1/models").raise_for_status().json()["data"][0]["coxswain"]
        H, L = card["hidden_size"], card["num_layers"]
        print(f"model {card['id']}: {L} layers, hidden {H}, {card['device']} {card['dtype']}")
        prompt = "The harbour master kept a log of every boat"
        base = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
        steering = {"vectors": [{"layers": list(range(L)), "vector": _vector(H, 1)}]}
        plain = http.post("/v1/completions", json=base).raise_for_status().json()
        steered = http.post("/v1/completions", json={**base, "steering": steering}).json()
        for name, resp in (("plain  ", plain), ("steered", steered)):
            lp = resp["choices"][0]["logprobs"]["token_logprobs"]
            text = resp["choices"][0]["text"]
            print(f"  {name} {text!r:40} mean logprob {sum(lp) / len(lp):+.3f}")

        capture = {"sites": {"post_block": "all"}, "positions": "last_prompt"}
        resp = http.post("/v1/completions", json={**base, "max_tokens": 1, "capture": capture})
        caps = resp.raise_for_status().json()["coxswain"]["prompts"][0]["captures"]
        norms = {k: round(float(unpack_tensor(v).norm()), 2) for k, v in sorted(caps.items())}
        print(f"  captured last-prompt residual norms by layer: {norms}")

        http.put("/v1/vectors/demo-direction", json={"value": _vector(H, 2), "overwrite": True})
        spec = {"vectors": [{"layers": [0], "vector": "demo-direction"}]}
        version = http.post("/v1/steering/set", json=spec).raise_for_status().json()
        print(f"  global steering set (cluster version {version['cluster_version']})")
        glob = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
        print(f"  every request is now steered: {glob!r}")
        http.post("/v1/steering/clear").raise_for_status()

        body = {
            "clean_prompt": "the cat sat on the mat",
            "corrupt_prompt": "the dog sat on the mat",
            "answer_token": plain["choices"][0]["coxswain"]["token_ids"][0],
            "layers": list(range(L)),
            "positions": "all_prompt",
            "metric": "logit_diff",
            "foil_token": plain["choices"][0]["coxswain"]["token_ids"][1],
        }
        with http.stream("POST", "/v1/patch_sweep", json=body) as r:
            r.raise_for_status()
            data = [ln[5:] for ln in r.iter_lines() if ln.startswith("data:")]
        summary = json.loads(data[-1])
        print(f"  sweep: {len(data) - 1} cells streamed; logit diff by [layer][position]:")
        for layer, row in zip(summary["layers"], summary["grid"][0], strict=True):
            print(f"    layer {layer}: " + " ".join(f"{v:+7.2f}" for v in row))
    from services.client import CoxswainClient

    with CoxswainClient(info["grpc"], api_key=key) as grpc_client:
        out = grpc_client.complete(prompt, max_tokens=6, temperature=0.0)
        print(f"  gRPC Generate: {out.outputs[0].text!r}")
    print(f"dashboard: {info['dashboard']}")
    print("stop the cluster with: coxswain down")
