"""Generated gRPC stubs, laid out as the .proto packages are (`swaserve.v1`)."""
