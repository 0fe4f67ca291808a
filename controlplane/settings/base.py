"""Settings shared by every environment, read from the environment (docs/configuration.md)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from common.body_limits import DEFAULT_FILE_LIMIT, body_limits_by_path
from common.hosts import HostError, check_origin
from common.tracing import TracingError, traces_endpoint
from controlplane.settings.env import (
    ImproperlyConfiguredEnv,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
    find_env_file,
    load_env_file,
    parse_database_url,
)


def _router_origins(name: str, urls: list[str]) -> list[str]:
    """Each URL as a plain origin (common/hosts.py), or a start-up error naming ``name``."""
    try:
        return list(dict.fromkeys(check_origin(url) for url in urls if url.strip()))
    except HostError as exc:
        raise ImproperlyConfiguredEnv(f"{name}: {exc}") from None


BASE_DIR = Path(__file__).resolve().parent.parent.parent
load_env_file(find_env_file(BASE_DIR))
VAR_DIR = Path(env_str("SYSHAX_VAR_DIR", str(BASE_DIR / "var")) or BASE_DIR / "var")
VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
# It holds the database, the secret key and the broker's messages. A directory someone else
# owns (a mounted volume) keeps the mode its owner gave it.
with contextlib.suppress(PermissionError):
    VAR_DIR.chmod(0o700)

DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "django_celery_beat",
    "controlplane.core",
    "controlplane.inventory",
    "controlplane.access",
    "controlplane.policy",
    "controlplane.deployments",
    "controlplane.routers",
    "controlplane.tenants",
    "controlplane.batches",
    "controlplane.benchmarks",
    "controlplane.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.core.middleware.ContentSecurityPolicyMiddleware",
    "controlplane.core.middleware.ApiErrorMiddleware",
    "controlplane.core.middleware.BodySizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # With DEBUG (the laptop default): the friendly 404/500 pages, not Django's debug pages.
    "controlplane.dashboard.views.common.FriendlyErrorPages",
]

DEFAULT_EXCEPTION_REPORTER_FILTER = "controlplane.core.middleware.SecretSettingsFilter"

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": parse_database_url(
        env_str("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}",
        base_dir=BASE_DIR,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory, so processes a test starts (worker, agent) share the test database.
    # Named per process: concurrent test runs never share (or delete) each other's file.
    DATABASES["default"]["TEST"] = {
        "NAME": str(VAR_DIR / f"test-controlplane-{os.getpid()}.sqlite3")
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC") or "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

# Bodies larger than this are refused with a JSON 413 before any view reads them.
MAX_REQUEST_BODY_BYTES = env_int("MAX_REQUEST_BODY_BYTES", 2 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES

# --- The Batch API (docs/batches.md) ------------------------------------------------------
# An uploaded batch input file's bytes (they are stored in the database) and its requests.
BATCH_MAX_FILE_BYTES = env_int("BATCH_MAX_FILE_BYTES", DEFAULT_FILE_LIMIT, minimum=1024)
# What one owner (a tenant) may store: its uploads and its batches' output and error files.
BATCH_MAX_FILES_PER_OWNER = env_int("BATCH_MAX_FILES_PER_OWNER", 500, minimum=1)
BATCH_MAX_BYTES_PER_OWNER = env_int(
    "BATCH_MAX_BYTES_PER_OWNER", 2 * 1024 * 1024 * 1024, minimum=1024
)
BATCH_MAX_LINES = env_int("BATCH_MAX_LINES", 50_000, minimum=1)
# Lines of one batch sent to the router at once.
BATCH_CONCURRENCY = env_int("BATCH_CONCURRENCY", 4, minimum=1)
# Where batch lines go; empty: the live router seen last (its registered listen URL).
BATCH_ROUTER_URL = env_str("BATCH_ROUTER_URL", "") or ""
# A running batch's worker renews its lease this often (a third of it); a batch whose lease
# ran out is queued again by the sweep. A queued batch's task has BATCH_QUEUED_SECONDS to start.
BATCH_LEASE_SECONDS = env_float("BATCH_LEASE_SECONDS", 60.0, minimum=3.0)
BATCH_QUEUED_SECONDS = env_float("BATCH_QUEUED_SECONDS", 600.0, minimum=3.0)
BATCH_REQUEST_TIMEOUT_SECONDS = env_float("BATCH_REQUEST_TIMEOUT_SECONDS", 600.0, minimum=1.0)
# Tries of a line the router answers 429 or 502-504 (or does not answer) before it fails.
BATCH_MAX_ATTEMPTS = env_int("BATCH_MAX_ATTEMPTS", 8, minimum=1)
# Bodies larger than MAX_REQUEST_BODY_BYTES accepted on these paths (a multipart upload's
# framing on top of the file's bytes); `syshax web`'s worker applies the same.
BODY_LIMITS_BY_PATH = body_limits_by_path(BATCH_MAX_FILE_BYTES)

REST_FRAMEWORK = {
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.core.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.access.authentication.MachineTokenAuthentication",
        "controlplane.access.authentication.PersonalTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.access.permissions.ScopedPermission"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.SearchFilter",
        "controlplane.core.pagination.ModelFieldOrderingFilter",
    ],
    "DEFAULT_THROTTLE_CLASSES": ["controlplane.access.throttling.MachineRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"machine": env_str("MACHINE_RATE_LIMIT", "20/s")},
    "DEFAULT_PAGINATION_CLASS": "controlplane.core.pagination.StrictLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.core.api.exception_handler",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "syshax control plane API",
    "DESCRIPTION": "Inventory, deployments, PD scheduling policy, routers and benchmarks.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["controlplane.access.permissions.ScopedPermission"],
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.core.schema.document_errors",
    ],
    "ENUM_NAME_OVERRIDES": {
        "NodeStatusEnum": "controlplane.inventory.choices.NodeStatus",
        "ContainerStatusEnum": "controlplane.deployments.choices.ContainerStatus",
        "CommandStatusEnum": "controlplane.deployments.choices.CommandStatus",
        "CommandOutcomeEnum": "controlplane.deployments.choices.CommandOutcome",
        "RunStatusEnum": "controlplane.benchmarks.choices.RunStatus",
        "DeploymentStateEnum": "controlplane.deployments.choices.DeploymentState",
        "DesiredStateEnum": "controlplane.deployments.choices.DesiredState",
        "AcceleratorKindEnum": "controlplane.inventory.choices.AcceleratorKind",
        "BenchmarkModeEnum": "controlplane.benchmarks.choices.BenchmarkMode",
    },
}

# Hosts (or host:port) a benchmark may target besides the fleet's routers and engines.
BENCHMARK_ALLOWED_TARGETS = env_list("BENCHMARK_ALLOWED_TARGETS", [])
# The routers' API key (their SYSHAX_ROUTER_API_KEY): a benchmark run sends it to a registered
# router, and to no other target.
ROUTER_API_KEY = env_str("ROUTER_API_KEY", "") or ""
# Their benchmark key (SYSHAX_ROUTER_BENCHMARK_KEY), which may force a policy mode per request:
# sent in place of ROUTER_API_KEY when set, so a run's CPU, GPU and hetero modes are honoured.
ROUTER_BENCHMARK_KEY = env_str("ROUTER_BENCHMARK_KEY", "") or ""
# The routers the control plane may send a router key, the benchmark key or a tenant's prompts
# to (comma-separated http(s) origins): the batch worker, the playground and benchmark runs
# reach routers here and nowhere else; a router's reported listen_url is never trusted
# (docs/decisions/0056-router-destinations-configured.md).
ROUTER_URLS = _router_origins("ROUTER_URLS", env_list("ROUTER_URLS", []))

# The control plane's own traces (docs/tracing.md): on when an OTLP/HTTP collector is named
# by OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT), as for the router.
try:
    TRACES_ENDPOINT = traces_endpoint(None)
except TracingError as exc:
    raise ImproperlyConfiguredEnv(str(exc)) from None
# Where an operator looks a trace id up: the dashboard links ids there, "{trace_id}" replaced
# (http://jaeger:16686/trace/{trace_id}); empty: ids are shown as text.
TRACE_URL_TEMPLATE = env_str("SYSHAX_TRACE_URL_TEMPLATE", "") or ""
if TRACE_URL_TEMPLATE and (
    "{trace_id}" not in TRACE_URL_TEMPLATE
    or not TRACE_URL_TEMPLATE.startswith(("http://", "https://"))
):
    raise ImproperlyConfiguredEnv(
        "SYSHAX_TRACE_URL_TEMPLATE must be an http(s) URL holding {trace_id}; got "
        f"{TRACE_URL_TEMPLATE!r}"
    )

# Throttle counts (access/throttling.py): shared through Redis when there is one.
# A frozen Redis must not hang every request: each cache call gives up after a second, and
# the throttle then lets the request through.
CACHES = (
    {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_CACHE,
            "OPTIONS": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
        }
    }
    if (REDIS_CACHE := env_str("REDIS_URL"))
    else {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
)

# --- Celery -------------------------------------------------------------------------------
# With REDIS_URL (or CELERY_BROKER_URL) set, Redis carries tasks and results. Without it the
# broker is kombu's filesystem transport under var/celery: a real transport with real worker
# and beat processes, so retries and routing behave as in production
# (docs/decisions/0018-broker-syshaxfs.md).
REDIS_URL = env_str("REDIS_URL")
CELERY_DATA_DIR = VAR_DIR / "celery"
_broker = env_str("CELERY_BROKER_URL") or REDIS_URL
if _broker:
    CELERY_BROKER_URL = _broker
    CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND") or _broker
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=60),
    }
else:
    for sub in ("queue", "processed", "results", "control"):
        (CELERY_DATA_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = (
        "syshaxfs://"  # controlplane/core/broker.py: kombu's folder layout, atomic writes
    )
    CELERY_RESULT_BACKEND = f"file://{CELERY_DATA_DIR / 'results'}"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_DATA_DIR / "queue"),
        "data_folder_out": str(CELERY_DATA_DIR / "queue"),
        "processed_folder": str(CELERY_DATA_DIR / "processed"),
        "control_folder": str(CELERY_DATA_DIR / "control"),
        "store_processed": False,
        "polling_interval": env_float("CELERY_POLLING_INTERVAL", 0.2, minimum=0.01),
    }

CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_TASK_DEFAULT_QUEUE = "controlplane"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = TIME_ZONE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Benchmarks run for minutes on a queue and worker of their own, so they never hold up a
# deploy step (`syshax worker --queues benchmarks`; docs/deployment.md).
BENCHMARK_QUEUE = "benchmarks"
# Batches run for hours on a queue of their own (`syshax worker --queues batches`).
BATCH_QUEUE = env_str("BATCH_QUEUE", "batches") or "batches"
CELERY_TASK_ROUTES = {
    "syshax.agent.*": {"queue": "agents"},
    "benchmarks.*": {"queue": BENCHMARK_QUEUE},
    "batches.run_batch": {"queue": BATCH_QUEUE},
}
# Housekeeping; beat writes these into django-celery-beat's tables, where admins can see them.
CELERY_BEAT_SCHEDULE = {
    "reap-lost-nodes": {
        "task": "inventory.reap_lost_nodes",
        "schedule": env_float("HEARTBEAT_INTERVAL_SECONDS", 5.0, minimum=0.1),
    },
    "prune-heartbeats": {"task": "inventory.prune_heartbeats", "schedule": 3600.0},
    "prune-router-samples": {"task": "routers.prune_samples", "schedule": 3600.0},
    "expire-stale-commands": {"task": "deployments.expire_stale_commands", "schedule": 30.0},
    "reschedule-stranded": {"task": "deployments.reschedule_stranded", "schedule": 30.0},
    "resume-in-flight-deployments": {"task": "deployments.resume_in_flight", "schedule": 60.0},
    "sweep-batches": {"task": "batches.sweep", "schedule": 30.0},
}

# --- Fleet behaviour ----------------------------------------------------------------------
# A node is offline after HEARTBEAT_INTERVAL * HEARTBEAT_TOLERANCE seconds without a heartbeat.
HEARTBEAT_INTERVAL_SECONDS = env_float("HEARTBEAT_INTERVAL_SECONDS", 5.0, minimum=0.1)
# How long an agent's command fetch waits for a command before it answers empty (a long
# poll). 0: answer at once, and agents ask again every heartbeat interval.
AGENT_COMMAND_WAIT_SECONDS = env_float("AGENT_COMMAND_WAIT_SECONDS", 20.0, minimum=0.0)
HEARTBEAT_TOLERANCE = env_float("HEARTBEAT_TOLERANCE", 3.0, minimum=1.0)
HEARTBEAT_RETENTION_HOURS = env_int("HEARTBEAT_RETENTION_HOURS", 24, minimum=1)
ROUTER_GRACE_SECONDS = env_float("ROUTER_GRACE_SECONDS", 30.0, minimum=1.0)
# Routers' stats samples kept; the dashboard's longest window is 24 h.
ROUTER_STATS_RETENTION_HOURS = env_int("ROUTER_STATS_RETENTION_HOURS", 24, minimum=24)
# A token's last_used_at is written at most this often (a write per request would double the
# fleet's write load; docs/decisions/0024-heartbeat-seven-statements.md).
TOKEN_LAST_USED_SECONDS = env_float("TOKEN_LAST_USED_SECONDS", 300.0, minimum=1.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO") or "INFO"},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # One line per HTTP request of every client is noise at INFO.
        "httpx": {"level": "WARNING"},
        # The filesystem broker has no host name, and kombu says so on every connection.
        "kombu.connection": {"level": "ERROR"},
    },
}
