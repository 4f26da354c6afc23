"""Attention sinks through the server: a completion runs past max_model_len, streamed or not, and
equals the offline engine's; without sinks the same request is a 400 naming max_tokens."""

from __future__ import annotations

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess

CONTEXT = 64
ENGINE_ARGS = ["--num-kv-blocks", "40", "--block-size", "4", "--max-model-len", str(CONTEXT), "--dtype", "float32"]
PROMPT = list(range(5, 25))
LONG = {"temperature": 0, "max_tokens": 3 * CONTEXT, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-sinks"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def sinks_server(model_dir):
    proc = ServerProcess([str(model_dir), *ENGINE_ARGS, "--attention-sinks", "4", "--max-num-batched-tokens", "16",
                          "--served-model-name", "x"])
    yield proc
    assert proc.stop() == 0, proc.log_text()


def test_a_completion_runs_past_the_context_and_equals_the_offline_engine(sinks_server, model_dir):
    client = openai.OpenAI(base_url=sinks_server.url("/v1"), api_key="unused", max_retries=0)
    served = client.completions.create(model="x", prompt=PROMPT, **LONG)
    assert served.usage.completion_tokens == 3 * CONTEXT and served.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="x", prompt=PROMPT, stream=True,
                                                                                **LONG))
    offline = LLM(model=str(model_dir), num_kv_blocks=40, block_size=4, max_model_len=CONTEXT,
                  attention_sinks=4, max_num_batched_tokens=16).generate([PROMPT], SamplingParams(max_tokens=3 * CONTEXT, temperature=0,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert served.choices[0].text == streamed == offline.text
    assert sinks_server.wait_metric("kvserve:kv_cache_usage_perc", 0.0) == 0.0


def test_without_sinks_the_same_request_is_refused_with_the_numbers(model_dir):
    with ServerProcess([str(model_dir), *ENGINE_ARGS, "--served-model-name", "x"]) as proc:
        client = openai.OpenAI(base_url=proc.url("/v1"), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
            client.completions.create(model="x", prompt=PROMPT, **LONG)
