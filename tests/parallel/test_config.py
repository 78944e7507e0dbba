"""ParallelConfig refuses every bad layout with a one-line message; ParallelMesh builds the groups it promises."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pipedsl.errors import PipeDSLError
from pipedsl.parallel import ParallelConfig, ParallelConfigError, ParallelMesh

BAD = [
    (dict(dp=0), "dp must be at least 1, got 0"),
    (dict(tp=-2), "tp must be at least 1, got -2"),
    (dict(pp=1.5), "pp must be an integer, got 1.5"),
    (dict(tp_mode="2d"), "tp_mode must be one of '1d', '3d', got '2d'"),
    (dict(zero=4), "zero must be a ZeRO stage 0, 1, 2 or 3, got 4"),
    (dict(tp=4, tp_mode="3d"), "tp_mode='3d' needs tp to be a cube q*q*q, got tp=4 (nearest cubes: 1, 8)"),
    (dict(tp=9, tp_mode="3d"), "tp_mode='3d' needs tp to be a cube q*q*q, got tp=9 (nearest cubes: 8, 27)"),
    (dict(zero=2, zero_reduce="never"), "zero_reduce must be one of 'step', 'microbatch', got 'never'"),
    (dict(zero=1, zero_reduce="microbatch"),
     "zero_reduce='microbatch' needs zero=2 or 3 (zero=1 keeps the full gradient buffer anyway); use zero_reduce='step'"),
    (dict(zero=3, zero_reshard="never"), "zero_reshard must be one of 'auto', 'unit', 'step', got 'never'"),
    (dict(zero=2, zero_reshard="step"), "zero_reshard='step' needs zero=3 (zero=2 keeps the full parameters anyway)"),
]


def _one_line(err: PipeDSLError) -> str:
    text = str(err)
    assert "\n" not in text
    assert text.startswith("invalid parallel configuration: ")
    return text.removeprefix("invalid parallel configuration: ")


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_config(kwargs, message):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs)
    assert _one_line(info.value) == message


def test_world_size_not_the_product():
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(dp=2, pp=2, tp=2).check_world(6)
    assert _one_line(info.value) == "world size 6 is not dp*pp*tp = 2*2*2 = 8"


MODEL = [
    (dict(tp=4), dict(heads=6), "number of attention heads 6 is not divisible by tp=4 (1-D tensor parallelism splits it over the tp ranks)"),
    (dict(tp=4), dict(hidden=30), "hidden size 30 is not divisible by tp=4 (1-D tensor parallelism splits it over the tp ranks)"),
    (dict(tp=2), dict(vocab=50257), "vocabulary size 50257 is not divisible by tp=2 (1-D tensor parallelism splits it over the tp ranks)"),
    (dict(tp=2), dict(ffn=33), "ffn size 33 is not divisible by tp=2 (1-D tensor parallelism splits it over the tp ranks)"),
    (dict(), dict(hidden=30, heads=4), "hidden size 30 is not divisible by the 4 attention heads"),
    (dict(dp=4), dict(batch=6), "batch 6 is not divisible by dp*microbatches = 4*1 = 4"),
    (dict(dp=2), dict(batch=12, microbatches=4), "batch 12 is not divisible by dp*microbatches = 2*4 = 8"),
    (dict(tp=8, tp_mode="3d"), dict(heads=3), "attention heads 3 are not divisible by q=2 (3-D tensor parallelism splits heads over a cube edge, tp=8)"),
    (dict(tp=8, tp_mode="3d"), dict(hidden=18, heads=2), "hidden size 18 is not divisible by q*q=4 (3-D weights are split [in/q^2, out/q], tp=8)"),
    (dict(tp=8, tp_mode="3d"), dict(vocab=50), "vocabulary size 50 is not divisible by q*q=4 (3-D weights are split [in/q^2, out/q], tp=8)"),
    (dict(dp=2, tp=8, tp_mode="3d"), dict(batch=16, microbatches=4),
     "microbatch of 2 samples (batch 16 / dp 2 / 4 microbatches) is not divisible by q*q=4 (3-D tensor parallelism splits it over q^2 ranks)"),
    (dict(), dict(batch=8, microbatches=0), "microbatches must be at least 1, got 0"),
]


@pytest.mark.parametrize("cfg,model,message", MODEL)
def test_model_does_not_divide(cfg, model, message):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**cfg).check_model(**model)
    assert _one_line(info.value) == message


def test_good_layouts_pass():
    ParallelConfig(dp=2, pp=2, tp=2).check_model(hidden=64, heads=8, vocab=1024, ffn=256, batch=32, microbatches=8)
    cfg = ParallelConfig(tp=27, tp_mode="3d", zero=3)
    assert cfg.q == 3 and cfg.world_size == 27
    cfg.check_model(hidden=72, heads=6, vocab=90, batch=36)
    with pytest.raises(ParallelConfigError, match="only exists for tp_mode='3d'"):
        _ = ParallelConfig(tp=2).q


def test_mesh_needs_an_initialised_world():
    assert not dist.is_initialized(), "the test process itself never joins a world"
    with pytest.raises(ParallelConfigError, match="torch.distributed is not initialised"):
        ParallelMesh(ParallelConfig())


@pytest.mark.parametrize("backend, device_type", [("nccl", "cuda"), ("gloo", "cpu")])
def test_the_mesh_lives_on_the_backends_device(monkeypatch, backend, device_type):
    """Under NCCL the DeviceMesh is a CUDA one: DTensors on a CPU mesh (the old default every caller kept) moved
    Hugging Face tensor parallelism's activations to the host while its weights stayed on the GPU."""
    from pipedsl.parallel import mesh as mesh_module

    seen = []

    class BuiltError(Exception):  # stops the mesh once its device type is seen
        pass

    def init_device_mesh(kind, shape, **_):
        seen.append(kind)
        raise BuiltError

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *_: 1)
    monkeypatch.setattr(dist, "get_backend", lambda *_: backend)
    monkeypatch.setattr(mesh_module, "_options", lambda *_: None)
    monkeypatch.setattr(mesh_module, "init_device_mesh", init_device_mesh)
    with pytest.raises(BuiltError):
        ParallelMesh(ParallelConfig())
    assert seen == [device_type]


def mesh_job(cfg: ParallelConfig) -> dict:
    mesh = ParallelMesh(cfg)
    out = {"rank": dist.get_rank(), "coords": mesh.coords, "dp": mesh.dp_ranks, "pp": mesh.pp_ranks,
           "tp": mesh.tp_ranks, "desc": mesh.dp_group.group_desc}
    if mesh.cube is not None:
        c = mesh.cube
        out["cube"] = {name: dist.get_process_group_ranks(getattr(c, name))
                       for name in ("input", "weight", "output", "input_x_weight", "weight_x_output", "whole")}
        out["a"] = (c.a_in, c.a_w, c.a_out)
        s = c.swapped()
        out["swapped"] = (dist.get_process_group_ranks(s.input), dist.get_process_group_ranks(s.output),
                          dist.get_process_group_ranks(s.input_x_weight))
    try:
        ParallelMesh(ParallelConfig(dp=cfg.world_size + 1))
    except ParallelConfigError as err:
        out["wrong world"] = str(err)
    return out


@pytest.mark.slow
def test_mesh_dp_pp_tp(run_once):
    res = run_once(mesh_job, 8, ParallelConfig(dp=2, pp=2, tp=2))
    for r, m in enumerate(res):
        pp, dp, tp = r // 4, (r // 2) % 2, r % 2  # (pp, dp, tp), tp fastest
        assert (m["coords"].pp, m["coords"].dp, m["coords"].tp) == (pp, dp, tp)
        assert m["tp"] == [r - tp, r - tp + 1]
        assert m["dp"] == [pp * 4 + tp, pp * 4 + 2 + tp]
        assert m["pp"] == [dp * 2 + tp, 4 + dp * 2 + tp]
        assert m["wrong world"] == "invalid parallel configuration: world size 8 is not dp*pp*tp = 9*1*1 = 9"


@pytest.mark.slow
def test_mesh_3d_cube(run_once):
    res = run_once(mesh_job, 8, ParallelConfig(tp=8, tp_mode="3d"))
    seen = set()
    for r, m in enumerate(res):
        x, y, z = m["coords"].cube
        assert r == x * 4 + y * 2 + z
        cube = m["cube"]
        assert cube["weight"] == sorted({i * 4 + y * 2 + z for i in range(2)})  # x varies
        assert cube["output"] == sorted({x * 4 + j * 2 + z for j in range(2)})  # y varies
        assert cube["input"] == sorted({x * 4 + y * 2 + k for k in range(2)})  # z varies
        assert cube["input_x_weight"] == sorted({i * 4 + y * 2 + k for i in range(2) for k in range(2)})
        assert cube["weight_x_output"] == sorted({i * 4 + j * 2 + z for i in range(2) for j in range(2)})
        assert cube["whole"] == list(range(8)) == m["tp"]
        assert m["a"] == (z, x, y)
        assert m["swapped"] == (cube["output"], cube["input"], cube["weight_x_output"])
        seen.add((x, y, z))
    assert len(seen) == 8
