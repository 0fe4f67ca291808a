"""The policy sources: where the router's policies and deployments (the deciders' inputs)
come from, written into its live state (``router.state``).

- ``standalone``: a policy file plus flag overrides, a tenants file and a deployments file,
  reloaded on change and on SIGHUP;
- ``deployments_file``: that deployments file, in the control plane's document shape;
- ``documents``: reading those files (JSON or YAML);
- ``managed``: pulled from the control plane, with the last good copy kept on disk;
- ``source``: what the composition root (``router.cli``) asks of either.
"""
