"""The request body limits the control plane's web server (``controlplane/webworker.py``,
Django-free) and its settings (``BODY_LIMITS_BY_PATH``) share: one source for each default."""

from __future__ import annotations

# An uploaded batch input file's default cap (BATCH_MAX_FILE_BYTES).
DEFAULT_FILE_LIMIT = 50 * 1024 * 1024
# The one path that takes a file-sized body, and a multipart upload's framing around the file.
UPLOAD_PATH = "/v1/files"
UPLOAD_FRAMING_BYTES = 1024 * 1024


def body_limits_by_path(max_file_bytes: int) -> dict[str, int]:
    """The paths whose bodies may be larger than ``MAX_REQUEST_BODY_BYTES``, exactly as
    named: the Batch API's upload, a file and its multipart framing."""
    return {UPLOAD_PATH: max_file_bytes + UPLOAD_FRAMING_BYTES}
