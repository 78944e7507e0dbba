"""pipedsl.parallel: data × pipeline × tensor process groups, 1-D and 3-D tensor parallelism, ZeRO.

Everything takes its process groups explicitly; nothing here keeps global state.  A leaf over
torch.distributed: nothing here knows a pipeline or a model (tp blocks are built from any dense pre-LN
block, tp1d's `DenseBlock`, such as pipedsl.models.gpt's `Block`; which module of a model splits how is the
model's own plan, models/<name>/parallelize.py, over the mechanisms here).

    cfg = ParallelConfig(dp=2, pp=2, tp=8, tp_mode="3d", zero=2)
    cfg.check_model(hidden=1024, heads=16, vocab=32768, batch=64, microbatches=8)
    mesh = ParallelMesh(cfg)                    # collective: every rank of the world
    block = Block3D.from_dense(dense_block, mesh.cube)
    zero = ZeroOptimizer(block, torch.optim.Adam, group=mesh.dp_group, stage=cfg.zero, lr=1e-3)
"""

from pipedsl.parallel.comm import CommCounter, count_comm
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.mesh import Coords, Cube3D, ParallelMesh
from pipedsl.parallel.tp1d import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from pipedsl.parallel.tp3d import Block3D, Classifier3D, Embedding3D, LayerNorm3D, Linear3D, loss_value
from pipedsl.parallel.zero import MemoryReport, ZeroOptimizer, memory_report

__all__ = [
    "Block3D",
    "Classifier3D",
    "ColumnParallelLinear",
    "CommCounter",
    "Coords",
    "Cube3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "MemoryReport",
    "ParallelBlock",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelMLP",
    "ParallelMesh",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ZeroOptimizer",
    "count_comm",
    "loss_value",
    "memory_report",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str) -> object:  # names that moved up a layer (registry.MOVED)
    from pipedsl.registry import moved

    return moved(__name__, name)
