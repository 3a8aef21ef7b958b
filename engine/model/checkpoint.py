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
# The JSON files of a checkpoint (config, index, tokenizer and generation configs) are read whole;
# the largest real ones (a sharded index of ~100k tensors) are a few MB.
MAX_JSON_BYTES = 64 * 2**20
# Upper bounds of config.json's sizes, far above any published model's (hidden 16k, MLP 53k,
# vocabulary 262k, context 10M, 126 layers), so that a config that lies is refused before shapes
# are built from it: the meta model builds every layer it declares.
MAX_LAYERS = 1024  # decoder layers, and MTP layers
MAX_MODEL_DIM = 2**20
MAX_VOCAB_SIZE = 2**24
MAX_POSITIONS = 2**30
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


def regular_file(path: Path) -> Path:
    """`path` when it is (or links to) a regular file: opening a FIFO would block for ever, and
    a device such as /dev/zero never ends."""
    if not path.exists():
        raise CheckpointError(f"{path}: file not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    return path


def read_json(path: Path) -> dict:
    """A JSON object from a file of at most MAX_JSON_BYTES; anything else is a CheckpointError."""
    try:
        with open(regular_file(path), "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES // 2**20} MiB")
        value = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON, huge numbers
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: unreadable: a JSON object expected, found {type(value).__name__}")
    return value


def config_int(config: dict, key: str, low: int, high: int, default: int | None = None) -> int:
    """config.json's integer `key`, which must lie in [low, high]; `default` when absent or null
    (None: required)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CheckpointError(f"config.json: {key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def num_mtp_layers(config: dict) -> int:
    """MTP layers a config declares, in either naming."""
    key = "mtp_num_hidden_layers" if config.get("mtp_num_hidden_layers") else "num_nextn_predict_layers"
    return config_int(config, key, 0, MAX_LAYERS, default=0)


def num_hidden_layers(config: dict) -> int:
    return config_int(config, "num_hidden_layers", 1, MAX_LAYERS)


def is_mtp_tensor(name: str, config: dict) -> bool:
    if name.startswith("mtp."):
        return True
    match = _LAYER.match(name)
    return bool(match) and int(match.group(1)) >= num_hidden_layers(config)


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
            for name, file in weight_map.items():  # shard names, in this directory (as Hugging Face writes them)
                if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                    raise CheckpointError(f"{index}: weight_map[{name!r}] must name a file in this directory, "
                                          f"got {file!r}")
            files = {name: self.dir / file for name, file in weight_map.items()}
            by_file: dict[Path, list[str]] = {}
            for name, path in files.items():
                by_file.setdefault(path, []).append(name)
            for path, names in by_file.items():
                if not path.exists():
                    raise CheckpointError(f"{index} names {path.name}, which is missing")
                held = set(self._open(path).keys())
                lacking = [name for name in names if name not in held]
                if lacking:
                    raise CheckpointError(f"{index} maps {lacking[0]!r} to {path.name}, which does not hold it"
                                          + (f" ({len(lacking) - 1} more likewise)" if len(lacking) > 1 else ""))
            return files
        single = self.dir / SINGLE_FILE
        if not single.exists():
            raise CheckpointError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        if path not in self._handles:
            regular_file(path)
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

    def rows(self, name: str, start: int, stop: int):
        """Rows [start, stop) of one tensor, read alone (a big tensor a block at a time)."""
        return self._slice(name)[start:stop]

    def mtp_names(self) -> list[str]:
        return [n for n in self._file_of if is_mtp_tensor(n, self.config)]
