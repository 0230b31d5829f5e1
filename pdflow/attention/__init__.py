"""KV cache layouts and bindings (page size, head-major order) and attention backends."""
