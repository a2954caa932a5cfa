"""torch.distributed.checkpoint (DCP) in safepoint's format.

``Writer`` is a DCP ``StorageWriter`` and ``Reader`` a ``StorageReader``::

    import torch.distributed.checkpoint as dcp
    import safepoint.dcp

    dcp.save(state, storage_writer=safepoint.dcp.Writer("/ckpt/run1", step=100, keep=3))
    dcp.load(state, storage_reader=safepoint.dcp.Reader("/ckpt/run1"))          # newest step
    dcp.load(state, storage_reader=safepoint.dcp.Reader("/ckpt/run1", step=100))

The step can also be given as DCP's ``checkpoint_id``: ``dcp.save(state,
checkpoint_id="/ckpt/run1/step-100", storage_writer=safepoint.dcp.Writer("/ckpt/run1"))``
(the last path component ``step-<N>`` names the step, the rest the checkpoint directory; a
``Writer``'s or ``Reader``'s ``checkpoint_id`` is the step directory itself).

Retention: no agent prunes a DCP directory. ``Writer(..., keep=K)`` deletes, after its save is
committed, the committed steps older than the newest K, except tagged steps, the step it wrote
and steps a ``Reader`` of this process is reading; ``keep=None`` (the default) keeps every step.

What lands on storage is a normal safepoint checkpoint (docs/format.md): one image per rank per
step holding that rank's DCP write items, checksummed per 4 MiB chunk, and a commit record
written once every rank's image of the same save is durable (every save draws a new attempt id
that its images carry, so an image an earlier, unfinished save left is never committed beside
them); ``safepoint ls``, ``inspect`` and ``verify`` work on it. Each image holds:

- ``tensors``: one tensor per tensor write item, keyed ``"<fqn>@<chunk offsets>"`` (the chunk of
  the global tensor that rank saved), in its own dtype when the image format has it (every dtype
  of ``safepoint._core.DTYPES``), else (complex32, sub-byte types) as its raw bytes;
- ``bytes``: one uint8 tensor per byte write item (DCP's ``torch.save`` of non-tensor values),
  keyed by fqn, so that loading reads only the items it needs;
- ``dcp``: what DCP's ``Metadata`` is rebuilt from (per item: fqn, chunk offsets and sizes, the
  global size, dtype, requires_grad; the planner's fqn mappings; the save id) in safepoint's
  tagged encoding. There is no pickled metadata file.

``Reader.read_metadata`` rebuilds DCP's ``Metadata`` from the images' headers, indexes and extras
(not their data), and ``Reader.read_data`` reads only the byte ranges of the items the rank needs,
verifying the CRC of every 4 MiB chunk it reads: resharding to another world size reads what the
new shards overlap, never whole images.

``ShmStager`` is an ``AsyncStager`` for ``dcp.async_save`` that copies the state dict into
shared-memory buffers allocated once and reused, so training blocks only for that copy.

Modules: ``writer`` (``Writer``), ``reader`` (``Reader``), ``stager`` (``ShmStager``).
"""

from safepoint.dcp.reader import Reader
from safepoint.dcp.stager import ShmStager
from safepoint.dcp.writer import FORMAT_VERSION, Writer

__all__ = ["Writer", "Reader", "ShmStager", "FORMAT_VERSION"]
