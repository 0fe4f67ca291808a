"""A heterogeneous deployment in virtual time: two simulated engines and the router's decider."""
