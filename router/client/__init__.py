"""The client's side of a request: what a client may send and the answer it gets.

- ``access``: the keys, who may force a policy mode, the engine paths the catch-all
  forwards and the headers that go with them;
- ``validate``: the body checked before any engine sees it, and the fields only the router
  sets;
- ``stream``: the client's request (``ClientRequest``) and its answer as one stream with one
  id and one usage (``ClientStream``), whatever number of engine requests produce it;
- ``sse``: the chunks the router writes itself when it splices a stream;
- ``errors``: OpenAI-shaped errors, the only failures a client ever sees.
"""
