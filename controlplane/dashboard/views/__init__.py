"""Thin views: each reads through dashboard.services or acts through an owning app's service."""
