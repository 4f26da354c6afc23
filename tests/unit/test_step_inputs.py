"""A step's host tensors travel to the GPU in one copy; the views they come back as must equal them
and start 16-byte aligned (Triton specializes kernels on pointer alignment)."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import CUDA_TOKEN_BUDGET, SchedulerConfig
from kvserve.entrypoints.llm import engine_config
from kvserve.worker.model_runner import _pack, _unpack


def test_packed_step_inputs_come_back_equal_and_aligned():
    tensors = [torch.arange(3), torch.arange(5) * 7, torch.arange(12).view(3, 4), torch.tensor([], dtype=torch.long),
               torch.tensor([9]), torch.arange(6).view(2, 3)[:, :2]]  # odd sizes, empty, 2-D, a strided view
    flat = _pack(tensors)
    parts = _unpack(flat, tensors)
    for got, want in zip(parts, tensors):
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.data_ptr() % 16 == 0


def test_token_budget_default_depends_on_the_device():
    assert engine_config(device="cpu").scheduler.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    assert engine_config(device="cuda").scheduler.max_num_batched_tokens == CUDA_TOKEN_BUDGET
    assert engine_config(device="cuda:1", max_num_batched_tokens=512).scheduler.max_num_batched_tokens == 512
    assert engine_config(device="cpu", max_num_batched_tokens=None).scheduler.max_num_batched_tokens == 1024


def _runner(block_size: int, extra_groups: int = 0):
    from kvserve.worker.block_tables import BlockTableRows
    from kvserve.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the input builders are exercised
    runner.device, runner.block_size, runner.block_table_rows = torch.device("cpu"), block_size, BlockTableRows()
    runner.group_table_rows = [BlockTableRows() for _ in range(extra_groups)]  # a hybrid model's KV groups 1..
    return runner


def _assert_same_meta(fast, general) -> None:
    for name, value in vars(general).items():
        got = getattr(fast, name)
        if name == "query_start_t":
            continue
        if name == "group_metas":
            assert len(got) == len(value)
            for a, b in zip(got, value):
                _assert_same_meta(a, b)
            continue
        assert (torch.equal(got, value) and got.is_contiguous()) if isinstance(value, torch.Tensor) \
            else got == value, name


@pytest.mark.parametrize("extra_groups", [0, 2])
def test_decode_fast_path_builds_what_the_general_path_builds(extra_groups):
    """Both input builders give the same tensors, a hybrid model's per-group slots and tables too."""
    import random

    from kvserve.scheduler.output import ScheduledRequest
    from kvserve.types import SamplingParams

    rng = random.Random(0)
    for n in (1, 3, 40):
        for block_size in (16, 5):
            batch = []
            for i in range(n):
                pos = rng.randrange(0, 300)
                blocks = -(-(pos + 1) // block_size) + rng.choice([0, 0, 1])  # sometimes a block to spare
                groups = tuple(rng.sample(range(5000), blocks) for _ in range(extra_groups))
                batch.append(ScheduledRequest(str(i), [rng.randrange(1000)], pos, rng.sample(range(5000), blocks),
                                              True, SamplingParams(), group_block_tables=groups))
            runner = _runner(block_size, extra_groups)
            fast, general = runner._prepare_decode(batch), runner._prepare_mixed(batch)
            for a, b in zip(fast[:2], general[:2]):
                assert torch.equal(a, b)
            _assert_same_meta(fast[2], general[2])
            assert len(general[2].group_metas) == extra_groups
            for j, meta in enumerate(general[2].group_metas):  # each group's slots come from its own table
                bs = block_size
                want = [s.group_block_tables[j][s.start_pos // bs] * bs + s.start_pos % bs for s in batch]
                assert meta.slot_mapping.tolist() == want
