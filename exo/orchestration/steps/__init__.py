"""A node's steps: the one step loop every forward pass goes through (loop.py), each shard's policy (scheduler.py,
micro_batches.py), and the step core (core.py), which makes each step's results one output."""
