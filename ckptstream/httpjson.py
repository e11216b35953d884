"""One JSON-over-HTTP request (urllib, no extra dependency): what the clients of vLLM and of vllm-router share.

Each client turns the errors into its own (``VllmError``, ``RouterError``), naming what it talked to.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def request_json(url: str, method: str, body: Any = None, *, api_key: str | None = None,
                 timeout: float) -> Any:
    """Send ``body`` (JSON, if not None) with ``method`` to ``url``; the answer parsed as JSON (its text if it
    is not JSON; None if empty).

    Raises:
        urllib.error.HTTPError: the server answered an error status (``read()`` gives its body).
        urllib.error.URLError, OSError: no answer (refused, reset, timed out).
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
