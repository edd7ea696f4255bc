"""Unfinished multipart uploads under a cache's prefix, aborted when a producer resumes it.

A producer killed while a large tar uploads leaves the parts it sent on S3: invisible to every
reader (no object exists until the upload completes), but stored and billed until someone aborts
them. obstore has no call to list them, so this one step goes through boto3 (in the ``s3`` extra),
with the same endpoint, region and credentials the cache's client uses. The resuming producer
holds the cache's lease, so every unfinished upload under its prefix belongs to a producer that is
gone; only the cache's own files are aborted (a nested cache, or another program's files under the
same prefix, are not its). Other schemes need nothing: Azure drops uncommitted blocks by itself, and GCS uploads
through obstore complete or leave nothing.

Weighed against the bucket lifecycle rule ``AbortIncompleteMultipartUpload`` alone (no boto3, a
warning instead): the rule is the better cure where a user may set it, and every message here names
it; but most users write to a bucket they do not administer, and a preempted job leaves up to one
shard per writer lane each time it is killed, billed with nothing to show. So the resuming producer
cleans up what it can see, and without boto3 (or without the permission) it says what is left.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from dspark_cache.storage.remote.client import client_endpoint
from dspark_cache.storage.remote.store import ObjectStoreError
from dspark_cache.storage.remote.url import RemoteURL

log = logging.getLogger(__name__)

_KEYS = {  # boto3's client argument <- the spellings obstore / s3fs users give in storage_options
    "region_name": ("region", "aws_region", "aws_default_region", "region_name"),
    "aws_access_key_id": ("aws_access_key_id", "access_key_id", "key"),
    "aws_secret_access_key": ("aws_secret_access_key", "secret_access_key", "secret"),
    "aws_session_token": ("aws_session_token", "session_token", "token"),
}


def _client_arguments(options: dict[str, Any]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    for argument, spellings in _KEYS.items():
        for key in spellings:
            if options.get(key):
                arguments[argument] = str(options[key])
                break
    endpoint = client_endpoint(options)
    if endpoint:
        arguments["endpoint_url"] = endpoint
    if "region_name" not in arguments and not (
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    ):
        arguments["region_name"] = "us-east-1"  # what obstore assumes too
    return arguments


def abort_unfinished_uploads(url: RemoteURL, storage_options: dict[str, Any] | None,
                             ours: Callable[[str], bool]) -> int:
    """Abort the unfinished multipart uploads of this cache's own files (``ours``: a path relative to the
    cache is one the producer writes); how many there were. Others under the prefix (a cache nested in
    it, another program's files) are left alone."""
    if url.scheme not in ("s3", "s3a"):
        return 0
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        log.warning(
            "boto3 is missing, so unfinished multipart uploads under %s are not aborted (they are "
            'invisible but billed): pip install "dspark-cache[s3]", or give the bucket a lifecycle rule '
            "AbortIncompleteMultipartUpload",
            url,
        )
        return 0
    client = boto3.client("s3", **_client_arguments(dict(storage_options or {})))
    prefix = url.prefix.strip("/") + "/" if url.prefix.strip("/") else ""
    aborted, marker, upload_marker = 0, "", ""
    try:
        while True:
            page = client.list_multipart_uploads(Bucket=url.bucket, Prefix=prefix, KeyMarker=marker,
                                                 UploadIdMarker=upload_marker)
            for upload in page.get("Uploads", []):
                key = upload["Key"]
                if not key.startswith(prefix) or not ours(key[len(prefix):]):
                    continue
                client.abort_multipart_upload(Bucket=url.bucket, Key=key, UploadId=upload["UploadId"])
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            marker, upload_marker = page.get("NextKeyMarker", ""), page.get("NextUploadIdMarker", "")
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("AccessDenied", "403"):  # a narrow policy: the run goes on, the parts stay billed
            log.warning(
                "%s: not allowed to list or abort unfinished multipart uploads (403), so parts left by "
                "an interrupted producer stay (invisible, billed); allow s3:ListBucketMultipartUploads and "
                "s3:AbortMultipartUpload, or give the bucket an AbortIncompleteMultipartUpload lifecycle rule",
                url,
            )
            return aborted
        raise ObjectStoreError(f"listing unfinished uploads under {url} failed ({code or exc}); check the "
                               "endpoint and rerun") from exc
    except BotoCoreError as exc:
        raise ObjectStoreError(
            f"listing unfinished uploads under {url} failed ({exc}); check the network and "
            "the endpoint, then rerun"
        ) from exc
