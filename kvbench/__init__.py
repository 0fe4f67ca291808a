"""A bench for the KV connector (kvconnector/): its two sides driven as vLLM drives
them, outside an engine, on CUDA where a card is present and on the CPU otherwise.
``scripts/bench/kv_connector_timing.py`` measures with it; ``tests/kvconnector`` checks with it."""
