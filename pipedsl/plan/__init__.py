"""`pipedsl plan`: which dp × pp × tp, ZeRO stage, schedule, batch split, recomputation, sequence
parallelism and attention kernel trains a model fastest on a cluster, among the layouts the runtime
can run for it — the pipeline part simulated on each schedule's real compiled program.  Encoder-decoders
(mT5), whose stages differ in cost, are searched alike (both kinds are a `PlannedModel`), their units priced by
the same cost function (`plan/cost.py`) into the same `Estimate`."""

from pipedsl.plan.activations import layer_activation_bytes
from pipedsl.plan.cluster import CLUSTERS, ClusterSpec, cluster_preset
from pipedsl.plan.config import Layout
from pipedsl.plan.encdec import ENCDEC_MODELS, encdec_preset
from pipedsl.plan.memory import ModelStates, model_states
from pipedsl.plan.model import MODELS, EncDecSpec, ModelSpec, PlannedModel, model_preset
from pipedsl.plan.runnable import NotRunnableError, check_runnable
from pipedsl.plan.search import EncDecEstimate, Estimate, LayoutError, PlanResult, evaluate, layouts, search, zero_table

__all__ = ["CLUSTERS", "ENCDEC_MODELS", "MODELS", "ClusterSpec", "EncDecEstimate", "EncDecSpec", "Estimate", "Layout",
           "ModelSpec", "ModelStates", "NotRunnableError", "PlanResult", "PlannedModel", "LayoutError",
           "check_runnable", "cluster_preset", "encdec_preset", "evaluate", "layer_activation_bytes", "layouts",
           "model_preset", "model_states", "search", "zero_table"]
