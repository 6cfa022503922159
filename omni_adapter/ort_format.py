"""An ORT-format model (``.ort``, onnxruntime's flatbuffer) read back into ONNX.

Moonshine's weights reach us only as ``.ort`` files inside the
``moonshine-cpp`` wheel. onnxruntime runs them as they are, but they keep
every weight as int8 plus a ``Cast -> Mul -> Add`` chain that rebuilds the
float weight on every run (every decoded token), ~30x slower than real time
here. Back in ONNX, :func:`fold_constants` computes those chains once. Used
once, at setup
(``omni_adapter/speech_models.py``); nothing here runs while serving.

The flatbuffer's tables mirror ONNX's protos nearly one to one (the enum
values of element and attribute types are ONNX's), so this is a walk over
the graph, its node args and initializers, recursing into subgraphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: The ops a weight's rebuilding chain is made of; nodes of these ops whose
#: inputs are all constants are computed at conversion.
_FOLDABLE = {
    "Cast": lambda inputs, attrs: inputs[0].astype(_numpy_type(attrs["to"])),
    "Mul": lambda inputs, attrs: inputs[0] * inputs[1],
    "Add": lambda inputs, attrs: inputs[0] + inputs[1],
}
#: Domains the graph may use; the ``.ort`` file lists every domain ORT knows.
_KEPT_DOMAINS = {"", "com.microsoft"}


def _fbs() -> Any:
    # Importing the package puts its generated flatbuffer classes on sys.path.
    import onnxruntime.tools.ort_format_model  # noqa: F401
    import ort_flatbuffers_py.fbs as fbs  # type: ignore[import-not-found]

    return fbs


def _numpy_type(onnx_type: int) -> Any:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(onnx_type)


def load_ort_model(path: Path) -> Any:
    """The ``.ort`` file at ``path`` as an ``onnx.ModelProto``."""
    from onnx import helper

    fbs = _fbs()
    buffer = bytearray(path.read_bytes())
    if not fbs.InferenceSession.InferenceSession.InferenceSessionBufferHasIdentifier(buffer, 0):
        raise ValueError(f"{path} is not an ORT-format model")
    model = fbs.InferenceSession.InferenceSession.GetRootAsInferenceSession(buffer, 0).Model()
    opsets = []
    for i in range(model.OpsetImportLength()):
        opset = model.OpsetImport(i)
        domain = (opset.Domain() or b"").decode()
        if domain in _KEPT_DOMAINS:
            opsets.append(helper.make_opsetid(domain, opset.Version()))
    graph = _graph(fbs, model.Graph(), "main")
    return helper.make_model(graph, opset_imports=opsets, ir_version=model.IrVersion(),
                             producer_name="omni-gateway ort_format")


def _graph(fbs: Any, graph: Any, name: str) -> Any:
    from onnx import helper

    types = {}
    for i in range(graph.NodeArgsLength()):
        arg = graph.NodeArgs(i)
        types[arg.Name().decode()] = arg.Type()

    def value_info(arg_name: str) -> Any:
        return _value_info(fbs, arg_name, types.get(arg_name))

    nodes = [_node(fbs, graph.Nodes(i)) for i in range(graph.NodesLength())]
    initializers = [_tensor(graph.Initializers(i)) for i in range(graph.InitializersLength())]
    constant_names = {t.name for t in initializers}
    inputs = [value_info(graph.Inputs(i).decode()) for i in range(graph.InputsLength())
              if graph.Inputs(i).decode() not in constant_names]
    outputs = [value_info(graph.Outputs(i).decode()) for i in range(graph.OutputsLength())]
    return helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)


def _value_info(fbs: Any, name: str, type_info: Any) -> Any:
    from onnx import helper

    if type_info is None or type_info.ValueType() != fbs.TypeInfoValue.TypeInfoValue.tensor_type:
        return helper.make_empty_tensor_value_info(name)
    tensor_type = fbs.TensorTypeAndShape.TensorTypeAndShape()
    table = type_info.Value()
    tensor_type.Init(table.Bytes, table.Pos)
    shape = tensor_type.Shape()
    dims: list[int | str | None] | None = None
    if shape is not None:
        dims = []
        for i in range(shape.DimLength()):
            value = shape.Dim(i).Value()
            if value is None or value.DimType() == fbs.DimensionValueType.DimensionValueType.UNKNOWN:
                dims.append(None)
            elif value.DimType() == fbs.DimensionValueType.DimensionValueType.VALUE:
                dims.append(value.DimValue())
            else:
                dims.append(value.DimParam().decode())
    return helper.make_tensor_value_info(name, tensor_type.ElemType(), dims)


def _tensor(tensor: Any) -> Any:
    from onnx import helper, numpy_helper

    dims = [tensor.Dims(i) for i in range(tensor.DimsLength())]
    if tensor.StringDataLength():
        strings = [tensor.StringData(i) for i in range(tensor.StringDataLength())]
        return helper.make_tensor(tensor.Name().decode(), tensor.DataType(), dims, strings)
    raw = tensor.RawDataAsNumpy()
    data = raw.tobytes() if isinstance(raw, np.ndarray) else b""
    array = np.frombuffer(data, dtype=_numpy_type(tensor.DataType())).reshape(dims)
    return numpy_helper.from_array(array, tensor.Name().decode())


def _node(fbs: Any, node: Any) -> Any:
    from onnx import helper

    inputs = [node.Inputs(i).decode() for i in range(node.InputsLength())]
    outputs = [node.Outputs(i).decode() for i in range(node.OutputsLength())]
    made = helper.make_node(node.OpType().decode(), inputs, outputs, name=(node.Name() or b"").decode(),
                            domain=(node.Domain() or b"").decode())
    made.attribute.extend(_attribute(fbs, node.Attributes(i)) for i in range(node.AttributesLength()))
    return made


def _attribute(fbs: Any, attribute: Any) -> Any:
    from onnx import AttributeProto, helper

    kinds = fbs.AttributeType.AttributeType
    kind, name = attribute.Type(), attribute.Name().decode()
    if kind == kinds.FLOAT:
        return helper.make_attribute(name, attribute.F(), attr_type=AttributeProto.FLOAT)
    if kind == kinds.INT:
        return helper.make_attribute(name, attribute.I(), attr_type=AttributeProto.INT)
    if kind == kinds.STRING:
        return helper.make_attribute(name, attribute.S(), attr_type=AttributeProto.STRING)
    if kind == kinds.TENSOR:
        return helper.make_attribute(name, _tensor(attribute.T()), attr_type=AttributeProto.TENSOR)
    if kind == kinds.GRAPH:
        return helper.make_attribute(name, _graph(fbs, attribute.G(), name), attr_type=AttributeProto.GRAPH)
    if kind == kinds.FLOATS:
        values = [attribute.Floats(i) for i in range(attribute.FloatsLength())]
        return helper.make_attribute(name, values, attr_type=AttributeProto.FLOATS)
    if kind == kinds.INTS:
        values = [attribute.Ints(i) for i in range(attribute.IntsLength())]
        return helper.make_attribute(name, values, attr_type=AttributeProto.INTS)
    if kind == kinds.STRINGS:
        values = [attribute.Strings(i) for i in range(attribute.StringsLength())]
        return helper.make_attribute(name, values, attr_type=AttributeProto.STRINGS)
    raise ValueError(f"attribute {name!r} has a type this reader does not take ({kind})")


def fold_constants(model: Any) -> int:
    """Compute the top-level nodes whose inputs are all constants; return how many were folded.

    Only the ops of a weight's rebuilding chain (:data:`_FOLDABLE`) are
    computed; the results become initializers and the nodes go.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:  # ONNX nodes are in topological order
        compute = _FOLDABLE.get(node.op_type) if node.domain == "" else None
        if compute is None or not all(name in constants for name in node.input):
            kept.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        constants[node.output[0]] = np.asarray(compute([constants[n] for n in node.input], attrs))
        folded += 1
    used = _names_used(kept) | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(numpy_helper.from_array(np.array(array, order="C"), name)
                             for name, array in constants.items() if name in used)
    return folded


def _names_used(nodes: Any) -> set[str]:
    """Every value name the nodes read, their subgraphs included."""
    from onnx import AttributeProto

    used: set[str] = set()
    for node in nodes:
        used.update(node.input)
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                used |= _names_used(attribute.g.node) | {o.name for o in attribute.g.output}
    return used

