"""tools/trtllm_contract.py reads fields and validator rules out of source it never imports."""

import importlib.util
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "trtllm_contract.py"
spec = importlib.util.spec_from_file_location("trtllm_contract", SCRIPT)
trtllm_contract = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trtllm_contract)

# Two made-up source trees in the two shapes TensorRT-LLM has had; imports it lacks do not matter.
GRAPHS_IN_ARGS = """
    class CudaGraphConfig(Base):
        batch_sizes: Optional[List[int]] = Field(default=None)
        max_batch_size: int = Field(default=0)
        enable_padding: bool = False
    class TorchLlmArgs(BaseLlmArgs):
        cuda_graph_config: Optional[CudaGraphConfig] = Field(default_factory=CudaGraphConfig)
        @model_validator(mode='after')
        def check(self):
            c = self.cuda_graph_config
            if c.batch_sizes and c.max_batch_size != 0:
                if c.batch_sizes != CudaGraphConfig._generate_cuda_graph_batch_sizes(c.max_batch_size, True):
                    raise ValueError("both")
            return self
    class MTPDecodingConfig(Base):
        max_draft_len: Optional[int] = None
        num_nextn_predict_layers: int = 1
        use_mtp_vanilla: bool = False
        def __init__(self, **kwargs):
            if 'num_nextn_predict_layers' in kwargs:
                self.max_draft_len = kwargs['num_nextn_predict_layers']
"""
GRAPHS_IN_CONFIG = """
    class BaseCudaGraphConfig(Base):
        batch_sizes: Optional[List[int]] = Field(default=None)
        max_batch_size: NonNegativeInt = Field(0)
        enable_padding: bool = Field(default=False)
        @model_validator(mode='after')
        def check(self):
            if self.batch_sizes:
                largest = max(self.batch_sizes)
                if self.max_batch_size and self.max_batch_size != largest:
                    raise ValueError("both")
            return self
    class DecodeCudaGraphConfig(BaseCudaGraphConfig):
        mode: str = "decode"
    CudaGraphConfig = DecodeCudaGraphConfig
    class TorchLlmArgs(BaseLlmArgs):
        cuda_graph_config: Optional[CudaGraphConfig] = Field(default_factory=CudaGraphConfig)
    class MTPDecodingConfig(Base):
        max_draft_len: Optional[int] = Field(default=None)
        num_nextn_predict_layers: Optional[int] = Field(default=None, init=False)
        use_mtp_vanilla: bool = False
        @model_validator(mode="before")
        @classmethod
        def remap(cls, data):
            if "num_nextn_predict_layers" in data:
                data["max_draft_len"] = data.pop("num_nextn_predict_layers")
            return data
"""
COMMON_ARGS = """
    class KvCacheConfig(Base):
        free_gpu_memory_fraction: Optional[float] = Field(default=0.9, description="share")
        enable_block_reuse: bool = Field(default=True)
        tokens_per_block: int = Field(default=32)
    class BaseLlmArgs(Base):
        model: str = Field(description="path")
        dtype: str = "auto"
        skip_tokenizer_init: bool = False
        max_batch_size: Optional[int] = Field(default=2048)
        max_seq_len: Optional[int] = None
        max_num_tokens: Optional[int] = Field(default=8192)
        enable_chunked_prefill: bool = False
        kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
        speculative_config: Optional[object] = None
        disable_overlap_scheduler: bool = False
        enable_iter_perf_stats: bool = False
"""
SAMPLING = '''
    class SamplingParams:
        """Sampling.

        Args:
            seed (int, optional): Random seed. None means using C++ runtime default 0. Defaults to None.
        """
        end_id: Optional[int] = None
        max_tokens: int = 32
        temperature: Optional[float] = None
        top_p: Optional[float] = None
        top_k: Optional[int] = None
        min_p: Optional[float] = None
        seed: Optional[int] = None
        stop: Optional[List[str]] = None
        stop_token_ids: Optional[List[int]] = None
        ignore_eos: bool = False
        skip_special_tokens: bool = True
        detokenize: bool = True
        @staticmethod
        def params_imply_greedy_decoding(*, temperature, top_p, top_k):
            return top_k == 1 or temperature == 0
'''
LLM = """
    class LLM:
        def _prepare(self, sampling_params):
            if sampling_params.end_id is None:
                if self.tokenizer is None:
                    raise ValueError("tokenizer is required")
"""
RESULT = """
    class CompletionOutput:
        text: str = ""
        token_ids: Optional[list[int]] = field(default_factory=list)
        finish_reason: Optional[str] = None
        stop_reason: Optional[str] = None
        @property
        def text_diff(self) -> str:
            return self.text
        @property
        def token_ids_diff(self) -> list[int]:
            return self.token_ids
"""


def tree(tmp_path, graphs_and_mtp):
    sources = {"llm_args": COMMON_ARGS + graphs_and_mtp, "sampling_params": SAMPLING, "llm": LLM, "result": RESULT}
    for key, source in sources.items():
        path = tmp_path / trtllm_contract.FILES[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return tmp_path


def test_reads_the_1_0_to_1_2_shape(tmp_path):
    c = trtllm_contract.contract(tree(tmp_path, GRAPHS_IN_ARGS), "v1.x", "abc")
    assert c["source"] == {"repository": "NVIDIA/TensorRT-LLM", "tag": "v1.x", "commit": "abc"}
    assert c["rules"]["cuda_graph"] == {"both_set": "batch_sizes == generated(max_batch_size, enable_padding)",
                                        "where": "TorchLlmArgs.check"}
    assert c["rules"]["mtp"]["draft_len_from"] == "num_nextn_predict_layers"
    assert c["classes"]["MTPDecodingConfig"]["fields"]["num_nextn_predict_layers"] == {"type": "int", "default": 1}
    assert c["classes"]["KvCacheConfig"]["fields"]["free_gpu_memory_fraction"] == {
        "type": "Optional[float]", "default": 0.9, "description": "share"}
    assert c["rules"]["greedy"]["greedy_when"] == ["top_k == 1", "temperature == 0"]
    assert c["rules"]["seed"]["none_means"] == 0 and c["rules"]["end_id"]["end_id_required_without_tokenizer"]


def test_reads_the_main_shape(tmp_path):
    c = trtllm_contract.contract(tree(tmp_path, GRAPHS_IN_CONFIG), "main", "def")
    assert c["rules"]["cuda_graph"]["both_set"] == "max_batch_size == max(batch_sizes)"
    assert c["classes"]["CudaGraphConfig"]["defined_as"] == "DecodeCudaGraphConfig"
    assert c["classes"]["CudaGraphConfig"]["fields"]["max_batch_size"]["default"] == 0  # inherited, positional
    assert c["rules"]["mtp"] == {"draft_len_from": "max_draft_len", "alias": "num_nextn_predict_layers",
                                 "where": "MTPDecodingConfig.remap"}
    assert c["classes"]["MTPDecodingConfig"]["fields"]["num_nextn_predict_layers"]["init"] is False
    assert c["classes"]["TorchLlmArgs"]["fields"]["kv_cache_config"]["default_factory"] == "KvCacheConfig"


def test_a_field_the_mapping_uses_but_the_source_lacks_is_an_error(tmp_path):
    root = tree(tmp_path, GRAPHS_IN_CONFIG.replace("use_mtp_vanilla", "use_vanilla"))
    with pytest.raises(LookupError, match="MTPDecodingConfig has no use_mtp_vanilla"):
        trtllm_contract.contract(root, "main", "def")
