"""What the TensorRT runner is built from: the bundle's plans, checked against the TensorRT installed here and
against the I/O contract, deserialized into engines; and whether plans can run on this machine at all."""

from __future__ import annotations

from mambatrt.errors import BundleError
from mambatrt.tensorrt_flavour import find_tensorrt, import_polygraphy

from ...bundle import Bundle
from ..states import check_io


def check_plan_flavour(bundle: Bundle, graph: str, flavour: str, version: str) -> None:
    """A plan runs only on the TensorRT flavour and major.minor version that built it."""
    record = bundle.plan(graph)
    if record is None:
        raise BundleError(f"{bundle.path}: no TensorRT plan for the {graph} graph; rebuild it with --plans auto")
    built = (record.tensorrt_flavour, ".".join(record.tensorrt_version.split(".")[:2]))
    here = (flavour, ".".join(version.split(".")[:2]))
    if built != here:
        raise BundleError(
            f"{bundle.plan_path(graph).name} was built with {built[0]} {record.tensorrt_version}, this runtime has "
            f"{flavour} {version}; rebuild the bundle on this machine (mambatrt bundle ... --force)"
        )


def check_plans(bundle: Bundle) -> None:
    """Every graph of the bundle has a plan built by the TensorRT flavour and version installed here."""
    trt = find_tensorrt()
    if trt is None:
        raise BundleError("no TensorRT runtime found (tensorrt or tensorrt_rtx); use --device cpu or cuda")
    for graph in bundle.graphs:
        check_plan_flavour(bundle, graph, trt.flavour, trt.version)


def tensorrt_runtime_available() -> str | None:
    """None when TensorRT plans can run here, else the reason they cannot."""
    trt = find_tensorrt()
    if trt is None:
        return "no TensorRT module (tensorrt or tensorrt_rtx) is installed"
    try:
        cuda = import_polygraphy("polygraphy.cuda")
        G_LOGGER = import_polygraphy("polygraphy.logger").G_LOGGER
    except ImportError:
        return "polygraphy (used for CUDA buffers) is not installed; pip install polygraphy"
    severity = G_LOGGER.module_severity
    G_LOGGER.module_severity = G_LOGGER.CRITICAL + 10
    try:
        cuda.Stream().free()
    except Exception as exc:  # no driver, no device, or no CUDA runtime library
        return f"{trt.flavour} is installed but CUDA is not usable here ({str(exc).split('. ')[0]})"
    finally:
        G_LOGGER.module_severity = severity
    return None


def engine_io(trt, engine) -> tuple[list[tuple], list[tuple]]:
    """(inputs, outputs) of a plan as (name, dtype, shape) triples; -1 marks a dynamic dimension."""
    dtypes = {trt.DataType.INT64: "int64", trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16"}
    io: tuple[list[tuple], list[tuple]] = ([], [])
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = engine.get_tensor_dtype(name)
        found = (name, dtypes.get(dtype, str(dtype)), tuple(engine.get_tensor_shape(name)))
        io[0 if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else 1].append(found)
    return io


def load_engines(bundle: Bundle, runtime, trt) -> dict:
    """graph -> the deserialized engine of its plan, its I/O checked against the contract."""
    engines = {}
    for graph in bundle.graphs:
        path = bundle.plan_path(graph)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise BundleError(f"{path}: TensorRT could not deserialize the plan (corrupt?)")
        check_io(bundle.contract(graph), *engine_io(trt, engine), str(path))
        engines[graph] = engine
    return engines
