"""Replay service: fresh store and reference pool, staleness policy and admission, write-ahead log,
batch serving (docs/data_plane.md). Runs as its own process or in a thread of the learner."""
