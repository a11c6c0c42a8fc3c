"""Integrations with training frameworks (import each one explicitly; each needs its framework)."""
