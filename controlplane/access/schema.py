"""Describe machine and personal tokens in the OpenAPI schema (imported by AccessConfig.ready)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class MachineTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.access.authentication.MachineTokenAuthentication"
    name = "machineToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "agent (sxa_…) or router (sxr_…) token",
        }


class PersonalTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.access.authentication.PersonalTokenAuthentication"
    name = "personalToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "a person's API token: 'Token <key>' or 'Bearer sxp_…'",
        }
