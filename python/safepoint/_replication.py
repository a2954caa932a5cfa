"""Peer replication's Python side (docs/replication.md): who this node is, which address its
agent listens on, and the membership exchange at every ``Checkpointer`` start.

The agents do the replicating (C++, ``src/agent/replicator.cc``); the training processes only tell
their agent, once per start, the job's nodes as the ranks all-gathered them, the redundancy, and a
fresh secret that authenticates the agents to each other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import warnings
from typing import Any, Optional

from safepoint import _collectives, _core
from safepoint.errors import InvalidArgumentError


def node_id() -> str:
    """This node's identity: ``$SAFEPOINT_NODE``, else torchrun's node rank (``$GROUP_RANK``),
    else the hostname. Ranks with the same identity share a node (a failure domain)."""
    env = os.environ.get("SAFEPOINT_NODE")
    if env:
        return env
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank is not None and group_rank != "":
        return f"node{int(group_rank)}"
    return socket.gethostname()


def _node_order() -> Optional[int]:
    group_rank = os.environ.get("GROUP_RANK")
    return int(group_rank) if group_rank not in (None, "") else None


def bind_host() -> str:
    """The address of the interface the job uses: ``$SAFEPOINT_PEER_HOST``, else the local
    address of the route to ``$MASTER_ADDR`` (the interface torch.distributed talks over), else
    the address the hostname resolves to."""
    env = os.environ.get("SAFEPOINT_PEER_HOST")
    if env:
        return _unbracket(env)
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            # IPv4 or IPv6, whichever the master's address is.
            family, _, _, _, addr = socket.getaddrinfo(
                _unbracket(master), int(os.environ.get("MASTER_PORT", "29500")),
                type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return _host_of(s.getsockname())
        except (OSError, IndexError, ValueError):
            pass
    return socket.gethostbyname(socket.gethostname())


def _unbracket(host: str) -> str:
    """'[::1]' -> '::1' (an IPv6 address as written in HOST:PORT); other hosts unchanged."""
    return host[1:-1] if len(host) >= 2 and host[0] == "[" and host[-1] == "]" else host


def _host_of(sockname: tuple) -> str:
    """The address of a socket name; a link-local IPv6 one with its interface ('fe80::1%eth0'),
    without which peers cannot reach it."""
    host = str(sockname[0])
    if len(sockname) >= 4 and sockname[3] and "%" not in host:
        try:
            host += "%" + socket.if_indextoname(sockname[3])
        except OSError:
            pass
    return host


def link_bytes_per_second(host: str) -> Optional[float]:
    """The speed of the interface that holds `host` (from /sys/class/net/*/speed), or None when
    the kernel does not say (virtual interfaces)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True,
                             timeout=5, check=True).stdout
        address = host.split("%", 1)[0]  # a link-local IPv6 address names its interface
        for iface in json.loads(out):
            if any(a.get("local") == address for a in iface.get("addr_info", [])):
                with open(f"/sys/class/net/{iface['ifname']}/speed") as f:
                    mbit = int(f.read().strip())
                return mbit * 1e6 / 8 if mbit > 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None


def default_bandwidth(host: str) -> int:
    """Half of the link when the kernel knows its speed; else no cap (0)."""
    link = link_bytes_per_second(host)
    return int(link / 2) if link else 0


def _share_secret(group: Any, rank: int, epoch: str) -> str:
    """A fresh secret from rank 0, handed over through the launcher's store (never on a command
    line), falling back to a broadcast on the checkpointer's group."""
    import torch.distributed as dist

    key = f"safepoint/secret/{epoch}"
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default store (a custom init): broadcast instead
        store = None
    if store is not None:
        if rank == 0:
            store.set(key, os.urandom(32).hex())
        secret = store.get(key).decode()
        dist.barrier(group=group)
        if rank == 0:
            try:
                store.delete_key(key)
            except Exception:
                pass
        return secret
    box = [os.urandom(32).hex() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return str(box[0])


def exchange_membership(client: Any, group: Any, rank: int, world_size: int, redundancy: str,
                        bandwidth: Optional[float], peer_timeout: float,
                        optional: bool = False) -> Optional[dict[str, Any]]:
    """Starts this node's peer service, all-gathers every rank's (node, address), checks that the
    nodes can hold `redundancy`, and tells the agent. Returns what the status reports.

    `optional` (the commit relay alone, no replicas): a node whose peer service cannot start
    does not fail the job; every rank then sees that and gives no agent a membership (None),
    and the agents commit through storage as they do without the relay."""
    import torch.distributed as dist

    node = node_id()
    host = bind_host()
    try:
        address: Optional[str] = client.peer_setup(node, host, float(peer_timeout))
    except Exception as e:
        if not optional:
            raise
        warnings.warn(f"safepoint: node {node!r} cannot start its peer service on {host} ({e}); "
                      "the job's agents commit through storage (no commit relay)",
                      stacklevel=3)
        address = None
    everyone: list = [None] * world_size
    _collectives.all_gather_object(everyone, (node, address, _node_order()), group)
    if optional and any(a is None for _, a, _ in everyone):
        return None
    nodes: dict[str, tuple[str, Optional[int]]] = {}
    for n, a, order in everyone:
        if n in nodes and nodes[n][0] != a:
            raise InvalidArgumentError(
                f"node {n!r} reports two agents ({nodes[n][0]} and {a}): ranks of one node "
                "must share /dev/shm and the job name; set $SAFEPOINT_NODE per host")
        nodes[n] = (a, order)
    order = sorted(nodes, key=lambda n: (nodes[n][1] is None, nodes[n][1] or 0, n))
    spec, targets, tolerated, factor = _core.check_redundancy(redundancy, len(order))
    epoch_box = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(epoch_box, src=dist.get_global_rank(group, 0), group=group)
    epoch = str(epoch_box[0])
    secret = _share_secret(group, rank, epoch)
    cap = default_bandwidth(host) if bandwidth is None else int(bandwidth)
    client.set_membership(epoch, order.index(node), [(n, nodes[n][0]) for n in order], spec,
                          secret, cap)
    # Every agent knows the new secret before any rank asks a peer for anything (a peer still on
    # the old epoch's secret would refuse the connection).
    dist.barrier(group=group)
    return {"redundancy": spec, "node": node, "nodes": order, "address": address,
            "targets": targets, "tolerates_node_losses": tolerated,
            "memory_factor": factor, "bandwidth": cap}


def join_commit_relay(client: Any, group: Any, rank: int, world_size: int,
                      peer_timeout: float) -> Optional[dict[str, Any]]:
    """A job without replicas whose ranks span several nodes: starts each node's peer service
    and gives the agents the membership (redundancy none), so that each agent hands the facts
    of its images to one committer and learns of commits from it instead of asking storage
    (the commit relay: docs/architecture.md, "Committing at scale"). One all-gather of the
    ranks' nodes at every ``Checkpointer`` start; on one node nothing more. None where the
    relay is not used (one node, ``$SAFEPOINT_COMMIT_RELAY=0``, or a peer service that could
    not start); the agents then commit through storage."""
    everyone: list = [None] * world_size
    # Every rank decides alike: off where any rank's environment turns it off.
    _collectives.all_gather_object(
        everyone, (node_id(), os.environ.get("SAFEPOINT_COMMIT_RELAY", "1") != "0"), group)
    if len({n for n, _ in everyone}) < 2 or not all(on for _, on in everyone):
        return None
    return exchange_membership(client, group, rank, world_size, "none", 0, peer_timeout,
                               optional=True)
