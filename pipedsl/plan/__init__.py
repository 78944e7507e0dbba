"""`pipedsl plan`: which dp × pp × tp, ZeRO stage, schedule and batch split trains a model fastest
on a cluster — the pipeline part simulated on each schedule's real compiled program."""

from pipedsl.plan.cluster import CLUSTERS, ClusterSpec, cluster_preset
from pipedsl.plan.config import Layout
from pipedsl.plan.memory import ModelStates, model_states
from pipedsl.plan.model import MODELS, ModelSpec, model_preset
from pipedsl.plan.search import Estimate, LayoutError, PlanResult, evaluate, layouts, search

__all__ = ["CLUSTERS", "MODELS", "ClusterSpec", "Estimate", "Layout", "ModelSpec", "ModelStates", "PlanResult",
           "LayoutError", "cluster_preset", "evaluate", "layouts", "model_preset", "model_states", "search"]
