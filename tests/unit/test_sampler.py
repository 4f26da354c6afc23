"""The sampler draws each row from exactly the distribution its parameters define (temperature,
top-k, top-p, min-p), never a token of probability 0, and a seeded row the same token wherever it
sits in the batch."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_kernels import load_kernels
from kvserve.sample import sampler as sampler_module
from kvserve.sample.sampler import Sampler, SamplingBatch, filtered_probs, kernel_samples, sample_from_probs
from kvserve.types import SamplingParams

VOCAB = 40


def _logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
], ids=["temperature", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_frequencies_match_the_filtered_distribution(params, path, monkeypatch):
    if path == "torch":  # the path CUDA and machines without the C++ kernels take
        monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    elif load_kernels() is None:
        pytest.skip("no C++ kernels here")
    rows = 40_000
    logits = _logits().expand(rows, VOCAB).contiguous()
    want = filtered_probs(logits[:1], [params])[0]
    want = want / want.sum()  # min-p masks without renormalising
    sampler = Sampler(seed=3)
    tokens = sampler(logits, SamplingBatch([params] * rows, [0] * rows)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    assert counts[want == 0].sum() == 0  # filtered-out tokens never come up
    sigma = (want.double() * (1 - want.double()) / rows).sqrt()
    assert torch.all((counts / rows - want.double()).abs() <= 5 * sigma + 1e-9)
    assert (want > 0).sum() > 1  # a real distribution, not a point mass


def test_edges_of_the_unit_interval_land_on_tokens_with_probability():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    almost_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert sample_from_probs(probs, torch.zeros(3)).tolist() == [1, 0, 3]
    assert sample_from_probs(probs, almost_one.expand(3)).tolist() == [2, 1, 3]
    assert sample_from_probs(probs, torch.ones(3)).tolist() == [2, 1, 3]  # even u = 1 stays inside


def test_a_seeded_row_draws_the_same_token_at_any_place_in_the_batch():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    alone = Sampler(seed=0)(logits[:1], SamplingBatch([seeded], [7])).token_ids[0]
    for row in range(1, 6):
        mixed = logits.clone()
        mixed[row] = logits[0]
        params = [other] * 6
        params[row] = seeded
        got = Sampler(seed=row)(mixed, SamplingBatch(params, [7] * 6)).token_ids[row]
        assert got == alone
    later = [Sampler(seed=0)(logits[:1], SamplingBatch([seeded], [n])).token_ids[0] for n in range(8, 40)]
    assert len(set(later)) > 1  # the position moves the stream on


def _reference_cut(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, one row at a time with a full sort: keep the top-k, then the smallest set of
    best tokens whose renormalised mass reaches top_p (the best always stays)."""
    order = row.sort(descending=True).indices
    keep = order[:top_k] if 0 < top_k < len(row) else order
    if top_p < 1:
        probs = row[keep].softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        keep = keep[(before < top_p) | (torch.arange(len(keep)) == 0)]
    out = torch.full_like(row, float("-inf"))
    out[keep] = row[keep]
    return out


def test_top_k_top_p_sorts_only_candidates_and_cuts_like_a_full_sort(monkeypatch):
    widths = []
    real = sampler_module._cut_to_candidates
    monkeypatch.setattr(sampler_module, "_cut_to_candidates", lambda *a: widths.append(a[3]) or real(*a))
    vocab = 10_000
    gen = torch.Generator().manual_seed(0)

    def check(scales, params):
        widths.clear()
        logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
        got = sampler_module._top_k_top_p(logits, params)
        for row, p in enumerate(params):
            assert torch.equal(got[row], _reference_cut(logits[row], p.top_k, p.top_p)), row
        return got, logits

    # peaked rows settle among the 256 best; a top-k wider than that widens the first pass
    got, logits = check([4.0, 4.0, 4.0, 0.5, 4.0], [
        SamplingParams(top_p=0.9), SamplingParams(top_k=20, top_p=0.5), SamplingParams(),
        SamplingParams(top_k=5000), SamplingParams(top_k=vocab + 3, top_p=0.3)])
    assert widths == [5000]
    assert torch.equal(got[2], logits[2])  # a row without a cut keeps every token
    # a flatter row's nucleus is cut among the tokens that can belong to it, not the whole vocabulary
    check([4.0, 1.5], [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)])
    assert widths[0] == 256 and 256 < widths[1] < vocab and len(widths) == 2
    # a near-uniform one needs them all
    check([0.01, 1.0], [SamplingParams(top_p=0.8), SamplingParams(top_k=1)])
    assert widths == [256, vocab]


def _kept_midpoints(logits: torch.Tensor, params: SamplingParams, limit: int | None = None):
    """The tokens that filtered_probs keeps for one row with probability > 1e-4 (narrower intervals
    are below float32 u's resolution), and for each (or ``limit`` of them, the first and last
    included) the uniform number at the middle of its interval of the kept tokens' CDF (float64, in
    index order): any correct inverse-CDF sampler of that distribution picks the token there, and one
    that kept a token more or less would shift the intervals after it."""
    kept = filtered_probs(logits.float()[None], [params])[0] > 0
    temperature = params.temperature if params.temperature > 0 else 1.0
    probs = (logits.double() / temperature).masked_fill(~kept, float("-inf")).softmax(-1)
    cdf = probs.cumsum(-1)
    tokens = torch.nonzero(probs > 1e-4).flatten()
    if limit is not None and len(tokens) > limit:
        pick = torch.randperm(len(tokens) - 2, generator=torch.Generator().manual_seed(1))[:limit - 2] + 1
        tokens = tokens[torch.cat([torch.tensor([0, len(tokens) - 1]), pick]).sort().values]
    return tokens, (cdf[tokens] - probs[tokens] / 2).float()


def _kernel_tokens(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> list[int]:
    """The kernel's token for one row at each uniform number (rows made in chunks, to bound memory)."""
    out = []
    for chunk in u.split(256):
        rows = logits.expand(len(chunk), logits.shape[-1]).contiguous()
        out += kernel_samples(rows, [params] * len(chunk), chunk).tolist()
    return out


def _distinct_bf16(vocab: int, seed: int) -> torch.Tensor:
    """``vocab`` logits with no two equal in bfloat16, so that every cut is unambiguous."""
    draws = torch.randn(vocab * 8, generator=torch.Generator().manual_seed(seed)) * 3
    values = torch.unique(draws.bfloat16().float())
    order = torch.randperm(len(values), generator=torch.Generator().manual_seed(seed))[:vocab]
    assert len(order) == vocab
    return values[order].bfloat16()


_FILTERS = [{}, {"top_k": 1}, {"top_k": 5}, {"top_k": 300}, {"top_p": 0.9}, {"top_p": 0.5}, {"min_p": 0.05},
            {"top_k": 50, "top_p": 0.8}, {"top_k": 40, "top_p": 0.95, "min_p": 0.02}, {"top_p": 0.7, "min_p": 0.01}]


@pytest.mark.parametrize("filters", _FILTERS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "none")
@pytest.mark.parametrize("case", ["f32-37", "bf16-1000", "f32-49152-peaked", "f32-49152-flat"])
def test_kernel_lands_every_uniform_in_its_tokens_interval_of_the_filtered_distribution(filters, case):
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    vocab = int(case.split("-")[1])
    if case.startswith("bf16"):
        logits = _distinct_bf16(vocab, vocab)
    else:  # peaked: a few dozen tokens hold most of the mass; flat: thousands share it
        scale = 0.3 if case.endswith("flat") else 3.0
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    for temperature in (0.6, 1.0, 1.7):
        params = SamplingParams(temperature=temperature, **filters)
        tokens, u = _kept_midpoints(logits, params, limit=400)
        assert _kernel_tokens(logits, params, u) == tokens.tolist()


def test_kernel_cuts_among_near_equal_weights_like_a_full_sort():
    """Weights that agree in their top float bits (every logit within 1e-3) send the radix select
    through all its rounds; the kept sets must still be the definition's."""
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    for vocab, filters in ((49152, {"top_k": 100}), (49152, {"top_k": 3000}), (49152, {"top_k": 2000, "top_p": 0.5}),
                           (16384, {"top_p": 0.3})):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1e-3
        params = SamplingParams(temperature=1.0, **filters)
        want = _reference_cut(logits, params.top_k, params.top_p) > float("-inf")
        tokens, u = _kept_midpoints(logits, params)  # every kept token here has probability > 1e-4
        assert torch.equal(torch.zeros_like(want).index_fill_(0, tokens, True), want)
        assert _kernel_tokens(logits, params, u) == tokens.tolist()


def test_kernel_breaks_ties_by_index_and_keeps_only_tokens_with_weight():
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    # equal logits: top-k and top-p keep the lowest indices, through every radix round at 49K
    for vocab in (100, 49152):
        flat = torch.zeros(vocab)
        for params, kept in ((SamplingParams(temperature=1.0, top_k=7), 7),
                             (SamplingParams(temperature=1.0, top_p=0.25), vocab // 4)):
            u = (torch.arange(kept, dtype=torch.float64) + 0.5) / kept
            assert _kernel_tokens(flat, params, u.float()) == list(range(kept)), (vocab, params)
    # a top-k wider than the tokens of weight > 0 keeps just those
    logits = torch.full((64,), float("-inf"))
    logits[[5, 9, 60]] = torch.tensor([1.0, 3.0, 2.0])
    params = SamplingParams(temperature=1.0, top_k=10, min_p=0.0)
    got = _kernel_tokens(logits, params, torch.linspace(0, 1, 101))
    assert set(got) == {5, 9, 60}
    assert _kernel_tokens(logits, SamplingParams(temperature=1.0, top_k=1), torch.tensor([0.0, 0.5, 1.0])) == [9] * 3


def test_kernel_takes_greedy_rows_argmax_whatever_their_filters():
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    logits[3, [10, 20]] = 50.0  # a tie: the first index wins, as torch's max().indices
    params = [SamplingParams(temperature=0, top_k=3), SamplingParams(temperature=0.9, top_p=0.5),
              SamplingParams(temperature=0, min_p=0.5), SamplingParams(temperature=0)]
    got = kernel_samples(logits, params, torch.rand(4)).tolist()
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax()) and got[3] == 10
    assert Sampler()(logits, SamplingBatch(params, [0] * 4)).token_ids[::2] == [got[0], got[2]]


def test_kernel_is_skipped_without_the_cpp_kernels(monkeypatch):
    monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    logits = torch.randn(2, 64)
    assert kernel_samples(logits, [SamplingParams(temperature=0.8)] * 2, torch.rand(2)) is None
    # the torch path gives the same greedy tokens
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=1)]
    assert Sampler()(logits, SamplingBatch(params, [0, 0])).token_ids == logits.argmax(-1).tolist()


def _midpoints(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of probability > 1e-4 and the uniform number at the middle of each one's CDF interval
    (float64), where any correct inverse-CDF sampler must pick that token."""
    probs = (logits.double() / temperature).softmax(-1)
    cdf = probs.cumsum(-1)
    tokens = torch.nonzero(probs > 1e-4).flatten()
    return tokens, (cdf[tokens] - probs[tokens] / 2).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 37, 49152])
def test_temperature_kernel_lands_every_uniform_in_its_tokens_interval(dtype, vocab):
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(dtype)
    for temperature in (0.5, 1.0, 1.7):
        tokens, u = _midpoints(logits.float(), temperature)
        rows = logits.expand(len(tokens), vocab).contiguous()
        params = [SamplingParams(temperature=temperature)] * len(tokens)
        assert kernel_samples(rows, params, u).tolist() == tokens.tolist()


def test_temperature_kernel_edges_and_masked_tokens():
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    logits = torch.full((3, 40), float("-inf"))
    logits[0, [3, 17, 33]] = torch.tensor([0.0, 1.0, 2.0])
    logits[1, 39] = 5.0
    logits[2] = torch.arange(40.0)
    logits[2, :10] = -1000.0  # 2^-126 and more below the best: weight 0, as -inf
    params = [SamplingParams(temperature=1.0)] * 3
    assert kernel_samples(logits, params, torch.zeros(3)).tolist() == [3, 39, 10]
    for u in (torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)), torch.tensor(1.0)):
        assert kernel_samples(logits, params, u.expand(3)).tolist() == [33, 39, 39]


@pytest.mark.parametrize("filters", _FILTERS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()) or "none")
@pytest.mark.parametrize("case", ["f32-37", "bf16-1000", "f32-49152-peaked", "f32-49152-flat"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_row_probs_is_the_filtered_distribution(filters, case, path, monkeypatch):
    """Speculative verification's distributions: the kernel keeps exactly filtered_probs' tokens, with
    their probabilities; greedy rows put everything on the argmax."""
    if path == "kernel" and load_kernels() is None:
        pytest.skip("no C++ kernels here")
    if path == "torch":
        monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    vocab = int(case.split("-")[1])
    if case.startswith("bf16"):
        logits = _distinct_bf16(vocab, vocab)
    else:
        scale = 0.3 if case.endswith("flat") else 3.0
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    params = [SamplingParams(temperature=t, **filters) for t in (0.6, 1.0, 1.7)] + [SamplingParams(temperature=0.0)]
    got = sampler_module.row_probs(logits.expand(len(params), vocab).contiguous(), params)
    want = filtered_probs(logits.float().expand(3, vocab), params[:3])
    want = want / want.sum(-1, keepdim=True)  # min-p masks after the softmax
    assert got.dtype == torch.float32 and got.shape == (len(params), vocab)
    assert torch.equal(got[:3] > 0, want > 1e-30)
    assert torch.allclose(got[:3], want, rtol=1e-4, atol=1e-9)
    assert torch.allclose(got.sum(-1).double(), torch.ones(len(params), dtype=torch.float64), atol=1e-5)
    assert torch.equal(got[3], torch.nn.functional.one_hot(logits.float().argmax(), vocab).float())
