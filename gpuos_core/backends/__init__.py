"""Backends execute batches of ABI task records: `cuda` on a GPU, `cpu` with torch on the CPU."""
