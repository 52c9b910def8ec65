"""Python clients of a Coxswain engine over gRPC.

```python
from services.client import CoxswainClient

with CoxswainClient("localhost:50051", api_key="...") as client:
    out = client.complete("The capital of France is", max_tokens=8, temperature=0.0)
```
"""

from services.client.grpc_client import AsyncCoxswainClient, CoxswainClient

__all__ = ["AsyncCoxswainClient", "CoxswainClient"]
