"""The router's HTTP face: the aiohttp app, its routes and middleware (``app``), the health,
metrics and models endpoints (``endpoints``) and the catch-all that forwards a few engine
paths (``proxy``). The completions endpoints hand each request to ``router.request``."""
