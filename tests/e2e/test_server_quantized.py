"""`kvserve serve --quantization int8 --kv-cache-dtype fp8`: same text as the offline engine with the
same options, and the memory report on /metrics."""

from __future__ import annotations

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess

OPTIONS = {"num_kv_blocks": 64, "block_size": 4, "quantization": "int8", "kv_cache_dtype": "fp8"}
ARGS = ["--num-kv-blocks", "64", "--block-size", "4", "--quantization", "int8", "--kv-cache-dtype", "fp8",
        "--max-model-len", "256", "--served-model-name", "q"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-quant"), "LlamaForCausalLM")


def test_quantized_server_matches_offline_and_reports_memory(model_dir):
    server = ServerProcess([str(model_dir), *ARGS])
    try:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        prompt = [5, 6, 7, 8] * 8
        served = client.completions.create(model="q", prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        llm = LLM(model=str(model_dir), **OPTIONS)
        offline = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert served.choices[0].text == offline.text
        memory = llm.engine.core.memory
        assert server.metric("kvserve:model_weight_bytes") == memory.weight_bytes
        assert server.metric("kvserve:kv_cache_bytes_per_token") == memory.kv_bytes_per_token == 144
        assert server.metric("kvserve:kv_cache_capacity_tokens") == 64 * 4
        assert "memory: weights" in server.log_text()
    finally:
        assert server.stop() == 0, server.log_text()
