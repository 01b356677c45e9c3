"""The batching plugin (plugin.py), a scheduling policy that EXO_BATCH_SIZE turns on, and its settings (config.py)."""
