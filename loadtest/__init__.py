"""Load tests of gpuos-serve: Locust users (locustfile.py) and the scenario runner (run.py)."""
