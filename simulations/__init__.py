"""fedloom."""
