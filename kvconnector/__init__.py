"""The syshax KV connector for vLLM: this directory's ``syshax_kv_*.py`` modules are what the
node agent puts on the engines' ``PYTHONPATH`` (docs/agent.md), loaded there as top-level
modules with vLLM and torch. ``syshax_kv_shm.py`` needs the standard library only: the
simulator imports it from here for the same segment names and parameter checks."""
