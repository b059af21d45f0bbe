"""Object stores (S3, GCS, R2, MinIO, any fsspec protocol) beside local paths: telling a URL
from a path, opening a store's filesystem with bounded timeouts, reading and writing its
objects, and the byte-range reader that the token reader builds on.

Credentials come only from each cloud SDK's standard environment variables and files, never
from a config, and are never logged; an S3-compatible endpoint is the standard
``AWS_ENDPOINT_URL``. The store clients are optional extras (``pip install kempnerforge[s3]``),
imported only when a URL is opened.
"""
