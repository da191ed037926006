"""mambatrt: Mamba-1 language models from a checkpoint to ONNX graphs and TensorRT plans, a thin runtime and a server.

The repository's folders are the pipeline's stages, one sub-package each:

- ``mambatrt.export``  -- the PyTorch model, checkpoint loading, ONNX export;
- ``mambatrt.compile`` -- the bundle: ONNX graphs, the kernels library, TensorRT plans (Polygraphy);
- ``mambatrt.runtime`` -- bundle loading, the runners (onnxruntime CPU and CUDA, TensorRT), the engine, the server.

This package holds what they share (config, the graphs' I/O contract, the manifest, errors, paths, environment
variables), the command line (``mambatrt.cli``) and the references (``mambatrt.reference``). The runtime needs numpy
plus onnxruntime or TensorRT only; it never imports torch or ``mambatrt.export``. docs/architecture.md walks through
the code.
"""

__version__ = "0.1.0"
