"""Quayutec rooms: the common package shared by every service (config, database, server, errors).

The generated protobuf code lives in ``quayutec.v1``.
"""
