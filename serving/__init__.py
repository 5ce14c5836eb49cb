"""Ray Serve layer of gpuos-serve: the app builder, HTTP routes and their schemas.

May import gpuos_core and ray; gpuos_core never imports this package.
"""
