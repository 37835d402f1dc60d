"""The serving process: engine, model loading, HTTP and gRPC APIs, metrics."""
