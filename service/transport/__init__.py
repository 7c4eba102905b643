"""The transports over the one data plane: gRPC (servicer, health, reflection, long-lived streams), HTTP, and the RPC
spans."""
