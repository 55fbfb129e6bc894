"""pagedserve on Ray Serve (``pip install 'pagedserve[ray]'``; docs/SCALE_OUT.md, "Ray Serve").

Ray places, restarts and autoscales the engine replicas across the machines of a cluster; this
package supplies what runs there:

- :mod:`~pagedserve.ray_serve.replica` — ``EngineReplica``, one engine per replica, serving the
  project's own FastAPI app (``serve.ingress``), and the routing stats Ray collects from it;
- :mod:`~pagedserve.ray_serve.router` — ``PagedServeRouter``, Ray's request router replaced by the
  gateway's wait estimate and prefix affinity;
- :mod:`~pagedserve.ray_serve.front` — ``OpenAIFront``, the HTTP ingress: reads the body (Ray's
  HTTP proxy routes before any body is read, so a router behind it could not see the prompt),
  then forwards the request, streamed, through a handle whose router can;
- :mod:`~pagedserve.ray_serve.app` — the two deployments bound into one Serve application;
- :mod:`~pagedserve.ray_serve.cli` — ``pagedserve serve-ray``.

Nothing else in pagedserve imports this package except the CLI registration, and
:mod:`~pagedserve.ray_serve.cli` and :mod:`~pagedserve.ray_serve.settings` import ``ray`` only when
a command runs, so pagedserve works without Ray installed.
"""
