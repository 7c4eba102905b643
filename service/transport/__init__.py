"""The transports over the one data plane: gRPC (the servicer, health, reflection and their long-lived streams)
and HTTP (probes and metrics; the RPCs as protobuf or JSON)."""
