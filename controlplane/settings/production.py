"""Production: a real secret is required and the transport is locked down."""

from __future__ import annotations

from controlplane.settings.base import *  # noqa: F403
from controlplane.settings.env import ImproperlyConfiguredEnv, env_bool, env_int, env_str

_secret = env_str("SECRET_KEY")
if not _secret or len(_secret) < 50:
    raise ImproperlyConfiguredEnv(
        "SECRET_KEY (or SECRET_KEY_FILE) must be set to at least 50 characters in production"
    )
SECRET_KEY = _secret
DEBUG = False

# X-Forwarded-Proto is believed only behind a proxy that sets it (and strips a client's own);
# a server reached directly would otherwise take any client's word that it came over HTTPS.
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("TRUST_X_FORWARDED_PROTO", False) else None
)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SECURE_REDIRECT_EXEMPT = [r"^api/v1/health$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
