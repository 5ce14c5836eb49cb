"""gpuos-serve's command line (`gpuos-serve`, cli.py): the top layer, above `serving` and
`gpuos_core`. Installed from a wheel it also holds the benchmark scripts (bench/) and the Serve
configs (deployments/) as package data."""
