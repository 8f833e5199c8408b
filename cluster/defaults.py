"""Ports and other defaults shared by the CLI, the servers and the deployment files (light:
importing it pulls in neither Ray nor gRPC)."""

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the suggested --http-port (the OpenAI-compatible API is off by default)
DEFAULT_SERVE_GRPC_PORT = 9000  # Ray Serve's gRPC proxy in deploy/serve.yaml and the Helm chart
AUTH_TOKEN_ENV = "SWASERVE_AUTH_TOKEN"  # the gRPC bearer token, when no --auth-token-file
API_KEY_ENV = "SWASERVE_API_KEY"  # the HTTP API's key, when no --api-key-file / api_key
