"""eagle3-extract."""
