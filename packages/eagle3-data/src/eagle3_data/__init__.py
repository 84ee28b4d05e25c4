"""eagle3-data."""
