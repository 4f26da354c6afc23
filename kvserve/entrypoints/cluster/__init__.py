"""Data-parallel replicas behind one OpenAI front end: `kvserve serve --data-parallel-size N`.

Each replica is a whole `kvserve serve` process (its own engine, KV cache and prefix cache), started
by a ``ReplicaLauncher`` (a local subprocess, or a Ray actor that owns the process on its node); the
front end (proxy.py) routes every request to one replica (router.py) and streams its answer back.
"""
