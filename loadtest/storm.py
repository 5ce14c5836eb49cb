"""The swap storm's operator: affine versions `A * scale ± shift`, so that any answer can be
checked against the version it reports. Plain `requests`, no Locust: loadtest/run.py registers the
operator before Locust starts, so registration does not eat into the measured time."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import requests

STORM_OP = os.environ.get("GPUOS_STORM_OP", "storm_affine")
FIRST = "A * 1 + 0"
EXPRESSIONS = ("A * 2 + 1", "A * 3 - 1", "A * 0.5 + 2", "A * 1.5 - 0.25")
AFFINE = re.compile(r"^A \* (-?[\d.]+) ([+-]) ([\d.]+)$")


def admin_headers(token: str | None = None) -> dict[str, str]:
    """Bearer header for `token`, default $GPUOS_ADMIN_TOKEN."""
    return {"Authorization": f"Bearer {token or os.environ.get('GPUOS_ADMIN_TOKEN', '')}"}


def affine_versions(history: Iterable[Mapping[str, Any]]) -> dict[int, tuple[float, float]]:
    """version → (scale, shift) for the history entries that are affine expressions."""
    known = {}
    for entry in history:
        match = AFFINE.match(entry["source"])
        if match:
            sign = 1.0 if match[2] == "+" else -1.0
            known[int(entry["version"])] = (float(match[1]), sign * float(match[3]))
    return known


def ensure_registered(url: str, token: str | None = None) -> dict[int, tuple[float, float]]:
    """Register the storm operator unless it exists; its versions so far."""
    headers = admin_headers(token)
    response = requests.post(
        f"{url}/admin/ops",
        headers=headers,
        timeout=120,
        json={"name": STORM_OP, "expression": FIRST},
    )
    if response.status_code not in (201, 409):  # 409: it exists already
        raise RuntimeError(
            f"cannot register {STORM_OP}: HTTP {response.status_code} {response.text[:300]}"
        )
    op = requests.get(f"{url}/admin/ops/{STORM_OP}", headers=headers, timeout=60)
    op.raise_for_status()
    return affine_versions(op.json()["history"])
