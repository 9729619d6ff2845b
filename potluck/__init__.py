"""potluck: train one transformer on GPUs that volunteers lend over the internet."""
__version__ = "0.1.0"
