"""Token bitmasks (sample/grammar.py) and the StructuredOutputs spec, without a model."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample.grammar import apply_bitmask, unpack_bitmask
from kvserve.sample.sampler import Sampler, SamplingBatch
from kvserve.types import SamplingParams, StructuredOutputs


def _random_bitmask(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random allowed set [rows, vocab] and its llguidance bitmask (bit j of word w: token 32w + j)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    bitmask = (padded.view(rows, words, 32).long() * weights).sum(-1)
    return allowed, ((bitmask + 2**31) % 2**32 - 2**31).to(torch.int32)  # as llguidance's int32 words


def test_unpack_matches_the_bit_layout():
    allowed, bitmask = _random_bitmask(3, 1000)
    assert torch.equal(unpack_bitmask(bitmask, 1000), allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_masked_rows_change(dtype):
    logits = torch.randn(5, 100).to(dtype)
    allowed, bitmask = _random_bitmask(2, 100)
    out = apply_bitmask(logits, bitmask, [1, 3])
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])
    for j, row in enumerate((1, 3)):
        assert torch.equal(out[row][allowed[j]], logits[row][allowed[j]])
        assert bool((out[row][~allowed[j]] == float("-inf")).all())
    assert not bool((logits == float("-inf")).any()), "the caller's logits are kept (logprobs read them)"


def test_a_row_that_allows_nothing_is_left_alone():
    logits = torch.randn(2, 64)
    out = apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [0, 1])
    assert torch.equal(out, logits)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5)])
def test_sampler_picks_only_allowed_tokens(params):
    logits = torch.randn(16, 300)
    allowed, bitmask = _random_bitmask(8, 300, seed=1)
    rows = list(range(0, 16, 2))
    out = Sampler(seed=0)(logits, SamplingBatch([params] * 16, [0] * 16, bitmask=bitmask, masked_rows=rows))
    for j, row in enumerate(rows):
        assert allowed[j, out.token_ids[row]], f"row {row} sampled a disallowed token"
    free = Sampler(seed=0)(logits, SamplingBatch([params] * 16, [0] * 16))
    if params.greedy:  # unconstrained rows are untouched
        assert [out.token_ids[i] for i in range(1, 16, 2)] == [free.token_ids[i] for i in range(1, 16, 2)]


def test_structured_outputs_shape():
    assert StructuredOutputs(json={"type": "object"}).kind == "json"
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a|b")
