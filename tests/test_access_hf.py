"""A Hugging Face Llama with its parameters managed (both tiers) used the way HF code uses a model,
and Hugging Face's Trainer driving a zinf-compiled model.

Training: 3 steps of zinf_compile.optimizer(AdamW) and torch's own clip_grad_norm_ (routed to
zinf's) against Inductor with torch's AdamW and clip. Bit-identical, as in tests/test_hf_models.py
(decisions.md, "Determinism in tests"): zinf only moves bytes, Inductor compiles the same
arithmetic, zinf's clip is torch's arithmetic over the shards and its AdamW torch's update on flat
shards; Llama has no tied parameter, so no difference is rounding. Then, on the trained model,
what HF and torch code does with parameters outside the graph: each read is eager on the gathered
value and the reference is eager on the same bits, so those are compared bit for bit too.

Trainer: transformers' TrainingArguments(torch_compile_backend="zinf") is refused by accelerate's
DynamoBackend enum, so the recipe compiles the model in place (nn.Module.compile: the HF model
keeps its class, forward and save_pretrained) and passes zinf's optimizer:

    model.compile(backend="zinf", options={...})
    Trainer(model=model, args=TrainingArguments(..., torch_compile=False),
            optimizers=(zinf_compile.optimizer(model, torch.optim.AdamW, lr=...), None))

One compiled model and one trained Inductor reference per tier are shared by the tests (the suite
resets Dynamo per test, so a test that runs a compiled step compiles again: only two do).
"""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch
import transformers as tf

import zinf_compile
from zinf_compile.runtime.access import ManagedMixin
from zinf_compile.runtime.state import STORE
from tests.hf_models import hf_batch, hf_model

STEPS, LR, MAX_NORM = 3, 1e-3, 1.0
BATCH = hf_batch("llama")


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _step(fn, model, opt, batch=BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    loss = fn(**batch).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.detach().clone(), norm


@pytest.fixture(scope="module")
def inductor_run():
    """The reference trained once: its losses, norms, and the state after them (model, optimizer)."""
    torch.use_deterministic_algorithms(True)
    try:
        torch._dynamo.reset()
        ref = hf_model("llama")
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        fn = torch.compile(ref)
        losses, norms = zip(*(_step(fn, ref, opt) for _ in range(STEPS)))
        return dict(losses=losses, norms=norms, state=copy.deepcopy(ref.state_dict()),
                    opt_state=copy.deepcopy(opt.state_dict()))
    finally:
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()


@pytest.fixture(scope="module", params=["cpu", "nvme"])
def trained(request, inductor_run, offload_root):
    """The zinf model trained as the reference, and a reference at the same state (its own copy:
    a test steps both)."""
    tier = request.param
    zinf_compile.reset()
    torch.use_deterministic_algorithms(True)
    try:
        model = hf_model("llama")
        fn = torch.compile(model, backend="zinf", options={
            "params": "offload", "offload": tier, "offload_dir": os.path.join(offload_root, f"access-hf-{tier}")})
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=LR)
        losses, norms = zip(*(_step(fn, model, opt) for _ in range(STEPS)))
    finally:
        torch.use_deterministic_algorithms(False)
    ref = hf_model("llama")
    ref.load_state_dict(inductor_run["state"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_opt.load_state_dict(copy.deepcopy(inductor_run["opt_state"]))  # torch's load keeps the tensors
    yield dict(tier=tier, model=model, fn=fn, opt=opt, losses=losses, norms=norms, ref=ref, ref_opt=ref_opt)
    zinf_compile.reset()


def _managed(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if STORE.is_managed(p)]


def _eager_loss(model, batch=BATCH) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).loss


def test_training_with_clip_equals_inductor(trained, inductor_run):
    assert len(_managed(trained["model"])) == 16  # every projection, the embedding and the head
    assert all(n > MAX_NORM for n in inductor_run["norms"])  # every step clips
    for a, b in zip(trained["norms"] + trained["losses"], inductor_run["norms"] + inductor_run["losses"], strict=True):
        assert torch.equal(a, b), (trained["norms"], inductor_run["norms"], trained["losses"], inductor_run["losses"])


def test_norm_and_repr_read_the_trained_value(trained):
    model, ref = trained["model"], trained["ref"]
    refs = dict(ref.named_parameters())
    for name, p in _managed(model):
        assert isinstance(p, ManagedMixin) and p.untyped_storage().nbytes() == 0
        assert torch.equal(p.norm(), refs[name].norm()), name
    name, w = _managed(model)[1]
    text = repr(w)
    assert "managed by zinf" in text and str(refs[name].detach()[0, 0].item())[:6] in text
    assert str(refs[name].detach()[0, 0].item())[:6] in str(model.model.layers[0].self_attn.q_proj.weight)


def test_deepcopy_computes_the_reference_loss(trained):
    twin = copy.deepcopy(trained["model"])
    assert not _managed(twin) and all(type(p) is torch.nn.Parameter for p in twin.parameters())
    assert torch.equal(_eager_loss(twin), _eager_loss(trained["ref"]))


def test_state_dict_round_trip_through_torch_save(trained):
    buf = io.BytesIO()
    torch.save(trained["model"].state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    want = trained["ref"].state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
    plain = hf_model("llama", seed=7)
    plain.load_state_dict(loaded)
    assert torch.equal(_eager_loss(plain), _eager_loss(trained["ref"]))


def test_save_pretrained_and_from_pretrained(trained, tmp_path):
    trained["model"].save_pretrained(tmp_path / "llama")
    back = tf.LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    assert not _managed(back)
    assert torch.equal(_eager_loss(back), _eager_loss(trained["ref"]))


def test_load_state_dict_mid_training_then_a_step(trained):
    """Spoil the managed values in place, load the reference's state dict back (refilling the
    shards), then one compiled step on both: the same loss, norm and parameters after it."""
    model, ref = trained["model"], trained["ref"]
    with torch.no_grad():
        for _, p in _managed(model):
            p.mul_(-3.0)
    assert not torch.equal(_eager_loss(model), _eager_loss(ref))
    model.load_state_dict(ref.state_dict())
    loss, norm = _step(trained["fn"], model, trained["opt"])
    want_loss, want_norm = _step(torch.compile(ref), ref, trained["ref_opt"])
    assert torch.equal(loss, want_loss) and torch.equal(norm, want_norm), (loss, want_loss, norm, want_norm)
    got, want = model.state_dict(), ref.state_dict()
    bad = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not bad, bad


def test_dynamo_fallback_frame_equals_eager(trained):
    """Past the recompile limit Dynamo runs the HF forward eagerly on the managed parameters."""
    fn, ref = trained["fn"], trained["ref"]
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        _eager_loss(fn)  # compiled (inference graph)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        short = hf_batch("llama", seq=32, seed=4)  # a new shape: over the limit, so the frame runs eagerly
        assert torch.equal(_eager_loss(fn, short), _eager_loss(ref, short))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


# -- Hugging Face Trainer -------------------------------------------------------------------------

def _dataset() -> list[dict[str, torch.Tensor]]:
    b = hf_batch("llama", batch=8)
    return [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for i in range(8)]


def _trainer(model, out, optimizers=(None, None)) -> tf.Trainer:
    args = tf.TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                                learning_rate=LR, max_grad_norm=MAX_NORM, logging_steps=1, torch_compile=False,
                                report_to=[], use_cpu=True, save_strategy="no", seed=0)
    return tf.Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=optimizers)


def _steps(trainer) -> list[dict]:
    return [{k: h[k] for k in ("loss", "grad_norm", "learning_rate")} for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_zinf_equals_trainer_with_inductor(tmp_path, offload_root):
    """The recipe: 3 Trainer steps (its clip through accelerate, its linear schedule, model.zero_grad()
    between steps) log the same losses and grad norms as Inductor + torch's AdamW, and end with
    the same parameters."""
    ref = hf_model("llama")
    ref.compile(backend="inductor")
    want = _trainer(ref, tmp_path / "inductor", (torch.optim.AdamW(ref.parameters(), lr=LR), None))
    want.train()
    torch._dynamo.reset()
    zinf_compile.reset()
    model = hf_model("llama")
    model.compile(backend="zinf", options={"params": "offload", "offload": "nvme",
                                           "offload_dir": os.path.join(offload_root, "access-hf-trainer")})
    try:
        got = _trainer(model, tmp_path / "zinf", (zinf_compile.optimizer(model, torch.optim.AdamW, lr=LR), None))
        got.train()
        assert type(model) is tf.LlamaForCausalLM and len(_managed(model)) == 16
        assert len(_steps(got)) == STEPS and _steps(got) == _steps(want), (_steps(got), _steps(want))
        assert all(s["grad_norm"] > MAX_NORM for s in _steps(want))
        state, ref_state = model.state_dict(), ref.state_dict()
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    finally:
        zinf_compile.reset()


def test_trainer_default_optimizer_is_refused_at_the_first_step(tmp_path):
    """Trainer's own AdamW is made before the first forward manages anything; its first step meets
    managed parameters and raises zinf's error, before any parameter changes."""
    zinf_compile.reset()
    model = hf_model("llama")
    before = copy.deepcopy(model.state_dict())
    model.compile(backend="zinf", options={"params": "offload", "offload": "cpu"})
    try:
        trainer = _trainer(model, tmp_path / "default")
        with pytest.raises(zinf_compile.ZinfError,
                           match=r"AdamW holds parameter .*zinf_compile\.optimizer\(model, torch\.optim\.AdamW"):
            trainer.train()
        assert _managed(model) and trainer.state.global_step == 0
        after = model.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
    finally:
        zinf_compile.reset()
