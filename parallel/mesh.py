"""Process groups for a `ParallelConfig`: one torch `DeviceMesh`, a group per dimension.

The mesh is (pp, dp, tp) with tp fastest (its ranks consecutive); with expert parallelism dp is
itself (edp, ep): `ep_group` the ep consecutive dp ranks that exchange tokens, `edp_group` the ranks
holding the same experts (parallel/expert.py).  For 3-D tensor
parallelism the tp dimension is itself a q × q × q cube with axes (tp_x, tp_y, tp_z), and
the flattened groups `tp` (the whole cube) and the two q² planes `tp_xz`, `tp_xy` exist too.
Nothing is global: the runtime takes `mesh.pp_group` for its messages and `mesh.dp_group` for
gradient reduction, tensor-parallel layers take `mesh.tp_group` (1-D) or `mesh.cube` (3-D).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipedsl.parallel.config import ParallelConfig, ParallelConfigError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Cube3D:
    """One orientation of a q × q × q tensor-parallel cube (Bian et al. 2021, §3).

    A linear Y = X W in this orientation works on blocks (a_in, a_w, a_out = this rank's
    coordinates in the `input`, `weight` and `output` groups):

        X  [b/q², in/q]   rows: block a_w, sub-block a_in;   columns: block a_out
        W  [in/q², out/q] rows: block a_out, sub-block a_w;  columns: block a_in
        Y  [b/q², out/q]  rows: block a_w, sub-block a_out;  columns: block a_in

    so Y is laid out like X in the `swapped()` orientation (input ⟷ output), which is the
    orientation of the next linear.  Parameters that are not split q³ ways are replicated
    on a q² plane and reduce their gradients over it: a vector over Y's columns (a bias)
    over `weight_x_output`, a vector over X's columns (a LayerNorm weight) over `input_x_weight`.
    """

    q: int
    input: ProcessGroup
    weight: ProcessGroup
    output: ProcessGroup
    input_x_weight: ProcessGroup
    weight_x_output: ProcessGroup
    whole: ProcessGroup

    @property
    def a_in(self) -> int:
        return dist.get_rank(self.input)

    @property
    def a_w(self) -> int:
        return dist.get_rank(self.weight)

    @property
    def a_out(self) -> int:
        return dist.get_rank(self.output)

    def swapped(self) -> Cube3D:
        """The orientation of the next linear: input and output axes exchanged."""
        return Cube3D(self.q, self.output, self.weight, self.input, self.weight_x_output, self.input_x_weight,
                      self.whole)

    # -------- the block of a full tensor this rank holds, for tests and data loading (no communication)

    def row_block(self, full_rows: int) -> slice:
        """The samples of a [b, …] tensor this rank holds: block a_w, sub-block a_in (b/q² of them)."""
        if full_rows % (self.q * self.q):
            raise ParallelConfigError(f"{full_rows} samples cannot be split over q*q={self.q * self.q} ranks")
        n = full_rows // (self.q * self.q)
        start = (self.a_w * self.q + self.a_in) * n
        return slice(start, start + n)

    def col_block(self, full_cols: int) -> slice:
        """The columns of an activation in this orientation: block a_out (of q)."""
        if full_cols % self.q:
            raise ParallelConfigError(f"{full_cols} columns cannot be split over q={self.q} ranks")
        n = full_cols // self.q
        return slice(self.a_out * n, (self.a_out + 1) * n)

    def split_input(self, x):
        """This rank's block [b/q², …, h/q] of a full activation [b, …, h] in this orientation."""
        return x[self.row_block(x.shape[0])][..., self.col_block(x.shape[-1])].contiguous()


@dataclass(frozen=True)
class Coords:
    """This rank's position: dp replica, pp rank, tp rank (and its cube coordinates in 3-D)."""

    dp: int
    pp: int
    tp: int
    cube: tuple[int, int, int] | None = None  # (x, y, z) for 3-D


def backend_device_type(group: ProcessGroup | None = None) -> str:
    """The device type `group`'s collectives move and its tensors live on: "cuda" under NCCL (device memory
    only), "cpu" otherwise."""
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def _options(backend: str, timeout: datetime.timedelta):
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":  # pragma: no cover - no GPU here
        opts = dist.ProcessGroupNCCL.Options()
    else:  # pragma: no cover
        return None
    opts._timeout = timeout
    return (backend, opts)


class ParallelMesh:
    """The groups of one rank for a `ParallelConfig`, built collectively by every rank of the world."""

    def __init__(self, config: ParallelConfig, device_type: str | None = None,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        """`device_type`: the DeviceMesh's, which DTensors built on it (tensor parallelism) place their local
        tensors on — by default "cuda" under NCCL, else "cpu" (a CPU mesh under NCCL moved every activation of
        Hugging Face tensor parallelism to the host while its weights stayed on the GPU)."""
        if not dist.is_initialized():
            raise ParallelConfigError("torch.distributed is not initialised: call init_process_group "
                                      "(or launch with torchrun) before building a ParallelMesh")
        config.check_world(dist.get_world_size())
        self.config = config
        backend = dist.get_backend()
        if device_type is None:
            device_type = backend_device_type()
        override = _options(backend, timeout)
        # dp is (edp, ep) with expert parallelism: ep consecutive dp ranks share one copy of the experts
        dp_names, dp_shape = (("edp", "ep"), (config.dp // config.ep, config.ep)) if config.ep > 1 else (("dp",),
                                                                                                      (config.dp,))
        if config.tp_mode == "3d":
            q = config.q
            names = ("pp", *dp_names, "tp_x", "tp_y", "tp_z")
            shape = (config.pp, *dp_shape, q, q, q)
        else:
            names, shape = ("pp", *dp_names, "tp"), (config.pp, *dp_shape, config.tp)
        kw = {} if override is None else {"backend_override": {n: override for n in names}}
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=names, **kw)
        fkw = {} if override is None else {"backend_override": override}
        # the ranks that exchange tokens (ep) and those that hold the same experts (edp): parallel/expert.py
        self.ep_group: ProcessGroup | None = None
        self.edp_group: ProcessGroup | None = None
        if config.ep > 1:
            self.device_mesh["edp", "ep"]._flatten("dp", **fkw)
            self.ep_group = self.device_mesh.get_group("ep")
            self.edp_group = self.device_mesh.get_group("edp")
        self.cube: Cube3D | None = None
        if config.tp_mode == "3d":
            m = self.device_mesh
            tp = m["tp_x", "tp_y", "tp_z"]._flatten("tp", **fkw)
            xz = m["tp_x", "tp_z"]._flatten("tp_xz", **fkw)
            xy = m["tp_x", "tp_y"]._flatten("tp_xy", **fkw)
            # canonical orientation: weight axis x, output axis y, input axis z
            self.cube = Cube3D(q, input=m.get_group("tp_z"), weight=m.get_group("tp_x"), output=m.get_group("tp_y"),
                               input_x_weight=xz.get_group(), weight_x_output=xy.get_group(), whole=tp.get_group())
            self.tp_group: ProcessGroup = tp.get_group()
        else:
            self.tp_group = self.device_mesh.get_group("tp")
        self.dp_group: ProcessGroup = self.device_mesh.get_group("dp")
        self.pp_group: ProcessGroup = self.device_mesh.get_group("pp")
        c = self.device_mesh.get_coordinate()
        assert c is not None
        if config.ep > 1:  # (pp, edp, ep, tp…) → (pp, dp, tp…)
            c = [c[0], c[1] * config.ep + c[2], *c[3:]]
        if self.cube is not None:
            x, y, z = c[2:]
            self.coords = Coords(dp=c[1], pp=c[0], tp=dist.get_rank(self.tp_group), cube=(x, y, z))
        else:
            self.coords = Coords(dp=c[1], pp=c[0], tp=c[2])

    def with_zero(self, zero: int, zero_reduce: str = "step", zero_reshard: str = "auto") -> ParallelMesh:
        """The same groups under another ZeRO setting (no collective: ZeRO only changes what runs on dp)."""
        out = copy.copy(self)
        out.config = dataclasses.replace(self.config, zero=zero, zero_reduce=zero_reduce, zero_reshard=zero_reshard)
        return out

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, in stage-rank order (pp rank k → pp_ranks[k])."""
        return dist.get_process_group_ranks(self.pp_group)

    @property
    def dp_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.dp_group)

    @property
    def tp_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.tp_group)

    def __repr__(self) -> str:
        c = self.config
        return (f"ParallelMesh(dp={c.dp}, pp={c.pp}, tp={c.tp} {c.tp_mode}, ep={c.ep}, rank {dist.get_rank()} at "
                f"{self.coords})")
