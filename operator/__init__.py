"""The Kubernetes operator: InferenceService CRD handlers, GPU discovery, profile selection."""
