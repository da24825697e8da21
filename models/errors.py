class ModelLoadError(ValueError):
    """A checkpoint or tokenizer file is missing, truncated or unsupported; names file and part."""
