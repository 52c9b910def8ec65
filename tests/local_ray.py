"""The one way a test starts Ray: a Ray of its own on this host, started again if it is slow.

`address="local"` always starts a new head, never a `coxswain up` cluster running beside the
tests (tests/unit/test_isolation.py checks that no test calls `ray.init` any other way).

Ray gives its raylet a fixed 30 s to register with the GCS (`ray/_private/node.py`, not
configurable). On a loaded 2-core CI machine that wait ran out once and the module's tests
errored at setup, though nothing in our code was wrong. A start that times out is tried
again, from nothing: the half-started head's processes are left to Ray's reaper, which ends
them with the test session.
"""

from __future__ import annotations

import time

ATTEMPTS = 3
_STARTUP_TIMEOUT = "timed out during startup"


def start_local_ray(**kwargs) -> None:
    """`ray.init(address="local", include_dashboard=False, log_to_driver=False, **kwargs)`,
    tried up to `ATTEMPTS` times when the node times out during startup."""
    import ray

    kwargs = {"include_dashboard": False, "log_to_driver": False, **kwargs}
    for attempt in range(1, ATTEMPTS + 1):
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if _STARTUP_TIMEOUT not in str(e) or attempt == ATTEMPTS:
                raise
            ray.shutdown()
            time.sleep(2.0 * attempt)
