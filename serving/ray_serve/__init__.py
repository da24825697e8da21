"""pagedjax on Ray: Serve replicas, routing, autoscaling, prefill/decode pools, multi-host.

    serve run deploy/ray/serve.yaml            # import_path: serving.ray_serve:build_app

    app.py       the application builder and the engine replica deployment (one PagedJaxServer
                 per replica, its FastAPI app as the ingress)

May import: serving (server assembly, flags, frontend, http, disagg), engine, ray. Nothing in
engine/ or the rest of serving/ imports this package: Ray is an optional extra.
"""

from serving.ray_serve.app import build_app

__all__ = ["build_app"]
