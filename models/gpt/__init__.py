"""The small GPT (model.py), how it is parallelized (parallelize.py) and its tensor-parallel modules (tp.py)."""
