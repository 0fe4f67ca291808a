"""The shared layer: what more than one process needs (docs/architecture.md).

The control plane, the agents, the router, the simulator and the load generator import this
package and themselves; this package imports none of them. It holds the wire contracts (the
engine spec, the policy schema, the inventory hash), the errors every layer raises, the CPU
affinity planner, the device and model datasheets, the container arguments of a spec, atomic
files and child-process supervision.
"""

__version__ = "0.1.0"
