"""Integrations with model libraries (diffusers), imported lazily by compile_ops.patch."""
