"""The status part of a ``Checkpointer``: ``status()`` (this rank's and the node agent's view of
the job) and the job's host memory."""

from __future__ import annotations

import json
from typing import Any, Optional

from safepoint import _core
from safepoint._ckpt_base import CheckpointerBase, _fields


def _proc_memory(pid: str) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status in bytes (VmRSS, VmHWM, RssAnon, RssShmem, ...);
    empty when it cannot be read."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB" and (key.startswith(("Vm", "Rss"))):
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out



class StatusMixin(CheckpointerBase):
    """Checkpointer's status."""

    def status(self) -> dict:
        """Snapshots in memory, pending persists, newest committed step, sizes and timings."""
        agent = json.loads(self._live.agent_status())
        mine: dict[str, Any] = next(
            (r for r in agent.get("ranks", []) if r["rank"] == self.rank), {})
        return {
            "job": self.job,
            "path": self.path,
            "rank": self.rank,
            "world_size": self.world_size,
            "snapshots": [_fields(s) for s in self._live.slots()],
            "pending_persists": mine.get("pending_persists", 0),
            "newest_committed": agent.get("newest_committed"),
            "last_persisted_step": mine.get("last_persisted_step"),
            "last_persist_seconds": mine.get("last_persist_seconds"),
            "last_persist_bytes": mine.get("last_persist_bytes"),
            "persists_ok": mine.get("persists_ok", 0),
            "persists_failed": mine.get("persists_failed", 0),
            "last_persist_error": mine.get("last_error") or None,
            "saves": self._stats["saves"],
            "skipped_saves": self._stats["skipped_saves"],
            "saves_not_due": self._stats["saves_not_due"],
            "preempted": self.preempted,
            "last_save": self._stats["last_save"],
            "last_load": self._stats["last_load"],
            "agent": {"pid": agent.get("agent_pid"), "job_dir": agent.get("job_dir"),
                      "queued": agent.get("queued"),
                      # frames from this process (status requests aside): one per save
                      "messages_received": mine.get("messages_received"),
                      # where the agent serving rank 0 keeps the job's measurement history
                      "history": agent.get("history")},
            "replication": agent.get("replication"),
            # a job on several nodes: its commits over the peer service (docs/operations.md)
            "commit_relay": agent.get("commit_relay"),
            "tiers": agent.get("tiers", []),
            "metrics_url": agent.get("metrics_url"),
            "metrics_error": agent.get("metrics_error"),
            "event_log": agent.get("event_log"),
            "storage_layout": agent.get("storage_layout"),
            "last_restore": self.last_restore._asdict() if self.last_restore else None,
            "persist_interval": self._advisor.status(agent.get("tiers", [])),
            "memory": self._memory(agent.get("agent_pid"), agent.get("replication")),
            # storage requests by URI scheme: this process's (restores, listings) and the
            # node agent's (persists, commits, tier copies); docs/operations.md
            "storage_requests": {"process": _core.storage_requests(),
                                 "agent": agent.get("storage_requests", {})},
        }

    def _memory(self, agent_pid: Optional[int],
                replication: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Host memory of the job (docs/operations.md, "Host memory"): the shared memory of
        this rank's snapshot slots and of every rank's of the job on this node, the slots this
        rank saves into (1 when ``max_shm_bytes`` holds fewer than two snapshots), the cap, the
        replica files this node keeps for other nodes (with replication; None without), and the
        resident memory of this process and of the node's agent (from /proc)."""
        rank_shm, node_shm = self._live.shm_bytes()
        me = _proc_memory("self")
        agent = _proc_memory(str(agent_pid)) if agent_pid else {}
        rep = replication or {}
        return {
            "shm_rank_bytes": rank_shm,
            "shm_node_bytes": node_shm,
            "replica_node_bytes": rep.get("held_bytes"),
            "replica_spare_bytes": rep.get("spare_bytes"),
            "slots": self._live.usable_slots(),
            "max_shm_bytes": self.max_shm_bytes,
            "rss_bytes": me.get("VmRSS"),
            "peak_rss_bytes": me.get("VmHWM"),
            "private_bytes": me.get("RssAnon"),
            "shared_rss_bytes": me.get("RssShmem"),
            "agent_rss_bytes": agent.get("VmRSS"),
            "agent_private_bytes": agent.get("RssAnon"),
        }
