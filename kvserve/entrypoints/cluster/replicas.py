"""Replicas: `kvserve serve` processes started here (backend "mp") or by Ray actors ("ray").

With Ray each replica is owned by an actor that Ray places on a node of the cluster (one per
replica, asking for no CPUs of Ray's accounting: the server's own threads use the node's cores);
the actor starts the server process beside itself and reports its URL, so the front end talks to
every replica over HTTP the same way, wherever it runs. Ray is an optional extra (kvserve[ray]).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvserve.entrypoints.cluster.launch import start_server, terminate, wait_for_health

BACKENDS = ("mp", "ray")
STARTUP_TIMEOUT_S = 600.0  # a first start may compile the C++ kernels


class ProcessReplica:
    """A server process on this machine."""

    def __init__(self, index: int, args: list[str], host: str = "127.0.0.1", die_with_parent: bool = False) -> None:
        self.index = index
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"kvserve-replica{index}-", suffix=".log", delete=False)
        self.proc, self.url = start_server(args, host=host, log=self.log, die_with_parent=die_with_parent)

    def wait_ready(self) -> None:
        try:
            wait_for_health(self.url, self.proc, STARTUP_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"replica {self.index}: {e}\n{Path(self.log.name).read_text()[-3000:]}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()

    def stop(self, timeout: float = 30.0) -> None:
        terminate(self.proc, timeout)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def _actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class ReplicaActor:
        """Owns one replica's server process on the node Ray placed it on."""

        def __init__(self, index: int, args: list[str], host: str | None) -> None:
            # on a cluster the server listens on its node's address, which only the actor knows
            self.replica = ProcessReplica(index, args, host or ray.util.get_node_ip_address())

        def url(self) -> str:
            return self.replica.url

        def wait_ready(self) -> None:
            self.replica.wait_ready()

        def pid(self) -> int:
            return self.replica.pid

        def alive(self) -> bool:
            return self.replica.alive()

        def kill(self) -> None:
            self.replica.kill()

        def stop(self) -> None:
            self.replica.stop()

    return ReplicaActor


class RayReplica:
    """A server process owned by a Ray actor."""

    def __init__(self, index: int, args: list[str], host: str | None) -> None:
        import ray

        self.index = index
        self._ray = ray
        self.actor = _actor_class().remote(index, args, host)
        self.url = ray.get(self.actor.url.remote())
        self.pid = ray.get(self.actor.pid.remote())

    def wait_ready(self) -> None:
        self._ray.get(self.actor.wait_ready.remote())

    def alive(self) -> bool:
        try:
            return self._ray.get(self.actor.alive.remote(), timeout=5)
        except Exception:  # the actor (or its node) is gone
            return False

    def kill(self) -> None:
        self._ray.get(self.actor.kill.remote())

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self._ray.get(self.actor.stop.remote(), timeout=timeout + 5)
        except Exception:  # already gone: nothing left to stop
            pass
        self._ray.kill(self.actor)


def start_replicas(backend: str, num_replicas: int, args: list[str], ray_address: str | None = None):
    """Start every replica, then wait until all are healthy (they load in parallel)."""
    if backend not in BACKENDS:
        raise ValueError(f"distributed_backend={backend!r} must be one of {list(BACKENDS)}")
    if backend == "ray":
        try:
            import ray
        except ImportError:
            raise ValueError("--distributed-backend ray needs Ray: pip install 'kvserve[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                     **({} if ray_address else {"num_cpus": 2}))
        host = "127.0.0.1" if ray_address is None else None
        replicas = [RayReplica(i, args, host) for i in range(num_replicas)]
    else:
        replicas = [ProcessReplica(i, args, die_with_parent=True) for i in range(num_replicas)]
    try:
        with ThreadPoolExecutor(num_replicas) as pool:
            list(pool.map(lambda r: r.wait_ready(), replicas))
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas) -> None:
    with ThreadPoolExecutor(max(1, len(replicas))) as pool:
        list(pool.map(lambda r: r.stop(), replicas))
