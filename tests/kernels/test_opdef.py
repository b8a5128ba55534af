"""Each op declared once (spd_kernels.opdef): the dispatcher's entry, the torch.library schema and
the Python function agree, and a declaration the schema cannot express is refused."""
import inspect

import pytest
import torch

import spd_kernels
from spd_kernels import dispatch, opdef


def _public(name):
    return getattr(spd_kernels, opdef.SPECS[name].qualname.split("::")[1])


def test_every_dispatched_op_is_declared_once_with_its_custom_op():
    assert set(dispatch.ops()) == set(opdef.SPECS)
    assert len(dispatch.ops()) == 20  # with the tree's two ops, slot_attention, the cycle's 3+3
    for name, spec in opdef.SPECS.items():
        fn = _public(name)
        custom = getattr(torch.ops.spd, spec.qualname.split("::")[1]).default
        declared = torch._C.parse_schema(f"{spec.qualname}{spec.schema}")
        assert str(custom._schema) == str(declared), name
        assert fn.custom_op is not None and callable(fn.register_fake)
        for impl in dispatch._REGISTRY[name].values():  # every backend registered against it
            assert callable(impl.fn)
        assert "reference" in dispatch._REGISTRY[name], name


def test_schema_defaults_are_the_python_defaults():
    for name, spec in opdef.SPECS.items():
        params = [p for p in inspect.signature(_public(name)).parameters.values()
                  if p.name != "backend"]
        args = getattr(torch.ops.spd, spec.qualname.split("::")[1]).default._schema.arguments
        assert [a.name for a in args] == [p.name for p in params], name
        for a, p in zip(args, params):
            if p.default is inspect.Parameter.empty:
                assert not a.has_default_value(), (name, p.name)
            else:
                assert a.has_default_value() and a.default_value == p.default, (name, p.name)


def test_keyword_only_arguments_keep_their_order_in_the_schema():
    # torch.ops.spd.rejection_sample_logits(..., uniforms, philox_seed, philox_offset, T, k, p)
    schema = opdef.SPECS["rejection_sample_logits"].schema
    order = ["uniforms", "philox_seed", "philox_offset", "temperature", "top_k", "top_p"]
    positions = [schema.index(f" {n}=") for n in order]
    assert positions == sorted(positions)
    assert "Tensor(a6!)? philox_offset=None" in schema  # written in place


def test_mutated_arguments_are_annotated():
    assert opdef.SPECS["truncate_kv"].schema.startswith("(Tensor(a0!) lengths")
    assert "Tensor(a2!)[]? buffers=None" in opdef.SPECS["truncate_kv"].schema
    assert opdef.SPECS["truncate_kv"].schema.endswith("-> ()")
    q = opdef.SPECS["qkv_rope_append"].schema
    assert "Tensor(a11!) k_cache" in q and "Tensor(a12!) v_cache" in q
    assert "Tensor start" in q  # a Position: int or tensor in Python, a tensor in the schema


def test_declarations_the_schema_cannot_express_are_refused():
    with pytest.raises(TypeError, match="no torch.library schema type"):
        opdef._schema_type(dict, "op x(arg)")
    with pytest.raises(TypeError, match="cannot be written in a schema"):
        opdef._default((), "op x(arg)")

    def no_backend(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match="takes no backend= keyword"):
        opdef.op("not_an_op")(no_backend)
    assert "not_an_op" not in dispatch.ops()


def test_backends_register_only_against_a_declared_op():
    with pytest.raises(ValueError, match="declare it"):
        dispatch.register("no_such_op", "reference")
    with pytest.raises(ValueError, match="declared twice"):
        dispatch.declare("fused_linear")


def test_programmatic_launch_is_recorded_per_registration():
    for op in ("anchor_projection", "qkv_rope_append", "cache_attention", "fused_linear",
               "fused_swiglu"):
        assert dispatch.programmatic(op, "triton"), op
    assert not dispatch.programmatic("verify_greedy", "triton")
    assert not dispatch.programmatic("verify_greedy", "reference")
    # every CUDA kernel (the DeltaNet ops have none yet)
    assert all(dispatch.programmatic(op, "cuda") for op in dispatch.ops()
               if "cuda" in dispatch._REGISTRY[op])
    assert sum("cuda" in dispatch._REGISTRY[op] for op in dispatch.ops()) == 9
