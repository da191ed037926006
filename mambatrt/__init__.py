"""mambatrt: Mamba-1 language models from a checkpoint to TensorRT engines and a thin runtime.

Pipeline stages, one sub-package each (the folders of the repository):

- ``mambatrt.export``  -- the PyTorch model (step and multi-row prefill), checkpoint loading, ONNX export;
- ``mambatrt.compile`` -- the bundle: ONNX graphs, the kernels library, TensorRT plans (Polygraphy);
- ``mambatrt.runtime`` -- bundle loading, onnxruntime/TensorRT backends, generation, CLI commands.

The runtime needs numpy plus onnxruntime or TensorRT only; it never imports torch or ``mambatrt.export``.
"""

__version__ = "0.1.0"
