"""Host side, plain Python (numpy at most, never JAX): requests, pages, scheduling, stop checks,
and the host half of a step.

    request.py       Request: one sequence's host state
    page_pool.py     PagePool: KV pages, the prefix cache (hash -> page), where a page is freed
    host_tier.py     HostKVTier: the prefix cache's second tier, evicted pages in host memory
    scheduler.py     Scheduler: admission into the running set, chunked prefill, preemption
    stop_checker.py  StopChecker: EOS, stop ids, stop strings, max_tokens
    outputs.py       OutputProcessor: the host half of a step, shared with the mock engine

May import: configs, engine's top level (api_types, errors), engine/sampling/params.py.
Never JAX, never engine/runner/, batch/ or spec/ (the mock engine runs this package
without JAX).
"""
