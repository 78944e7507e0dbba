"""pipedsl.parallel: data × pipeline × tensor process groups, 1-D and 3-D tensor parallelism, ZeRO.

Everything takes its process groups explicitly; nothing here keeps global state.

    cfg = ParallelConfig(dp=2, pp=2, tp=8, tp_mode="3d", zero=2)
    cfg.check_model(hidden=1024, heads=16, vocab=32768, batch=64, microbatches=8)
    mesh = ParallelMesh(cfg)                    # collective: every rank of the world
    block = Block3D.from_dense(dense_block, mesh.cube)
    zero = ZeroOptimizer(block, torch.optim.Adam, group=mesh.dp_group, stage=cfg.zero, lr=1e-3)
"""

from . import gpt
from .comm import CommCounter, count_comm
from .config import ParallelConfig, ParallelConfigError
from .mesh import Coords, Cube3D, ParallelMesh
from .optim import PipelineOptimizer
from .tp1d import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .tp3d import Block3D, Classifier3D, Embedding3D, LayerNorm3D, Linear3D, loss_value
from .tp_gpt import tp_gpt_loss, tp_gpt_stages
from .tp_hf import tp_hf_loss, tp_hf_stages
from .zero import MemoryReport, ZeroOptimizer, memory_report

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
    "PipelineOptimizer",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ZeroOptimizer",
    "count_comm",
    "gpt",
    "loss_value",
    "memory_report",
    "tp_gpt_loss",
    "tp_gpt_stages",
    "tp_hf_loss",
    "tp_hf_stages",
    "vocab_parallel_cross_entropy",
]
