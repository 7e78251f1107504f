"""Flower 1.42 app for benchmarks/transfer.py: fit-only FedAvg, trivial training."""
