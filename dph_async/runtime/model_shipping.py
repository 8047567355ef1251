"""Getting the model and the prompts to an actor on a host that does not share the head's filesystem.

The run directory, the model and the data live on the driver's node (the head). An actor placed on
another node must not read them from its own disk: they may be missing there, or stale copies of an
earlier run at the same path. So the driver packs the model's small files (config, tokenizer,
generation config) and the prompts file once into Ray's object store, and an actor elsewhere:

    1. writes those files into a temporary directory of its own;
    2. fetches the weights from the learner's weight server (the same versioned, checksummed buckets
       that carry every later update) and saves them there as model.safetensors;
    3. builds its engine and reads its prompts from that directory, which is removed once both are
       loaded.

Weight files of the model directory are never packed: the weight server is the one source of weights,
so a resumed run's actors start from the learner's current version, not from the base model.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from dph_async.actors.weight_client import WeightClient, WeightServerSilent
from dph_async.protocol import WeightsReady

# Files of a model directory that hold weights (or index them): they come from the weight server.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


@dataclass(frozen=True)
class Shipment:
    """Everything an actor reads from the head except the weights."""

    model_files: dict[str, bytes]  # path relative to the model directory -> contents
    prompts_name: str
    prompts: bytes

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.model_files.values())) + len(self.prompts)


def pack(model_dir: Path, prompts: Path) -> Shipment:
    """Read the model directory's files other than weights, and the prompts file."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a model directory (no config.json)")
    files = {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*"))
             if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)}
    return Shipment(files, prompts.name, prompts.read_bytes())


def first_weights(client: WeightClient, timeout_s: float = 300.0) -> WeightsReady:
    """The newest published weights' manifest, waiting while the learner has published none yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(WeightServerSilent):  # a lost request (the gate restarted): ask again
            if (ready := client.newest(-1)) is not None:
                return ready
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner published no weights within {timeout_s:.0f}s ({client.addr})")
        time.sleep(0.5)


def materialize(shipment: Shipment, weights: WeightClient, dest: Path) -> tuple[Path, Path, int]:
    """Write the shipment and the newest published weights under `dest`.
    Returns (model directory, prompts file, weights version)."""
    model_dir = dest / "model"
    for rel, data in shipment.model_files.items():
        path = model_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    ready = first_weights(weights)
    with weights.tensors(ready) as named:
        save_file({name: t.contiguous() for name, t in named}, str(model_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    prompts = dest / shipment.prompts_name
    prompts.write_bytes(shipment.prompts)
    return model_dir, prompts, ready.version
