"""Attention sinks (StreamingLLM, ``attention_sinks``): a sequence outgrows max_model_len with the KV
of its first tokens and of a window of the latest ones; attention scores are those of the paper's
cache-place positions; the bundled model's perplexity past the context stays near its in-context one."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import RopeConfig
from kvserve.kv_cache.sizing import max_window_blocks
from kvserve.model.attention.backend import AttentionMetadata
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
from kvserve.model.layers.rotary import RotaryEmbedding
from tests.conftest import TINY_VOCAB, assert_no_leak, make_tiny_model
from tests.models.reference import check_greedy_matches, load_hf

CONTEXT, SINKS, BLOCK = 64, 4, 4


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-sinks"), "LlamaForCausalLM")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def test_generation_runs_4x_past_max_model_len_with_bounded_kv(tiny_llama_path, monkeypatch):
    """256 tokens past a 20-token prompt with max_model_len 64: the request never holds more than
    the sink blocks plus a window's (the engine's own check), the sequence outgrows the pool (40
    blocks of 4 tokens), and the tokens before the window leaves the sinks are transformers' own."""
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=40, block_size=BLOCK, max_model_len=CONTEXT,
              attention_sinks=SINKS, max_num_batched_tokens=16)
    core = llm.engine.core
    assert core.max_model_len == CONTEXT and core.runner.fused_decoder is None
    kv = core.kv_cache
    held = []
    allocate = kv.allocate_slots
    monkeypatch.setattr(kv, "allocate_slots", lambda rid, *a, **k: allocate(rid, *a, **k) and (
        held.append(kv.num_held_blocks(rid)) or True))
    prompt, max_tokens = _prompt(20, seed=1), 4 * CONTEXT
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == max_tokens and len(prompt) + max_tokens > 4 * CONTEXT
    assert len(prompt) + max_tokens > kv.num_blocks * BLOCK  # more than the whole pool holds
    decode_bound = SINKS // BLOCK + max_window_blocks(CONTEXT - SINKS, BLOCK)
    assert max(held[2:]) <= decode_bound, held  # held[:2]: the prompt's chunks
    assert max(held) <= SINKS // BLOCK + max_window_blocks(CONTEXT - SINKS, BLOCK, 16)
    in_context = CONTEXT - len(prompt)  # outputs predicted at positions < 64: full attention still
    assert check_greedy_matches(load_hf(tiny_llama_path), prompt, out.token_ids[:in_context]) == in_context
    assert_no_leak(llm)


def test_preemption_and_prefix_hits_past_the_context(tiny_llama_path):
    """Recomputing a preempted request past max_model_len (a prefill of > 64 tokens under the sink
    mask) and reusing cached prompt blocks give the tokens of an uninterrupted run."""
    prompts = [_prompt(30, seed=2), _prompt(30, seed=3)]
    prompts.append(prompts[0][:24] + [5, 6, 7])
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=str(tiny_llama_path), block_size=BLOCK, max_model_len=CONTEXT, attention_sinks=SINKS,
                  max_num_batched_tokens=16, **kw)
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leak(llm)
        return llm, outs

    alone = [run(num_kv_blocks=64, enable_prefix_caching=False)[1][i] for i in range(len(prompts))]
    squeezed, outs = run(num_kv_blocks=24)
    assert squeezed.engine.core.scheduler.num_preemptions > 0
    assert squeezed.engine.core.kv_cache.prefix_stats.hits > 0
    assert outs == alone


def test_scores_are_those_of_cache_place_positions():
    """The paper's attention, computed directly: a query past the window sees the sinks at places
    0..N-1 and the window at N..N+W-1, itself at the last place, keys rotated by place. Ours keeps
    keys rotated by their own positions in the paged cache."""
    torch.manual_seed(0)
    sinks, window, length, heads, kv_heads, dim = 3, 9, 30, 4, 2, 16
    rotary = RotaryEmbedding(RopeConfig(), dim, 64)
    q_raw = torch.randn(length, heads, dim)
    k_raw, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    q, k = q_raw.clone(), k_raw.clone()
    positions = torch.arange(length)
    rotary(positions, q, k)
    sink_q = q_raw.clone()
    rotary.rotate(torch.full((length,), sinks + window - 1), sink_q)
    backend = TorchAttentionBackend(use_kernels=False)
    cache = backend.allocate_kv_cache(length // BLOCK + 1, BLOCK, kv_heads, dim, torch.float32, torch.device("cpu"))
    table = torch.arange(length // BLOCK + 1)[None, :]
    meta = AttentionMetadata(num_seqs=1, query_start=[0, length], seq_lens=[length], slot_mapping=positions,
                             block_tables=table, seq_lens_t=torch.tensor([length]), decode_seqs=[], prefill_seqs=[0],
                             decode_token_index=torch.zeros(0, dtype=torch.long), decode_block_tables=table[:0],
                             decode_seq_lens=torch.zeros(0, dtype=torch.long), block_size=BLOCK)
    ours = backend.forward(q, k, v, cache, meta, dim**-0.5, window=window, sinks=sinks, sink_q=sink_q)
    for p in range(length):
        kept = sorted(set(range(min(sinks, p + 1))) | set(range(max(0, p - window + 1), p + 1)))
        place = torch.arange(len(kept))
        kq, kk = q_raw[p:p + 1].clone(), k_raw[kept].clone()
        rotary(place[-1:], kq, kk[:1].clone())  # the query at the last place
        rotary(place, kk.clone(), kk)  # each kept key at its place
        kk = kk.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", kq[0], kk) * dim**-0.5
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), v[kept].repeat_interleave(heads // kv_heads, 1))
        torch.testing.assert_close(ours[p], want, rtol=1e-4, atol=1e-5)


def test_bad_settings_are_refused(tiny_llama_path, tmp_path):
    with pytest.raises(ValueError, match="below max_model_len"):
        LLM(model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=8, attention_sinks=8)
    with pytest.raises(ValueError, match="speculative"):
        LLM(model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=64, attention_sinks=4,
            speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="the pool has 8"):
        LLM(model=str(tiny_llama_path), num_kv_blocks=8, block_size=4, max_model_len=64, attention_sinks=4)
    windowed = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=16)
    with pytest.raises(ValueError, match="sliding window of its own"):
        LLM(model=str(windowed), num_kv_blocks=64, max_model_len=64, attention_sinks=4)
    with pytest.raises(ValueError, match="attention_sinks=-1"):
        LLM(model=str(tiny_llama_path), attention_sinks=-1)


@pytest.mark.slow
def test_bundled_model_perplexity_past_the_context():
    """alice29.txt, 1025 tokens, max_model_len 256: streamed with 4 sinks in one request, the tokens
    past the context score within 10% of the same tokens scored in context (windows of 255 tokens
    every 128, the Hugging Face recipe of eval/perplexity.py); the first 255 as the plain engine does."""
    from kvserve.eval.perplexity import sliding_windows

    context = 256
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    stream = LLM(dtype="float32", max_model_len=context, attention_sinks=4, kv_cache_memory_bytes=64 * 2**20,
                 max_num_batched_tokens=128)
    with open("tests/data/alice29.txt") as f:
        ids = stream.get_tokenizer().encode(f.read())[:4 * context + 1]
    streamed = [lp.logprob for lp in stream.generate([ids], scoring, use_tqdm=False)[0].prompt_logprobs[1:]]
    plain = LLM(dtype="float32", max_model_len=context, kv_cache_memory_bytes=64 * 2**20)
    spans = sliding_windows(len(ids), context - 1, context // 2)
    in_context = [0.0] * (len(ids) - 1)
    for w, out in zip(spans, plain.generate([ids[w.start:w.end] for w in spans], scoring, use_tqdm=False)):
        for j in range(w.first_scored, w.end):
            in_context[j - 1] = out.prompt_logprobs[j - w.start].logprob

    def ppl(lps):
        return math.exp(-sum(lps) / len(lps))

    first = context - 1  # tokens 1..255: the whole sequence still fits, both engines attend fully
    assert ppl(streamed[:first]) == pytest.approx(ppl(in_context[:first]), rel=1e-3)
    past, reference = ppl(streamed[first:]), ppl(in_context[first:])
    assert abs(past / reference - 1) < 0.10, (past, reference)
