"""Prefix caching and speculative decoding through the server: same outputs, visible in usage and /metrics."""

from __future__ import annotations

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess

ENGINE_ARGS = ["--num-kv-blocks", "256", "--block-size", "4", "--max-model-len", "512", "--dtype", "float32"]
PROMPT = [5, 6, 7, 8] * 10 + [9, 10]  # 42 tokens, repetitive: n-gram lookup has guesses
GREEDY = {"temperature": 0, "max_tokens": 20, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-features"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def spec_server(model_dir):
    proc = ServerProcess([str(model_dir), *ENGINE_ARGS, "--speculative-method", "ngram",
                          "--num-speculative-tokens", "3", "--served-model-name", "x"])
    yield proc
    assert proc.stop() == 0, proc.log_text()


def test_cached_tokens_in_usage_and_metrics(spec_server):
    client = openai.OpenAI(base_url=spec_server.url("/v1"), api_key="unused", max_retries=0)
    first = client.completions.create(model="x", prompt=PROMPT, **GREEDY)
    second = client.completions.create(model="x", prompt=PROMPT[:40] + [11, 12, 13], **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 40  # 10 full blocks of 4 tokens
    assert spec_server.metric("kvserve:prefix_cache_hits_total") >= 40
    assert 0 < spec_server.metric("kvserve:prefix_cache_hit_rate") < 1


def test_speculative_server_matches_offline_plain(spec_server, model_dir):
    client = openai.OpenAI(base_url=spec_server.url("/v1"), api_key="unused", max_retries=0)
    served = client.completions.create(model="x", prompt=PROMPT, logprobs=None, **GREEDY)
    plain = LLM(model=str(model_dir), num_kv_blocks=256, block_size=4).generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert served.choices[0].text == plain.text
    assert spec_server.metric("kvserve:spec_decode_num_draft_tokens_total") > 0
    assert spec_server.metric("kvserve:spec_decode_num_accepted_tokens_total") >= 0
