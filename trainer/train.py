"""The training loop of `pipedsl train` / `pipedsl run`, run on every rank (trainer/cli.py starts it).

One loop for both models the command trains, composed from a *source* that owns the model's
stages, its loss and its data:

- `GPTSource`: the built-in GPT on synthetic tokens (the demo): every rank draws the same
  global batch from a seeded generator (`batch="global"`), whose state is the data position.
- `HFSource`: a Hugging Face causal decoder from a local directory (models/hf/io.py) on real
  text (trainer/data.py): each dp replica reads its own rows of the global batch
  (`batch="local"`), the loader's state is the data position, a held-out split feeds
  `Pipeline.evaluate` every `eval_every` steps, and every checkpoint carries what
  `pipedsl export` needs.

The loop itself: step → clip → optimizer step (learning-rate schedule, fp16 skip) → one
record to the `MetricsLogger` (rank 0) → evaluation → checkpoint, each when due.  A resumed
run restores parameters, optimizer, RNG and the data position, and continues with exactly the
batch that would have come next.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pipedsl
from pipedsl.arguments import no_decay_kinds
from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import COMPUTE
from pipedsl.runtime import checkpoint
from pipedsl.runtime.post_validate import StepReport, TrainingSteps
from pipedsl.runtime.precision import MixedPrecision
from pipedsl.trainer.config import GPT_HEADS, GPT_VOCAB, TrainConfig, split_keywords
from pipedsl.trainer.stop import Stop


class GPTSource:
    """The small GPT on synthetic tokens (`pipedsl train` without `--model`)."""

    batch_mode = "global"
    ties = None  # found in the stage list

    def __init__(self, cfg: TrainConfig, program: pipedsl.Program, mesh: Any = None) -> None:
        from pipedsl.models.gpt.model import GPT, gpt_loss

        self.cfg = cfg
        self.gcfg = gpt_config(cfg)
        torch.manual_seed(cfg.model.seed)
        self.model = GPT(self.gcfg)  # the same weights on every rank; each keeps only its stages (or slices)
        self.token = cfg.loss_reduction == "token"
        split = split_keywords(cfg.model.split)
        if mesh is not None:  # Megatron's 1-D slices, experts over ep: the model's own plan (models/gpt/parallelize.py)
            from pipedsl.models.gpt.parallelize import parallelize_gpt

            self.stages = parallelize_gpt(self.model, program.num_stages, mesh,
                                          sequence_parallel=cfg.parallel.sequence_parallel, **split)
        else:
            self.stages = self.model.stages(program.num_stages, **split)
        if cfg.parallel.tp > 1:
            from pipedsl.models.gpt.parallelize import tp_gpt_loss

            self.loss_fn = tp_gpt_loss(mesh, "sum", -100) if self.token else tp_gpt_loss(mesh)
        else:
            self.loss_fn = _token_loss_sum if self.token else gpt_loss
        self.recompute_filter = _is_attention
        self.gen = torch.Generator().manual_seed(cfg.model.seed + 1)
        self.samples_per_step = cfg.training.batch
        self.tokens_per_step = cfg.training.batch * cfg.data.seq
        g = self.gcfg
        self.num_experts = g.n_experts
        params = active_parameters(self.model, g.top_k, g.n_experts)
        embedding = g.vocab_size * g.n_embd + g.block_size * g.n_embd
        self.flops_per_token = _flops(params, embedding, g.n_layer, g.n_embd, cfg.data.seq)

    def bind(self, pipe: pipedsl.Pipeline) -> None:
        del self.model  # the pipeline holds this rank's stages

    def next_batch(self, step: int) -> tuple[Any, Any]:
        from pipedsl.models.gpt.model import synthetic_batch

        cfg = self.cfg
        x, y = synthetic_batch(cfg.training.batch, cfg.data.seq, self.gcfg.vocab_size, self.gen)
        if cfg.data.pad_fraction:
            y = _pad_targets(y, cfg.data.pad_fraction, cfg.model.seed * 100003 + step)
        return x, y

    def state(self, rank: int) -> dict[str, Any]:
        return {"data": self.gen.get_state()}

    def restore(self, extra: Any, where: Any) -> None:
        data = extra.get("data") if isinstance(extra, dict) else None
        if data is None:
            raise checkpoint.CheckpointError(f"{where}: no data-generator state in 'extra' (not written by "
                                             f"pipedsl train/run)")
        self.gen.set_state(data)

    def eval_batches(self) -> list:
        return []

    def describe(self) -> dict[str, Any]:
        return {"config": asdict(self.gcfg)}


class HFSource:
    """A Hugging Face causal decoder on a tokenized text cache (`pipedsl train --model DIR --data …`)."""

    batch_mode = "local"

    def __init__(self, cfg: TrainConfig, program: pipedsl.Program, pp_rank: int, mesh: Any = None) -> None:
        from pipedsl.models.hf import io as hf_io
        from pipedsl.models.hf import stages as hf
        from pipedsl.trainer import data, hf_setup

        self.cfg = cfg
        hfc, d, seed = cfg.hf, cfg.data, cfg.model.seed
        assert hfc is not None, "HFSource: a Hugging Face run's configuration (trainer/hf_setup.py's hf_config)"
        held = {s for (_, s), r in program.placement.items() if r == pp_rank}
        self.ties: list | None = None
        if hfc.local:  # only this rank's stages, read or initialised module by module (hf_io.py)
            try:
                local = hf_io.LocalStages(hfc.path, program.num_stages, hfc.split, held, seed=seed, attn=hfc.attn)
            except hf_io.LocalStages.NotLocal as why:  # the launcher found every tensor fillable: a bug, said so
                raise PipeRuntimeError(f"rank {pp_rank}: cannot build its stages alone: {why}") from None
            self.stages: Any = local
            self.ties = local.ties
            model = local.model
        else:  # the launcher decided, for every rank alike: the whole model (hf_setup._check_architecture)
            model = hf_io.build_model(hfc.path, seed=seed, attn=hfc.attn)
            self.stages = hf_io.model_stages(model, program.num_stages, hfc.split, check=False)  # checked there
        self.token = cfg.loss_reduction == "token"
        self.loss_fn = functools.partial(hf.causal_lm_loss, reduction="sum") if self.token else hf.causal_lm_loss
        if cfg.parallel.tp > 1 or cfg.parallel.ep > 1:
            self._parallelize(mesh, held)
        self.recompute_filter = _is_attention
        c = model.config
        self.num_experts = hf_setup.num_experts(c) if hfc.experts_seen else 0  # routed experts pipedsl can count
        params = active_parameters(model, getattr(c, "num_experts_per_tok", 1), self.num_experts)
        embedding = model.get_input_embeddings().weight.numel()
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None) or sum(hf_io.seq2seq_layers(c))
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None) or c.d_model
        self.flops_per_token = _flops(params, embedding, layers, hidden, d.seq)
        if hfc.seq2seq is not None:  # an encoder-decoder: pairs or span corruption (seq2seq_data.py)
            from pipedsl.trainer import seq2seq_data

            samples = seq2seq_data.samples(hfc.seq2seq, hfc.cache, d.seq)
            held = seq2seq_data.samples(hfc.seq2seq, hfc.eval_cache, d.seq, held_out=True) if hfc.eval_cache else None
        else:
            samples = data.PackedSequences(data.TokenCache.open(hfc.cache), d.seq, d.packing, d.doc_mask)
            held = (data.PackedSequences(data.TokenCache.open(hfc.eval_cache), d.seq, d.packing, d.doc_mask)
                    if hfc.eval_cache else None)
        self.train_set, self.heldout = samples.split(d.heldout_fraction)
        if held is not None:  # --eval-data: a held-out set of its own
            self.heldout = held
        self.samples_per_step = cfg.training.batch
        self.tokens_per_step = cfg.training.batch * (d.seq + getattr(samples, "target_len", 0))
        self.meta = hfc.export.to_dict()  # every checkpoint carries it (plain values) for `pipedsl export`
        self.loader: Any = None

    def _parallelize(self, mesh: Any, held: set[int]) -> None:
        """This rank's stages parallelized in place by the model's own plan (models/hf/parallelize.py: tp slices,
        experts over ep), with the vocabulary-parallel loss under tp.  Only the held stages: the ranks of one tp
        group hold the same ones, and slicing is collective among them; the stage list keeps the others whole."""
        from pipedsl.models.hf.parallelize import parallelize_hf, tp_hf_loss

        build = self.stages
        local = {s: build[s] if isinstance(build, list) else build(s) for s in sorted(held)}
        parallelize_hf(list(local.values()), mesh, sequence_parallel=self.cfg.parallel.sequence_parallel)
        if mesh.config.tp > 1:  # only the held stages are sliced: the pipeline gets those (ties: `self.ties`)
            self.stages = local.__getitem__
            self.loss_fn = tp_hf_loss(mesh, "sum" if self.token else "mean")

    def bind(self, pipe: pipedsl.Pipeline) -> None:
        from pipedsl.trainer import data

        dp, d = pipe.dp, pipe.dp_rank
        cfg = self.cfg
        batch, evals = cfg.training.batch, cfg.eval
        self.loader = data.BatchLoader(self.train_set, batch, dp_rank=d, dp_size=dp, seed=cfg.model.seed)
        self._eval = (data.eval_batches(self.heldout, batch, d, dp, evals.eval_batches or None)
                      if evals.eval_every or cfg.hf.eval_at_end else [])

    def next_batch(self, step: int) -> tuple[Any, Any]:
        return next(self.loader)

    def state(self, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {"data": self.loader.state_dict()}
        if rank == 0:
            out["hf"] = self.meta
        return out

    def restore(self, extra: Any, where: Any) -> None:
        data = extra.get("data") if isinstance(extra, dict) else None
        if not isinstance(data, dict):
            raise checkpoint.CheckpointError(f"{where}: no data-loader state in 'extra' (not written by "
                                             f"pipedsl train --model)")
        self.loader.load_state_dict(data)

    def eval_batches(self) -> list:
        return self._eval

    def describe(self) -> dict[str, Any]:
        return {"model": self.cfg.hf.path}


def _is_attention(module: nn.Module) -> bool:
    """Selective recomputation's regions: the attention modules (Korthikanti et al.) — an HF decoder's, the
    GPT's `CausalSelfAttention` and its tensor-parallel `ParallelSelfAttention`."""
    name = type(module).__name__
    return name.endswith("Attention") and not name.endswith("FlashAttention2")


def active_parameters(model: nn.Module, top_k: int, num_experts: int) -> int:
    """The parameters a token passes through: an MoE layer's experts count top_k / E of theirs, E each experts
    module's own (MFU's FLOPs); `num_experts` 0: a dense model, every parameter."""
    from pipedsl.parallel.expert import holders, token_shares

    total = sum(p.numel() for p in model.parameters())
    if not num_experts:
        return total
    shares = token_shares(model, top_k)
    unused = sum(p.numel() * (1 - shares[id(m)]) for m in model.modules() if id(m) in shares
                 for h in holders(m) for p in h.parameters())  # a view's: its holders'
    return total - math.ceil(unused)  # exact: the shares are fractions


def _flops(params: int, embedding: int, layers: int, hidden: int, seq: int) -> float:
    from pipedsl.trainer.metrics import model_flops_per_token

    return model_flops_per_token(params, embedding, layers, hidden, seq)


def model_record(cfg: TrainConfig) -> dict[str, Any]:
    """The model's configuration as every checkpoint of the run records it: an HF model's config.json fields, the
    GPT's `GPTConfig`; a resume under another is refused naming the fields (`checkpoint.model_differences`)."""
    if cfg.hf is not None:
        return dict(cfg.hf.export.config)
    return asdict(gpt_config(cfg))


def gpt_config(cfg: TrainConfig) -> Any:
    """The built-in GPT's `GPTConfig` for the run (its heads and vocabulary are fixed: config.GPT_*)."""
    from pipedsl.models.gpt.model import GPTConfig

    m = cfg.model
    return GPTConfig(vocab_size=GPT_VOCAB, block_size=cfg.data.seq, n_layer=m.layers, n_head=GPT_HEADS,
                     n_embd=m.embd, dropout=m.dropout, n_experts=m.experts, top_k=m.top_k,
                     capacity_factor=m.capacity_factor or None)


AUTO_PROFILE_STEPS = 3  # `--schedule auto`: steps traced under ZB-H1 before the search (the first one warms up)


def train(rank: int, program_json: str, cfg: TrainConfig) -> dict[str, Any] | None:
    """Every rank: build the pipeline, restore a checkpoint if asked, train to `cfg.training.steps`.

    `cfg` is made concrete for the program here as the launcher does (`for_program` is idempotent), so a
    configuration built in code (`TrainConfig.from_options`) runs as well as the launcher's.  With
    `--schedule auto` the program is the profile (ZB-H1) and `_switch` replaces it after its steps."""
    program = pipedsl.Program.from_json(program_json)
    cfg = cfg.for_program(program)
    parallel = None
    dp, zero, tp, t = cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.tp, cfg.training
    if dp > 1 or zero or tp > 1:
        from pipedsl.parallel import ParallelConfig, ParallelMesh
        parallel = ParallelMesh(ParallelConfig(dp=dp, pp=program.num_ranks, tp=tp, zero=zero, ep=cfg.parallel.ep,
                                               zero_reshard=cfg.parallel.zero_reshard))
    pipe, opt, source, load = _build(rank, program, cfg, parallel)
    start = 0
    history: dict[int, float] = {}  # every step's loss, the run's before a resume included (losses.json)
    if cfg.checkpoint.resume:
        restored = checkpoint.load(pipe, cfg.checkpoint.resume, opt)
        source.restore(restored.extra, restored.path)
        start = restored.step
        saved = restored.extra.get("losses") if isinstance(restored.extra, dict) else None
        history.update({int(k): float(v) for k, v in (saved or {}).items() if int(k) <= start})
        if rank == 0:
            changed = ("; another stage partition, loaded by tensor name" if restored.partition_changed else
                       "; a different schedule now, same stage partition" if restored.schedule_changed else "")
            print(f"resumed at step {start} ({restored.saved_schedule}{changed})", flush=True)
    log = _logger(cfg, start) if rank == 0 else None
    began = cfg.started_at or time.time()
    stop = Stop(began + cfg.run.max_time if cfg.run.max_time else None)
    _arm_step_fault(pipe, rank, stop)
    try:
        with stop.catching():
            if cfg.schedule.schedule == AUTO and start < t.steps:
                until = min(start + AUTO_PROFILE_STEPS, t.steps)
                clock = _unit_clock(pipe, cfg) if until < t.steps else None
                pipe.counter.measure_w_shares = True  # the profile steps report what a pending W holds
                try:
                    _loop(rank, pipe, opt, source, cfg, start, log, load, stop, history, until=until)
                finally:
                    if clock is not None:
                        clock.close()
                if until < t.steps and max(history, default=start) == until:  # not stopped early
                    pipe, opt, source, load, cfg = _switch(rank, pipe, opt, source, cfg, parallel, until, log, clock)
                    _loop(rank, pipe, opt, source, replace(cfg, started_at=None), until, log, load, stop, history)
            else:
                _loop(rank, pipe, opt, source, cfg, start, log, load, stop, history)
    finally:
        if log is not None:
            log.close()
    pipe.close()  # its groups' threads and sockets; the timeline below needs only the pipeline group
    if start >= t.steps:
        return {"losses": history, "timeline": None, "start": start} if rank == 0 else None
    return _report(pipe, history, start, source, cfg.training.post_validate)


AUTO = "auto"  # the schedule name that profiles, searches and switches (`_switch`)


def _build(rank: int, program: pipedsl.Program, cfg: TrainConfig, parallel: Any) -> tuple[Any, Any, Any, Any]:
    """This rank's stages (a fresh source), its pipeline for `program`, the optimizer with its lr schedule, and the
    router statistics of an MoE model (None otherwise)."""
    t = cfg.training
    pp_rank = parallel.coords.pp if parallel is not None else rank
    source = HFSource(cfg, program, pp_rank, parallel) if cfg.hf else GPTSource(cfg, program, parallel)
    precision = MixedPrecision(t.precision, params=t.param_dtype, grads=t.grad_dtype)
    pipe = pipedsl.Pipeline(source.stages, program=program, loss_fn=source.loss_fn, parallel=parallel,
                            ties=source.ties, batch=source.batch_mode, precision=precision,
                            loss_reduction=cfg.loss_reduction, recompute=t.recompute,
                            recompute_filter=source.recompute_filter,
                            activation_bytes=True)  # the run's report gives each rank's peak bytes
    del source.stages
    source.bind(pipe)
    load = None
    if source.num_experts:  # router statistics: each step's routings per expert over every rank (a small all-reduce)
        from pipedsl.runtime.expert_load import ExpertLoad
        load = ExpertLoad(pipe.local_stages().values(), source.num_experts, pipe.device)
    opt = pipe.optimizer(torch.optim.AdamW, lr=t.lr, weight_decay=t.weight_decay, no_decay=no_decay_kinds(t.no_decay))
    if t.lr_schedule != "constant" or t.warmup_steps:
        from pipedsl.runtime.optim import LRSchedule
        opt.lr_schedule = LRSchedule(t.lr_schedule, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_lr=t.min_lr,
                                     decay=t.decay_steps)
    return pipe, opt, source, load


def _unit_clock(pipe: Any, cfg: TrainConfig) -> Any:
    """`--schedule auto`'s timer of each unit's forward, and of what it saves, during the profile steps, when the
    run may re-partition: stages that offer their units (the GPT's, an HF decoder's), no tensor parallelism (whose
    checkpoints load only into the same partition); bytes without recomputation only (unit_clock.py)."""
    from pipedsl.runtime.unit_clock import UnitClock

    stages = pipe.local_stages()
    seq2seq = cfg.hf is not None and cfg.hf.seq2seq is not None
    if cfg.parallel.tp > 1 or seq2seq or not UnitClock.supports(stages.values()):
        return None
    return UnitClock(stages, pipe.counter if pipe.recompute is None else None)


def _switch(rank: int, pipe: Any, opt: Any, source: Any, cfg: TrainConfig, parallel: Any, step: int,
            log: Any, clock: Any) -> tuple[Any, Any, Any, Any, TrainConfig]:
    """`--schedule auto` after its profile steps: the op and message costs fitted to the last step's trace
    (`Cost.fit`, means, per stage), the units re-partitioned from their measured times (`choose_cut`), ZB-auto
    searched under the costs of that partition (on rank 0, which sends every rank the program), and the run
    carried over through a checkpoint of this step — weights, optimizer state, random state, the data position
    — into a pipeline for the new program.  A new partition loads from that checkpoint by tensor name
    (runtime/checkpoint/state.py), so later checkpoints are of the new partition and a resume may use any;
    the gradients stay one process's.  Without `-p mem` the cap is what each rank's memory holds of the chosen
    cut's stage activations (`_room`; what each rank reports is gathered at once).  Returns the new pipeline,
    optimizer, source, router statistics and configuration (its `--split` the new cut points)."""
    import shutil
    import statistics

    from pipedsl.plan.recut import ROOM_UNBOUNDED, CutChoice, choose_cut

    # collective; the first rank of the pipeline holds it.  On the CPU the ops' own work: a loaded machine's other
    # processes stretch the wall clock of one stage's ops more than another's (runtime/device_clock.py)
    timeline = pipe.timeline(cpu_work=True)
    counter = pipe.counter
    mine = (None if clock is None else clock.report(), pipe.rank, _budget(pipe, cfg),
            float(counter.largest_bytes),  # one stage activation's bytes, measured
            statistics.median(counter.w_shares) if counter.w_shares else None)  # a pending W's share of it, measured
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    units = [g[0] for g in gathered]
    held = [g[4] for g in gathered if g[4] is not None]
    wmem = max(held) if held else None  # one share for every stage: the most any rank measured
    wanted = dict(cfg.schedule.params)  # the user's -p mem wins over what the memory holds
    if cfg.training.post_validate:  # steps overlap: the search minimises their period
        wanted.setdefault("post", 1)
    plan = [choose_cut(timeline, units, pipe.program, wanted, _room(pipe.size, cfg, [g[1:4] for g in gathered]), wmem)
            if timeline is not None else None]
    torch.distributed.broadcast_object_list(plan, src=0)
    decision: CutChoice = plan[0]
    cost = decision.cost
    if decision.points is not None:
        cfg = _with_points(cfg, decision.points)
    program = pipedsl.Program.from_json(decision.program)  # searched once, on rank 0
    directory = Path(cfg.logging.out) / "auto-switch"
    checkpoint.save(pipe, directory, step, opt, extra=source.state(rank), timeout=cfg.run.save_timeout)
    pipe.close()
    new, new_opt, new_source, load = _build(rank, program, cfg, parallel)
    restored = checkpoint.load(new, directory, new_opt)
    new_source.restore(restored.extra, restored.path)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        split = (f"stages re-cut at units {','.join(map(str, decision.points))} (predicted "
                 f"{decision.kept_ms:.1f} ms on the old cut), " if decision.points is not None else "")
        fit = decision.fit
        params = " ".join(f"{k}={v}" for k, v in program.params.items())
        if fit is not None:
            said = f"{fit:,}" if fit < ROOM_UNBOUNDED else "any number of"
            least = f"; {decision.mem} is the least ZB-auto runs with" if fit < decision.mem else ""
            params += f" ({said} stage activations fit a rank{least})"
        if decision.peak_bytes is not None:
            mib = [round(b / 2**20, 2) for b in decision.peak_bytes]
            params += f", predicted peak activation MiB per rank {mib}"
        if wmem is not None:
            params += f", a pending W holding {wmem:.2f} of an activation after I (measured; the search's Cost.wmem)"
        spread = op_time_spread(timeline)
        gain = 1 - decision.predicted_ms / decision.profiled_ms
        noise = (f"; the profile's op times varied {spread:.0%} about their means (the median over op kinds and "
                 f"stages){', as much as the predicted gain: it may not hold' if spread >= gain else ''}"
                 if spread is not None else "")
        what = "step" if not program.params.get("post") else "step (the period of overlapped steps)"
        line = (f"auto: from ZB-H1's step {step} (F {cost.F * 1e3:.2f} ms, I {cost.I * 1e3:.2f}, W {cost.W * 1e3:.2f}, "
                f"messages {cost.comm * 1e3:.2f}): {split}{program.name} {params}, predicted {what} "
                f"{decision.predicted_ms:.1f} ms against ZB-H1's {decision.profiled_ms:.1f} ms "
                f"{'measured' if not program.params.get('post') else '(its measured step at its simulated period)'}"
                f"{noise}")
        fields = {"program": program.name, "params": program.params, "activations_that_fit": fit, "wmem_measured": wmem,
                  "stage_bytes": decision.stage_bytes, "predicted_peak_bytes": decision.peak_bytes,
                  "predicted_ms": decision.predicted_ms,
                  "profiled_ms": decision.profiled_ms, "split": decision.points,
                  "kept_split_ms": decision.kept_ms, "op_time_spread": spread,
                  "cost": {k: getattr(cost, k) for k in ("F", "I", "W", "comm", "wmem")}}
        if log is not None:
            log.event(step, "schedule", fields, line)
        else:
            print(line, flush=True)
    return new, new_opt, new_source, load, cfg


def op_time_spread(timeline: Any) -> float | None:
    """How noisy the profile's op times were: the median, over (op kind, stage) groups of forwards and backwards
    with two samples or more, of their standard deviation over their mean.  A prediction from their means is no
    better than that (on a loaded 2-core machine they were 1.2-2.6x optimistic); None without such groups."""
    import statistics

    groups: dict[tuple[str, int | None], list[float]] = {}
    for events in timeline.ranks:
        for e in events:
            for part in e.instr.parts:
                if part.op.value in ("F", "B", "I", "W"):
                    groups.setdefault((part.op.value, part.stage), []).append(e.duration / len(e.instr.parts))
    spreads = [statistics.pstdev(v) / statistics.fmean(v) for v in groups.values()
               if len(v) > 1 and statistics.fmean(v) > 0]
    return statistics.median(spreads) if spreads else None


def _budget(pipe: Any, cfg: TrainConfig) -> float:
    """The memory this rank gives activations: --auto-memory, else the device's free memory now, between steps,
    less a tenth."""
    return cfg.schedule.auto_memory * 2**30 if cfg.schedule.auto_memory else 0.9 * _free_bytes(pipe.device)


def _room(size: int, cfg: TrainConfig, shares: list[tuple[int, float, float]]) -> Any:
    """Per pipeline rank, from every rank's (pipeline rank, `_budget`, one stage activation's measured bytes): the
    least budget over its data-parallel replicas and the most bytes; with free
    memory, the model-state bytes a parameter brings, which a re-cut moves with its layers."""
    from pipedsl.plan.memory import model_states
    from pipedsl.plan.recut import Room

    budgets, measured = [float("inf")] * size, [0.0] * size
    for r, b, e in shares:
        budgets[r], measured[r] = min(budgets[r], b), max(measured[r], e)
    # free memory also pays for the model states of the layers a new cut brings: weights, gradients, AdamW's state
    per_param = 0.0 if cfg.schedule.auto_memory else \
        model_states(1, cfg.parallel.dp, cfg.parallel.zero, cfg.training.state_bytes).total
    return Room(tuple(budgets), tuple(measured), per_param)


def _free_bytes(device: torch.device) -> float:
    """Memory this rank may still use: the GPU's free memory plus what torch holds cached but unused; on a CPU the
    machine's available memory shared by the ranks on it."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    from pipedsl.runtime.launch.capacity import available_memory

    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))
    return (available_memory() or 0) / max(local, 1)


def _with_points(cfg: TrainConfig, points: list[int]) -> TrainConfig:
    """`cfg` cut at `points` (`--split 3,7`): the GPT's split, or an HF model's stage keywords and export record."""
    split = ",".join(map(str, points))
    cfg = replace(cfg, model=replace(cfg.model, split=split))
    if cfg.hf is None:
        return cfg
    cut = replace(cfg.hf.split, points=tuple(points))
    return replace(cfg, hf=replace(cfg.hf, split=cut, export=replace(cfg.hf.export, split=cut.keywords())))


def _logger(cfg: TrainConfig, start: int) -> Any:
    from pipedsl.trainer.metrics import MetricsLogger

    log = cfg.logging
    return MetricsLogger(log.out, total_steps=cfg.training.steps, tensorboard=log.tensorboard,
                         wandb_project=log.wandb, config=cfg.options(), resume_from=start)


def _loop(rank: int, pipe: Any, opt: Any, source: Any, cfg: TrainConfig, start: int, log: Any, load: Any,
          stop: Stop, history: dict[int, float], until: int | None = None) -> None:
    """Steps start+1 … `until` (default the last), or fewer: up to the one after which `stop` says to end
    (`--max-time`, a stop signal), which saves a checkpoint when the run has a directory.  Each step's loss goes
    into `history` (every step's, saved in each checkpoint so that a resumed run reports them all)."""
    clip, steps = cfg.training.clip_grad, cfg.training.steps
    every, directory = cfg.checkpoint.checkpoint_every, cfg.checkpoint.checkpoint_dir
    log_every, record = cfg.logging.log_every, model_record(cfg)
    eval_every, eval_at_end = cfg.eval.eval_every, cfg.hf is not None and cfg.hf.eval_at_end
    peak = cfg.peak_flops or 0.0
    last, post = until or steps, cfg.training.post_validate
    training = TrainingSteps(pipe, opt, max_norm=clip, post_validate=post)
    # post-validated, nothing waits for every rank at a step's end: the stop question and the expert counts are
    # collectives issued after a step and read after the next one (a stop then ends the step after)
    asked: Any = None
    experts_of: dict[int, Any] = {}
    if load is not None:
        training.pass_state.append(load.mark)
    for step in range(start + 1, last + 1):
        x, y = source.next_batch(step)
        t0 = time.perf_counter()
        report = training.step(x, y)
        if load is not None:  # every rank: a collective, waited for when its step's report comes
            experts_of[step] = load.read(async_op=True)
        evaluate = bool(source.eval_batches()) and ((eval_every and step % eval_every == 0)
                                                   or (step == steps and eval_at_end))
        if not post:
            reason = stop.reason(pipe, time.perf_counter() - t0) if step < steps else None
        else:
            answer = asked.answer() if asked is not None else None
            asked = stop.ask(pipe, 2 * (time.perf_counter() - t0)) if step < steps and not answer else None
            reason = answer if step < steps else None
        save = directory and ((every and step % every == 0) or step == steps or reason)
        reports = [report] if report is not None else []
        if evaluate or save or reason or step == last:  # post-validated: what follows reads this step's weights
            reports += [r for r in [training.settle()] if r is not None]
        dt = time.perf_counter() - t0
        for r in reports:  # post-validated: the previous step's report comes with this step's
            history[r.step] = r.loss
            waited = experts_of.pop(r.step, None)
            experts = waited() if waited is not None else None
            if log is not None and (r.step % log_every == 0 or r.step in (start + 1, steps)):
                log.log(r.step, _metrics(r, dt, source, peak, opt, pipe, experts,
                                         cfg.started_at if r.step == start + 1 else None))
        if evaluate:
            _evaluate(pipe, source, step, log)
        if save:
            info = checkpoint.save(pipe, directory, step, opt, extra={**source.state(rank), "losses": dict(history)},
                                   timeout=cfg.run.save_timeout, model=record)
            if log is not None:
                log.note(f"checkpoint step {step}: {info.path}")
            if rank == 0 and cfg.checkpoint.keep_checkpoints:
                checkpoint.prune(directory, cfg.checkpoint.keep_checkpoints)
        if reason:
            if log is not None:
                why = (f"another step would pass --max-time {cfg.run.max_time:g} s" if reason == "--max-time"
                       else f"{reason} received")
                log.note(f"stopped after step {step} of {steps}: {why}" +
                         (" (checkpoint saved; --resume continues it)" if directory else " (no --checkpoint-dir: "
                          "nothing saved)"))
            break
    if asked is not None:  # stopped early with a question in flight: every rank answers it alike
        asked.answer()
    ran = step - start if last > start else 0
    if training.redone and log is not None and training.redone * 10 > ran:
        log.note(f"--post-validate redid {training.redone} of {ran} steps (clipped, or a gradient not finite): each "
                 f"redo runs the next step's forwards again, so above about one step in ten synchronous steps are "
                 f"faster; raise --clip-grad or drop --post-validate")


def _metrics(r: StepReport, dt: float, source: Any, peak: float, opt: Any, pipe: Any, experts: dict | None,
             started_at: float | None) -> dict[str, Any]:
    """A step's logged metrics: its report, and the timing of the step call that produced it."""
    m: dict[str, Any] = {"loss": r.loss, "step_ms": dt * 1e3, "samples_per_s": source.samples_per_step / dt,
                         "tokens_per_s": source.tokens_per_step / dt}
    if r.grad_norm is not None:
        m["grad_norm"] = r.grad_norm
    if peak:
        m["mfu"] = source.flops_per_token * source.tokens_per_step / dt / peak
    if opt.lr_schedule is not None:
        m["lr"] = r.lr
    if r.skipped:
        m["skipped"] = True
        if pipe.scaler is not None:
            m["loss_scale"] = pipe.scaler.scale
    if r.redone:
        m["redone"] = True
    if experts is not None:
        routed = sum(experts["tokens_per_expert"]) + experts["dropped"]
        m.update(expert_imbalance=experts["imbalance"], dropped_frac=experts["dropped"] / max(routed, 1),
                 tokens_per_expert=experts["tokens_per_expert"])
    if started_at:
        m["time_to_first_step_s"] = time.time() - started_at
    return m


def _evaluate(pipe: Any, source: Any, step: int, log: Any) -> None:
    """Loss and perplexity over the held-out batches: each batch's mean weighted by its count."""
    total = count = 0.0
    t0 = time.perf_counter()
    for x, y in source.eval_batches():
        loss = pipe.evaluate(x, y)
        total += loss * pipe.eval_count
        count += pipe.eval_count
    if log is not None:
        mean = total / max(count, 1.0)
        log.log(step, {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "batches": len(source.eval_batches()),
                       "eval_ms": (time.perf_counter() - t0) * 1e3}, kind="eval")


def _report(pipe: Any, losses: dict[int, float], start: int, source: Any,
            overlapped: bool = False) -> dict[str, Any] | None:
    """What rank 0 reports: the measured timeline of the last step — post-validated (`overlapped`), of the last
    two, which overlap, when they ran at the same shapes — the mean op times, the peaks, the losses."""
    peaks = [None] * pipe.size  # per pipeline rank (of this rank's pipeline): (activations, bytes)
    torch.distributed.all_gather_object(peaks, (pipe.peak_activations, pipe.counter.peak_bytes), group=pipe.group)
    two = overlapped and pipe.timed_steps == 2
    timeline = pipe.timeline(steps=2 if two else 1)
    if timeline is None:
        return None
    # mean measured time per op kind: the cost the simulator is given for its prediction
    sums: dict[str, list[float]] = {}
    for events in timeline.ranks:
        for e in events:
            if e.instr.op in COMPUTE:
                sums.setdefault("FB" if e.instr.sub else e.instr.op.value, []).append(e.duration)
    cost = {k: sum(v) / len(v) for k, v in sums.items()}
    if two:  # between a rank's two steps: its optimizer step and the checks' issue, what `Cost.step` stands for
        gaps = [events[len(stream)].start - events[len(stream) - 1].end
                for events, stream in zip(timeline.ranks, pipe.program.ranks) if len(events) > len(stream)]
        cost["step"] = max(0.0, sum(gaps) / len(gaps)) if gaps else 0.0
    return {"timeline": timeline.to_dict(), "cost": cost, "peaks": peaks, **source.describe(),
            "losses": losses, "start": start, "program": pipe.program.to_json()}


def _token_loss_sum(logits: Any, targets: Any) -> Any:
    """--loss-reduction token: the microbatch's summed next-token losses (padding -100 ignored)."""
    import torch.nn.functional as F  # noqa: N812

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _pad_targets(y: Any, fraction: float, seed: int) -> Any:
    """A padded tail per sequence, of uniform random length in [0, 2·fraction·T] (capped at T): about
    `fraction` of the targets become -100, unevenly over sequences (so over microbatches and replicas).
    Seeded by the step, so resumed runs pad alike."""
    n, T = y.shape
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(0, int(2 * fraction * T) + 1, (n, 1), generator=g).clamp(max=T)
    return y.masked_fill(torch.arange(T) >= T - tail, -100)


def _wait_at_gate(rank: int, step: int, stop: Stop) -> None:
    """`_arm_step_fault`'s gate: announce this rank is in `step`, then wait until the test opens the gate or a stop
    signal reaches this rank."""
    if os.environ.get("PIPEDSL_FAULT") != f"gate:{rank}:{step}":
        return
    gate = Path(os.environ["PIPEDSL_FAULT_GATE"])
    gate.with_name(gate.name + ".reached").touch()
    while not gate.exists() and stop.received is None:
        time.sleep(0.01)


def _arm_step_fault(pipe: Any, rank: int, stop: Stop) -> None:
    """Test-only: with PIPEDSL_FAULT=step:RANK:STEP (hang:RANK:STEP), this rank SIGKILLs (SIGSTOPs) itself in
    the middle of that step, at its first stage's forward of microbatch M/2; with gate:RANK:STEP it creates
    `$PIPEDSL_FAULT_GATE.reached` there and waits until `$PIPEDSL_FAULT_GATE` exists (a test signals a step in
    flight without racing the steps after it: the gate also opens when a stop signal reaches this rank)."""
    point = os.environ.get("PIPEDSL_FAULT", "").partition(":")[0]
    if point not in ("step", "hang", "gate"):
        return
    from pipedsl.runtime.checkpoint import fault_point

    first = min(pipe.local_stages().items())[1]
    seen = {"step": -1, "n": 0}

    def hook(module: Any, args: Any) -> None:
        if not torch.is_grad_enabled():  # an evaluation's forward, not the step's
            return
        step = pipe.steps + 1
        if seen["step"] != step:
            seen.update(step=step, n=0)
        seen["n"] += 1
        if seen["n"] == pipe.num_microbatches // 2 + 1:
            if point == "gate":
                _wait_at_gate(rank, step, stop)
            else:
                fault_point(point, rank, step)

    first.register_forward_pre_hook(hook)
