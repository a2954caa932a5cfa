"""safepoint.megatron: the load strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from safepoint.dcp.reader import Reader
from safepoint.megatron._storage import (
    BACKEND,
    VERSION,
    _rank0_decides,
    _read_pointer,
    _wait_committed,
)

# -- loading ---------------------------------------------------------------------------------

class SafepointLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron load strategy for checkpoints ``SafepointSaveStrategy`` saved: Megatron's
    ``torch_dist`` loading (its planner, shape checks and state dict translation) over
    ``safepoint.dcp.Reader``, which reads only the byte ranges each rank's shards overlap.
    ``load_timeout``: seconds to wait for a flash save's step to be committed. ``load`` (which
    every rank calls) has rank 0 read the pointer and wait for the commit, and every rank gets
    its verdict; the metadata entry points (``load_tensors_metadata``, ``load_sharded_metadata``),
    which a single rank may call, look at storage on each rank that calls them."""

    def __init__(self, load_timeout: float = 120.0) -> None:
        super().__init__()
        self.load_timeout = load_timeout
        self.last_reader: Optional[Reader] = None  # of the last load (bytes_read, for tests)

    def _reader(self, checkpoint_dir: Union[str, Path], collective: bool = False) -> Reader:
        """``collective`` (``load``, which every rank calls): rank 0 alone reads the pointer
        and waits for the commit, and every rank gets its verdict (or raises its error)."""
        def committed() -> tuple[str, int]:
            root, step, attempt = _read_pointer(checkpoint_dir)
            _wait_committed(root, step, self.load_timeout, attempt)
            return root, step

        root, step = _rank0_decides(committed) if collective else committed()
        return Reader(root, step=step)

    def load(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> dict:
        # As TorchDistLoadShardedStrategy.load (megatron-core 0.16.1), with safepoint's reader.
        flexible_shape = [t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        allow_mismatch = {t.key: t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        orig = sharded_state_dict
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        reader = self._reader(checkpoint_dir, collective=True)
        dcp.load(pyt_state_dict, storage_reader=reader,
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=flexible_shape,
                                          allow_shape_mismatch_sharded_tensors=allow_mismatch))
        self.last_reader = reader
        mcore = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        out = _replace_sharded_keys_with_state_dict_keys(mcore, flat_mapping, rename_mapping)
        _restore_dict_types(out, orig)
        return out

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path],
                              metadata: Any = None) -> dict:
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(Path(checkpoint_dir), metadata)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        metadata = self._reader(checkpoint_dir).read_metadata()
        out: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        raise CheckpointingException(
            f"{checkpoint_dir}: remove_sharded_tensors is not supported for safepoint "
            f"checkpoints (a committed step is never rewritten); save a new checkpoint without "
            f"the {key_prefix!r} tensors instead")

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"SafepointLoadStrategy loads the backend {BACKEND!r}, "
                                         f"not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"SafepointLoadStrategy loads version {VERSION} of "
                                         f"{BACKEND!r}, not {loaded_version!r}")
