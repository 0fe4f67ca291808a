"""What stands real things up for the tests and the benchmarks alike: the vLLM CPU virtualenv
and tiny local models (vllm_env, tiny_model), throwaway Redis and PostgreSQL (services), the
chaos suite's own system (chaos), database builders (factories), and the load harnesses that
both a test and a script in scripts/bench drive (broker_stress, slow_clients, stall_probe).

It sits above every product package and no product package imports it (pyproject.toml's
import contracts)."""
