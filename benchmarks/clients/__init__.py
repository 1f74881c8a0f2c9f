"""One module per client for benchmarks/bench_clients.py.

Each defines ``CONTENDERS`` (names), ``LOADERS`` (the contenders whose loads are measured),
``PAIRS`` ((client default, fastckpt) pairs whose ratios are reported), ``DESCRIPTIONS`` and
``run(payload) -> dict``: in a fresh process, build the state and do ``payload["op"]``
("save", "load_cold" or "load_warm") at ``payload["path"]``, returning ``stall_s`` and
``durable_s`` (save) or ``load_s`` (loads), ``state_bytes`` and a ``fingerprint`` of the state
saved or loaded.
"""
