"""gRPC transport of the ring: node_service.proto (the wire contract), its generated stubs, codec, server, client."""
