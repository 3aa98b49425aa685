"""The model a partial zip builds: a shared trunk, then one tail per input model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.fx as fx
import torch.nn as nn

__all__ = ["ZippedModel"]


class ZippedModel(nn.Module):
    """Two copies of one traced graph that compute their shared trunk once.

    ``heads[0]`` holds model A's tail, ``heads[1]`` model B's; both hold the zipped trunk. A
    node of the graph is *shared* when it reads only the trunk's state (``shared`` keys) and
    shared nodes: it is computed once, by head A's graph, and its value serves both heads.
    Every other node is computed by each head with its own state. The forward returns
    ``(output_a, output_b)``.

    Parameters
    ----------
    graph_a, graph_b : torch.fx.GraphModule
        The graphs of both heads (one architecture: the same nodes in the same order).
    shared : iterable of str
        The state_dict keys the heads share (the trunk's).
    """

    def __init__(self, graph_a: fx.GraphModule, graph_b: fx.GraphModule, shared: Iterable[str]) -> None:
        super().__init__()
        nodes_a, nodes_b = list(graph_a.graph.nodes), list(graph_b.graph.nodes)
        if [n.name for n in nodes_a] != [n.name for n in nodes_b]:
            raise ValueError("graph_a and graph_b must be graphs of one architecture")
        self.heads = nn.ModuleList([graph_a, graph_b])
        keys = set(shared)
        state_keys = list(graph_a.state_dict())
        on_shared: set[str] = set()
        for node in nodes_a:
            if node.op == "output":
                continue
            reads = [k for k in state_keys if isinstance(node.target, str) and node.op in ("call_module", "get_attr")
                     and (k == node.target or k.startswith(node.target + "."))]  # fmt: skip
            inputs = node.all_input_nodes
            if all(k in keys for k in reads) and all(n.name in on_shared for n in inputs):
                on_shared.add(node.name)
        self.shared_nodes = frozenset(on_shared)

    def forward(self, *args: Any) -> tuple[Any, Any]:
        graph_a, graph_b = self.heads
        run_a, run_b = fx.Interpreter(graph_a), fx.Interpreter(graph_b)
        for run in (run_a, run_b):
            run.env = {}
            run.args_iter = iter(args)
        for node_a, node_b in zip(graph_a.graph.nodes, graph_b.graph.nodes):
            if node_a.op == "output":
                return run_a.run_node(node_a), run_b.run_node(node_b)
            value = run_a.run_node(node_a)
            run_a.env[node_a] = value
            run_b.env[node_b] = value if node_a.name in self.shared_nodes else run_b.run_node(node_b)
        raise RuntimeError("the graph has no output node")
