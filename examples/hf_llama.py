"""Pipeline-parallel training of a Hugging Face Llama (or Qwen2, Mistral, GPT-2) built from a small random config.

    python examples/hf_llama.py                                      # ZB-H1 on 2 local processes
    python examples/hf_llama.py --schedule interleaved -p V=2 --family qwen2 --steps 20
    python examples/hf_llama.py --precision bf16 --recompute full -o out/hf_llama
    torchrun --nproc-per-node 2 examples/hf_llama.py                 # the same script under torchrun

No download: the model comes from a config with random weights (`transformers` is the optional
`examples` extra: `pip install 'pipedsl[examples]'`).  `causal_lm_stages` cuts it into
embedding, decoder layers and final norm + head; each stage recomputes the rotary embeddings
and the attention masks from the padding mask that travels with the hidden states, and the
tied embedding stays one weight (pipedsl/models/hf/stages.py).  The batches are padded to a common
length with labels -100 on the padding, as a collator makes them, and the loss is HF's: the mean
over every label of the batch (`loss_reduction="token"`), so `pipe.step` returns what
`model(input_ids, attention_mask=…, labels=…).loss` would.  The last step's measured timeline is
written to OUT/timeline.json and OUT/timeline.png.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from torch import nn

import pipedsl
from pipedsl.models.hf.stages import IGNORE_INDEX, causal_lm_loss, causal_lm_stages, shift_labels

VOCAB, SEQ = 128, 32
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def tiny_model(family: str = "llama", layers: int = 4, seed: int = 0) -> nn.Module:
    """A random causal LM: hidden 64, 4 heads (2 key/value heads), tied input and output embeddings."""
    import transformers as tf

    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=layers, n_head=4,
                               bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    else:
        configs = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
        config = configs[family](vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                 tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config.loss_type = "ForCausalLM"
    torch.manual_seed(seed)  # the same weights on every rank
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def padded_batch(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [rows, SEQ]: sequences of a learnable rule (count up by a step of
    1, 2 or 3 mod V, from a random start), right-padded from random lengths; labels -100 on the padding."""
    start = torch.randint(VOCAB, (rows, 1), generator=generator)
    step = torch.randint(1, 4, (rows, 1), generator=generator)
    ids = (start + step * torch.arange(SEQ)) % VOCAB  # [rows, SEQ]
    lengths = torch.randint(SEQ // 2, SEQ + 1, (rows, 1), generator=generator)
    mask = (torch.arange(SEQ) < lengths).long()  # [rows, SEQ], 1 = token
    return ids.masked_fill(mask == 0, 0), mask, ids.masked_fill(mask == 0, IGNORE_INDEX)


def train(rank: int, family: str, schedule: str, params: dict[str, int], M: int, steps: int, precision: str,
          recompute: str, out: str | None, lr: float = 1e-2) -> list[float]:
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M, **params)
    model = tiny_model(family)
    stages = causal_lm_stages(model, program.num_stages, attention_mask=True)  # stage 0 takes (ids, mask)
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=functools.partial(causal_lm_loss, reduction="sum"),
                            loss_reduction="token", precision=precision, recompute=recompute)
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr)  # this rank's stages; a tied weight once
    gen = torch.Generator().manual_seed(1)  # the same data on every rank
    losses = []
    for step in range(steps):
        ids, mask, labels = padded_batch(2 * M, gen)
        loss = pipe.step((ids, mask), shift_labels(labels))  # = model(ids, attention_mask=mask, labels=labels).loss
        norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if rank == 0:
            print(f"step {step + 1}/{steps}  loss {loss:.4f}  grad norm {norm.item():.3f}", flush=True)
    timeline = pipe.timeline()  # collective; the Timeline on rank 0
    if rank == 0 and out is not None:
        from pipedsl.visualize import plot_timeline

        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "timeline.json").write_text(timeline.to_json())
        plot_timeline(timeline, path / "timeline.png")
        print(f"wrote {path / 'timeline.json'}, {path / 'timeline.png'} (last step {timeline.makespan * 1e3:.1f} ms, "
              f"bubble {timeline.bubble_ratio:.3f})", flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=INT",
                    help="a schedule parameter, e.g. -p V=2 for interleaved")
    ap.add_argument("-P", type=int, default=2, help="ranks (ignored under torchrun)")
    ap.add_argument("-M", type=int, default=4, help="microbatches")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--recompute", default="none", choices=["none", "full"])
    ap.add_argument("-o", "--out", default="out/hf_llama", help="directory for timeline.json / timeline.png")
    a = ap.parse_args()
    try:
        params = {k: int(v) for k, v in (p.split("=", 1) for p in a.param)}
    except ValueError:
        ap.error(f"-p takes NAME=INT, got {a.param}")
    pipedsl.launch(train, a.P, a.family, a.schedule, params, a.M, a.steps, a.precision, a.recompute, a.out)


if __name__ == "__main__":
    main()
