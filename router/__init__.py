"""Prefix-, SWA- and headroom-aware routing (architecture §5 router). Python and numpy: no torch, no Ray."""

from swaserve.router.approx_view import ApproxCacheView
from swaserve.router.cache_view import CacheViewCorrupted
from swaserve.router.config import RouterConfig
from swaserve.router.decision import Outcome, Overloaded, RouteDecision
from swaserve.router.exact_view import ExactCacheView
from swaserve.router.policies import POLICIES, Candidate, Candidates, Policy, RouteRequest
from swaserve.router.request_queue import QueuedRequest, RequestQueue
from swaserve.router.router import Router
from swaserve.router.stats import RouterStats
from swaserve.router.worker_state import RequestNeed, WorkerState, request_need
from swaserve.router.worker_table import WorkerTable

__all__ = [
    "POLICIES",
    "ApproxCacheView",
    "CacheViewCorrupted",
    "Candidate",
    "Candidates",
    "ExactCacheView",
    "Outcome",
    "Overloaded",
    "Policy",
    "QueuedRequest",
    "RequestNeed",
    "RequestQueue",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterStats",
    "WorkerState",
    "WorkerTable",
    "request_need",
]
