"""A training process's own view in Prometheus, for jobs that already run ``prometheus_client``.

The node agent serves the job's metrics (``Checkpointer(..., metrics="HOST:PORT")``;
docs/operations.md, "Metrics"). A training process that already exposes its own metrics with
``prometheus_client`` can add what its ``Checkpointer`` saw to that endpoint::

    import prometheus_client, safepoint.metrics
    ckpt = safepoint.Checkpointer(path)
    safepoint.metrics.register(ckpt)            # into prometheus_client's default registry
    prometheus_client.start_http_server(8000)

The collector reads only the checkpointer's own counters (no call to the agent happens on the
scrape thread): saves, skipped saves, the time saves blocked training, restores by source and
the errors telling the agent. Series are named ``safepoint_process_*`` and labelled
``safepoint_job`` and ``rank``. ``prometheus_client`` is an optional dependency: this module
imports it only when ``register`` is called.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["register", "unregister"]


class _CheckpointerCollector:
    def __init__(self, ckpt: Any) -> None:
        self._ckpt = ckpt

    def describe(self) -> list:
        return []  # collected on demand; nothing is registered ahead

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        ck = self._ckpt
        stats = ck._stats  # plain dicts and numbers, updated by save() and load()
        labels = ["safepoint_job", "rank"]
        values = [ck.job, str(ck.rank)]

        saves = CounterMetricFamily("safepoint_process_saves", "Saves that took a snapshot.",
                                    labels=labels)
        saves.add_metric(values, stats["saves"] - stats["skipped_saves"])
        yield saves
        skipped = CounterMetricFamily("safepoint_process_saves_skipped",
                                      "Saves skipped because no slot was free.", labels=labels)
        skipped.add_metric(values, stats["skipped_saves"])
        yield skipped
        blocking = SummaryMetricFamily("safepoint_process_save_blocking_seconds",
                                       "Time save() blocked training.", labels=labels)
        blocking.add_metric(values, count_value=stats["saves"],
                            sum_value=stats.get("blocking_seconds_sum", 0.0))
        yield blocking
        last = GaugeMetricFamily("safepoint_process_last_save_blocking_seconds",
                                 "Time the last save() blocked training.", labels=labels)
        last_save = stats.get("last_save")
        if last_save:
            last.add_metric(values, last_save["blocking_seconds"])
        yield last
        errors = CounterMetricFamily("safepoint_process_agent_errors",
                                     "Saves the agent could not be told of.", labels=labels)
        errors.add_metric(values, stats["agent_errors"])
        yield errors
        restores = CounterMetricFamily("safepoint_process_restores", "Restores by source.",
                                       labels=labels + ["source"])
        for source, n in sorted(stats.get("restores", {}).items()):
            restores.add_metric(values + [source], n)
        yield restores
        restore_s = GaugeMetricFamily("safepoint_process_last_restore_seconds",
                                      "Time the last restore took.", labels=labels + ["source"])
        if ck.last_restore is not None:
            restore_s.add_metric(values + [ck.last_restore.source], ck.last_restore.seconds)
        yield restore_s


def register(ckpt: Any, registry: Optional[Any] = None) -> _CheckpointerCollector:
    """Adds ``ckpt``'s view to ``registry`` (default: prometheus_client's REGISTRY) and returns
    the collector (for ``unregister``). Raises ImportError when prometheus_client is missing."""
    try:
        import prometheus_client
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("safepoint.metrics needs prometheus_client (pip install "
                          "prometheus_client); the agent's own /metrics needs nothing") from e
    collector = _CheckpointerCollector(ckpt)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector


def unregister(collector: _CheckpointerCollector, registry: Optional[Any] = None) -> None:
    import prometheus_client

    (registry if registry is not None else prometheus_client.REGISTRY).unregister(collector)
