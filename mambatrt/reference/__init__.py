"""The references beside the pipeline, for `compare`, `bench --reference hf` and the tests; never on a runtime path.

:mod:`.torch_runner` runs mambatrt's own PyTorch model (export's) behind the runtime's runner face, :mod:`.hf`
times transformers' independent ``MambaForCausalLM``, and :mod:`.compare` holds a bundle's graphs and plans to them.
This package imports both pipeline stages (and torch), so that neither stage imports the other: ``export`` never
imports ``runtime`` and ``runtime`` never imports ``export``.
"""
