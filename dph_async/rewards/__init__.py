"""Verifiable rewards: a registry keyed by `data_source`, sandboxed scorers, pools and services."""
