"""The synchronous API: durable when it returns."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from safepoint import _core
from safepoint._attempt import new_attempt, run_attempt
from safepoint._pickle import AllowPickle, pickler, unpickler
from safepoint._shards import fill_elsewhere, read_newest_into
from safepoint._stateful import apply_loaded, to_saveable
from safepoint._tiers import check_layout
from safepoint.errors import InvalidArgumentError, NotFoundError


def _path(path: str | os.PathLike[str]) -> str:
    p = os.fspath(path)
    if not isinstance(p, str) or not p:
        raise InvalidArgumentError(f"checkpoint path must be a non-empty str, got {path!r}")
    return p


def save(path: str | os.PathLike[str], step: int, state: Any, *, rank: int = 0,
         world_size: int = 1, job: str = "", allow_pickle: AllowPickle = False,
         attempt: Optional[int] = None, overwrite: bool = False,
         metadata: Optional[dict[str, Any]] = None, parent: Optional[str] = None,
         compression: str = "none", incremental: bool = False) -> dict:
    """Saves ``state`` as ``rank``'s shard of ``step`` in the checkpoint directory ``path``.

    ``state`` is a nested mapping (dicts, lists, tuples) whose leaves are torch tensors, numpy
    arrays, or None / bool / int / float / str / bytes. The image is durable when this returns;
    the step becomes visible (committed) once every rank of ``world_size`` has saved it.
    With several ranks, ``attempt`` (an int all ranks of this save share; default from
    $SAFEPOINT_ATTEMPT or torchrun's run id and restart count) makes sure a step commits only
    from images of the same attempt, never beside an image an earlier, unfinished save left.
    A committed step is immutable: saving it again raises ``AlreadyExistsError``, unless
    ``overwrite=True``, which replaces it atomically once every rank has saved (readers see the
    old step or the new one, never a mix or nothing). Every rank of a replacing save must pass
    the same ``attempt``, one that differs from the attempt that committed the step (a single
    rank draws one).
    ``metadata`` (a small dict of str to str/int/float/bool/None, at most 2 KiB as JSON) and
    ``parent`` (the step this state descends from: ``"PATH@TAG"``, ``"PATH@step-N"``, or
    ``"step-N"``/``N`` of ``path`` itself) are recorded in the step's lineage (``safepoint log``).
    ``compression`` (``"none"`` or another of the codec's modes, ``_core.COMPRESSIONS``) and
    ``incremental`` choose how the image is stored (docs/guide.md, "Compression and
    incremental checkpoints"): the defaults write today's plain image; anything else a packed
    image whose chunks are encoded in parallel on the way to storage and, with
    ``incremental=True``, shared with the steps that stored them before (only new chunks are
    written).
    Returns ``{"bytes", "write_seconds", "committed", "stored_bytes"}`` (``stored_bytes``: what a
    packed image wrote, new chunks and manifest; 0 for a plain image).
    """
    p = _path(path)
    if type(step) is not int or step < 0:
        raise InvalidArgumentError(f"{p}: step must be a non-negative int, got {step!r}")
    if type(world_size) is not int or world_size < 1:
        raise InvalidArgumentError(f"{p}: world_size must be a positive int, got {world_size!r}")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{p}: rank {rank!r} is not in [0, {world_size})")
    if attempt is None:
        attempt = run_attempt() if world_size > 1 else 0
        if overwrite and world_size == 1:
            attempt = new_attempt()  # names the new images
        elif overwrite and attempt == 0:
            raise InvalidArgumentError(
                f"{p}: overwrite=True with several ranks needs attempt= (an int all ranks of "
                f"this save share) or $SAFEPOINT_ATTEMPT")
    if type(attempt) is not int or not 0 <= attempt < 2**64:
        raise InvalidArgumentError(f"{p}: attempt must be an int in [0, 2**64), got {attempt!r}")
    from safepoint._versions import encode_metadata, resolve, same_location, split_ref

    meta = encode_metadata(p, metadata)
    parent_step, parent_location = None, ""
    if parent is not None:
        text = os.fspath(parent) if not isinstance(parent, int) else str(parent)
        if "@" in text:
            parent_location, ref = split_ref(text)
            parent_step = resolve(parent_location, ref)
            if same_location(parent_location, p):
                parent_location = ""
        else:
            parent_step = resolve(p, text)
    check_layout(p, compression, incremental)
    r = _core.save(p, step, rank, world_size, job, to_saveable(state), pickler(allow_pickle),
                   attempt, bool(overwrite), parent_step, parent_location, meta, compression,
                   bool(incremental))
    return {"bytes": r.bytes, "write_seconds": r.write_seconds, "committed": r.committed,
            "stored_bytes": r.stored_bytes}


def _step(p: str, step: Optional[int | str]) -> Optional[int]:
    """A step argument: None (the newest), an int, or a str naming a committed step (a tag,
    ``"step-N"`` or ``"N"``)."""
    if isinstance(step, str):
        from safepoint._versions import resolve

        return resolve(p, step)
    if step is not None and (type(step) is not int or step < 0):
        raise InvalidArgumentError(
            f"{p}: step must be a non-negative int, a tag or None, got {step!r}")
    return step


def load(path: str | os.PathLike[str], step: Optional[int | str] = None, *,
         rank: int = 0, allow_pickle: AllowPickle = False) -> tuple[int, Any]:
    """Loads ``rank``'s shard; returns ``(step, state)``.

    With ``step=None`` the newest committed step that reads back intact (older steps are tried
    when a newer one is corrupt, with a warning); ``step`` may also name a step by its tag
    (``safepoint.tag``) or as ``"step-N"``. Tensors come back as torch tensors (numpy arrays
    as numpy arrays) with their saved dtype and shape; the structure is the one saved.
    """
    p = _path(path)
    return load_shard(p, _step(p, step), rank, allow_pickle)


def load_shard(p: str, step: Optional[int], rank: int, allow_pickle: AllowPickle = False,
               commit: Optional[_core.Commit] = None) -> tuple[int, Any]:
    """load() of a resolved path and step. `commit`: the step's COMMIT record, already read
    (``_core.commit_from_bytes`` of the bytes the restore agreement's lister read): only the
    image is read, checked against it."""
    out = _core.load(p, step, rank, unpickler(allow_pickle), commit)
    for _ in range(3):  # the step was replaced between reading this rank's and another's image
        same = commit is not None and commit.step == out.step \
            and commit.generation == out.generation
        if fill_elsewhere(p, out.step, rank, out.elsewhere, out.generation,
                          commit if same else None):
            break
        out = _core.load(p, out.step, rank, unpickler(allow_pickle))
        commit = None
    else:
        raise NotFoundError(f"{p}: step {out.step} was replaced again and again while loading")
    for skipped in out.skipped:
        warnings.warn(f"safepoint: skipped a damaged checkpoint: {skipped}", RuntimeWarning,
                      stacklevel=3)
    return out.step, out.state


def restore(path: str | os.PathLike[str], state: Any, step: Optional[int | str] = None, *,
            rank: int = 0, allow_pickle: AllowPickle = False) -> int:
    """Loads the newest (or the given) step into ``state`` in place, as ``rank`` of the loading
    world: tensors are copied into the existing tensors (a DTensor gets its own shard), objects
    with ``load_state_dict`` get it, other values are replaced. Returns the step.

    Only the byte ranges the state's tensors need are read, from whichever ranks' images hold
    them, so a step saved by N ranks restores into M ranks with any sharding (resharding).
    With ``step=None`` a newer step that cannot be read is skipped with a warning; a str
    ``step`` names a step by its tag or as ``"step-N"``."""
    p = _path(path)
    step = _step(p, step)
    got_step, got = read_newest_into(p, step, rank, to_saveable(state), unpickler(allow_pickle))
    apply_loaded(state, got)
    return got_step


def steps(path: str | os.PathLike[str]) -> list[int]:
    """The committed steps of the checkpoint directory, ascending."""
    return list(_core.steps(_path(path)))


def tag(path: str | os.PathLike[str], step: int | str, name: str, *,
        replace: bool = False) -> None:
    """Names committed ``step`` of ``path`` ``name`` (``safepoint tag``): a tagged step is kept
    past every retention (``keep``) until the tag is removed, and ``load``/``restore``/
    ``Checkpointer.restore(from_="PATH@NAME")`` accept the name. ``replace=True`` moves an
    existing tag; without it a tag that names another step raises ``AlreadyExistsError``."""
    p = _path(path)
    resolved = _step(p, step)
    if resolved is None:
        raise InvalidArgumentError(f"{p}: tag needs a step (an int, 'step-N' or a tag)")
    _core.set_tag(p, resolved, name, bool(replace))


def untag(path: str | os.PathLike[str], name: str) -> None:
    """Removes tag ``name`` of ``path`` (its step is then subject to retention again)."""
    _core.delete_tag(_path(path), name)


def tags(path: str | os.PathLike[str]) -> dict[str, int]:
    """The tags of ``path``: name -> step."""
    return dict(_core.tags(_path(path)))
