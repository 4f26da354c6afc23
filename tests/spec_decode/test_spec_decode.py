"""Speculative decoding changes speed, never outputs: greedy token-identical, sampling same distribution."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import SpeculativeConfig
from kvserve.sample import sampler as sampler_module
from kvserve.sample.rejection import verify_sampled
from kvserve.sample.sampler import filtered_probs, row_probs
from kvserve.spec_decode.controller import SpeculativeController, best_k
from kvserve.spec_decode.ngram import NgramProposer, ngram_lookup
from tests.conftest import TINY_VOCAB, assert_no_leak, check_report, make_tiny_model


def _llm(path, spec: SpeculativeConfig | None = None, **kw) -> LLM:
    opts = {"model": str(path), "block_size": 4, "num_kv_blocks": 512, **kw}
    if spec is not None:
        opts.update(speculative_method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
                    speculative_model=spec.model, speculative_max_batch_size=spec.max_batch_size)
    return LLM(**opts)


def _truncated(model_dir, out):
    """A copy of the model with only its first layer: same vocabulary, agrees with it only sometimes."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama, tmp_path_factory):
    return _truncated(tiny_llama, tmp_path_factory.mktemp("tiny-draft"))


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    """A random model with large weights: sharp distributions, so sampled tokens often repeat."""
    target = make_tiny_model(tmp_path_factory.mktemp("peaky"), "LlamaForCausalLM", initializer_range=0.8)
    return target, _truncated(target, tmp_path_factory.mktemp("peaky-draft"))


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a motif, so n-gram lookup has something to propose; mixed lengths."""
    rng = random.Random(seed)
    out = []
    for _i in range(n):
        motif = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(2, 6))]
        out.append(motif * rng.randint(2, 12) + [rng.randrange(3, TINY_VOCAB)])
    return out


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 1, 3, 4) == [9, 1, 2, 3]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 2) == []
    assert ngram_lookup([5, 1, 7, 5, 2, 8, 5], 1, 2, 2) == [2, 8]  # latest occurrence wins


def test_k_follows_the_acceptance_and_the_verify_cost():
    assert best_k(1.0, 0.25, 7) == 7  # every guess held: the longest chain
    assert best_k(0.0, 0.25, 7) == 0  # none held: plain decoding beats any verify
    ks = [best_k(a / 10, 0.25, 7) for a in range(11)]
    assert ks == sorted(ks) and 0 < ks[5] < ks[9] < 7  # more acceptance, longer chains
    assert best_k(0.5, 0.0, 7) == 7 and best_k(0.9, 1.0, 7) == 0  # free verification / verify as dear as decoding
    assert best_k(1.0, 0.25, 3) == 3  # never past the cap (num_speculative_tokens, the room left)


def test_acceptance_estimate_rises_with_held_chains_and_falls_at_misses():
    from kvserve.request import Request

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=7, max_batch_size=8)
    controller = SpeculativeController(config, NgramProposer(), max_model_len=1024)
    r = Request(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=100))
    for _ in range(8):
        controller.record(r, 7, 1)  # the first guess missed every time
    assert r.spec_acceptance < 0.1 and controller._k_for(r) in (0, 1)  # probes at most
    low = r.spec_acceptance
    controller.record(r, 1, 2)  # a probe held
    assert r.spec_acceptance > low
    for _ in range(10):
        controller.record(r, 7, 8)  # whole chains held
    assert r.spec_acceptance > 0.95 and controller._k_for(r) == 7
    assert controller.stats.proposed == 8 * 7 + 1 + 70 and controller.stats.accepted == 1 + 70


@pytest.mark.parametrize("method, k", [("ngram", 1), ("ngram", 3), ("ngram", 6), ("draft", 2), ("draft", 4)])
def test_greedy_identical(tiny_llama, tiny_draft, method, k):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, max_batch_size=64,
                             model=str(tiny_draft) if method == "draft" else None)
    prompts = _repetitive_prompts(10)
    params = [SamplingParams(max_tokens=random.Random(i).randint(4, 30), temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    plain = [o.token_ids for o in _llm(tiny_llama).generate(prompts, params)]
    fast = _llm(tiny_llama, spec)
    assert [o.token_ids for o in fast.generate(prompts, params)] == plain
    stats = fast.engine.core.spec.stats
    assert stats.proposed > 0 and stats.accepted > 0
    assert_no_leak(fast)


def test_min_tokens_identical_and_speculated_after(tiny_llama):
    """A request speculates only once its min_tokens are out; its stop id is held back until then."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch_size=64)
    prompts = _repetitive_prompts(6, seed=5)
    free = [o.token_ids for o in _llm(tiny_llama).generate(prompts, SamplingParams(max_tokens=30, temperature=0,
                                                                                   ignore_eos=True))]
    # each stop id: a token the free output writes past where speculation starts, before its min_tokens
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[out[m - 2]], min_tokens=m)
              for out, m in zip(free, (8, 12, 16, 20, 24, 28))]
    plain = [o.token_ids for o in _llm(tiny_llama).generate(prompts, params)]
    assert all(len(p) > m.min_tokens for p, m in zip(plain, params))
    fast = _llm(tiny_llama, spec)
    assert [o.token_ids for o in fast.generate(prompts, params)] == plain
    assert fast.engine.core.spec.stats.accepted > 0
    assert_no_leak(fast)


def test_greedy_identical_under_preemption(tiny_qwen2):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch_size=64)
    prompts = _repetitive_prompts(8, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in _llm(tiny_qwen2).generate(prompts, params)]
    small = _llm(tiny_qwen2, spec, num_kv_blocks=30, max_num_batched_tokens=48)
    assert [o.token_ids for o in small.generate(prompts, params)] == plain
    assert small.engine.core.scheduler.num_preemptions > 0
    assert_no_leak(small)


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; rare tokens pooled so expected counts are >= 5."""
    total_a, total_b = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
    rows, other = [], [0, 0]
    for t in keys:
        if a[t] + b[t] >= 10:
            rows.append([a[t], b[t]])
        else:
            other[0] += a[t]
            other[1] += b[t]
    if sum(other):
        rows.append(other)
    stat = 0.0
    for ca, cb in rows:
        col = ca + cb
        for count, total in ((ca, total_a), (cb, total_b)):
            expected = col * total / (total_a + total_b)
            stat += (count - expected) ** 2 / expected
    dof = max(1, len(rows) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("filters", [{}, {"min_p": 0.2}, {"top_k": 4, "top_p": 0.9}],
                         ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "none")
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_ngram_verification_emits_the_filtered_distribution(filters, path, monkeypatch):
    """One proposal checked against one position: the emitted token is distributed as the target's
    filtered, renormalised distribution, whether the guess is likely, unlikely or filtered out."""
    if path == "torch":
        monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, 0.5]).expand(2, 6).contiguous()
    params = SamplingParams(temperature=1.0, **filters)
    probs = row_probs(logits, [params] * 2)
    want = filtered_probs(logits[:1], [params])[0]
    want = want / want.sum()
    assert torch.allclose(probs[0], want, atol=1e-6)
    gen, n = torch.Generator().manual_seed(0), 8000
    for guess in (0, 1, 4):
        counts = Counter(verify_sampled(probs, [guess], params, 0, gen)[0] for _ in range(n))
        freq = torch.tensor([counts[t] / n for t in range(6)])
        assert (freq - want).abs().max() < 0.02, (guess, freq, want)  # ~3.5 sigma; min-p's unnormalised p was 0.04 off


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_distribution_unchanged(peaky, method):
    target, draft = peaky
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, max_batch_size=4096,
                             model=str(draft) if method == "draft" else None)
    # The prompt starts with [its last token + the model's own greedy continuation of it], so after a
    # likely first sample the n-gram lookup finds a guess that is often, but not always, accepted.
    plain_llm = _llm(target, max_num_seqs=512, num_kv_blocks=4096)
    def greedy(p, n=4):
        return plain_llm.generate(
            [p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids
    body = [7, 8, 9, 10, 11, 12] + greedy([7, 8, 9, 10, 11, 12], 20)
    likely = greedy(body)
    for _ in range(8):  # iterate to a fixed point: the prefix itself changes the continuation
        prompt = [body[-1]] + likely + body
        likely, previous = greedy(prompt), likely
        if likely == previous:
            break
    n = 1200
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    plain = plain_llm.generate([prompt] * n, params, use_tqdm=False)
    fast_llm = _llm(target, spec, max_num_seqs=512, num_kv_blocks=4096)
    fast = fast_llm.generate([prompt] * n, params, use_tqdm=False)
    stats = fast_llm.engine.core.spec.stats
    assert stats.proposed > n // 2 and 0.05 < stats.acceptance_rate < 0.95  # both accept and reject paths ran
    for pos in (0, 1, 2, 3):  # tokens decided by verification, not by the first plain sample
        p = _chi_square_p(Counter(o.token_ids[pos] for o in plain), Counter(o.token_ids[pos] for o in fast))
        assert p > 0.01, f"position {pos}: chi-square p = {p:.4f}"


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"]],
                         ids=["greedy", "sampled"])
def test_bench_spec_runs_greedy_and_sampled(tmp_path_factory, capsys, sampling):
    """`kvserve bench spec`: greedy outputs must match; sampled ones are reported as not comparable."""
    import json

    from kvserve.cli import build_parser

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-chat-spec"), "LlamaForCausalLM")
    config_file = path / "tokenizer_config.json"
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    out = tmp_path_factory.mktemp("spec-report")
    args = build_parser().parse_args(["bench", "spec", "--model", str(path), "--dtype", "float32", "--block-size", "8",
                                      "--num-kv-blocks", "512", "--concurrency", "1", "2", "--max-tokens", "8", "--json",
                                      "--report", str(out), *sampling])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    page, saved = check_report(out, ("throughput.png", "acceptance.png"))
    assert saved == report and page.count("<tr><td>") == 2
    assert ("n/a (sampled)" in page) is bool(sampling)
    row = report["results"][0]
    assert row["identical"] is (None if sampling else True)
    assert report["sampling"]["temperature"] == (0.8 if sampling else 0.0)
    assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
