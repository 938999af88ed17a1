"""How the graphs of one compile relate: a forward/backward pair linked by the saved tensors, or an
inference graph alone; and which placeholders of a joint graph are its primals."""
from __future__ import annotations

import torch
import torch.fx as fx

from zinf_compile.analysis.facts import GraphSpec
from zinf_compile.ir import output_node


def graph_specs(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int) -> list[GraphSpec]:
    """Specs for an inference graph, or a forward/backward pair linked by the saved tensors."""
    if "inference" in graphs:
        return [GraphSpec("inference", graphs["inference"])]
    fw, bw = graphs["forward"], graphs["backward"]
    flat: list = []
    fx.node.map_arg(output_node(fw.graph).args[0], flat.append)
    # AOT autograd hands the saved tensors to the backward by position: the forward's outputs after
    # the user's are the saved tensors (then symints), and the backward's tensor placeholders start
    # with the same tensors in the same order (after symints), then the tangents.
    saved_fw = [n for n in flat[num_fwd_outputs:] if isinstance(n.meta.get("val"), torch.Tensor)]
    bw_tensors = [p for p in bw.graph.find_nodes(op="placeholder")
                  if isinstance(p.meta.get("val"), torch.Tensor)]
    saved = dict(zip(bw_tensors[:len(saved_fw)], saved_fw))
    return [GraphSpec("forward", fw, num_user_outputs=num_fwd_outputs), GraphSpec("backward", bw, saved=saved)]


def primal_nodes(joint: fx.Graph, joint_inputs) -> list[fx.Node]:
    """The joint graph's primal placeholders: AOT's joint inputs are (primals, tangents), and its
    placeholders follow them in that order."""
    primals = joint_inputs[0] if isinstance(joint_inputs, (tuple, list)) and len(joint_inputs) == 2 else joint_inputs
    return list(joint.find_nodes(op="placeholder"))[:len(primals)]
