# The project image: control plane (web, worker, beat), router and agent share it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings.production \
    SYSHAX_VAR_DIR=/var/lib/syshax

WORKDIR /app
COPY pyproject.toml README.md manage.py ./
COPY controlplane ./controlplane
COPY agents ./agents
COPY router ./router
COPY syshax ./syshax
COPY templates ./templates
RUN pip install --no-cache-dir . \
    && useradd --system --home /var/lib/syshax --create-home syshax \
    && SECRET_KEY=build-only-build-only-build-only-build-only-build-only \
       python manage.py collectstatic --noinput --verbosity 0

USER syshax
EXPOSE 8000 7010
CMD ["syshax", "web", "--bind", "0.0.0.0:8000"]
