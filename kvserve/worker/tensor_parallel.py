"""Tensor parallelism: one model split over N processes (model/sharding.py), stepped in lockstep.

Rank 0 is the engine's own process: it keeps the scheduler, the block tables and sampling, and runs
``TensorParallelRunner``, an ordinary ``ModelRunner`` whose forward passes first send the step's
inputs (token ids, positions, attention metadata) to every other rank in one message. Ranks 1..N-1
are worker processes (``_worker_main``) that hold their own shard and a paged KV pool for their own
heads, with the same block layout, and only run the model forward. The ranks meet in the two
all-reduces of every layer, over a gloo process group on the CPU (NCCL on CUDA).

Step messages go over a pipe per worker, not a collective: an idle worker then waits on the pipe
without a collective timeout, and exits when rank 0 goes away (end of file). A worker that dies is
seen by rank 0 before the next step (process liveness) or inside a step (the collective fails or
times out): ``RankFailedError``, which the engine treats as fatal.

The KV-cache budget is for all ranks together: every rank keeps the same blocks, each with its own
heads' share (a KV head replicated on several ranks counts once in the budget, once per rank in memory).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import pickle
import tempfile
import traceback
import weakref
from pathlib import Path

import numpy as np
import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata, get_backend
from kvserve.model.loader import load_model
from kvserve.model.sharding import TensorShard, install_all_reduce
from kvserve.runtime.threads import available_cpus
from kvserve.worker.model_runner import ModelRunner, allocate_kv_caches

log = logging.getLogger(__name__)

# How long a rank waits in an all-reduce for the others (a hung rank), and at start for the workers to load.
COLLECTIVE_TIMEOUT_S = 60.0
START_TIMEOUT_S = 600.0


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for all on the CPU, else the rank-th GPU from ``device``'s index."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _process_group(store_path: str, rank: int, world_size: int, device: torch.device):
    """This rank's process group (not torch.distributed's global default: several engines may live
    in one process, each with its own group)."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class _AllReduce:
    """Sums a row-parallel layer's partial output over the ranks, in place."""

    def __init__(self, group, on_error=None) -> None:
        self.group, self.on_error = group, on_error
        self.calls, self.seconds = 0, 0.0  # for measuring the collective's share of a step
        self.timed = False

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        import time

        start = time.perf_counter() if self.timed else 0.0
        try:
            self.group.allreduce([tensor]).wait()
        except RuntimeError as error:
            if self.on_error is not None:
                self.on_error(error)
            raise
        if self.timed:
            self.calls += 1
            self.seconds += time.perf_counter() - start
        return tensor


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: a ModelRunner over rank 0's shard that drives the other ranks each step.

    The fused C++ decoder and CUDA graphs are not used: the all-reduces sit between their kernels.
    """

    def __init__(self, model: torch.nn.Module, model_path: Path, config: EngineConfig, backend: AttentionBackend,
                 num_blocks: int, block_size: int) -> None:
        world = config.tensor_parallel_size
        base = torch.device(config.device)
        if base.type == "cuda" and (base.index or 0) + world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world} needs one GPU per rank from {base}; "
                             f"{torch.cuda.device_count()} visible")
        device = rank_device(base, 0)
        self.world_size = world
        self._workers: list[tuple[multiprocessing.process.BaseProcess, object]] = []
        self._store_dir = tempfile.TemporaryDirectory(prefix="kvserve-tp-")
        store_path = os.path.join(self._store_dir.name, "store")
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"kvserve-tp-rank{rank}", daemon=True,
                               args=(child, config, str(model_path), rank, num_blocks, block_size, store_path))
            proc.start()
            child.close()
            self._workers.append((proc, parent))
        self._finalizer = weakref.finalize(self, _stop_workers, list(self._workers), self._store_dir)
        try:
            self._wait_ready()
            self.group = _process_group(store_path, 0, world, device)
        except BaseException:
            self.close()
            raise
        self.all_reduce = _AllReduce(self.group, on_error=self._collective_failed)
        install_all_reduce(model, self.all_reduce)
        super().__init__(model, model.config, backend, num_blocks, block_size, config.torch_dtype, device, config.seed)

    def _build_fused_decoder(self):
        return None  # every step eager: the fused decoder has no all-reduce between its layers

    def close(self) -> None:
        """Stop the worker processes (also done when the runner is collected, or rank 0 exits)."""
        self._finalizer()

    def _wait_ready(self) -> None:
        """Each worker sends "ready" once its shard and KV pool are in place, or the error that stopped it."""
        for rank, (proc, conn) in enumerate(self._workers, start=1):
            waited = 0.0
            while not conn.poll(1.0):
                waited += 1.0
                if not proc.is_alive():
                    raise RankFailedError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} while loading")
                if waited > START_TIMEOUT_S:
                    raise RankFailedError(f"tensor-parallel rank {rank} did not load in {START_TIMEOUT_S:.0f} s")
            try:
                kind, detail = conn.recv()
            except EOFError:
                kind, detail = "error", f"exited with code {proc.join(5) or proc.exitcode}"
            if kind != "ready":
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def check_alive(self) -> None:
        for rank, (proc, _) in enumerate(self._workers, start=1):
            if not proc.is_alive():
                raise RankFailedError(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code "
                                      f"{proc.exitcode}; the engine cannot continue")

    def _collective_failed(self, error: RuntimeError) -> None:
        self.check_alive()
        raise RankFailedError(f"tensor-parallel all-reduce failed ({error}); a rank stopped answering") from error

    def _send(self, message: tuple) -> None:
        self.check_alive()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (_, conn) in enumerate(self._workers, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError) as error:
                raise RankFailedError(f"tensor-parallel rank {rank} is gone ({error})") from error

    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self._send(("forward", _to_host(input_ids), _to_host(positions), _meta_to_host(meta)))
        try:
            return super()._eager_forward(input_ids, positions, meta)
        except RankFailedError:
            raise
        except Exception as error:
            # The other ranks are inside this step's collectives: rank 0 cannot take the step back.
            raise RankFailedError(f"rank 0's forward pass failed mid-step ({error!r}); the tensor-parallel "
                                  "ranks are out of step") from error

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._send(("copy_blocks", copies))
        super()._copy_blocks(copies)


def _stop_workers(workers, store_dir) -> None:
    for _, conn in workers:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
        conn.close()
    for proc, _ in workers:
        proc.join(3)  # a healthy worker exits at once; one stuck in a collective is killed
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    store_dir.cleanup()


def _to_host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _meta_to_host(meta: AttentionMetadata) -> dict:
    return {f.name: _to_host(v) if isinstance(v, torch.Tensor) else v
            for f in dataclasses.fields(meta) if (v := getattr(meta, f.name)) is not None}


def _meta_from_host(fields: dict, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(**{k: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
                                for k, v in fields.items()})


class _ShardWorker:
    """Ranks 1..N-1: this rank's shard, its KV pool, and forward passes as rank 0 asks."""

    def __init__(self, config: EngineConfig, model_path: Path, rank: int, num_blocks: int, block_size: int,
                 store_path: str) -> None:
        self.device = rank_device(torch.device(config.device), rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        shard = TensorShard(rank, config.tensor_parallel_size)
        self.model, _ = load_model(model_path, config.torch_dtype, self.device, config.quant,
                                   config.scheduler.max_model_len, shard=shard)
        cfg: ModelConfig = self.model.config
        self.backend = get_backend(self.device, config.cache.kv_cache_dtype, config.attention_backend)
        self.kv_caches = allocate_kv_caches(self.backend, cfg, num_blocks, block_size, config.torch_dtype, self.device)
        self.store_path, self.rank, self.world_size = store_path, rank, config.tensor_parallel_size

    def join_group(self) -> None:
        group = _process_group(self.store_path, self.rank, self.world_size, self.device)
        install_all_reduce(self.model, _AllReduce(group))

    @torch.inference_mode()
    def handle(self, message: tuple) -> bool:
        """Run one message from rank 0; False on "stop"."""
        kind = message[0]
        if kind == "forward":
            _, input_ids, positions, meta = message
            self.model(torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                       self.kv_caches, _meta_from_host(meta, self.device), self.backend)
        elif kind == "copy_blocks":
            src = torch.tensor([s for s, _ in message[1]], device=self.device)
            dst = torch.tensor([d for _, d in message[1]], device=self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown tensor-parallel message {kind!r}")
        return True


def _worker_main(conn, config: EngineConfig, model_path: str, rank: int, num_blocks: int, block_size: int,
                 store_path: str) -> None:
    """A worker process: load, report ready, join the group, then serve rank 0's messages until it
    says stop or goes away. An error is reported (while loading) or ends the process (while
    stepping), which rank 0 sees as a failed collective or a dead rank."""
    try:
        threads = config.num_threads or max(1, available_cpus() // config.tensor_parallel_size)
        torch.set_num_threads(threads)
        worker = _ShardWorker(config, Path(model_path), rank, num_blocks, block_size, store_path)
    except BaseException as error:  # noqa: BLE001 - sent to rank 0, which raises it
        conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    worker.join_group()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # rank 0 is gone
            return
        if not worker.handle(pickle.loads(data)):
            return
