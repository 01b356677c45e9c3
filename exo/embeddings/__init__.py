"""Sentence embeddings: the embedding models a node serves (registry.py), loaded and run (model.py), and the batcher
that runs concurrent requests together on a thread of their own (batcher.py)."""
