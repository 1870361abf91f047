"""tfray's implementation. Nothing here is public API; see ``tfray``."""
