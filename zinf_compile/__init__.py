"""zinf: ZeRO-Infinity as a torch.compile backend.

    model = torch.compile(model, backend="zinf", options={"budget": "300MB", "offload": "nvme"})

Nothing needs importing for that (the backend is found through its entry point). From here:
`last_plans()` and `compiles()` show what each compile planned and changed; `optimizer(model, cls,
**kwargs)` steps on parameter shards where they live; `full_state_dict`, `load_state_dict`,
`save_checkpoint`, `load_checkpoint` save and restore a model whose parameters zinf manages;
`load_pretrained(model, path, options)` and `materialize(model, options)` give a model built on the
meta device its values straight in shards (zinf_compile/loading.py); `clip_grad_norm_` and
`total_norm` count managed parameters' gradients (torch's own
`torch.nn.utils.clip_grad_norm_` does too, once zinf manages a parameter).
"""
from zinf_compile.config import ZinfConfig
from zinf_compile.errors import BudgetError, ZinfConfigError, ZinfError
from zinf_compile.plan import Plan
from zinf_compile.checkpoint import full_state_dict, load_checkpoint, load_state_dict, save_checkpoint
from zinf_compile.grads import clip_grad_norm_, total_norm
from zinf_compile.loading import load_pretrained, materialize
from zinf_compile.optim import ZinfOptimizer, optimizer
from zinf_compile.records import compiles, last_plans


def reset() -> None:
    """Forget everything zinf holds in this process, as a fresh one would start: compiled functions
    (torch._dynamo.reset()), managed parameters (each gets its data back), optimizer states in the
    tiers' files (moved into memory), offload engines and their swap files, compile records."""
    from zinf_compile.runtime.state import RUNTIME

    RUNTIME.reset()

__version__ = "0.1.0"
__all__ = ["BudgetError", "Plan", "ZinfConfig", "ZinfConfigError", "ZinfError", "ZinfOptimizer",
           "clip_grad_norm_", "compiles", "full_state_dict", "last_plans", "load_checkpoint", "load_pretrained",
           "load_state_dict", "materialize", "optimizer", "reset",
           "save_checkpoint", "total_norm"]
