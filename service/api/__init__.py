"""The serving process's APIs: OpenAI-compatible HTTP and gRPC, thin adapters over one engine client."""
