"""Read TensorRT-LLM's own source into the contract our TensorRT-LLM backend is tested against.

TensorRT-LLM cannot be installed on our CI machines, so the backend's tests check its output
against this contract instead: the fields, types and defaults of the classes the mapping fills
in, and the cross-field rules (validators) that decide what those values mean. The source is
parsed with `ast`, never imported (importing needs CUDA, TensorRT and torch).

    git -C TensorRT-LLM checkout v1.2.1
    python tools/trtllm_contract.py TensorRT-LLM --tag v1.2.1 > tests/engine/trtllm_contracts/1.2.json

The commit is read from SRC when it is a git checkout, or given with --commit.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

FILES = {
    "llm_args": "tensorrt_llm/llmapi/llm_args.py",
    "sampling_params": "tensorrt_llm/sampling_params.py",
    "llm": "tensorrt_llm/llmapi/llm.py",
    "result": "tensorrt_llm/executor/result.py",
}

# The classes and fields jetserve's mapping fills in or reads back; nothing else is recorded.
USED = {
    ("llm_args", "CudaGraphConfig"): ("batch_sizes", "max_batch_size", "enable_padding"),
    ("llm_args", "KvCacheConfig"): ("free_gpu_memory_fraction", "enable_block_reuse", "tokens_per_block"),
    ("llm_args", "MTPDecodingConfig"): ("max_draft_len", "num_nextn_predict_layers", "use_mtp_vanilla"),
    ("llm_args", "TorchLlmArgs"): (
        "model", "dtype", "skip_tokenizer_init", "max_batch_size", "max_seq_len", "max_num_tokens",
        "enable_chunked_prefill", "kv_cache_config", "cuda_graph_config", "speculative_config",
        "disable_overlap_scheduler", "enable_iter_perf_stats"),
    ("sampling_params", "SamplingParams"): (
        "end_id", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "stop_token_ids", "ignore_eos", "skip_special_tokens", "detokenize"),
    ("result", "CompletionOutput"): ("text", "token_ids", "finish_reason", "stop_reason", "text_diff",
                                     "token_ids_diff"),
}


def text(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def literal(node: ast.AST):
    """A default as JSON: the literal value, or {"expr": source} for anything computed."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"expr": text(node)}


class Module:
    """One source file: its classes (fields, methods, docstrings) and module-level aliases."""

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        self.aliases = {t.id: n.value.id for n in self.tree.body if isinstance(n, ast.Assign)
                        for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Name)}

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def mro(self, name: str) -> list[ast.ClassDef]:
        """The class and its bases defined in this file, most basic first."""
        cls = self.classes.get(self.resolve(name))
        if cls is None:
            return []
        chain = []
        for base in cls.bases:
            if isinstance(base, ast.Name):
                chain.extend(c for c in self.mro(base.id) if c not in chain)
        return chain + [cls]

    def fields(self, name: str) -> dict[str, dict]:
        out = {}
        for cls in self.mro(name):
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    out[node.target.id] = field(node)
                elif isinstance(node, ast.FunctionDef) and any(text(d) == "property" for d in node.decorator_list):
                    out[node.name] = {"type": text(node.returns), "property": True}
        return out

    def methods(self, name: str):
        for cls in self.mro(name):
            for node in cls.body:
                if isinstance(node, ast.FunctionDef):
                    yield cls.name, node


def field(node: ast.AnnAssign) -> dict:
    """Type and default of `name: T = default` or `name: T = Field(default=..., ...)`."""
    out = {"type": text(node.annotation)}
    value = node.value
    if isinstance(value, ast.Call) and text(value.func) in ("Field", "PydanticField", "field"):
        kw = {k.arg: k.value for k in value.keywords}
        if "default_factory" in kw:
            out["default_factory"] = text(kw["default_factory"])
        elif "default" in kw:
            out["default"] = literal(kw["default"])
        elif value.args and text(value.args[0]) != "...":
            out["default"] = literal(value.args[0])
        else:
            out["required"] = True
        if "description" in kw:
            out["description"] = literal(kw["description"])
        if kw.get("init") is not None:
            out["init"] = literal(kw["init"])
    elif value is not None:
        out["default"] = literal(value)
    else:
        out["required"] = True
    return out


def decorated(fn: ast.FunctionDef, kind: str) -> str | None:
    """The mode of a `@model_validator(mode=...)`/`@field_validator(...)` decorator, or None."""
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and text(d.func) == kind:
            mode = next((k.value for k in d.keywords if k.arg == "mode"), None)
            return literal(mode) if mode is not None else "after"
    return None


def raises(body: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Raise) for stmt in body for n in ast.walk(stmt))


def local_values(fn: ast.FunctionDef) -> dict[str, str]:
    """`x = expr` assignments in a function, so `a != x` can be read as `a != expr`."""
    return {t.id: text(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)}


def cuda_graph_rule(mod: Module) -> dict:
    """What TensorRT-LLM requires when both CudaGraphConfig.batch_sizes and .max_batch_size are set."""
    for cls in mod.classes.values():
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            values = local_values(fn)
            where = f"{cls.name}.{fn.name}"
            for node in ast.walk(fn):
                if not (isinstance(node, ast.If) and raises(node.body)):
                    continue
                for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                    if not isinstance(cmp.ops[0], ast.NotEq):
                        continue
                    sides = [values.get(text(s), text(s)) for s in (cmp.left, cmp.comparators[0])]
                    if any(s.endswith("max_batch_size") for s in sides) and \
                            any(re.fullmatch(r"max\(.*\bbatch_sizes\)", s) for s in sides):
                        return {"both_set": "max_batch_size == max(batch_sizes)", "where": where}
                    if any(s.endswith(".batch_sizes") for s in sides) and \
                            any("_generate_cuda_graph_batch_sizes(" in s for s in sides):
                        return {"both_set": "batch_sizes == generated(max_batch_size, enable_padding)",
                                "where": where}
    raise LookupError("no CudaGraphConfig batch_sizes/max_batch_size validator found")


def mtp_rule(mod: Module) -> dict:
    """Which MTPDecodingConfig field ends up as the draft length."""
    for owner, fn in mod.methods("MTPDecodingConfig"):
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and text(node.targets[0]).endswith(".max_draft_len") and \
                    "num_nextn_predict_layers" in text(node.value):
                return {"draft_len_from": "num_nextn_predict_layers", "where": f"{owner}.{fn.name}"}
        if decorated(fn, "model_validator") == "before" and any(
                isinstance(n, ast.Constant) and n.value == "num_nextn_predict_layers" for n in ast.walk(fn)):
            return {"draft_len_from": "max_draft_len", "alias": "num_nextn_predict_layers",
                    "where": f"{owner}.{fn.name}"}
    raise LookupError("no MTPDecodingConfig draft-length rule found")


def greedy_rule(mod: Module) -> dict:
    """The conditions under which SamplingParams counts a request as greedy."""
    for owner, fn in mod.methods("SamplingParams"):
        if fn.name == "params_imply_greedy_decoding":
            ret = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Return))
            terms = ret.values if isinstance(ret, ast.BoolOp) and isinstance(ret.op, ast.Or) else [ret]
            return {"greedy_when": [text(t) for t in terms], "where": f"{owner}.{fn.name}"}
    raise LookupError("no SamplingParams.params_imply_greedy_decoding found")


def documented(mod: Module, cls: str, name: str) -> str:
    """The Args: line of `name` in a class docstring (SamplingParams documents its fields there)."""
    doc = ast.get_docstring(mod.classes[cls]) or ""
    match = re.search(rf"^\s*{name} \(.*?\):\s*(.+)$", doc, re.MULTILINE)
    if not match:
        raise LookupError(f"{cls} does not document {name}")
    return match.group(1).strip()


def seed_rule(mod: Module) -> dict:
    doc = documented(mod, "SamplingParams", "seed")
    match = re.search(r"None means using C\+\+ runtime default (\d+)", doc)
    return {"none_means": int(match.group(1)) if match else None, "doc": doc}


def end_id_rule(mod: Module) -> dict:
    """Whether the LLM refuses a request without end_id when it has no tokenizer to find one."""
    for cls in mod.classes.values():
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and "end_id is None" in text(node.test):
                    tests = [text(n.test) for n in ast.walk(node) if isinstance(n, ast.If)]
                    if any("tokenizer is None" in t for t in tests) and raises(node.body):
                        return {"end_id_required_without_tokenizer": True, "where": f"{cls.name}.{fn.name}"}
    return {"end_id_required_without_tokenizer": False}


def git_commit(src: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def contract(src: Path, tag: str, commit: str | None, note: str | None = None) -> dict:
    mods = {key: Module((src / path).read_text()) for key, path in FILES.items()}
    classes = {}
    for (key, name), wanted in USED.items():
        found = mods[key].fields(name)
        missing = [f for f in wanted if f not in found]
        if missing:
            raise LookupError(f"{FILES[key]}: {name} has no {', '.join(missing)}")
        classes[name] = {"file": FILES[key], "defined_as": mods[key].resolve(name),
                         "fields": {f: found[f] for f in wanted}}
    source = {"repository": "NVIDIA/TensorRT-LLM", "tag": tag, "commit": commit or git_commit(src)}
    if note:
        source["note"] = note
    return {"source": source, "classes": classes, "rules": {
        "cuda_graph": cuda_graph_rule(mods["llm_args"]),
        "mtp": mtp_rule(mods["llm_args"]),
        "greedy": greedy_rule(mods["sampling_params"]),
        "seed": seed_rule(mods["sampling_params"]),
        "end_id": end_id_rule(mods["llm"]),
    }}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a TensorRT-LLM source tree (the repository root)")
    parser.add_argument("--tag", required=True, help="the release tag, or 'main'")
    parser.add_argument("--commit", help="the commit SRC is at (read with git when omitted)")
    parser.add_argument("--note", help="where SRC came from, when it is not a plain checkout")
    args = parser.parse_args(argv)
    json.dump(contract(args.src, args.tag, args.commit, args.note), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
