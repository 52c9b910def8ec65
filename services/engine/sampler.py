"""Turn the last-position logits of each sampling sequence into tokens and logprobs.

All rows are processed as one batch; the only per-row loop is drawing noise for seeded
requests from their own generator, which makes a seeded request's tokens independent of
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: logprob} (top-k ∪ sampled ∪ requested ids), or None if not asked.
    logprobs: list[dict[int, float] | None]


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); k == 0 and p == 1 mean off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    v = logits.shape[-1]
    ranks = torch.arange(v, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, v)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (keeps >= 1 token).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SamplerOutput:
    n = logits.shape[0]
    device = logits.device
    tokens = logits.argmax(dim=-1)

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=device)
        x = (
            logits[rows]
            / torch.tensor([params[i].temperature for i in random_rows], device=device)[:, None]
        )
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=device)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            x = _apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([params[i].min_p for i in random_rows], device=device)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), draws exactly from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=generators[i] or default_generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)

    token_list = tokens.tolist()
    out_logprobs: list[dict[int, float] | None] = [None] * n
    wants = [i for i, p in enumerate(params) if p.logprobs is not None or p.logprob_token_ids]
    if wants:
        logprobs = torch.log_softmax(logits, dim=-1)  # the raw model distribution
        k = max(params[i].logprobs or 0 for i in wants)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        sampled_lp = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_vals_l = top_vals.tolist() if k else None
        top_ids_l = top_ids.tolist() if k else None
        for i in wants:
            p = params[i]
            d: dict[int, float] = {}
            if p.logprobs and top_ids_l is not None:
                d.update(zip(top_ids_l[i][: p.logprobs], top_vals_l[i][: p.logprobs], strict=True))
            d[token_list[i]] = sampled_lp[i]
            if p.logprob_token_ids:
                vals = logprobs[i, p.logprob_token_ids].tolist()
                d.update(zip(p.logprob_token_ids, vals, strict=True))
            out_logprobs[i] = d
    return SamplerOutput(token_list, out_logprobs)


def prompt_logprobs(
    logits: torch.Tensor,  # [P, V]: logits at prompt positions p, predicting token p+1
    next_ids: list[int],  # [P] the actual prompt tokens at p+1
    k: int,
) -> list[dict[int, float]]:
    """Per prompt position: top-k logprobs plus the actual next prompt token's."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    actual = lp.gather(1, torch.tensor(next_ids, device=lp.device)[:, None]).squeeze(1).tolist()
    out = [{t: v} for t, v in zip(next_ids, actual, strict=True)]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        for d, row_ids, row_vals in zip(out, ids.tolist(), vals.tolist(), strict=True):
            for t, v in zip(row_ids, row_vals, strict=True):
                d.setdefault(t, v)
    return out
