"""Clients of the object stores that OLMo configs name, made the way OLMo's users already configure them.

* ``s3://``: boto3's own credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
  ``~/.aws``, instance roles), the profile ``S3_PROFILE`` when set, the endpoint ``AWS_ENDPOINT_URL`` (or
  ``AWS_ENDPOINT_URL_S3``) when set.
* ``r2://``: the S3 API at ``R2_ENDPOINT_URL`` (``https://ACCOUNT_ID.r2.cloudflarestorage.com``), with
  ``R2_ACCESS_KEY_ID``/``R2_SECRET_ACCESS_KEY`` or the profile ``R2_PROFILE``.
* ``weka://``: the S3 API at ``WEKA_ENDPOINT_URL``, with ``WEKA_ACCESS_KEY_ID``/``WEKA_SECRET_ACCESS_KEY`` or
  the profile ``WEKA_PROFILE`` (OLMo's launch scripts set ``R2_PROFILE=R2 S3_PROFILE=S3 WEKA_PROFILE=WEKA``).
* ``gs://``: google-cloud-storage with application-default credentials (``GOOGLE_APPLICATION_CREDENTIALS``,
  ``gcloud auth application-default login``, or the metadata server on Google Cloud), the project
  ``GOOGLE_CLOUD_PROJECT``; ``STORAGE_EMULATOR_HOST`` points it at an emulator.
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["S3_SCHEMES", "credentials_help", "endpoint_problem", "gcs_client", "s3_client"]

S3_SCHEMES = ("s3", "r2", "weka")
"""URL schemes served through the S3 API."""

_ENDPOINT_VARS = {"r2": "R2_ENDPOINT_URL", "weka": "WEKA_ENDPOINT_URL"}


def s3_client(
    scheme: str, *, max_attempts: int = 3, max_pool_connections: int = 10, timeout: Optional[float] = None
) -> Any:
    """A boto3 S3 client for ``scheme`` (one of :data:`S3_SCHEMES`); boto3 clients may be shared by threads.

    :param max_attempts: tries of each request inside botocore (1: the caller retries).
    :param max_pool_connections: connections kept open for reuse (at least the threads that share the client).
    :param timeout: connect and read timeout in seconds; None is botocore's default (60).
    :raises botocore.exceptions.ProfileNotFound: when the profile named by the environment does not exist.
    """
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {
        "retries": {"max_attempts": max_attempts, "mode": "standard"},
        "max_pool_connections": max_pool_connections,
    }
    if timeout is not None:
        options.update(connect_timeout=timeout, read_timeout=timeout)
    config = Config(**options)
    if scheme == "s3":
        session = boto3.Session(profile_name=os.environ.get("S3_PROFILE"))
        return session.client("s3", config=config)
    prefix = scheme.upper()
    key_id, secret = os.environ.get(f"{prefix}_ACCESS_KEY_ID"), os.environ.get(f"{prefix}_SECRET_ACCESS_KEY")
    if key_id and secret:
        session = boto3.Session(aws_access_key_id=key_id, aws_secret_access_key=secret)
    else:
        session = boto3.Session(profile_name=os.environ.get(f"{prefix}_PROFILE"))
    endpoint = os.environ.get(_ENDPOINT_VARS[scheme])
    return session.client("s3", endpoint_url=endpoint, region_name="auto", config=config)


def gcs_client() -> Any:
    """A google-cloud-storage client (application-default credentials; ``STORAGE_EMULATOR_HOST`` honoured)."""
    from google.cloud import storage

    return storage.Client()


def endpoint_problem(scheme: str) -> Optional[str]:
    """What is missing from the environment to reach ``scheme`` at all (an endpoint), or None."""
    var = _ENDPOINT_VARS.get(scheme)
    if var is None or os.environ.get(var):
        return None
    example = "https://ACCOUNT_ID.r2.cloudflarestorage.com" if scheme == "r2" else "https://WEKA_HOST:PORT"
    return f"{scheme}:// URLs are read through the S3 API at the endpoint in {var}: export {var}={example}"


def credentials_help(scheme: str) -> str:
    """Where the client for ``scheme`` looks for credentials, as one sentence for an error message."""
    if scheme == "gs":
        return (
            "google-cloud-storage looks for application-default credentials: set GOOGLE_APPLICATION_CREDENTIALS "
            "to a service-account key file, or run `gcloud auth application-default login` (and set "
            "GOOGLE_CLOUD_PROJECT)"
        )
    if scheme == "s3":
        return (
            "boto3 looks for AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary "
            "keys), the profile in S3_PROFILE or AWS_PROFILE (from ~/.aws/credentials), or an instance role"
        )
    prefix = scheme.upper()
    return (
        f"{scheme}:// needs {prefix}_ACCESS_KEY_ID and {prefix}_SECRET_ACCESS_KEY, or the profile in "
        f"{prefix}_PROFILE (from ~/.aws/credentials), plus the endpoint in {_ENDPOINT_VARS[scheme]}"
    )
