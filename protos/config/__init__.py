"""The run's configuration: sections, the model config (native and Hugging Face), and the checks a run's config must pass before it starts.

- ``runconfig``: The run configuration: one TOML file, one typed section per component
- ``files``: Run files: reading a TOML run file into a :class:`~potluck.protos.config.runconfig.RunConfig`, the ``--set SECTION.FIELD=VALUE`` overrides, and writing one back (``dump_toml``)
- ``modelconfig``: ``[model]`` of a run file: the family (built-in GPT, native Llama-style, Hugging Face), its sizes or a preset, and what a Hugging Face model's own config decides (:mod:`potluck.protos.config.hfconfig`)
- ``hfconfig``: Hugging Face model configs, read for ``model.family = "hf"`` runs (needs ``potluck[hf]``)
- ``section``: The base of every run-config section, and the error a bad config raises
- ``runcheck``: What a run needs from the machines it runs on: its data file, the identity of its data, addresses
"""
