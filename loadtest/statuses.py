"""How the load tests judge an answer's status (locustfile.py's users; pure, so tests import it
without Locust, which patches the standard library when imported)."""

from __future__ import annotations

from typing import Any

SHED = "shed"  # entry-name prefix of shed answers: "shed 503", "shed 504"


def shed(response: Any) -> bool:
    """Whether `response` is load shed as the API promises (a 503 with Retry-After, a 504): then
    it is reported as a success under its own entry, "shed <status>", out of the others' times."""
    status = response.status_code
    if not (status == 504 or (status == 503 and response.headers.get("Retry-After"))):
        return False
    response.request_meta["name"] = f"{SHED} {status}"
    response.success()
    return True


def status_problem(response: Any) -> str | None:
    """None for a 200; else "HTTP <status>: " and the start of the body (or the connection error,
    status 0)."""
    if response.status_code == 200:
        return None
    detail = response.text or getattr(response, "error", "")
    return f"HTTP {response.status_code}: {str(detail)[:200]}"
