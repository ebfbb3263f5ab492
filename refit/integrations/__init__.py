"""Integrations: refit inside the frameworks users run (vLLM engines today)."""
