"""Offline capture: forward and backward graphs of a model built under FakeTensorMode, so that
`zinf plan` can plan a 7B-parameter model on a laptop without allocating a byte of it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zinf_compile.errors import ZinfConfigError


def load_factory(spec: str) -> Callable[..., Any]:
    """`path/to/file.py:fn` or `package.module:fn` -> the callable."""
    if ":" not in spec:
        raise ZinfConfigError(f"FACTORY must look like 'file.py:build' or 'module:build', got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.path.sep in where:
        if not os.path.exists(where):
            raise ZinfConfigError(f"no such file {where!r} (from FACTORY {spec!r})")
        mod_name = "_zinf_factory_" + os.path.splitext(os.path.basename(where))[0]
        s = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(s)
        sys.modules[mod_name] = module
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ZinfConfigError(f"{where!r} has no callable {name!r}")
    return fn


def parse_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values become int, float, bool or stay strings."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise ZinfConfigError(f"--arg expects key=value, got {p!r}")
        k, v = p.split("=", 1)
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _loss_of(out) -> torch.Tensor:
    """The output's `.loss` if it has one, the output if it is a scalar, else its sum."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.sum()
    if isinstance(out, (tuple, list)):
        return sum(_loss_of(o) for o in out if isinstance(o, torch.Tensor) or hasattr(o, "loss"))
    raise ZinfConfigError(f"cannot derive a loss from a model output of type {type(out).__name__}")


def capture(factory: Callable[..., Any], kwargs: dict[str, Any], inference: bool = False):
    """Build the model under FakeTensorMode and trace it. Returns (graphs by role, num_fwd_outputs).

    Training: the joint graph of the loss goes through the default partitioner, as in a real
    compile, and the forward/backward pair comes back. Inference: the forward graph alone.
    """
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    graphs: dict[str, fx.GraphModule] = {}
    nfo: list[int] = []

    def partition(joint, joint_inputs, **kw):
        try:
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        except Exception as e:  # the min-cut solver can fail on unusual graphs: plan the default split
            warnings.warn(f"zinf plan: the min-cut partitioner failed ({e}); planning torch's default "
                          f"partition instead, which saves more for backward than a real compile would")
            fw, bw = default_partition(joint, joint_inputs, **kw)
        graphs["forward"], graphs["backward"] = fw, bw
        nfo.append(kw["num_fwd_outputs"])
        return fw, bw

    def keep_inference(gm, _inputs):
        graphs["inference"] = gm
        return gm

    with FakeTensorMode(allow_non_fake_inputs=False):
        built = factory(**kwargs)
        if not (isinstance(built, tuple) and len(built) == 2):
            raise ZinfConfigError("FACTORY must return (model, example_inputs)")
        model, inputs = built
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        named = [*model.named_parameters(), *model.named_buffers()]
        names = [n for n, _ in named]
        k = len(named)
        if inference:
            model.requires_grad_(False)

        def run(*args):
            out = torch.func.functional_call(model, dict(zip(names, args[:k])), args[k:])
            return out if inference else _loss_of(out)

        if inference:
            compiled = aot_function(run, fw_compiler=keep_inference, inference_compiler=keep_inference,
                                    num_params_buffers=k)
            with torch.no_grad():
                compiled(*[t for _, t in named], *inputs)
        else:
            compiled = aot_function(run, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                                    partition_fn=partition, num_params_buffers=k)
            compiled(*[t for _, t in named], *inputs)
    return graphs, (nfo[0] if nfo else -1)
