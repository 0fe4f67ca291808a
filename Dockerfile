# The project image: control plane (web, worker, beat), router and agent share it.
#
# BASE is python:3.11-slim by default. Any Debian bookworm image with python3 and python3-venv
# works too, e.g. the debootstrapped base scripts/dev/compose_setup.sh builds where no registry is
# reachable (docs/deployment.md). The project lives in a virtualenv at /opt/syshax, on PATH.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings.production \
    SYSHAX_VAR_DIR=/var/lib/syshax \
    VIRTUAL_ENV=/opt/syshax \
    PATH=/opt/syshax/bin:$PATH

# pgrep (procps) for the health checks of beat and the agent; python:3.11-slim lacks it.
RUN if ! command -v pgrep >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends procps \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/syshax \
    && useradd --system --home /var/lib/syshax --create-home syshax

WORKDIR /app
# The dependencies first, in a layer of their own: a change to the code reuses it.
COPY pyproject.toml README.md manage.py ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY controlplane ./controlplane
COPY agents ./agents
COPY router ./router
COPY syshax ./syshax
COPY common ./common
COPY sim ./sim
COPY loadgen ./loadgen
COPY kvconnector ./kvconnector
COPY templates ./templates
# The state directories exist in the image, owned by syshax, so the named volumes mounted on
# them start out writable by the services.
RUN pip install --no-cache-dir --no-deps . \
    && SECRET_KEY=build-only-build-only-build-only-build-only-build-only \
       python manage.py collectstatic --noinput --verbosity 0 \
    && mkdir -p /var/lib/syshax/router /var/lib/syshax/agent \
    && chown -R syshax:syshax /var/lib/syshax

USER syshax
EXPOSE 8000 7010
CMD ["syshax", "web", "--bind", "0.0.0.0:8000"]
