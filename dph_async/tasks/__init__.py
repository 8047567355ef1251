"""Tasks: the embedded procedural task and loaders for user datasets."""
