"""pagedjax on Ray: Serve replicas, routing, autoscaling, prefill/decode pools, multi-host.

    serve run deploy/ray/serve.yaml            # import_path: serving.ray_serve:build_app
    serve run serving.ray_serve:build_pd_app model=tiny decode_replicas=2
    serve run serving.ray_serve:build_multihost_app model=tiny num_hosts=2 server_args=...

    app.py        the application builder and the engine replica deployment (one PagedJaxServer
                  per replica; calls run through its own OpenAI-compatible FastAPI app)
    ingress.py    the ingress deployment: reads the body, makes the RoutingKey, relays the
                  chosen replica's streamed answer (status, headers, SSE) to the client
    router.py     PrefixAffinityRouter (Serve's RequestRouter API): session, longest learned
                  prefix of our block hashes, least load; spills when the home is busy
    autoscale.py  the replicas' load / KV-usage signals, the Serve autoscaling policy over
                  them, and the Serve caps that leave shedding (429) to the replica
    disagg.py     prefill and decode pools as two deployments and the P/D ingress that
                  pairs them with llm-d's two calls (kv_transfer_params); K/V moves by
                  serving/disagg's transport between the replicas Serve picked
    multihost.py  one replica over a placement group of N processes: jax.distributed with
                  the coordinator on the replica's node, followers as Ray actors

May import: serving (server assembly, flags, frontend, http, disagg, engine_host),
engine, ray, fastapi. Nothing in engine/ or the rest of serving/ imports this package: Ray is
an optional extra.
"""

from serving.ray_serve.app import build_app
from serving.ray_serve.disagg import build_pd_app
from serving.ray_serve.multihost import build_multihost_app

__all__ = ["build_app", "build_multihost_app", "build_pd_app"]
