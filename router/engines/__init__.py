"""The engines as the router reaches them.

- ``transport``: the one HTTP/1.1 client for engines, a pool of keep-alive connections
  each (passthrough, PD, tokenize, scrapes, the proxy), and ``UpstreamFailed``;
- ``deadlines``: one 100 ms ticker for every deadline (connect, first byte, idle, request);
- ``backends``: one engine endpoint: its pool, in-flight requests, ejection, scraped load;
- ``scrape``: the background scrape of every engine's ``/metrics``;
- ``load``: parsing that text into the numbers the deciders read (pure functions).
"""
