"""A torchft ``CheckpointTransport`` that heals a recovering replica through safepoint.

    from torchft import Manager
    from safepoint.torchft import SafepointTransport

    transport = SafepointTransport("/dev/shm/torchft-heal/replica0", timeout=timedelta(seconds=60))
    manager = Manager(pg=pg, load_state_dict=..., state_dict=..., checkpoint_transport=transport,
                      ...)

How a heal goes. When torchft finds a replica group behind, a live replica's manager calls
``send_checkpoint(step, state_dict)``: the transport snapshots the state into host shared memory
with a ``safepoint.Checkpointer`` (the training thread is blocked only for that copy, so
``disallow_checkpoint`` returns at once: the snapshot no longer depends on ``state_dict``) and
the node agent writes it, with safepoint's checksums and commit protocol, to the transport's
location. ``metadata()`` is that location; the recovering replica's ``recv_checkpoint`` waits
(at most ``timeout``) until the step is committed there and loads it, verified.

The location decides where a heal can come from: a directory in ``/dev/shm`` (shared memory:
replicas on the same node), a node-local or shared file system, or any storage URI safepoint
writes (``s3://...``, ``rados://...``: replicas on other nodes). Each sending replica needs its
own location (``metadata()`` names it). The newest ``keep`` sent steps are kept there.

``mode="peer"`` heals without storage, memory to memory (docs/guide.md, "torchft"): send takes
the same flash snapshot and nothing is persisted; ``metadata()`` names the sender's node agent
(its peer-service address, node, job and a secret drawn for this transport) instead of a
location; the recovering replica's own agent fetches the snapshot straight from the sender's
agent's shared memory over UCX (authenticated with that secret, every chunk checked on arrival
against the checksum recorded when the snapshot was taken, and refused when the sender's next
snapshot began to overwrite it meanwhile) into its own shared memory, where the recovering
process loads it, verified. A recovering process that sees the sender's shared memory (the same
node and user) reads the snapshot from there itself: one verified copy, no agent in between.
The sender is free as soon as its copy is taken (it never serves its live tensors); a receive
in any mode reads whichever kind of metadata it is given.

A DTensor comes back as a DTensor with the sender's spec (mesh, placements, global shape and
stride; as torchft's own transports give it), its local tensor the sender's shard, on the CPU.
Its mesh is rebuilt from a plain description that the sender stores beside the state, without
creating process groups (a receive is no collective): it equals the receiver's own mesh of that
layout, so the receiver copies it into its DTensors shard by shard.

Not covered: torchft's in-place receive into preallocated (GPU) tensors that ``PGTransport``
does (this transport returns CPU tensors, which torchft's ``load_state_dict`` copies); values
other than tensors and plain values need ``allow_pickle``. Tested with torchft 0.2.0.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional, TypeVar

from torchft.checkpointing.transport import CheckpointTransport

import safepoint
from safepoint import _core
from safepoint._checkpointer import _node_name as _shm_identity
from safepoint._pickle import AllowPickle, unpickler
from safepoint._shards import _dtensor_type
from safepoint.errors import InvalidArgumentError, NotFoundError, UnavailableError

T = TypeVar("T")

# metadata() of a "peer" transport starts with this; a location never does.
_PEER_PREFIX = "safepoint-peer:"
_PEER_TIMEOUT_S = 30.0  # a heal's transfer that makes no progress this long fails


def _not_taken(wait: timedelta, step: int, src_rank: int, address: str,
               why: Exception) -> TimeoutError:
    """torchft's contract for a receive that waited in vain: a TimeoutError that says it timed
    out."""
    return TimeoutError(f"timed out after {wait.total_seconds():g}s waiting for step {step} from "
                        f"rank {src_rank} at {address}: not sent (taken) there ({why})")


def _node_name() -> str:
    """This node's name as its agent's peer service serves it ([A-Za-z0-9._-], <= 64)."""
    from safepoint import _replication

    name = re.sub(r"[^A-Za-z0-9._-]", "-", _replication.node_id())[:64].lstrip(".")
    return name or "node"


class SafepointTransport(CheckpointTransport[T]):
    """torchft ``CheckpointTransport`` over safepoint (module doc).

    ``location``: where this replica's sent checkpoints go (a directory or a storage URI; its
    ``metadata()``). ``timeout``: the default wait of ``recv_checkpoint``. ``keep``: sent steps
    kept at ``location``. ``job``, ``shm_dir``: as for ``safepoint.Checkpointer`` (default job:
    one per transport). ``allow_pickle``: as for ``safepoint.save``. ``mode``: ``"flash"``
    (send returns after the copy into shared memory; the agent writes the step), ``"sync"``
    (send writes the step itself: the sender waits longer, the receiver gets it sooner) or
    ``"peer"`` (send returns after the copy into shared memory and nothing is written to
    ``location``; the receiver's agent fetches it from the sender's agent over UCX: the
    fastest of the three, within one node or across nodes). ``peer_host``: the address the agent's
    peer service listens on in ``"peer"`` mode (default: as for replication,
    ``$SAFEPOINT_PEER_HOST`` or the route to ``$MASTER_ADDR``, else the hostname's address).
    ``shm_reads``: a receive of a ``"peer"`` sender whose shared memory this process sees (the
    same node, the same user) reads the sender's snapshot straight from it, one verified copy and
    no agent in between; ``False`` always fetches over the peer service.
    ``last_source`` names where the last received state was read from.
    """

    def __init__(self, location: str | os.PathLike[str], *,
                 timeout: timedelta = timedelta(seconds=60), keep: int = 2,
                 job: Optional[str] = None, shm_dir: Optional[str] = None,
                 allow_pickle: AllowPickle = False, mode: str = "flash",
                 peer_host: Optional[str] = None, shm_reads: bool = True) -> None:
        loc = os.fspath(location)
        if not isinstance(loc, str) or not loc:
            raise InvalidArgumentError(f"location must be a non-empty path or URI, got "
                                       f"{location!r}")
        if mode not in ("flash", "sync", "peer"):
            raise InvalidArgumentError(f"mode must be 'flash', 'sync' or 'peer', got {mode!r}")
        self.location = loc if "://" in loc else os.path.abspath(loc)
        self.mode = mode
        self.timeout, self.keep, self.allow_pickle = timeout, keep, allow_pickle
        self.job = job or f"torchft-{uuid.uuid4().hex[:12]}"
        self.shm_dir = shm_dir
        self.peer_host = peer_host
        self.shm_reads = bool(shm_reads)
        self.last_source: Optional[str] = None
        self._ckpt: Optional[safepoint.Checkpointer] = None
        self._sent: Optional[int] = None
        self._peer_address: Optional[str] = None  # this transport's agent's peer service
        self._origin: Optional[str] = None  # metadata() in "peer" mode

    def _checkpointer(self) -> safepoint.Checkpointer:
        if self._ckpt is None:
            # One replica's sender: a world of one whatever torch.distributed says (the
            # replica's ranks each have their own transport and location).
            self._ckpt = safepoint.Checkpointer(
                self.location, job=self.job, rank=0, world_size=1, keep=self.keep,
                shm_dir=self.shm_dir, allow_pickle=self.allow_pickle, preemption=False)
        return self._ckpt

    def _peer_service(self) -> str:
        """Starts this transport's agent's peer service (once); its address."""
        if self._peer_address is None:
            from safepoint import _replication

            host = self.peer_host or _replication.bind_host()
            self._peer_address = self._checkpointer()._live.peer_setup(
                _node_name(), host, _PEER_TIMEOUT_S)
        return self._peer_address

    # -- CheckpointTransport ------------------------------------------------------------------
    def metadata(self) -> str:
        """``location``; in ``"peer"`` mode what the receiver's agent needs to fetch from this
        transport's agent: its address, node, job and secret (``_PEER_PREFIX`` + JSON)."""
        if self.mode != "peer":
            return self.location
        if self._origin is None:
            address = self._peer_service()
            secret = os.urandom(32).hex()
            # A membership of this node alone (nothing is replicated): it gives the agent the
            # secret that a receiver must prove it knows.
            self._checkpointer()._live.set_membership(
                uuid.uuid4().hex, 0, [(_node_name(), address)], "none", secret, 0)
            # Where a receiver on this node finds the snapshot without the network: this job's
            # slots under its shm directory, which _shm_identity names (boot id, device, inode).
            shm = self._checkpointer().shm_dir
            self._origin = _PEER_PREFIX + json.dumps(
                {"address": address, "node": _node_name(), "job": self.job, "secret": secret,
                 "shm": {"dir": shm, "node": _shm_identity(shm)}})
        return self._origin

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: timedelta) -> None:
        """Snapshots ``state_dict`` into shared memory (the agent persists it to ``location``;
        in ``"peer"`` mode it only serves it to receivers); returns once the copy is done.
        Sending a step already sent does nothing."""
        if step == self._sent:
            return
        sent = {"state": state_dict, "dtensors": _dtensor_specs(state_dict)}
        if self.mode == "peer":
            self.metadata()  # the agent serves the snapshot once it has the secret
            self._checkpointer().save(step, sent, persist=False)
        elif self.mode == "flash":
            self._checkpointer().save(step, sent, persist=True)
        else:
            safepoint.save(self.location, step, sent, allow_pickle=self.allow_pickle)
            for old in safepoint.steps(self.location)[:-self.keep]:
                _core.delete_step(self.location, old)
        self._sent = step

    def disallow_checkpoint(self) -> None:
        # The snapshot is a copy: the caller may change state_dict as soon as send returned.
        return None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> T:
        """The state the replica at ``metadata`` sent for ``step``; ``TimeoutError`` when it is
        not committed there (``"peer"``: not taken by the sender) within ``timeout``."""
        wait = timeout or self.timeout
        if metadata.startswith(_PEER_PREFIX):
            got = self._recv_peer(src_rank, metadata, step, wait)
        else:
            got = self._recv_stored(src_rank, metadata, step, wait)
        self.last_source, sent = got
        state = sent["state"]
        meshes: dict = {}
        for path, spec in sent.get("dtensors") or ():
            state = _put(state, tuple(path), lambda local, sp=spec: _dtensor(local, sp, meshes))
        return state

    def _recv_stored(self, src_rank: int, metadata: str, step: int,
                     wait: timedelta) -> tuple[str, Any]:
        deadline = time.monotonic() + wait.total_seconds()
        delay = 0.001
        while True:
            if step in safepoint.steps(metadata):
                break
            if time.monotonic() >= deadline:
                # torchft's contract: a TimeoutError that says it timed out.
                raise TimeoutError(f"timed out after {wait.total_seconds():g}s waiting for "
                                   f"step {step} from rank {src_rank} at {metadata}: not sent "
                                   f"(committed) there")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        _, got = safepoint.load(metadata, step, allow_pickle=self.allow_pickle)
        return f"{metadata} (step {step})", got

    def _recv_peer(self, src_rank: int, metadata: str, step: int,
                   wait: timedelta) -> tuple[str, Any]:
        """``"peer"`` mode: the sender's snapshot of ``step`` read from its shared memory where
        this process sees it, else fetched by this transport's agent from the sender's agent into
        a slot of this transport's job and loaded from there; (where from, what was sent)."""
        try:
            origin = json.loads(metadata[len(_PEER_PREFIX):])
            address, node, job, secret = (str(origin[k]) for k in
                                          ("address", "node", "job", "secret"))
            shm = origin.get("shm") or {}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgumentError(f"not a safepoint peer transport's metadata: "
                                       f"{metadata[:200]!r}") from e
        if self.shm_reads and isinstance(shm, dict) and isinstance(shm.get("dir"), str) and \
                shm.get("node") == _shm_identity(shm["dir"]):
            # The sender's shared memory is this node's: its snapshot is read there, unless this
            # process cannot open the sender's slots (another user's): then over the network.
            try:
                got = _core.read_node_snapshot(shm["dir"], job, 0, step, wait.total_seconds(),
                                               unpickler(self.allow_pickle))
                return got.source, got.state
            except NotFoundError as e:
                raise _not_taken(wait, step, src_rank, address, e) from e
            except UnavailableError:
                pass
        self._peer_service()
        client = self._checkpointer()._live
        try:
            client.heal_from(address, node, job, secret, step, wait.total_seconds())
        except NotFoundError as e:
            raise _not_taken(wait, step, src_rank, address, e) from e
        loaded = client.load_step(step, self._checkpointer()._unpickler, False, None)
        if loaded is None:
            raise NotFoundError(f"step {step} healed from {address} is not in memory")
        return f"{address} ({loaded.source})", loaded.state

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every sent step is committed at ``location``."""
        if self._ckpt is not None:
            self._ckpt.wait(timeout)

    def shutdown(self, wait: bool = True) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is None:
            return
        if wait:
            ckpt.close()
        else:
            ckpt.abandon()


# -- DTensors: a plain description sent beside the state, a DTensor again on receipt -----------

def _placement_desc(p: Any, where: str) -> list:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):
        return ["SS", int(p.dim), int(p.split_factor)]
    if isinstance(p, Shard):
        return ["S", int(p.dim)]
    if isinstance(p, Replicate):
        return ["R"]
    raise InvalidArgumentError(f"{where}: cannot send a DTensor with placement {p!r} (Shard and "
                               f"Replicate only; redistribute a Partial one first)")


def _dtensor_specs(state: Any) -> list:
    """[(key path, description)] of every DTensor in ``state`` (dicts, lists, tuples): what
    ``recv_checkpoint`` needs to make a DTensor of the local shard that safepoint loads."""
    dt = _dtensor_type()
    if dt is None:  # torch.distributed.tensor not loaded: there is no DTensor
        return []
    import torch.distributed as dist

    out: list = []

    def walk(obj: Any, path: tuple) -> None:
        if isinstance(obj, dt):
            mesh = obj.device_mesh
            where = ".".join(map(str, path))
            out.append((path, {
                "device_type": mesh.device_type,
                "mesh_shape": list(mesh.mesh.shape),
                "ranks": mesh.mesh.flatten().tolist(),
                "dim_names": list(mesh.mesh_dim_names or ()),
                "placements": [_placement_desc(p, where) for p in obj.placements],
                "shape": list(obj.shape), "stride": list(obj.stride()),
                "rank": dist.get_rank() if dist.is_initialized() else 0}))
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, path + (k,))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, path + (i,))

    walk(state, ())
    return out


def _put(obj: Any, path: tuple, fn: Any) -> Any:
    """``obj`` with the value at ``path`` replaced by ``fn(value)`` (tuples rebuilt)."""
    if not path:
        return fn(obj)
    k = path[0]
    child = _put(obj[k], path[1:], fn)
    if isinstance(obj, tuple):
        items = list(obj)
        items[k] = child
        return tuple(items) if type(obj) is tuple else type(obj)(*items)
    obj[k] = child
    return obj


def _mesh(spec: dict, meshes: dict) -> Any:
    """The DeviceMesh a description names, one per receive for each layout. Built without
    process groups (``_init_backend=False``: a receive must not be a collective); this rank's
    coordinate on it is set as DeviceMesh's own initialization sets it, from this process's
    rank (a recovering replica's rank is its sender's), else the sender's."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    key = (spec["device_type"], tuple(spec["mesh_shape"]), tuple(spec["ranks"]),
           tuple(spec["dim_names"]))
    mesh = meshes.get(key)
    if mesh is None:
        ranks = torch.tensor(spec["ranks"], dtype=torch.int).reshape(spec["mesh_shape"])
        mesh = DeviceMesh(spec["device_type"], ranks,
                          mesh_dim_names=tuple(spec["dim_names"]) or None, _init_backend=False)
        mesh._rank = dist.get_rank() if dist.is_initialized() else int(spec["rank"])
        mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
        if dist.is_initialized() and dist.get_backend() == "threaded":
            mesh._thread_id = threading.get_ident()
        meshes[key] = mesh
    return mesh


def _dtensor(local: Any, spec: dict, meshes: dict) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    def placement(d: list) -> Any:
        if d[0] == "SS":
            return _StridedShard(d[1], split_factor=d[2])
        return Shard(d[1]) if d[0] == "S" else Replicate()

    import torch

    meta = TensorMeta(torch.Size(spec["shape"]), tuple(spec["stride"]), local.dtype)
    dspec = DTensorSpec(_mesh(spec, meshes), tuple(placement(p) for p in spec["placements"]),
                        tensor_meta=meta)
    # As torchft's PGTransport gives a received DTensor: the local tensor as received (CPU).
    return DTensor(local, dspec, requires_grad=False)
