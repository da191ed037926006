"""``mambatrt serve``: an OpenAI-compatible server over the engine.

The engine process (:mod:`.server`, :mod:`.host`) keeps the engine, its slots and the state cache, and renders the
metrics (:mod:`.metrics`); HTTP front ends in processes of their own (:mod:`.http`) translate requests and stream
tokens; they talk over pipes in the messages of :mod:`.wire`. The HTTP layer never touches the model.
"""
