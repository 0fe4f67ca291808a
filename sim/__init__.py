"""A vLLM-compatible engine simulator: API, metrics, timing and KV handoff (docs/simulator.md)."""
