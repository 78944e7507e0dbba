"""Hugging Face causal decoders (stages.py) and encoder-decoders (seq2seq.py) as pipeline stages, and their
files (io.py).

This package's own names are torch-free: the trainer's data reader (which runs without torch) reads
`TOKENIZER_FILES` to find a model directory's tokenizer.
"""

# the files a tokenizer is read from (tokenizers' or sentencepiece's); an export copies these and io.py's companions
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
