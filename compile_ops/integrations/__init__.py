"""Integrations with model libraries (diffusers, transformers).

``import compile_ops`` imports the modules here that need neither library
(``options``, ``sparse_attention``, ``schedule``, ``attention_backend``, which
imports diffusers only when the backend is registered); the ``diffusers`` and
``transformers`` integrations are imported lazily, when ``compile_ops.patch``
or ``compile_ops.unpatch`` first needs them."""
