"""Interchange with inference tools: export a step's tensors to safetensors or torch files, and
import safetensors files (a Hugging Face model directory) as a committed step.

``safepoint export`` and ``safepoint import`` (the C++ CLI) run this module
(``python -m safepoint.interchange``): the torch format needs PyTorch, and safetensors files are
read and written by the ``safetensors`` package itself, the format's reference implementation,
so no second writer of either format exists (docs/guide.md, "Export and import").

Export reads the step from storage with every chunk verified and assembles each tensor whole
from the shards of every rank (the resharding reader of ``restore``), so a step saved by N ranks
exports full tensors. Both formats' writers take a whole dict of tensors, so a single file holds
the exported tensors in memory once; ``max_shard_bytes`` (safetensors) writes a Hugging Face
sharded directory instead, one shard in memory at a time, and ``select`` exports a subtree
(``"model"``).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import sys
import time
from typing import Any, Optional

import torch

from safepoint._api import save as safepoint_save
from safepoint._files import fsync_dir
from safepoint._shards import StepReader
from safepoint._versions import resolve
from safepoint.errors import (
    AlreadyExistsError,
    Error,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StorageError,
)

FORMATS = ("safetensors", "torch")


def _safetensors():
    try:
        import safetensors.torch

        return safetensors
    except ImportError:
        raise InvalidArgumentError("safetensors files need the safetensors package "
                                   "(pip install safetensors)") from None


class _Progress:
    """A progress bar on stderr over bytes (done, rate, time left), redrawn at most 10 times a
    second, shown only on a terminal (as ``safepoint cp``'s)."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.done = max(total, 1), what, 0
        self.start = self.last = time.monotonic()
        self.shown = sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.shown and (now - self.last >= 0.1 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else 0.0
            width = 30
            filled = int(width * min(self.done / self.total, 1.0))
            sys.stderr.write(f"\r{self.what} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB "
                             f"{rate / 2**20:.1f} MiB/s {left:.0f}s left ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _selected(names: list[str], select: Optional[str]) -> dict[str, str]:
    """name in the step -> name in the output (without the ``select`` prefix)."""
    if not select:
        return {n: n for n in names}
    prefix = select.rstrip(".")
    out = {}
    for n in names:
        if n == prefix:
            out[n] = n.rsplit(".", 1)[-1]
        elif n.startswith(prefix + "."):
            out[n] = n[len(prefix) + 1:]
    return out


def _atomic_write(out: str, write) -> None:
    """``write(tmp)``, then fsync, rename to ``out`` and fsync the directory: ``out`` is whole
    and durable, or absent."""
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(os.path.dirname(os.path.abspath(out)))
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        # A full disk or an I/O error (the safetensors package reports them as "I/O error: ...
        # (os error N)" in its own exception type) is a storage error naming the file.
        if not isinstance(e, Error) and (isinstance(e, OSError) or "I/O error" in str(e)):
            full = getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in str(e)
            kind = ResourceExhaustedError if full else StorageError
            raise kind(f"{out}: cannot write: {e}") from None
        raise


SHARD_INDEX = "model.safetensors.index.json"


def export_step(path: str, out: str, *, format: str, step: Optional[int] = None,
                tag: Optional[str] = None, select: Optional[str] = None,
                max_shard_bytes: Optional[int] = None) -> dict:
    """Writes the tensors of a committed step of ``path`` (``step``, the step ``tag`` names, or
    the newest) to ``out`` as full tensors: a safetensors file or a torch file of a flat dict
    (``torch.load(out, weights_only=True)``). ``select`` keeps only the tensors under that
    prefix of the state (``"model"``), named without it. With ``max_shard_bytes``
    (safetensors only), ``out`` is a new or empty directory that receives a Hugging Face sharded
    model: ``model-00001-of-0000N.safetensors`` files of at most that many bytes of tensors each
    (a larger tensor gets a file of its own) and ``model.safetensors.index.json``, written last;
    only one shard's tensors are in memory at a time. Returns a report."""
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {FORMATS}, got {format!r}")
    if step is not None and tag is not None:
        raise InvalidArgumentError("pass step or tag, not both")
    if max_shard_bytes is not None:
        if format != "safetensors":
            raise InvalidArgumentError("shards (max_shard_bytes) are written as safetensors only")
        if max_shard_bytes <= 0:
            raise InvalidArgumentError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise InvalidArgumentError(f"{out}: the shards need a new or empty directory")
    step = resolve(path, tag) if step is None else resolve(path, str(step))
    t0 = time.perf_counter()
    sr = StepReader(path, step)
    chosen = _selected(sorted(sr.pieces), select)
    if not chosen:
        what = f"under '{select}'" if select else "at all"
        raise NotFoundError(f"{path}: step {step} has no tensors {what}")
    if len(set(chosen.values())) != len(chosen):
        raise InvalidArgumentError(f"{path}: the selected tensors' names collide once the "
                                   f"prefix '{select}' is removed")
    shapes = {}
    for name in chosen:
        piece = next(iter(sr.pieces[name].values()))[0]
        gshape, dtype = piece.global_shape, getattr(torch, piece.dtype)
        shapes[name] = (gshape, dtype, math.prod(gshape) * dtype.itemsize)
    total = sum(n for _, _, n in shapes.values())
    # "format": "pt" as Hugging Face writes it (transformers 4.x refuses a file without it).
    meta = {"format": "pt", "safepoint_source": str(path), "safepoint_step": str(step)}
    progress = _Progress(total, f"export step {step}")
    try:
        if max_shard_bytes is None:
            tensors = _read_full(sr, list(chosen.items()), shapes, progress)
            _write_file(out, format, tensors, meta)
            files = 1
        else:
            files = _write_shards(sr, out, chosen, shapes, max_shard_bytes, total, meta, progress)
    finally:
        progress.close()
    return {"source": str(path), "step": step, "format": format, "out": out,
            "tensors": len(chosen), "bytes": total, "files": files,
            "seconds": time.perf_counter() - t0}


def _read_full(sr: StepReader, names: list[tuple[str, str]], shapes: dict,
               progress: _Progress) -> dict[str, torch.Tensor]:
    """The full tensors ``names`` ((name in the step, name in the output)) of the step, read in
    batches of about 64 MiB: one batched read per image each (small tensors share their checksum
    chunks), and a progress bar that moves."""
    tensors: dict[str, torch.Tensor] = {}
    batch: list = []
    pending = 0
    for i, (name, out_name) in enumerate(names):
        gshape, dtype, nbytes = shapes[name]
        t = torch.empty(gshape, dtype=dtype)
        tensors[out_name] = t
        batch.append((name, t, tuple(gshape), (0,) * len(gshape)))
        pending += nbytes
        if pending >= 64 << 20 or i == len(names) - 1:
            sr.fill(batch, rank=0)
            progress.update(pending)
            batch, pending = [], 0
    return tensors


def _write_file(out: str, format: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Writes ``tensors`` to ``out`` under a temporary name, fsynced, then renamed."""
    if format == "safetensors":
        save_file = _safetensors().torch.save_file

        def write(tmp: str) -> None:
            try:
                save_file(tensors, tmp, metadata=meta)
            except (ValueError, TypeError, RuntimeError) as e:
                raise InvalidArgumentError(f"{out}: safetensors cannot hold these tensors: "
                                           f"{e}") from None
    else:
        def write(tmp: str) -> None:
            torch.save(tensors, tmp)
    _atomic_write(out, write)


def _write_shards(sr: StepReader, out: str, chosen: dict[str, str], shapes: dict,
                  max_shard_bytes: int, total: int, meta: dict, progress: _Progress) -> int:
    """A Hugging Face sharded model in the directory ``out``: the tensors in name order, packed
    into files of at most ``max_shard_bytes`` of tensor bytes, then the index. Returns the number
    of files."""
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, out_name in chosen.items():
        nbytes = shapes[name][2]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, out_name))
        size += nbytes
    os.makedirs(out, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = _read_full(sr, names, shapes, progress)
        try:
            _write_file(os.path.join(out, file), "safetensors", tensors, meta)
        except Error as e:
            raise type(e)(f"{e}; {out} has {i} of {len(shards)} shards and no index (import "
                          "refuses it): remove the directory before exporting again") from None
        del tensors
        weight_map.update({out_name: file for _, out_name in names})
    index = {"metadata": {"total_size": total, **meta}, "weight_map": weight_map}

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
    # Every shard's name is durable (_atomic_write) before the index that names them.
    _atomic_write(os.path.join(out, SHARD_INDEX), write)
    return len(shards)



def _safetensors_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    if not os.path.isdir(src):
        raise NotFoundError(f"{src}: no such file or directory")
    index = os.path.join(src, SHARD_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidArgumentError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if os.path.basename(name) != name:
                raise InvalidArgumentError(f"{index}: '{name}' is not a file of {src}")
        return [os.path.join(src, name) for name in files]
    files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise NotFoundError(f"{src}: no *.safetensors files (and no model.safetensors.index.json)")
    # Shards named model-0000i-of-0000N without their index: an export or a download that did
    # not finish (the index comes last). Import them only when every shard is there.
    shards: dict[int, set[int]] = {}
    for n in files:
        m = re.search(r"-(\d+)-of-(\d+)\.safetensors$", n)
        if m:
            shards.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for total, have in shards.items():
        missing = sorted(set(range(1, total + 1)) - have)
        if missing:
            raise InvalidArgumentError(
                f"{src}: shards of {total} without {SHARD_INDEX}, and shard(s) "
                f"{', '.join(map(str, missing[:5]))} of them missing: an export or download "
                "that did not finish?")
    return [os.path.join(src, n) for n in files]


def import_safetensors(src: str, dst: str, step: int, *, prefix: str = "model",
                       overwrite: bool = False) -> dict:
    """Commits the tensors of a safetensors file, or of a directory of them (a Hugging Face
    model: ``model.safetensors.index.json`` and its shards, or every ``*.safetensors``), as step
    ``step`` of ``dst``, under the key ``prefix`` of the state (``{"model": {...}}``; '' for the
    top level), so that ``Checkpointer.restore({"model": model})`` or ``safepoint.load`` restores
    it. Returns a report."""
    safe_open = _safetensors().safe_open
    t0 = time.perf_counter()
    files = _safetensors_files(src)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    total = sum(os.path.getsize(f) for f in files)
    progress = _Progress(total, f"import {os.path.basename(src.rstrip('/'))}")
    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in tensors:
                        raise InvalidArgumentError(
                            f"{src}: tensor '{name}' is in both {origin[name]} and {path}")
                    t = f.get_tensor(name)
                    tensors[name] = t
                    origin[name] = path
                    progress.update(t.numel() * t.element_size())
    except Error:
        raise
    except Exception as e:  # the safetensors package's own errors: a damaged or foreign file
        raise InvalidArgumentError(f"{src}: not a readable safetensors file: {e}") from None
    finally:
        progress.close()
    state: Any = {prefix: tensors} if prefix else tensors
    metadata = {"imported_from": os.path.abspath(src)[-1000:], "format": "safetensors"}
    r = safepoint_save(dst, step, state, overwrite=overwrite, metadata=metadata)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"source": src, "destination": dst, "step": step, "files": len(files),
            "tensors": len(tensors), "bytes": nbytes, "committed": r["committed"],
            "seconds": time.perf_counter() - t0}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="safepoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export")
    e.add_argument("path")
    e.add_argument("out")
    e.add_argument("--format", required=True, choices=FORMATS)
    e.add_argument("--step", type=int)
    e.add_argument("--tag")
    e.add_argument("--select")
    e.add_argument("--max-shard-bytes", type=int)
    e.add_argument("--json", action="store_true")
    i = sub.add_parser("import")
    i.add_argument("src")
    i.add_argument("dst")
    i.add_argument("--step", type=int, required=True)
    i.add_argument("--prefix", default="model")
    i.add_argument("--overwrite", action="store_true")
    i.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    try:
        if a.command == "export":
            report = export_step(a.path, a.out, format=a.format, step=a.step, tag=a.tag,
                                 select=a.select, max_shard_bytes=a.max_shard_bytes)
            files = f", {report['files']} files" if a.max_shard_bytes is not None else ""
            text = (f"exported step {report['step']} of {report['source']}: "
                    f"{report['tensors']} tensors, {report['bytes']} bytes to {report['out']} "
                    f"({report['format']}{files})")
        else:
            report = import_safetensors(a.src, a.dst, a.step, prefix=a.prefix,
                                        overwrite=a.overwrite)
            text = (f"imported {report['tensors']} tensors ({report['bytes']} bytes) from "
                    f"{report['files']} file(s) as step {report['step']} of "
                    f"{report['destination']}")
    except Error as err:
        message = str(err)
        if a.command == "import" and isinstance(err, AlreadyExistsError):
            # The Python API's keyword is the command line's flag here.
            message = message.replace("overwrite=True", "--overwrite")
        print(f"safepoint: error: {message}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if a.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
