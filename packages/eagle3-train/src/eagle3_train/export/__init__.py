"""What comes out and goes back in: the checkpoint vLLM serves (write), its model card, and
reading a published draft to start from (init_from)."""
