"""A bench for the KV connector (syshax/kvconnector/): its two sides driven as vLLM drives
them, outside an engine, on CUDA where a card is present and on the CPU otherwise.
``scripts/kv_connector_timing.py`` measures with it; ``tests/kvconnector`` checks with it."""
