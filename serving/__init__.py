"""Ray Serve layer of gpuos-serve: the app builder and ingress (app.py), the HTTP API (routes.py,
schemas.py), the cross-request coalescer, the persisted operator registry, errors and metrics.

May import gpuos_core and ray; gpuos_core never imports this package.
"""
