"""The whole engine on the CUDA backend's Triton kernels matches transformers token for token.

On a machine without a GPU this runs the kernels in Triton's interpreter on the CPU (conftest.py);
with one, the same tests run on CUDA, where decode steps also replay captured CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.cuda_graphs import DecodeGraphs
from tests.conftest import TINY_VOCAB, assert_no_leak
from tests.models.reference import check_greedy_matches, load_hf

pytest.importorskip("triton")

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_triton_backend_matches_transformers(fixture, request):
    """Mixed lengths, chunked prefill sharing steps with decodes (a 32-token budget), and a shared
    prefix read back from the cache."""
    path = request.getfixturevalue(fixture)
    llm = LLM(model=str(path), device=_DEVICE, attention_backend="triton", num_kv_blocks=128, block_size=8,
              max_num_batched_tokens=32)
    assert type(llm.engine.core.runner.backend).__name__ == "TritonAttentionBackend"
    hf = load_hf(path)
    prompts = _prompts(5, 1, 60, seed=7)
    prompts.append(prompts[4][:40] + [5, 6, 7])  # a prefix-cache hit on the previous prompt's blocks
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert len(out.token_ids) == 12
        compared += check_greedy_matches(hf, prompt, out.token_ids)
    assert compared >= len(prompts) * 12 // 2
    assert_no_leak(llm)


def test_triton_backend_equals_torch_backend(tiny_llama):
    """Same tokens as the reference backend under preemption (a pool too small for the batch)."""
    prompts = _prompts(6, 20, 40, seed=8)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kwargs = dict(model=str(tiny_llama), device=_DEVICE, num_kv_blocks=24, block_size=4, max_num_batched_tokens=48)
    triton_llm = LLM(attention_backend="triton", **kwargs)
    got = [o.token_ids for o in triton_llm.generate(prompts, params)]
    assert triton_llm.engine.core.scheduler.num_preemptions > 0
    expected = [o.token_ids for o in LLM(attention_backend="torch", **kwargs).generate(prompts, params)]
    assert got == expected
    assert_no_leak(triton_llm)


def test_triton_backend_needs_cuda_or_interpreter(tiny_llama, monkeypatch):
    if _DEVICE == "cuda":
        pytest.skip("the interpreter switch only matters without a GPU")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(model=str(tiny_llama), attention_backend="triton", num_kv_blocks=16)


class _ReplayedOnCPU(DecodeGraphs):
    """DecodeGraphs whose 'graph' is the recorded step re-run on the static buffers (no CUDA here):
    the buckets, padding rows and buffer filling are the code under test."""

    def _capture(self, forward, device) -> None:
        self.forward = forward
        self.replayed: list[int] = []

    def _replay(self, size: int) -> None:
        self.replayed.append(size)
        self.outputs[size] = self.forward(self.input_ids[:size], self.positions[:size], self._metadata(size))


@pytest.mark.skipif(_DEVICE == "cuda", reason="on a GPU the real CUDA graphs run in the tests above")
def test_decode_graph_buffers_give_the_eager_tokens(tiny_qwen2):
    """Batches of 1-7 decodes in buckets of 1, 2, 4, 8: padded rows (slot -1, length 0) change nothing."""
    prompts = _prompts(7, 3, 40, seed=9)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    kwargs = dict(model=str(tiny_qwen2), attention_backend="triton", num_kv_blocks=96, block_size=8)
    expected = [o.token_ids for o in LLM(**kwargs).generate(prompts, params)]
    llm = LLM(**kwargs)
    runner = llm.engine.core.runner
    runner.decode_graphs = graphs = _ReplayedOnCPU(runner._eager_forward, 8, 16, 8, torch.device("cpu"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert {1, 2, 4, 8} <= set(graphs.replayed)  # staggered lengths: the batch shrinks through every bucket
    assert_no_leak(llm)
