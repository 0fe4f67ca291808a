"""The OpenAI-compatible PD router (``syshax router``; docs/router.md).

From the top (the composition root) to the bottom (the engines); each part imports only
those below it:

- ``cli``, ``workers``: flags, wiring, the ``--workers`` supervisor;
- ``api``: the HTTP face (the aiohttp app, health, metrics, the catch-all proxy);
- ``policy``: the policy sources (a file, or the control plane and its on-disk copy);
- ``request``: one completions request, from arrival to last byte, top-down;
- ``pd``: the PD protocols (vLLM's KV transfer, sysHAX's patched engines);
- ``state``: what every request reads: configuration, policies, deployments, metrics;
- ``client``: what a client may send and the answer it gets (access, validation, stream);
- ``decide``: the deciders, pure functions of the policy and the engines' loads;
- ``metrics``: the router's own Prometheus metrics;
- ``engines``: the engine transport, backends, scraping and deadlines.
"""
