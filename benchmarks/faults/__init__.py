"""Network and process faults and attacks on a live star in network namespaces (root)."""
