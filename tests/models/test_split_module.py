"""`split_module`: any traceable model into stages that train like one process; `split_sequential`'s tuples."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import split_module_cases as cases
import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.models.split import SequentialStage, split_sequential
from pipedsl.models.split_graph import ModuleStage, split_module
from pipedsl.runtime.ties import find_ties


def _chain(stages: list[nn.Module], *inputs: torch.Tensor):
    """The stages called one after another in this process, as the pipeline passes their outputs on."""
    h = inputs
    for stage in stages:
        h = stage(*h)
        if stage is not stages[-1]:
            h = h if isinstance(h, tuple) else (h,)
    return h


def _check(results: list[dict]) -> None:
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    covered = set().union(*(r["checked"] for r in results))
    assert covered == set(results[0]["all"]), f"parameters on no stage: {set(results[0]['all']) - covered}"


# ------------------------------------------------------------ one process


def test_exported_from_pipedsl_models():
    from pipedsl.models import split_module as exported  # the function, not a module of that name

    assert exported is split_module


@pytest.mark.parametrize("case", ["resnet", "unet", "vit", "dict", "frozen"])
def test_stages_hold_the_models_own_parameters_and_compute_its_output(case):
    """Every parameter and buffer is the model's object at its own name (no copies); the chained stages give
    the model's output and gradients exactly."""
    model, stages, inputs, _, _, forward = cases.build(case, 4)
    ref = copy.deepcopy(model)
    ours = {n: p for s in stages for n, p in s.named_parameters()}
    assert ours.keys() == dict(model.named_parameters()).keys()
    assert all(p is model.get_parameter(n) for n, p in ours.items())
    assert all(b is model.get_buffer(n) for s in stages for n, b in s.named_buffers())
    rows = slice(0, 2)
    out, want = _chain(stages, *(t[rows] for t in inputs)), forward(ref, rows)
    out, want = (out["logits"], want["logits"]) if case == "dict" else (out, want)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.square().mean().backward()
    want.square().mean().backward()
    for name, p in model.named_parameters():
        q = ref.get_parameter(name)
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def test_what_crosses_the_boundaries():
    """U-Net: the input crosses all three boundaries to the head, the first level's skip two.  ViT: only the
    hidden states; the cls token and position embeddings stay in stage 0.  Regroup: the batch size, which no
    tensor stage 1 receives has as a dimension, as a 0-d integer tensor."""
    _, stages, _, _, _, _ = cases.build("unet", 4)
    assert [s._program().inputs for s in stages] == [("x",), ("x", "relu", "max_pool2d"),
                                                    ("x", "relu", "relu_1", "max_pool2d_1"), ("x", "cat_1")]
    _, stages, (x,), _, _, _ = cases.build("vit", 4)
    assert [len(s._program().inputs) for s in stages] == [1, 1, 1, 1]
    assert {n for n, _ in stages[0].named_parameters()} >= {"cls_token", "pos_embed"}
    assert not any(n in ("cls_token", "pos_embed") for s in stages[1:] for n, _ in s.named_parameters())
    _, stages, (x,), _, _, _ = cases.build("regroup", 2)
    rows, h = stages[0](x[:2])
    assert rows.dtype == torch.int64 and rows.shape == () and rows.item() == 2 and h.shape == (8, 8)


def test_a_parameter_of_two_stages_is_a_tie_and_frozen_ones_stay_frozen():
    model, stages, *_ = cases.build("dict", 4)
    assert find_ties(stages) == [((0, "enc.embed.weight"), (3, "enc.embed.weight"))]
    model, stages, *_ = cases.build("frozen", 4)
    frozen = {n for s in stages for n, p in s.named_parameters() if not p.requires_grad}
    assert frozen == {"stem.weight", "stem.bias", "layers.1.weight", "layers.1.bias"}


def test_train_and_eval_run_their_own_graphs():
    """Dropout and BatchNorm follow the stage's mode: train equals the model in train mode (same seed, same
    dropout masks; BatchNorm's running statistics updated in place as the model would), eval its eval mode."""
    torch.manual_seed(0)
    vit = cases.ViT(depth=2, dropout=0.3)
    x = torch.randn(4, 3, 8, 8)
    stages = split_module(vit, ["blocks.1"], (x,))
    for mode in (True, False, True):
        vit.train(mode)
        for s in stages:
            s.train(mode)
        torch.manual_seed(5)
        out = _chain(stages, x)
        torch.manual_seed(5)
        torch.testing.assert_close(out, vit(x), rtol=0, atol=0)
    resnet, stages, *_ = cases.build("resnet", 4)
    ref = copy.deepcopy(resnet)
    torch.testing.assert_close(_chain(stages, x), ref(x), rtol=0, atol=0)
    for name, buf in ref.named_buffers():
        assert torch.equal(resnet.get_buffer(name), buf), name  # running stats and num_batches_tracked, in place
    for s in stages:
        s.eval()
    ref.eval()
    torch.testing.assert_close(_chain(stages, x[:3]), ref(x[:3]), rtol=0, atol=0)
    assert torch.equal(resnet.layer1[0].bn1.num_batches_tracked, torch.tensor(1))  # eval: no update


def test_a_model_in_eval_mode_is_traced_as_it_is():
    """Traced in eval mode (a BatchNorm kept frozen inside a model in train mode stays frozen too)."""
    model = cases.ResNet()
    model.layer1[0].bn1.eval()  # frozen statistics in a training model
    x = torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    stages = split_module(model, ["layer3"], (x,))
    torch.testing.assert_close(_chain(stages, x), ref(x), rtol=0, atol=0)
    assert torch.equal(model.layer1[0].bn1.running_mean, torch.zeros(8)), "its statistics stayed frozen"
    assert "train" in repr(stages[0]) and isinstance(stages[0], ModuleStage)


def test_unknown_out_of_order_and_idle_split_points_are_refused_in_one_line():
    resnet, x = cases.ResNet(), torch.randn(4, 3, 8, 8)
    dictnet, args, kwargs = cases.DictNet(), (torch.randn(4, 8),), {"mask": torch.ones(4, 8)}
    for model, points, message in [
            (resnet, ["layer5"], r"'layer5' is not a submodule of ResNet; near it: conv1, bn1, relu, layer1, layer2"),
            (resnet, ["layer2.1"], r"'layer2\.1' is not a submodule .* near it: layer2\.0$"),
            (dictnet, ["mix.2", "mix.1"], r"must follow the order the model runs them: 'mix\.1' runs before 'mix\.2'"),
            (dictnet, ["enc", "enc.embed"], r"'enc' and 'enc\.embed' begin at the same operation"),
            (dictnet, ["enc", "mix.1"], r"stage 0 \(before the first split point\) would compute nothing")]:
        with pytest.raises(PipeRuntimeError, match=message) as err:
            split_module(model, points, x if model is resnet else args, None if model is resnet else kwargs)
        assert "\n" not in str(err.value)

    class Idle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)
    with pytest.raises(PipeRuntimeError, match=r"'unused' \(Linear\) runs no operation in Idle\.forward .* near it: a$"):
        split_module(Idle(), ["unused"], (torch.randn(4, 4),))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # the line the error names
            h = self.b(h)
        return h


def test_untraceable_code_is_refused_naming_its_line(capfd):
    with pytest.raises(PipeRuntimeError) as err:
        split_module(DataDependent(), ["b"], (torch.randn(4, 4),))
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "the line the error names" in text)
    message = str(err.value)
    assert f"test_split_module.py:{line} (`if h.sum() > 0:  # the line the error names`)" in message
    assert "data-dependent control flow" in message and "\n" not in message
    assert capfd.readouterr().err == "", "torch's trace log is silenced"


def test_sequential_stages_pass_tuples_as_positional_arguments():
    seq = cases.tuple_seq()
    stages = split_sequential(seq, 3)
    assert all(isinstance(s, SequentialStage) for s in stages) and stages[1][0] is seq[2]
    assert [n for n, _ in stages[0].named_parameters()] == ["0.proj.weight", "0.proj.bias", "1.proj.weight",
                                                             "1.proj.bias"]
    x, mask = torch.randn(2, 5, 6), torch.ones(2, 5, dtype=torch.long)
    h, m = stages[0](x, mask)
    assert m.data_ptr() != mask.data_ptr(), "a received tensor passed on is a copy"
    torch.testing.assert_close(_chain(stages, x, mask), cases.run_sequential(seq, x, mask), rtol=0, atol=0)


# ------------------------------------------------------------ pipelines


@pytest.mark.quick
@pytest.mark.parametrize("case", ["resnet", "vit", "dict", "frozen", "regroup", "tuple_seq"])
def test_two_steps_under_1f1b_equal_one_process(pool2, case):
    """Loss, every gradient and the weights after two SGD steps equal one process on the same microbatches, and so do
    ResNet's running statistics on the rank holding them and its `evaluate()` in eval mode; DictNet's tied projection;
    Regroup's batch size sent as a tensor."""
    results = pool2.run(cases.equivalence, case, "1f1b")
    _check(results)
    if case == "resnet":
        assert sum(len(r["buffers"]) for r in results) == len(dict(cases.ResNet().named_buffers()))
    assert all(r["ties"] == (1 if case == "dict" else 0) for r in results)


@pytest.mark.parametrize("schedule, params, P", [("1f1b", None, 2), ("zb-v", None, 2), ("interleaved", {"V": 2}, 2),
                                                 ("1f1b", None, 4)], ids=["1f1b", "zb-v", "interleaved", "1f1b-P4"])
def test_unet_skips_under_every_kind_of_schedule(pools, schedule, params, P):
    """U-Net with skips crossing up to three stages: 4 stages under ZB-V (split backward, stages 0 and 3 on
    rank 0), interleaved and 1F1B at P=4; 2 under 1F1B at P=2."""
    _check(pools[P].run(cases.equivalence, "unet", schedule, params))
