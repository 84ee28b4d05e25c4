"""Capture backends: transformers (reference, CPU) and vLLM (production)."""
