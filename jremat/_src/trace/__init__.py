"""Tracing: a function's jaxpr as a `Graph` of values (bytes) and equations (FLOPs,
residuals), its layers, and per-device bytes under sharding."""
