"""eagle3-eval."""
