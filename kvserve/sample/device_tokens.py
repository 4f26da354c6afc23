"""One step's sampled token ids, left on the device: the next step's input ids are gathered from them
there, and the host reads them a step late without waiting for the steps queued after."""

from __future__ import annotations

import torch


class SampledTokens:
    def __init__(self, token_ids: torch.Tensor, request_ids: list[str]) -> None:
        self.token_ids = token_ids  # [B] int64 on the device, row i for request_ids[i]
        self.request_ids = request_ids
        self.rows = {rid: i for i, rid in enumerate(request_ids)}
        self._ready: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            # Copied out now, behind this step's sampling alone: a later blocking copy would wait for
            # every kernel queued after it, the next step's forward included.
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = token_ids

    def read(self) -> dict[str, int]:
        """The ids by request, once this step's sampling is done."""
        if self._ready is not None:
            self._ready.synchronize()
        return dict(zip(self.request_ids, self._host.tolist()))


def fill_placeholders(input_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each negative entry -1 - r replaced by ``previous[r]``: a device-side
    gather, so the host never needs the previous step's ids to build this step's inputs."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, previous.index_select(0, rows), input_ids)
