"""Helpers shared by tests (importable, unlike conftest.py)."""

from __future__ import annotations

import uuid


def new_bucket(endpoint: str) -> str:
    """Create an empty bucket with a fresh name on the S3 server at ``endpoint``; returns its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name
