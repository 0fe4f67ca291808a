"""The one error type for "this input is wrong": it names the field and the limit.

The control plane turns it into a 400 whose message starts with the field; the CLIs print it.
Django-free, so the router, the agents and the policy schema can raise it too.
"""

from __future__ import annotations


class FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
