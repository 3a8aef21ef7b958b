"""Read Hugging Face checkpoints: config.json plus one or many safetensors files.

Tensors are opened lazily (safetensors memory-maps them), so asking for names, shapes and
dtypes reads no weights. Both MTP layouts are recognised here, once, for the loader and the
`jetserve mtp` tools:

- Qwen3-Next style: `mtp.*`, layer count in `mtp_num_hidden_layers`;
- DeepSeek style: `model.layers.{N+j}.*` past the `num_hidden_layers` main layers, count in
  `num_nextn_predict_layers`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None


def num_mtp_layers(config: dict) -> int:
    """MTP layers a config declares, in either naming."""
    return int(config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers") or 0)


def is_mtp_tensor(name: str, config: dict) -> bool:
    if name.startswith("mtp."):
        return True
    match = _LAYER.match(name)
    return bool(match) and int(match.group(1)) >= int(config["num_hidden_layers"])


class Checkpoint:
    """The tensors of a checkpoint directory, by name, without loading them."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.config = read_json(self.dir / "config.json")
        self._handles: dict[Path, object] = {}
        self._file_of = self._map_tensors()

    def _map_tensors(self) -> dict[str, Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no weight_map")
            files = {name: self.dir / file for name, file in weight_map.items()}
            for path in set(files.values()):
                if not path.exists():
                    raise CheckpointError(f"{index} names {path.name}, which is missing")
            return files
        single = self.dir / SINGLE_FILE
        if not single.exists():
            raise CheckpointError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
        return self._handles[path]

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        return self._open(self._file_of[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def get(self, name: str):
        """Load one tensor (a torch.Tensor on the CPU)."""
        self._slice(name)  # raises a clear error when missing
        return self._open(self._file_of[name]).get_tensor(name)

    def mtp_names(self) -> list[str]:
        return [n for n in self._file_of if is_mtp_tensor(n, self.config)]
