"""The PD protocols: one request split across a deployment's engines, GPU prefill and CPU
decode, in the wire protocol its engines speak.

- ``registry``: the protocols by name (a deployment's ``pd_protocol``) and their interface;
- ``vllm``: upstream vLLM V1 with the SyshaxShmConnector (KV handed over by transfer);
- ``syshax``: sysHAX's patched engines (the KV named by ``request_id_inference``);
- ``sequence``: ``PdSequence``, all a protocol is given for one request.
"""
