"""Patch functions named by the manifests. Each is small and delegates to the original."""
