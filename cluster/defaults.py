"""Ports and other defaults shared by the CLI, the servers and the deployment files (light:
importing it pulls in neither Ray nor gRPC)."""

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the suggested --http-port (the OpenAI-compatible API is off by default)
DEFAULT_SERVE_GRPC_PORT = 9000  # Ray Serve's gRPC proxy in deploy/serve.yaml and the Helm chart
