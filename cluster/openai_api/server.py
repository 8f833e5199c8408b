"""OpenAIServer: what the routes of the OpenAI app serve from (`app.state.openai`)."""

from __future__ import annotations

import hmac
import time
from typing import Any

from swaserve.cluster.ingress_limits import client_key
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.model_info import ModelInfo
from swaserve.cluster.openai_api.jobs import JobBuilder
from swaserve.cluster.openai_api.responses import (
    ResponsesService,
    ResponseStore,
    SharedResponseStore,
)
from swaserve.cluster.openai_api.stream import Responder
from swaserve.cluster.routed import RoutedCluster


class OpenAIServer:
    """What the routes serve from: the cluster, the metrics (None: no /metrics) and the API key
    (None: no auth). Set it as `app.state.openai`."""

    def __init__(
        self,
        cluster: RoutedCluster,
        metrics: ServingMetrics | None = None,
        api_key: str | None = None,
        store: ResponseStore | SharedResponseStore | None = None,
    ) -> None:
        """`store`: where /v1/responses keeps responses (default: this process's own)."""
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key must not be empty")
        self.cluster, self.metrics = cluster, metrics
        if metrics is not None:
            metrics.watch(cluster)
        self._expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.started = int(time.time())
        self.jobs = JobBuilder(cluster)  # request body -> Job (tokenizes: off the event loop)
        self.responder = Responder(cluster, metrics)  # Job -> choices -> response
        self.responses = ResponsesService(self.jobs, self.responder, store)  # /v1/responses

    @property
    def info(self) -> ModelInfo:
        return self.jobs.info

    @property
    def serving(self) -> bool:
        ready = self.cluster.model_info is not None
        return ready and not self.cluster.draining and bool(self.cluster.live_workers)

    def authorized(self, header: str) -> bool:
        if self._expected_auth is None:
            return True
        return hmac.compare_digest(header.encode(), self._expected_auth)

    def client_of(self, header: str, peer: str | None) -> str | None:
        """Whose budget a request counts against (`ingress_limits.client_key`): its key when
        the server requires one, else its address; None when it fails the key (a 401 follows,
        and nothing is counted)."""
        if self._expected_auth is None:
            return client_key(None, peer)
        return client_key(header, peer) if self.authorized(header) else None

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.info.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "swaserve",
            "max_model_len": self.info.limits.max_model_len,
        }
