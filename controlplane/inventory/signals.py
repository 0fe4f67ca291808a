"""What the inventory announces about nodes. The deployments app (above this one) receives
them (deployments/apps.py), so the inventory never calls up into it.

``node_lost`` is sent inside the transaction that marks the node offline, so a receiver's
writes commit or roll back with it. ``node_returned`` is sent after the commit that brought
the node back online.
"""

from django.dispatch import Signal

node_lost = Signal()  # sender: Node (the class); node: the Node row
node_returned = Signal()  # sender: Node (the class); node_id: int
