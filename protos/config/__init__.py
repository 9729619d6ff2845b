"""The run's configuration: sections, the model config (native and Hugging Face), and the checks a run's config must pass before it starts.

- ``runconfig``: The run configuration: one TOML file, one typed section per component.
- ``modelconfig``: ``[model]`` of a run file: the family (built-in GPT, native Llama-style, Hugging Face), its sizes or
- ``hfconfig``: Hugging Face model configs, read for ``model.family = "hf"`` runs (needs ``potluck[hf]``).
- ``section``: The base of every run-config section, and the error a bad config raises.
- ``runcheck``: What a run needs from the machines it runs on: its data file, the identity of its data, addresses.
"""
