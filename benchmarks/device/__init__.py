"""One report per device profile, and the memory planner against measured peak RSS."""
