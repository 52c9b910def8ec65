"""The patch-source store: captured runs under a byte budget, with leases; gRPC server,
client and Ray actor."""

from services.patch_store.store import Manifest, PatchStore

__all__ = ["Manifest", "PatchStore"]
