"""The machine gateway: an asyncio front of the control plane for its fleet's hottest
requests (docs/scale.md, "The machine gateway").

Agents heartbeat and poll for commands, routers poll for policy and deployments; at 5,000
agents and 200 routers that is about 1,400 requests a second, nearly all of which change
nothing or little. Through Django each costs a web thread several milliseconds of CPU. The
gateway answers them in one event loop: heartbeats go to the database in group commits,
idle command fetches and unchanged polls are answered from one snapshot a quarter of a second
old, and everything else is handed to the control plane unchanged.
"""
