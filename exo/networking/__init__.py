from exo.networking.discovery import Discovery
from exo.networking.peer_handle import PeerHandle
from exo.networking.server import Server

__all__ = ["Discovery", "PeerHandle", "Server"]
