r"""Load generator and capacity report for the pagedjax gRPC server.

Capacity is not tokens per second: it is the highest arrival rate at which latency, quality
and error gates all pass on representative mixed traffic (bursts, long prompts, long answers,
shared prefixes, tenants, cancellations). This package measures that with one command:

    python -m serving.capacity.loadgen --target=127.0.0.1:PORT --metrics_url=http://127.0.0.1:MPORT/metrics \
        --workload=short_qa:0.5,long_context:0.2,long_generation:0.1,shared_prefix:0.1,multi_tenant:0.1 \
        --arrival=gamma --rate=2 --duration_s=60 --cancel_fraction=0.1 --out=DIR

Modules, in the order data flows through them:

    workloads.py  classes, joint (prompt, output) length distributions, prompts from corpus/
    arrivals.py   when to send: constant, Poisson, gamma bursts, on/off, diurnal, closed loop
    trace.py      JSONL trace replay (and saving a run as a trace)
    driver.py     grpc.aio streams; one RequestRecord per request, whatever its outcome
    scrape.py     Prometheus scraping of the server during the run
    metrics.py    the metric definitions (TTFT, ITL, TPOT, E2E, queue, goodput, percentiles)
    report.py     report.json; render.py -> report.md; plots.py -> PNGs
    labels.py     a run's one-line title (leaf)
    gates.py      the gates a run must pass (leaf; the sweep and a run's verdict)
    sweep.py      rate sweep: knee and operating point, latency-vs-rate plot
    run.py        one run end to end;  __main__.py  the absl-flags command line

The planner that turns a sweep's goodput into replicas is `serving/capacity/planner.py`.
"""
