"""Give an exported program's linear layers back their `nn.Linear` modules.

`torch.export` flattens `nn.Linear` into `aten.linear(x, weight, bias)` calls on constants, and
torchao's `quantize_` swaps weights of `nn.Linear` *modules*: on a bare exported graph it finds
nothing and quietly does nothing. Lifting each such call back into a module makes any exported
program quantizable by torchao without the model's Python class, which the `.pt2` does not keep.
"""

from __future__ import annotations

import torch
from torch import fx, nn

LIFTED_PREFIX = "lifted_linear_"


def lift_linear_layers(module: fx.GraphModule) -> int:
    """Rewrite every `aten.linear` on constant weights into a call of a new `nn.Linear`
    submodule holding those weights, drop the orphaned constants, and return how many."""
    lifted = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        x, weight_node, *rest = node.args
        bias_node = rest[0] if rest else None
        if not _is_constant(weight_node) or not (bias_node is None or _is_constant(bias_node)):
            continue  # a weight computed at run time has no module to give back
        weight = _attribute(module, weight_node.target)
        bias = _attribute(module, bias_node.target) if bias_node is not None else None
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
        layer.requires_grad_(False)
        name = f"{LIFTED_PREFIX}{lifted}"
        module.add_module(name, layer)
        with module.graph.inserting_before(node):
            call = module.graph.call_module(name, (x,))
        node.replace_all_uses_with(call)
        module.graph.erase_node(node)
        lifted += 1
    if lifted:
        module.graph.eliminate_dead_code()
        _drop_unreferenced_constants(module)
        module.recompile()
    return lifted


def _is_constant(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def _attribute(module: nn.Module, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    value = getattr(module.get_submodule(owner) if owner else module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{target} is not a tensor")
    return value


def _drop_unreferenced_constants(module: fx.GraphModule) -> None:
    """Weights now owned by lifted layers would otherwise be saved twice."""
    referenced = {n.target for n in module.graph.nodes if n.op == "get_attr"}
    named = [*module.named_parameters(), *module.named_buffers()]
    for target, _ in named:
        if target.startswith(LIFTED_PREFIX) or target in referenced:
            continue
        owner, _, name = target.rpartition(".")
        delattr(module.get_submodule(owner) if owner else module, name)
