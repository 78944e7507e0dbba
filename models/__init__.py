"""pipedsl.models: models as pipeline stages.

- split.py: `split_sequential`, `split_gpt` — cut any `nn.Sequential` or embedding/blocks/head model;
- gpt/: a small GPT (nanoGPT-style, model.py) and its tensor-parallel stages (parallelize.py: 1-D, 3-D, SP,
  from its tp modules in tp.py);
- hf/: Hugging Face causal decoders (stages.py) and encoder-decoders (seq2seq.py) as stages, their
  tensor-parallel plan (parallelize.py), and their files (io.py: each rank reads the tensors it owns, export
  back to a Hugging Face directory).

Built on `pipedsl.runtime` and `pipedsl.parallel`; the trainer (`pipedsl.trainer`) builds on this.
Names are imported on first use.
"""

from __future__ import annotations

from pipedsl.registry import lazy_attributes

_EXPORTS = {
    "GPT": "gpt.model",
    "GPTConfig": "gpt.model",
    "causal_lm_loss": "hf.stages",
    "causal_lm_stages": "hf.stages",
    "check_architecture": "hf.stages",
    "check_seq2seq_split": "hf.seq2seq",
    "check_split": "hf.stages",
    "seq2seq_loss": "hf.seq2seq",
    "seq2seq_stages": "hf.seq2seq",
    "shift_labels": "hf.stages",
    "split_gpt": "split",
    "split_module": "split_graph",
    "split_sequential": "split",
    "tp_gpt_loss": "gpt.parallelize",
    "tp_gpt_stages": "gpt.parallelize",
    "tp_hf_loss": "hf.parallelize",
    "tp_hf_stages": "hf.parallelize",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
