"""pipedsl.trainer: the training application — `pipedsl train`, `run`, `export`.

- cli.py: the commands' flags, the checks made before any rank starts, the launch;
- config.py: the training configuration (TOML and flags);
- train.py: one rank's training loop, built on the public `Pipeline` and checkpoint API;
- data.py: tokenized, packed, sharded, resumable data; metrics.py: logs and TensorBoard;
- hf_setup.py: a Hugging Face model's checks and memory estimate before launch;
- calibrate.py: `pipedsl plan --calibrate`, the planner's costs timed on local processes.
"""
