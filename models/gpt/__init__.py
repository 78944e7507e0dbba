"""The small GPT (model.py) and its tensor-parallel stages (tp.py)."""
