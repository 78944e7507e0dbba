"""What a training run reports: one owner for the progress line, the JSONL record, TensorBoard and W&B.

Rank 0 owns a `MetricsLogger`.  Every record — a training step, an evaluation — goes to
`metrics.jsonl` (always; one JSON object a line, flushed at once, so a killed run keeps every
line it printed), to TensorBoard when a log directory is given (`torch.utils.tensorboard`), and
to Weights & Biases when a project is given (offline unless `WANDB_MODE` says otherwise: it needs
no network).  The console gets one line per step; on a terminal, a live line (rich) that
shows the latest step, tokens/s, MFU and the ETA in place.

MFU is model FLOPs utilisation as PaLM defines it (Chowdhery et al. 2022, appendix B): the
FLOPs a step must do — 6 per parameter per token for the matmuls, forward and backward, plus
12·L·H·T per token for attention's scores and values (L layers, H hidden, T sequence) — over
the step time, against the peak of the hardware the run uses (`peak_flops`).  Recomputation
is not counted (it is overhead, not model FLOPs), so full recomputation lowers MFU.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipedsl.errors import PipeDSLError
from pipedsl.output import write_text

# dense bf16/fp16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name(); fp32 runs use TF32
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "V100": 125e12}


def model_flops_per_token(params: int, embedding_params: int, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6·(parameters that multiply, i.e. all but the input embedding's lookup)
    + 12·L·H·T for attention (PaLM's formula)."""
    return 6.0 * (params - embedding_params) + 12.0 * layers * hidden * seq


@functools.lru_cache(maxsize=4)
def measured_cpu_peak(seconds: float = 0.3) -> float:
    """One core's fp32 GEMM rate (FLOP/s): the 'peak' of a CPU, which has no datasheet number pipedsl could look
    up.  A 256² matmul, the best of a few rounds, measured once a process: a notebook or a test session running
    several commands pays the 0.3 s once."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(8):
                a @ a
            best = max(best, 8 * 2 * 256**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def peak_flops(devices: int, cores: int, override_tflops: float | None = None) -> tuple[float, str]:
    """The run's hardware peak (FLOP/s) and where the number comes from: `--peak-tflops` per device,
    a known GPU's datasheet peak, or on a CPU the measured one-core rate × the cores the ranks use."""
    if override_tflops:
        return override_tflops * 1e12 * devices, f"--peak-tflops {override_tflops:g} x {devices}"
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak * devices, f"{name} datasheet bf16 {peak / 1e12:g} TFLOP/s x {devices}"
        return 0.0, f"unknown GPU {name!r}: give --peak-tflops"
    one = measured_cpu_peak()
    return one * cores, f"measured fp32 GEMM {one / 1e9:.1f} GFLOP/s a core x {cores} cores"


def tensorboard_run(root: str | os.PathLike, out: Path | None) -> Path:
    """Where a run's TensorBoard events go: a folder of `root` named after the run's output directory (`-o`).
    TensorBoard shows each subfolder as a run of its own, so a fine-tune or another model given the same
    `--tensorboard` (a TOML file reused) sits beside the first run instead of writing into its curves."""
    return Path(root) / (out.resolve().name if out is not None else "run")


class MetricsLogger:
    """Rank 0's sink for every metric of a run (see the module docstring)."""

    def __init__(self, out: str | os.PathLike | None, *, total_steps: int, tensorboard: str | None = None,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None,
                 live: bool | None = None, resume_from: int = 0) -> None:
        self.out = Path(out) if out is not None else None  # None: the console only (a bare rank function)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.start_step = resume_from
        self.started = time.perf_counter()
        self._file = _metrics_file(self.out / "metrics.jsonl", resume_from) if self.out is not None else None
        self._tb = self._wandb = self._live = None
        self.tensorboard = tensorboard_run(tensorboard, self.out) if tensorboard else None
        if self.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            # a fresh run replaces this run folder's earlier events, a resumed one those past its step (as
            # metrics.jsonl is rewritten): TensorBoard then shows each step once
            self._tb = SummaryWriter(log_dir=str(self.tensorboard), purge_step=resume_from + 1)
        if wandb_project:
            wandb = _import_wandb()
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=wandb_project, dir=str(self.out or "."), config=config or {},
                                     resume="allow")
        if live if live is not None else sys.stdout.isatty():
            self._live = _LiveLine(total_steps)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """One record: to the JSONL file, TensorBoard (`kind/name`), W&B and the console."""
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **metrics}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numbers.items()}, step=step)
        line = self.format(step, metrics, kind)
        if self._live is not None:
            self._live.show(step, line, keep=kind != "train")
        else:
            print(line, flush=True)

    def eta(self, step: int) -> float | None:
        """Seconds left at the mean pace of this run's steps so far."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * (self.total - step)

    def format(self, step: int, m: dict[str, Any], kind: str) -> str:
        if kind != "train":
            extra = "".join(f"  {k} {v:.4g}" for k, v in m.items() if k not in ("loss", "perplexity")
                            and isinstance(v, float))
            return f"eval {step:>3}/{self.total}  loss {m['loss']:.4f}  perplexity {m['perplexity']:.3f}{extra}"
        parts = [f"step {step:>3}/{self.total}", f"loss {m['loss']:.4f}"]
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
        if "samples_per_s" in m:
            parts.append(f"{m['samples_per_s']:8.1f} samples/s")
        if m.get("mfu") is not None:
            parts.append(f"MFU {100 * m['mfu']:.2f}%")
        parts.append(f"{m['step_ms']:7.1f} ms/step")
        if "grad_norm" in m:
            parts.append(f"grad norm {m['grad_norm']:.3f}")
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        eta = self.eta(step)
        if eta is not None and step < self.total:
            parts.append(f"ETA {_clock(eta)}")
        if "time_to_first_step_s" in m:
            parts.append(f"first step done {m['time_to_first_step_s']:.1f} s after the command started")
        if m.get("skipped"):
            parts.append(f"skipped (fp16 overflow; loss scale now {m.get('loss_scale', 0):g})")
        return "  ".join(parts)

    def event(self, step: int, kind: str, fields: dict[str, Any], text: str) -> None:
        """A record of something that happened (`kind`: e.g. "schedule" when --schedule auto switches) to the JSONL
        file, and its line to the console."""
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "step": step, "time": round(time.time(), 3), **fields}) + "\n")
        self.note(text)

    def note(self, text: str) -> None:
        """A line for the console only (checkpoints, resumes)."""
        if self._live is not None:
            self._live.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise PipeDSLError("--wandb needs the wandb package (pip install wandb); it logs offline without "
                           "a network") from None
    return wandb


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _metrics_file(path: Path, resume_from: int) -> Any:
    """The run's metrics.jsonl, open for appending: a fresh run starts it empty (it is this run's, not a mix of
    runs); a resumed run keeps the records up to its checkpoint's step and drops the later ones (the steps it
    repeats), as TensorBoard purges them."""
    if resume_from and path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line).get("step", 0)
            except (ValueError, AttributeError):
                continue  # a line cut by a kill: dropped
            if isinstance(step, int) and step <= resume_from:
                kept.append(line)
        write_text(path, "".join(f"{line}\n" for line in kept))
    return open(path, "a" if resume_from else "w", buffering=1)  # noqa: SIM115 - kept open for the run


class _LiveLine:
    """A terminal's in-place progress line (rich): the bar, the step's numbers; evaluations stay above it."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
                                 transient=False)
        self.task = self.progress.add_task("train", total=total, line="")
        self.progress.start()

    def show(self, step: int, line: str, keep: bool) -> None:
        if keep:
            self.progress.console.print(line)
        else:
            self.progress.update(self.task, completed=step, line=line[line.find("loss"):])  # the bar shows the step

    def print(self, text: str) -> None:
        self.progress.console.print(text)

    def stop(self) -> None:
        self.progress.stop()
