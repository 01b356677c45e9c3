from exo.orchestration.node import Node

__all__ = ["Node"]
