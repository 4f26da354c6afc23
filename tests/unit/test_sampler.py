"""The sampler draws each row from exactly the distribution its parameters define (temperature,
top-k, top-p, min-p), never a token of probability 0, and a seeded row the same token wherever it
sits in the batch."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_kernels import load_kernels
from kvserve.sample.sampler import Sampler, SamplingBatch, filtered_probs, sample_from_probs, temperature_samples
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
def test_frequencies_match_the_filtered_distribution(params):
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
    from kvserve.sample import sampler as sampler_module

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
        assert temperature_samples(rows, params, u).tolist() == tokens.tolist()


def test_temperature_kernel_edges_and_masked_tokens():
    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    logits = torch.full((3, 40), float("-inf"))
    logits[0, [3, 17, 33]] = torch.tensor([0.0, 1.0, 2.0])
    logits[1, 39] = 5.0
    logits[2] = torch.arange(40.0)
    logits[2, :10] = -1000.0  # 2^-126 and more below the best: weight 0, as -inf
    params = [SamplingParams(temperature=1.0)] * 3
    assert temperature_samples(logits, params, torch.zeros(3)).tolist() == [3, 39, 10]
    for u in (torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)), torch.tensor(1.0)):
        assert temperature_samples(logits, params, u.expand(3)).tolist() == [33, 39, 39]


@pytest.mark.parametrize("filters", [{"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_temperature_kernel_is_used_only_where_no_sampled_row_filters(filters):
    logits = torch.randn(2, 64)
    plain = SamplingParams(temperature=0.8)
    assert temperature_samples(logits, [plain, SamplingParams(temperature=0.8, **filters)], torch.rand(2)) is None
    if load_kernels() is not None:  # a greedy row's filters do not matter: the caller takes its argmax
        out = temperature_samples(logits, [plain, SamplingParams(temperature=0, **filters)], torch.rand(2))
        assert out is not None and out.shape == (2,)
