"""Where each request goes: the route it travels (route.py), the group the node where it arrives picks for it
(router.py), and how each node passes it on along its route (forwarding.py)."""
