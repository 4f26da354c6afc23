"""Batched sampling where every row carries its own parameters.

Rows are sampled by inverse CDF, all at once: one uniform number per row, found in the row's
cumulative probabilities (on the CPU by one C++ call for the whole batch, filters included, see
kernel_samples; elsewhere by torch's cumsum and binary search). (An exponential race, argmax of p / Exp(1) noise,
needs a random number per vocabulary entry, which on a CPU costs a large share of a decode step.) A seeded request draws its number from a
generator keyed by (seed, tokens generated so far), so its samples do not depend on what else
is in the batch, on preemption, or on earlier steps having run at all.

Penalties and logit_bias (penalties.py) adjust the logits first, min_tokens rules out EOS and stop
ids while too few tokens are out, then structured outputs' token masks (grammar.py) rule out what a
row's grammar forbids; logprobs are read from the raw
log-softmax, before penalties, masks and temperature, and only for the rows that ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.model.cpu_kernels import load_kernels
from kvserve.sample.grammar import apply_bitmask
from kvserve.sample.penalties import apply_penalties, hold_back
from kvserve.types import SamplingParams, TokenLogprob

_SEED_STRIDE = 1_000_003


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, built once per step."""

    params: list[SamplingParams]
    num_generated: list[int]
    # Each row's token history, read only by rows that need penalties (references, not copies).
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Structured outputs: the allowed-token bitmask [len(masked_rows), words] of the constrained rows.
    bitmask: torch.Tensor | None = None
    masked_rows: list[int] = field(default_factory=list)
    # Per row, the token ids it may not sample yet (min_tokens: EOS and stop ids); empty lists, or none at all.
    held_back: list[list[int]] = field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


@dataclass
class SamplerOutput:
    """Next token per row; ``logprobs`` per row (None for rows that did not ask), or None if none asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  # for rows without their own seed, on the CPU
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] -> the next token id of every row (and logprobs where asked)."""
        tokens, logprobs = self.sample_on_device(logits, batch)
        return SamplerOutput(tokens.tolist(), logprobs)

    def sample_on_device(self, logits: torch.Tensor,
                         batch: SamplingBatch) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        """The next token ids [B] (int64) left on the logits' device, so that a next step can take its
        input ids from them before the host reads them; logprobs (read now) where asked."""
        # The sampling and logprob kernels need no float copy of [B, V] (bf16 -> float32 is exact and
        # monotonic); penalties work on one, and the torch paths make their own.
        raw = logits.float() if any(p.needs_penalties for p in batch.params) else logits
        adjusted = apply_penalties(raw, batch.params, batch.prompt_token_ids, batch.output_token_ids)
        adjusted = hold_back(adjusted, batch.held_back, copy=adjusted is raw)
        if batch.bitmask is not None:
            adjusted = apply_bitmask(adjusted, batch.bitmask, batch.masked_rows)
        tokens = self._sample(adjusted, batch)
        if all(p.logprobs is None for p in batch.params):
            return tokens, None
        return tokens, token_logprobs(raw, tokens, [p.logprobs for p in batch.params])

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Next token ids [B] (int64, on the logits' device)."""
        if batch.all_greedy:
            return argmax_rows(logits)
        uniforms = self._uniforms(batch, logits.device)
        sampled = kernel_samples(logits, batch.params, uniforms)
        if sampled is not None:
            return sampled
        greedy = argmax_rows(logits)
        sampled = sample_from_probs(filtered_probs(logits.float(), batch.params), uniforms)
        is_greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row on ``device``: unseeded rows from the sampler's generator there;
        seeded rows from the CPU (the same on every device), copied over in one go."""
        u = torch.rand(len(batch.params), generator=self._generator_for(device), device=device)
        seeded = [(row, p.seed, n) for row, (p, n) in enumerate(zip(batch.params, batch.num_generated))
                  if p.seed is not None and not p.greedy]
        if seeded:
            values = [torch.rand((), generator=seeded_generator(seed, n)).item() for _, seed, n in seeded]
            u[torch.tensor([row for row, _, _ in seeded], device=device)] = torch.tensor(values, device=device)
        return u

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._device_generators[device]


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """A request's own random stream at one output position (any int seed is valid)."""
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + position) % (1 << 63))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds ``uniforms[i]`` times the row's
    total (rows need not be normalised). A token of probability 0 adds nothing to the cumulative sum,
    so no u lands on it; u x total is kept below the total, so even u = 1 picks a token."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def kernel_samples(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor | None:
    """Every row's token in one C++ call on the CPU: greedy rows' argmax, the others
    ``sample_from_probs(filtered_probs(logits, params), uniforms)`` with their filters, without a
    float copy of the logits, a softmax or a sort (radix selection among the tokens a filter can
    keep); None where the kernels cannot run (another device, no C++ kernels)."""
    inputs = _kernel_inputs(logits, params)
    if inputs is None:
        return None
    kernels, temperatures, filters = inputs
    return kernels.sample_rows(logits, temperatures, uniforms.float(), filters)


def row_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's normalised distribution as the sampler draws from it, float32 [B, V] (greedy rows:
    all on the argmax): speculative verification reads it. On the CPU one C++ call over the logits as
    they are (torch's filtered_probs is an order of magnitude slower there), else filtered_probs."""
    inputs = _kernel_inputs(logits, params)
    if inputs is not None:
        kernels, temperatures, filters = inputs
        return kernels.filtered_probs(logits, temperatures, filters)
    probs = filtered_probs(logits.float(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p's mask leaves the rest unnormalised
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, argmax_rows(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _kernel_inputs(logits: torch.Tensor, params: list[SamplingParams]):
    """(kernels, temperatures, filters) for the C++ sampling kernels; None where they cannot run."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1:
        return None
    kernels = load_kernels()
    if kernels is None or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    vocab = logits.shape[-1]
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    filters = None
    if any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0) for p in params):
        filters = torch.tensor([(min(max(p.top_k, 0), vocab), p.top_p, p.min_p) for p in params], dtype=torch.float32)
    return kernels, temperatures, filters


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from one row of (unnormalised) probabilities on the CPU, by ``generator``."""
    return int(sample_from_probs(probs[None], torch.rand(1, generator=generator))[0])


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit, the first on ties: the C++ kernel on the CPU (one pass at
    memory speed, where torch's max(dim=-1) is far slower on bf16), else max().indices (not
    argmax(), which is slower still on the CPU)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        kernels = load_kernels()
        if kernels is not None and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, then softmax."""
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    logits = logits / temps[:, None]
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int | None]) -> list[TokenLogprob | None]:
    """Log-softmax of the rows whose ``num_top`` is not None: the chosen token's logprob and the top-k pairs.
    On the CPU one C++ call reads them off the logits as they are (``row_logprobs``); elsewhere, or
    without the kernels, torch's log_softmax of a float copy."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    width = min(max(num_top[i] for i in rows), logits.shape[-1])  # a vocabulary smaller than the ask: all of it
    index = torch.tensor(rows, device=logits.device)
    chosen_ids = token_ids.to(logits.device).index_select(0, index)
    kernels = load_kernels() if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 else None
    if kernels is not None and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        chosen_t, top_values, top_ids = kernels.row_logprobs(logits, index, chosen_ids, width)
    else:
        logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
        chosen_t = logprobs.gather(1, chosen_ids[:, None]).squeeze(1)
        top_values, top_ids = logprobs.topk(width, dim=-1)
    chosen, chosen_ids = chosen_t.tolist(), chosen_ids.tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = [None] * len(num_top)
    for j, i in enumerate(rows):
        kept = num_top[i]
        out[i] = TokenLogprob(chosen_ids[j], chosen[j], list(zip(top_ids[j][:kept], top_values[j][:kept])))
    return out


def scored_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """Logprob of ``targets[i]`` under row i of ``logits``, with each row's ``num_top`` best (prompt scoring)."""
    ids = torch.tensor(targets, device=logits.device)
    return token_logprobs(logits, ids, [num_top] * len(targets))  # type: ignore[return-value]


# Each row's best tokens are sorted first (topk), not the whole vocabulary: a full sort of a 49K
# vocabulary per row costs about as much as the decode step itself.
_FIRST_WIDTH = 256


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); the best token always survives.
    Top-p is taken over the top-k tokens' renormalised probabilities where a row has both.

    The 256 best tokens hold every top-k up to 256 and the nucleus of a peaked distribution. A row
    whose nucleus is wider (a flat distribution) is cut among the tokens of probability at least
    (1 - top_p) / vocabulary, which always hold its nucleus: all the rarer ones together have less
    than the 1 - top_p of mass that the nucleus leaves out. Rounding aside, which the last pass (the
    whole vocabulary) catches."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    out = logits.clone()
    rows = torch.nonzero((top_k > 0) | (top_p < 1)).flatten()
    for width in (_FIRST_WIDTH, None, vocab):
        if rows.numel() == 0:
            break
        if width is None:  # the rows left have no top-k (any top-k fitted the first width)
            probs = logits[rows].softmax(dim=-1)
            width = int((probs >= ((1 - top_p[rows]) / vocab)[:, None]).sum(dim=-1).max())
        width = min(vocab, max(width, int(top_k[rows].max())))
        cut, resolved = _cut_to_candidates(logits[rows], top_k[rows], top_p[rows], width)
        out[rows[resolved]] = cut[resolved]
        rows = rows[~resolved]
    return out


def _cut_to_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k and top-p among each row's ``width`` best tokens; also which rows that settles (all of
    their top-k, a nucleus that ends inside the candidates, or every token being a candidate)."""
    values, order = logits.topk(width, dim=-1)  # best first
    has_k = top_k > 0
    outside_k = torch.arange(width, device=logits.device)[None, :] >= torch.where(has_k, top_k, width)[:, None]
    kept = values.masked_fill(outside_k, float("-inf"))
    # each candidate's probability: among the top-k where a row has one, else in the whole vocabulary
    norm = torch.where(has_k, kept.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (kept - norm[:, None]).exp()
    cumulative = probs.cumsum(dim=-1)
    # drop tokens once the mass before them reaches top_p (top_p = 1 drops none, whatever the rounding)
    drop = outside_k | (((cumulative - probs) >= top_p[:, None]) & (top_p < 1)[:, None])
    drop[:, 0] = False
    resolved = has_k | (cumulative[:, -1] >= top_p) | (width == logits.shape[-1])
    cut = torch.full_like(logits, float("-inf")).scatter_(-1, order, values.masked_fill(drop, float("-inf")))
    return cut, resolved
