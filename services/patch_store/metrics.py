"""The patch store's counters and gauges: one table of names and help texts each, kept as
plain ints for `PatchStore.stats()` and as `coxswain_patch_store_*` prometheus metrics in the
store's registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

# Counters kept by every store: name -> help. Each is in stats() and, as
# `coxswain_patch_store_<name>_total`, in the store's prometheus registry.
COUNTERS = {
    "puts": "runs stored (overwrites included)",
    "gets": "get_rows calls",
    "hits": "get_rows calls that found every row asked for",
    "misses": "get_rows calls that failed: unknown run or missing rows",
    "rows_served": "rows returned by get_rows",
    "evictions": "runs evicted, least recently used first, to stay under the byte budget",
    "evicted_bytes": "bytes freed by evictions",
    "drops": "runs dropped by their owner",
    "invalidations": "invalidate_all calls (weights changed)",
    "invalidated_runs": "runs dropped by invalidate_all",
    "puts_refused": "puts refused: they fit the budget only by evicting leased runs",
    "leases_refused": "leases refused: the reader's leased runs would pass its byte share",
    "leases_granted": "leases taken",
    "leases_refreshed": "leases renewed by their holder",
    "leases_released": "leases released by their holder",
    "leases_expired": "leases that ran out",
}

# Gauges read from the store when scraped: name -> help (`coxswain_patch_store_<name>`).
GAUGES = {
    "runs": "runs held",
    "bytes": "bytes held",
    "budget_bytes": "the byte budget",
    "bytes_over_budget": "bytes held over budget: always 0, the budget is hard",
    "leased_runs": "runs with an unexpired lease",
    "leased_bytes": "bytes of the runs with an unexpired lease",
    "retired_versions": "overwritten versions kept readable for their lease holders",
}


class StoreMetrics:
    """A store's counters (`counts`, and prometheus counters) and its gauges, each gauge
    read by a function of the store's that `gauges` names."""

    def __init__(
        self, registry: CollectorRegistry, gauges: Mapping[str, Callable[[], float]]
    ) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._counters = {
            name: Counter(f"coxswain_patch_store_{name}", doc, registry=registry)
            for name, doc in COUNTERS.items()
        }
        for name, doc in GAUGES.items():
            Gauge(f"coxswain_patch_store_{name}", doc, registry=registry).set_function(gauges[name])

    def count(self, name: str, amount: int = 1) -> None:
        """Add `amount` to counter `name`."""
        self.counts[name] += amount
        if amount:
            self._counters[name].inc(amount)
