"""The Protocols that let a lower module name what it uses of a higher one without importing it (the batch's
attention backend, an MLA backend's layer, a stream's and the engine events' front-end) stay true of the classes
they stand for: every member they declare exists there, a method with the same parameters. Nothing type-checks
these in CI, so a renamed attribute would otherwise leave a Protocol describing a class that no longer exists."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from graphserve.layers.attention_backend import AttentionBackend
from graphserve.layers.forward_batch import StepAttention
from graphserve.layers.mla import MLAttention
from graphserve.layers.mla_types import LatentAttentionLayer
from graphserve.server.engine_events import FrontendState
from graphserve.server.frontend import Frontend
from graphserve.server.request_stream import StreamOwner


def _declared(protocol: type) -> tuple[set[str], dict[str, object]]:
    """(attribute names, methods and properties by name) a Protocol declares itself."""
    own = {k: v for k, v in vars(protocol).items() if callable(v) or isinstance(v, property)}
    own = {k: v for k, v in own.items() if not k.startswith("__")}
    return set(vars(protocol).get("__annotations__", {})), own


def _instance_attributes(cls: type) -> set[str]:
    """Names a class assigns to ``self`` anywhere in its body, or declares as class attributes."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
             for t in ([t] if not isinstance(t, ast.Tuple) else t.elts)
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names | {k for k in dir(cls) if not k.startswith("__")}


def _params(fn: object) -> list[str]:
    fn = fn.fget if isinstance(fn, property) else fn
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize(("protocol", "cls"), [(StepAttention, AttentionBackend), (LatentAttentionLayer, MLAttention),
                                               (StreamOwner, Frontend), (FrontendState, Frontend)])
def test_a_protocol_declares_only_what_its_class_has(protocol, cls):
    attributes, methods = _declared(protocol)
    have = _instance_attributes(cls)
    assert attributes - have == set(), f"{protocol.__name__} declares attributes {cls.__name__} lacks"
    for name, member in methods.items():
        real = inspect.getattr_static(cls, name)
        assert isinstance(real, property) == isinstance(member, property), name
        assert _params(real) == _params(member), f"{protocol.__name__}.{name} and {cls.__name__}.{name} differ"
