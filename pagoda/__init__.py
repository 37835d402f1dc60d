"""Pagoda: GPU-aware LLM inference services on Kubernetes."""

__version__ = "0.1.0"
