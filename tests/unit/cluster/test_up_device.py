"""`coxswain up`'s device (issue 26): on CUDA every engine rank gets a GPU of its own, so `up`
counts them first and refuses, in one line naming the flags, what this machine cannot hold,
before anything starts (see tests/e2e/test_up_devices.py for the command itself)."""

from __future__ import annotations

import pytest

from services.cluster.local import UpOptions, resolve_device
from services.common.errors import InvalidRequestError


def test_auto_is_cuda_when_a_gpu_is_visible_else_cpu():
    assert resolve_device(UpOptions(device="auto"), gpus=0) == "cpu"
    assert resolve_device(UpOptions(device="auto"), gpus=1) == "cuda"
    assert resolve_device(UpOptions(device="cpu", replicas=8), gpus=0) == "cpu"
    assert resolve_device(UpOptions(device="cuda", replicas=2, tp=2), gpus=4) == "cuda"


def test_cuda_without_a_gpu_says_so():
    with pytest.raises(InvalidRequestError) as e:
        resolve_device(UpOptions(device="cuda"), gpus=0)
    assert str(e.value) == (
        "--device cuda: no CUDA device is visible on this machine (torch.cuda.device_count() is 0)"
    )


def test_too_few_gpus_names_the_flags_that_multiply(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(InvalidRequestError) as e:
        resolve_device(UpOptions(device="cuda", replicas=2, tp=2), gpus=2)
    assert str(e.value) == "--replicas 2 × --tp 2 × --pp 1 needs 4 GPUs; this machine has 2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(
        InvalidRequestError, match=r"has 2 \(CUDA_VISIBLE_DEVICES=0,1\); --device cpu"
    ):
        resolve_device(UpOptions(device="auto", replicas=3), gpus=2)


def test_a_numbered_cuda_device_is_refused_with_what_to_use():
    # Ray shows each rank only its own GPU, as cuda:0: cuda:1 would not exist there.
    with pytest.raises(InvalidRequestError, match="use --device cuda"):
        resolve_device(UpOptions(device="cuda:1"), gpus=2)
    with pytest.raises(InvalidRequestError, match="cpu, cuda or auto"):
        resolve_device(UpOptions(device="tpu"), gpus=2)
