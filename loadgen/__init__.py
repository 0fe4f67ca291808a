"""The benchmark load generator: streaming OpenAI requests timed per SSE chunk.

``scenarios``, ``stats``, ``workload``, ``report`` and ``accuracy`` are pure and safe to
import anywhere (the control plane will use them); ``wire`` times the requests on bare asyncio
protocols; ``client`` and ``runner`` drive them; ``cli`` is ``syshax benchmark``.
"""
