"""The syshax KV connector for vLLM: ``syshax_kv_connector.py`` is a self-contained module the
node agent puts on the engines' ``PYTHONPATH`` (docs/agent.md); this package only locates it."""
