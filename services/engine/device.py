"""Where an engine runs: its device and dtype from `EngineConfig`'s strings, and the
attention backend that device can run."""

from __future__ import annotations

import logging

import torch

from services.engine.attention import AttentionBackend, SdpaBackend, TritonBackend

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto' picks CUDA when present, and float32 on CPU / bfloat16 on CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if dtype == "auto":
        dtype = "float32" if dev.type == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {dtype!r}")
    return dev, DTYPES[dtype]


def make_attention_backend(
    name: str, device: torch.device, head_dim: int | None = None, fused_decode: bool = False
) -> AttentionBackend:
    """`name` "auto" picks the Triton kernels on CUDA and SDPA on CPU, and SDPA on CUDA too
    for a head dimension the Triton kernels cannot tile (not a power of two), without CUDA
    graphs then (SDPA's steps are not capturable). `fused_decode`
    (`EngineConfig.fused_decode_attention`) needs the Triton kernels: asked for where SDPA
    runs, it is an error, not a quiet no-op."""
    tileable = head_dim is None or head_dim & (head_dim - 1) == 0
    if name == "auto":
        name = "triton" if device.type == "cuda" and tileable else "sdpa"
        if device.type == "cuda" and not tileable:
            log.warning(
                "head_dim %d is not a power of two: attention runs on SDPA, without CUDA "
                "graphs (the Triton kernels tile a head whole)",
                head_dim,
            )
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        if not tileable:
            raise ValueError(
                f"attention_backend='triton' needs a power-of-two head_dim (its kernels tile "
                f"a head whole); this model's is {head_dim}: use 'auto' or 'sdpa'"
            )
        return TritonBackend(fused_decode=fused_decode)
    if fused_decode:
        raise ValueError(
            "fused_decode_attention is the Triton decode kernel's; attention here runs on "
            f"SDPA ({device.type}, head_dim {head_dim}): turn it off"
        )
    return SdpaBackend()
