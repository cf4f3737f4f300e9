"""GGUF files: the format reader (`reader.py`), import of a Llama model (`importer.py`) and its
vocabulary as a tokenizer (`tokenizer.py`)."""
