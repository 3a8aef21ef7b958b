"""`jetserve mtp inspect|merge`: look at a checkpoint's MTP heads, and merge heads shipped apart.

Both read only metadata (names, shapes, dtypes) to decide anything; `merge` then copies tensors
shard by shard, so memory stays at about one output shard.

Naming: merge keeps the MTP source's own naming (Qwen3-Next `mtp.*` or DeepSeek
`model.layers.{N+j}.*`) and sets that style's layer-count field in config.json. Renaming would
gain nothing (the loader maps both onto one module) and DeepSeek heads carry tensors with no
`mtp.*` name (`shared_head.head`, `embed_tokens`), so the output stays a byte-exact copy.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path

from jetserve.engine.model.checkpoint import (INDEX_FILE, MAX_MODEL_DIM, Checkpoint, CheckpointError, config_int,
                                               is_mtp_tensor, num_hidden_layers, num_mtp_layers, read_json)

QWEN3_NEXT, DEEPSEEK = "qwen3-next", "deepseek"
LAYER_FIELD = {QWEN3_NEXT: "mtp_num_hidden_layers", DEEPSEEK: "num_nextn_predict_layers"}
NAMING = {QWEN3_NEXT: "mtp.*", DEEPSEEK: "model.layers.{N+j}.*"}
# safetensors dtype → (name users know, bytes per element)
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8),
    "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
_LAYER = re.compile(r"^(?:mtp|model)\.layers\.(\d+)\.(.+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


class _Heads(Checkpoint):
    """MTP heads shipped apart: one .safetensors file, or a directory of them. The index and
    config.json are optional; the base's config is the one that counts (a config here only
    cross-checks the layer count)."""

    def __init__(self, src: Path):  # Checkpoint's reading, minus its required config.json
        if not src.exists():
            raise CheckpointError(f"{src}: no such file or directory")
        self.dir = src if src.is_dir() else src.parent
        config = src / "config.json"
        self.config = read_json(config) if src.is_dir() and config.exists() else {}
        self._handles = {}
        if (src / INDEX_FILE).exists():
            self._file_of = self._map_tensors()
            return
        files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
        if not files:
            raise CheckpointError(f"{src}: no .safetensors files")
        self._file_of = {name: path for path in files for name in self._open(path).keys()}


def _nbytes(ckpt: Checkpoint, name: str) -> int:
    return math.prod(ckpt.shape(name)) * DTYPES[ckpt.dtype(name)][1]


def _style(names: list[str], where) -> str | None:
    styles = {QWEN3_NEXT if n.startswith("mtp.") else DEEPSEEK for n in names}
    if len(styles) > 1:
        raise CheckpointError(f"{where}: mixes both MTP namings (mtp.* and model.layers.{{N+j}}.*)")
    return styles.pop() if styles else None


def _layer_of(name: str, num_hidden_layers: int) -> tuple[int, str] | None:
    """(MTP layer j, name inside the layer) for a per-layer MTP tensor; None for shared ones (mtp.fc)."""
    match = _LAYER.match(name)
    if not match:
        return None
    offset = 0 if name.startswith("mtp.") else num_hidden_layers
    return int(match.group(1)) - offset, match.group(2)


def _dtype_names(ckpt: Checkpoint, names) -> list[str]:
    return sorted({DTYPES.get(ckpt.dtype(n), (ckpt.dtype(n),))[0] for n in names})


def inspect(model_dir) -> dict:
    """What a checkpoint holds in MTP heads, from its metadata only."""
    ckpt = Checkpoint(model_dir)
    n_main = num_hidden_layers(ckpt.config)
    mtp = ckpt.mtp_names()
    style = _style(mtp, ckpt.dir)
    numel = {name: math.prod(ckpt.shape(name)) for name in ckpt.names()}
    found = len({layer[0] for n in mtp if (layer := _layer_of(n, n_main))})
    declared = num_mtp_layers(ckpt.config)
    mtp_params, total = sum(numel[n] for n in mtp), sum(numel.values())
    return {
        "dir": str(ckpt.dir),
        "has_mtp": bool(mtp),
        "style": style,
        "naming": NAMING.get(style),
        "config_layers": declared,
        "found_layers": found,
        "layers_match": declared == found,
        "mtp_tensors": len(mtp),
        "mtp_params": mtp_params,
        "total_params": total,
        "mtp_share": mtp_params / total if total else 0.0,
        "dtypes": _dtype_names(ckpt, ckpt.names()),
        "mtp_dtypes": _dtype_names(ckpt, mtp),
        "files": [p.name for p in ckpt.files],
    }


def parse_size(size) -> int:
    """Bytes in "5GB" (10**9), "2GiB" (2**30), "500MB" or a plain number, as transformers reads them."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise ValueError(f"max_shard_size: cannot read {size!r} (try 5GB or 500MB)")
    unit = (match.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** (" KMGT".index(unit[0]))
    return int(float(match.group(1)) * scale)


def _expected_shape(name: str, base: Checkpoint) -> tuple[int, ...] | None:
    """The shape an MTP tensor must have to fit `base`; None for a name no MTP module has."""
    hidden = config_int(base.config, "hidden_size", 1, MAX_MODEL_DIM)
    layer = _layer_of(name, num_hidden_layers(base.config))
    if layer is None:
        fixed = {"mtp.fc.weight": (hidden, 2 * hidden)}
        norms = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
        return (hidden,) if name in norms else fixed.get(name)
    inner = layer[1]
    if f"model.layers.0.{inner}" in base:  # the decoder block: same shapes as the main layers
        return base.shape(f"model.layers.0.{inner}")
    if inner in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        return (hidden,)
    if inner == "eh_proj.weight":
        return (hidden, 2 * hidden)
    if inner in ("shared_head.head.weight", "embed_tokens.weight"):
        return base.shape("model.embed_tokens.weight")
    return None


def _check_heads(heads: _Heads, base: Checkpoint, src: Path) -> tuple[str, int]:
    """Refuse heads that would not load into `base`; return their style and layer count."""
    n_main = num_hidden_layers(base.config)
    names = heads.names()
    for name in names:
        if not is_mtp_tensor(name, base.config):
            raise CheckpointError(f"{src}: {name} is not an MTP tensor (want mtp.* or model.layers.{{>={n_main}}}.*)")
        expected, found = _expected_shape(name, base), heads.shape(name)
        if expected is None:
            raise CheckpointError(f"{src}: {name} is not part of an MTP module")
        if tuple(expected) != found:
            raise CheckpointError(f"{src}: {name} has shape {list(found)}, expected {list(expected)} "
                                  f"(base hidden_size {base.config['hidden_size']})")
    style = _style(names, src)
    layers = sorted({layer[0] for n in names if (layer := _layer_of(n, n_main))})
    if layers != list(range(len(layers))) or not layers:
        raise CheckpointError(f"{src}: MTP layers must be numbered 0..k-1 after the main layers, found {layers}")
    declared = num_mtp_layers(heads.config) if heads.config else len(layers)
    if declared != len(layers):
        raise CheckpointError(f"{src}: config.json declares {declared} MTP layers, its tensors hold {len(layers)}")
    return style, len(layers)


def _refuse_overlap(out: Path, inputs: list[Path]) -> None:
    for path in inputs:
        if out == path or out in path.parents or path in out.parents:
            raise CheckpointError(f"{out}: output must lie outside the input {path} (merge never touches its inputs)")


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Pack tensors in order into shards of at most `limit` bytes (a bigger tensor gets its own)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def merge(base_dir, mtp_src, out_dir, *, max_shard_size="5GB", force=False, replace=False) -> dict:
    """Write base + MTP heads as a new sharded checkpoint in `out_dir`; the inputs stay untouched.

    The result appears atomically: it is written next to `out_dir` and renamed into place.
    `force` replaces a non-empty `out_dir`; `replace` drops MTP heads the base already has.
    """
    from safetensors.torch import save_file

    base, src, out = Checkpoint(base_dir), Path(mtp_src), Path(out_dir).resolve()
    limit = parse_size(max_shard_size)
    _refuse_overlap(out, [base.dir.resolve(), src.resolve()])
    if out.exists() and not (out.is_dir() and (force or not any(out.iterdir()))):
        raise CheckpointError(f"{out}: exists and is not empty (use --force to replace it)")
    heads = _Heads(src)
    style, layers = _check_heads(heads, base, src)
    old_heads = set(base.mtp_names())
    if old_heads and not replace:
        raise CheckpointError(f"{base.dir}: already has MTP heads ({len(old_heads)} tensors; use --replace)")

    sources = {n: base for n in base.names() if n not in old_heads}
    sources.update(dict.fromkeys(heads.names(), heads))
    sizes = {name: _nbytes(ckpt, name) for name, ckpt in sources.items()}
    shards = _shards(sizes, limit)
    config = {k: v for k, v in base.config.items() if k not in LAYER_FIELD.values()}
    config[LAYER_FIELD[style]] = layers

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: sources[n].get(n) for n in names}, tmp / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for path in base.dir.iterdir():  # tokenizer, generation config, chat template, license...
            if path.is_file() and path.suffix != ".safetensors" and path.name not in (INDEX_FILE, "config.json"):
                shutil.copy2(path, tmp / path.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out), "style": style, "mtp_layers": layers, "mtp_tensors": len(heads.names()),
            "replaced_tensors": len(old_heads), "shards": len(shards), "total_size": index["metadata"]["total_size"]}
