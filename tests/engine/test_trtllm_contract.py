"""The TensorRT-LLM mapping, held to TensorRT-LLM's own fields, defaults and validators.

Each contract in trtllm_contracts/ was read from TensorRT-LLM's source by
tools/trtllm_contract.py (1.0–1.2 and main). A test sends the mapping's output through the
contract's rules, as TensorRT-LLM would: a misnamed field, a validator that would raise, or a
default that would change the meaning fails here.

No test builds TensorRT-LLM's own objects: NVIDIA ships it for CUDA machines only, so such a
test skipped wherever CI runs and could never fail. Its source is what the contracts are read
from (tools/trtllm_contract.py; tests/engine/test_trtllm_contract_script.py), and a new release
is checked by reading its contract, here, on a CPU.
"""

import ast
import json
from pathlib import Path

import pytest

from jetserve.engine import EngineArgs, SamplingParams
from jetserve.engine.backends.trtllm import TrtllmApi, llm_kwargs, sampling_kwargs
from tests.engine.builders import TINY

CONTRACTS = sorted((Path(__file__).parent / "trtllm_contracts").glob("*.json"))
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(params=CONTRACTS, ids=lambda p: p.stem)
def contract(request):
    return json.loads(request.param.read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A checkpoint directory as resolve() reads it (config.json only: the mapping loads no weights)."""
    path = tmp_path_factory.mktemp("trtllm")
    (path / "config.json").write_text(json.dumps({**TINY, "architectures": ["Qwen3ForCausalLM"],
                                                  "mtp_num_hidden_layers": 1}))
    return str(path)


def api_of(contract) -> TrtllmApi:
    return TrtllmApi.from_num_nextn_default(
        contract["classes"]["MTPDecodingConfig"]["fields"]["num_nextn_predict_layers"].get("default"))


def mapped(contract, model, num_mtp_layers=1, **args):
    config = EngineArgs(model=model, backend="tensorrt-llm", **args).resolve()
    return llm_kwargs(config, api_of(contract), num_mtp_layers=num_mtp_layers, free_gpu_memory_fraction=0.5)


def fields(contract, cls):
    return contract["classes"][cls]["fields"]


def conforms(value, annotation: str) -> bool:
    """Does a value fit a field's annotation (the scalar and list types our mapping sends)?"""
    inner = annotation.removeprefix("Optional[").removesuffix("]") if annotation.startswith("Optional[") else annotation
    if value is None:
        return annotation.startswith("Optional[")
    if inner == "bool":
        return isinstance(value, bool)
    if inner in ("int", "NonNegativeInt", "PositiveInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if inner == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if inner == "List[int]":
        return isinstance(value, list) and all(isinstance(v, int) for v in value)
    if inner in ("str", "Union[str, Path]"):
        return isinstance(value, str)
    return True  # config objects: checked class by class below


def check_fields(contract, cls, kwargs):
    known = fields(contract, cls)
    for name, value in kwargs.items():
        assert name in known, f"{cls} has no field {name!r} in {contract['source']['tag']}"
        assert conforms(value, known[name]["type"]), f"{cls}.{name}={value!r} is not {known[name]['type']}"


def holds(condition: str, values: dict) -> bool:
    """Evaluate a greedy condition from the contract (and/or, ==, is None) on request values."""
    def ev(node):
        if isinstance(node, ast.BoolOp):
            results = [ev(v) for v in node.values]
            return all(results) if isinstance(node.op, ast.And) else any(results)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right, op = ev(node.left), ev(node.comparators[0]), node.ops[0]
            return {ast.Eq: lambda: left == right, ast.NotEq: lambda: left != right,
                    ast.Is: lambda: left is right, ast.IsNot: lambda: left is not right}[type(op)]()
        if isinstance(node, ast.Name):
            return values.get(node.id)
        if isinstance(node, ast.Constant):
            return node.value
        raise ValueError(f"greedy condition {condition!r}: cannot evaluate {ast.dump(node)}")
    return ev(ast.parse(condition, mode="eval").body)


def is_greedy(contract, kwargs) -> bool:
    values = {k: kwargs.get(k) for k in ("temperature", "top_p", "top_k")}
    return any(holds(c, values) for c in contract["rules"]["greedy"]["greedy_when"])


def effective(contract, cls, kwargs, name):
    return kwargs[name] if name in kwargs else fields(contract, cls)[name].get("default")


def test_llm_kwargs_are_fields_of_the_llm_api(contract, model):
    kwargs = mapped(contract, model, dtype="bfloat16", max_num_seqs=6, max_num_batched_tokens=1024,
                    cudagraph_capture_sizes=[1, 2, 4], speculative_config=MTP3)
    check_fields(contract, "TorchLlmArgs", {k: v for k, v in kwargs.items() if not isinstance(v, tuple)})
    for name in ("kv_cache_config", "cuda_graph_config", "speculative_config"):
        cls, sub = kwargs[name]
        check_fields(contract, cls, sub)
    assert kwargs["max_batch_size"] == 6 and kwargs["max_num_tokens"] == 1024 and kwargs["max_seq_len"] == 256


@pytest.mark.parametrize("graphs", [dict(cudagraph_capture_sizes=[1, 2, 4]), dict(max_cudagraph_capture_size=4),
                                    dict(cudagraph_capture_sizes=[4, 2, 1, 8], max_cudagraph_capture_size=4), {}])
def test_cuda_graph_config_passes_its_validator(contract, model, graphs):
    kwargs = mapped(contract, model, max_num_seqs=6, **graphs)["cuda_graph_config"][1]
    sizes, largest = kwargs.get("batch_sizes"), kwargs.get("max_batch_size", 0)
    rule = contract["rules"]["cuda_graph"]["both_set"]
    if sizes and largest:
        # 1.0-1.2 accept both only when batch_sizes is exactly the list they would generate
        # from max_batch_size, which is theirs to choose, not ours: both set would raise.
        assert rule == "max_batch_size == max(batch_sizes)" and largest == max(sizes), \
            f"CudaGraphConfig({kwargs}) fails {contract['rules']['cuda_graph']['where']}: {rule}"
    assert (max(sizes) if sizes else largest) <= 6  # graphs never above max_num_seqs
    if graphs.get("cudagraph_capture_sizes"):
        assert sizes == sorted(s for s in graphs["cudagraph_capture_sizes"] if s <= 4)


def test_no_cuda_graphs_with_enforce_eager(contract, model):
    assert mapped(contract, model, enforce_eager=True)["cuda_graph_config"] is None


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafts_k_tokens(contract, model, k):
    cls, kwargs = mapped(contract, model, speculative_config={"method": "mtp", "num_speculative_tokens": k})[
        "speculative_config"]
    rule, known = contract["rules"]["mtp"], fields(contract, cls)
    if rule["draft_len_from"] == "num_nextn_predict_layers":  # 1.0-1.2: it overwrites max_draft_len
        drafts = kwargs.get("num_nextn_predict_layers", known["num_nextn_predict_layers"]["default"])
    else:  # later: max_draft_len, with num_nextn_predict_layers a deprecated alias for it
        drafts = kwargs.get("max_draft_len", kwargs.get(rule["alias"]))
    assert drafts == k, f"MTPDecodingConfig({kwargs}) drafts {drafts} tokens, not {k} ({rule['where']})"
    assert kwargs["use_mtp_vanilla"] is False  # one MTP layer, chained k times: EAGLE-style MTP


def test_mtp_layers_used_once_each_or_refused(contract, model):
    two = {"method": "mtp", "num_speculative_tokens": 2}
    assert mapped(contract, model, 3, speculative_config=two)["speculative_config"][1]["use_mtp_vanilla"] is True
    with pytest.raises(ValueError, match="at most 3 tokens"):
        mapped(contract, model, 3, speculative_config={"method": "mtp", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="needs MTP heads"):  # config.json declares a layer the weights lack
        mapped(contract, model, 0, speculative_config=MTP3)
    with pytest.raises(ValueError, match="speculative_config.method"):
        mapped(contract, model, speculative_config={"method": "eagle"})


@pytest.mark.parametrize("max_tokens,expected", [(None, 246), (1000, 246), (5, 5)])
def test_max_tokens_runs_up_to_max_model_len(contract, max_tokens, expected):
    kwargs = sampling_kwargs(SamplingParams(max_tokens=max_tokens), prompt_len=10, max_model_len=256)
    check_fields(contract, "SamplingParams", kwargs)
    assert effective(contract, "SamplingParams", kwargs, "max_tokens") == expected


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0, top_p=0.9, seed=3),
                                    SamplingParams(temperature=0.7, top_k=1)])
def test_greedy_is_greedy(contract, params):
    kwargs = sampling_kwargs(params, prompt_len=1, max_model_len=64)
    check_fields(contract, "SamplingParams", kwargs)
    assert is_greedy(contract, kwargs), f"{kwargs} samples in {contract['source']['tag']}"


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.1)])
def test_sampled_is_not_greedy(contract, params):
    kwargs = sampling_kwargs(params, prompt_len=1, max_model_len=64)
    check_fields(contract, "SamplingParams", kwargs)
    assert not is_greedy(contract, kwargs)
    assert {k: kwargs.get(k) for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": params.temperature, "top_p": params.top_p if params.top_p < 1 else None,
        "top_k": params.top_k or None, "min_p": params.min_p or None}


def test_unseeded_requests_are_not_all_seed_0(contract):
    seeds = [effective(contract, "SamplingParams", sampling_kwargs(SamplingParams(), prompt_len=1, max_model_len=64),
                       "seed") for _ in range(3)]
    assert contract["rules"]["seed"]["none_means"] == 0  # what an omitted seed would have meant
    assert len(set(seeds)) == 3 and None not in seeds
    assert sampling_kwargs(SamplingParams(seed=7), prompt_len=1, max_model_len=64)["seed"] == 7


def test_prefix_caching_block_size_and_async_scheduling_follow_our_flags(contract, model):
    for prefix, block, overlap in [(True, 16, False), (False, 32, True)]:
        kwargs = mapped(contract, model, enable_prefix_caching=prefix, block_size=block, async_scheduling=overlap)
        kv = kwargs["kv_cache_config"][1]
        assert kv["enable_block_reuse"] is prefix and kv["tokens_per_block"] == block
        assert kwargs["disable_overlap_scheduler"] is not overlap


def test_checkpoint_without_tokenizer_sends_end_id(contract, model, tmp_path):
    assert contract["rules"]["end_id"]["end_id_required_without_tokenizer"]
    assert mapped(contract, model)["skip_tokenizer_init"] is True  # this checkpoint has no tokenizer.json
    (tmp_path / "config.json").write_text((Path(model) / "config.json").read_text())
    (tmp_path / "tokenizer.json").write_text("{}")
    assert mapped(contract, str(tmp_path))["skip_tokenizer_init"] is False
    for params in (SamplingParams(), SamplingParams(temperature=0, stop_token_ids=[9])):
        kwargs = sampling_kwargs(params, prompt_len=1, max_model_len=64, end_ids=[5, 7])
        check_fields(contract, "SamplingParams", kwargs)
        assert kwargs["end_id"] == 5 and 7 in kwargs["stop_token_ids"] and kwargs["detokenize"] is False
    with pytest.raises(ValueError, match="stop strings"):
        sampling_kwargs(SamplingParams(stop="\n"), prompt_len=1, max_model_len=64, end_ids=[5])


@pytest.mark.parametrize("field, value", [("n", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                          ("repetition_penalty", 1.2), ("min_tokens", 3), ("logprobs", 2),
                                          ("prompt_logprobs", 1), ("include_stop_str_in_output", True),
                                          ("logit_bias", {3: 1.0}), ("allowed_token_ids", [1, 2]),
                                          ("bad_words", ["x"])])
def test_fields_the_mapping_does_not_carry_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        sampling_kwargs(SamplingParams(**{field: value}), prompt_len=1, max_model_len=64)
    sampling_kwargs(SamplingParams(), prompt_len=1, max_model_len=64)  # the defaults pass
