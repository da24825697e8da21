class ModelLoadError(ValueError):
    """A checkpoint or tokenizer file is missing, truncated, or not supported; names the file and the part."""
