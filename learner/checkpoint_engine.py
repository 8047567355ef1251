"""DeepSpeed's checkpoints written and read as state files (`dph_async.state_file`): nothing unpickled.

DeepSpeed decides what each rank saves and restores (model, optimizer partitions, its counters and
the client state) and under which file names (`mp_rank_00_model_states.pt`, ...); this engine only
changes how each of those dicts is stored: a safetensors file with the structure as JSON, whatever
the name's suffix says. Besides plain values and tensors they hold three DeepSpeed objects, named
here, and read back as those objects: the (static) loss scaler, the ZeRO stage and a flat-buffer
fragment's address. A checkpoint in DeepSpeed's own format (a pickle) is refused by file name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from dph_async.state_file import Codec, load_state, save_state

CODEC = Codec(
    encoders={
        LossScaler: ("loss_scaler", lambda s: {"scale": s.cur_scale}),
        ZeroStageEnum: ("zero_stage", int),
        fragment_address: ("fragment_address", lambda a: [a.numel, a.start]),
    },
    decoders={
        "loss_scaler": lambda v: LossScaler(scale=v["scale"]),
        "zero_stage": ZeroStageEnum,
        "fragment_address": lambda v: fragment_address(*v),
    },
)

# DeepSpeed's recovery scripts, which it copies beside the checkpoints: they read its own format, not this one.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class StateFileEngine(CheckpointEngine):
    def __init__(self) -> None:
        super().__init__()
        self.name = "StateFileEngine"

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: dict, path: str) -> None:
        save_state(state_dict, Path(path), CODEC)

    def load(self, path: str, map_location: Any = None) -> dict:
        """On the CPU whatever `map_location`: DeepSpeed copies what it loads into its own tensors."""
        return load_state(Path(path), CODEC)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        for script in RECOVERY_SCRIPTS:
            Path(info.save_dir, script).unlink(missing_ok=True)
        return True

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then skips cloning every tensor before a save; `save_state` stores only
        # each tensor's own bytes anyway.
        return False


def install(engine: Any) -> None:
    """Make a DeepSpeed engine save and load its checkpoints through `StateFileEngine`."""
    engine.checkpoint_engine = StateFileEngine()

