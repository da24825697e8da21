"""pagedjax on Ray: Serve replicas, routing, autoscaling, prefill/decode pools, multi-host.

    serve run deploy/ray/serve.yaml            # import_path: serving.ray_serve:build_app

    app.py       the application builder and the engine replica deployment (one PagedJaxServer
                 per replica; calls run through its own OpenAI-compatible FastAPI app)
    ingress.py   the ingress deployment: reads the body, makes the RoutingKey, relays the
                 chosen replica's streamed answer (status, headers, SSE) to the client
    router.py    PrefixAffinityRouter (Serve's RequestRouter API): session, longest learned
                 prefix of our block hashes, least load; spills when the home is busy
    autoscale.py the replicas' load / KV-usage signals, the Serve autoscaling policy over
                 them, and the Serve caps that leave shedding (429) to the replica

May import: serving (server assembly, flags, frontend, http, disagg), engine, ray, fastapi.
Nothing in engine/ or the rest of serving/ imports this package: Ray is an optional extra.
"""

from serving.ray_serve.app import build_app

__all__ = ["build_app"]
