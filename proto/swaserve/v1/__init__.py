"""swaserve.v1: the public inference API (inference.proto) and its generated stubs."""
