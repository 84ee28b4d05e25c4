"""eagle3-train."""
