"""Conformance vectors of the Fleet protocol: ``vectors.json``, written by `generate`.

A second implementation of the protocol checks itself against them: how a set of
tensors becomes a payload (bytes, SHA-256 digest, chunks), what FedAvg makes of a few
updates, how records and values encode, and a few whole wire messages. The vectors
come from fedloom's own code, and ``tests/protocol`` fails when the committed file no
longer matches it.
"""
