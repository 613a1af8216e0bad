"""Prepared optimizers and schedulers hand everything they do not define to the user's objects: a
schedule-free optimizer trains, evaluates and resumes through Accelerator.prepare as in a plain loop."""

import copy
import pickle

import pytest
import schedulefree
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.regions import compiled_regions
from kiln.optim import PreparedOptimizer, PreparedScheduler
from kiln.utils import set_seed
from toy_models import tiny_llama


class TrustSGD(torch.optim.SGD):
    """An optimizer with attributes and methods of its own, as LARS-style optimizers have."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.trust_ratio = 0.5

    def trusted_lr(self) -> float:
        return self.param_groups[0]["lr"] * self.trust_ratio


def test_prepared_optimizer_reaches_the_users_own_attributes_and_methods():
    model = torch.nn.Linear(4, 2)
    optimizer = Accelerator().prepare(TrustSGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, PreparedOptimizer) and isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.trust_ratio == 0.5 and optimizer.trusted_lr() == pytest.approx(0.05)
    optimizer.trust_ratio = 0.25  # the user's optimizer owns it: the write reaches it
    assert optimizer.optimizer.trust_ratio == 0.25 and optimizer.trusted_lr() == pytest.approx(0.025)
    assert "trust_ratio" not in vars(optimizer)
    optimizer.note = "mine"  # neither has it: the wrapper keeps it
    assert optimizer.note == "mine" and not hasattr(optimizer.optimizer, "note")
    with pytest.raises(AttributeError, match="no attribute 'trust_radius', nor has the TrustSGD it wraps") as raised:
        optimizer.trust_radius
    assert raised.value.name == "trust_radius"


def test_plain_optimizer_train_and_eval_do_nothing_as_in_accelerate():
    model = torch.nn.Linear(4, 2)
    optimizer = Accelerator().prepare(torch.optim.AdamW(model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.train()
    optimizer.eval()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_prepared_objects_copy_and_pickle_without_recursing():
    model = torch.nn.Linear(4, 2)
    optimizer = TrustSGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    optimizer, scheduler = Accelerator().prepare(optimizer, scheduler)
    scheduler.last_epoch = 7  # the user's scheduler owns it
    assert scheduler.scheduler.last_epoch == 7
    for clone in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        # (torch's Optimizer pickles only defaults, state and param_groups: trust_ratio stays behind)
        assert clone.optimizer is not optimizer.optimizer and clone.trusted_lr.__func__ is TrustSGD.trusted_lr
        assert clone.param_groups[0]["lr"] == 0.1
    for clone in (copy.deepcopy(scheduler), pickle.loads(pickle.dumps(scheduler))):
        assert isinstance(clone, PreparedScheduler) and clone.last_epoch == 7
    empty = PreparedOptimizer.__new__(PreparedOptimizer)  # as unpickling starts: nothing set yet
    with pytest.raises(AttributeError, match="'PreparedOptimizer' object has no attribute 'optimizer'"):
        empty.optimizer


# ----- schedule-free AdamW: the plain loop's losses, and an exact resume ---------------------------

STEPS_BEFORE_EVAL = 3
STEPS_AFTER_EVAL = 3


def _batches(count: int) -> list[torch.Tensor]:
    """Runs of consecutive tokens from random starts: learnable within a few steps."""
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 97, (4, 1), generator=generator) + torch.arange(16)) % 97 for _ in range(count)]


def _train(model, optimizer, batches, backward) -> list[float]:
    model.train()
    optimizer.train()
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _evaluate(model, optimizer, tokens) -> float:
    model.eval()
    optimizer.eval()  # the averaged weights: the ones to evaluate and to save
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss.item()


def _schedule_free(model):
    return schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, warmup_steps=2)


def _kiln_run(seed: int):
    set_seed(seed)
    model = tiny_llama(layers=2, width=64, init_std=0.08)
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    accelerator = Accelerator(dynamo_plugin=plugin)
    model, optimizer = accelerator.prepare(model, _schedule_free(model))
    return accelerator, model, optimizer


@pytest.fixture(scope="module")
def plain_losses():
    """Train, evaluate, train on: the same model and optimizer without Kiln."""
    set_seed(0)
    model = tiny_llama(layers=2, width=64, init_std=0.08)
    optimizer = _schedule_free(model)
    batches, held_out = _batches(STEPS_BEFORE_EVAL + STEPS_AFTER_EVAL), _batches(1)[0]
    first = _train(model, optimizer, batches[:STEPS_BEFORE_EVAL], lambda loss: loss.backward())
    evaluated = _evaluate(model, optimizer, held_out)
    rest = _train(model, optimizer, batches[STEPS_BEFORE_EVAL:], lambda loss: loss.backward())
    return first, evaluated, rest


def test_schedule_free_adamw_through_prepare_gives_the_plain_loops_losses(plain_losses):
    accelerator, model, optimizer = _kiln_run(seed=0)
    batches, held_out = _batches(STEPS_BEFORE_EVAL + STEPS_AFTER_EVAL), _batches(1)[0]
    first = _train(model, optimizer, batches[:STEPS_BEFORE_EVAL], accelerator.backward)
    evaluated = _evaluate(model, optimizer, held_out)
    assert optimizer.param_groups[0]["train_mode"] is False and optimizer.param_groups[0]["k"] == STEPS_BEFORE_EVAL
    rest = _train(model, optimizer, batches[STEPS_BEFORE_EVAL:], accelerator.backward)
    regions = compiled_regions(model)
    assert regions and all(region.calls > 0 for region in regions), [(r.name, r.calls) for r in regions]
    torch.testing.assert_close((first, evaluated, rest), plain_losses, rtol=1e-5, atol=1e-6)
    assert rest[-1] < first[0]  # it learns: the comparison is not between two idle runs


def test_schedule_free_adamw_resumes_exactly_from_save_state(tmp_path, plain_losses):
    batches, held_out = _batches(STEPS_BEFORE_EVAL + STEPS_AFTER_EVAL), _batches(1)[0]
    accelerator, model, optimizer = _kiln_run(seed=0)
    _train(model, optimizer, batches[:STEPS_BEFORE_EVAL], accelerator.backward)
    evaluated = _evaluate(model, optimizer, held_out)
    accelerator.save_state(tmp_path / "ckpt")  # in eval mode, as schedule-free asks
    uninterrupted = _train(model, optimizer, batches[STEPS_BEFORE_EVAL:], accelerator.backward)

    accelerator, model, optimizer = _kiln_run(seed=123)  # everything must come from the checkpoint
    accelerator.load_state(tmp_path / "ckpt")
    assert optimizer.param_groups[0]["k"] == STEPS_BEFORE_EVAL
    assert all("z" in optimizer.state[p] for p in model.parameters())
    assert _evaluate(model, optimizer, held_out) == evaluated
    resumed = _train(model, optimizer, batches[STEPS_BEFORE_EVAL:], accelerator.backward)
    assert resumed == uninterrupted
    torch.testing.assert_close(resumed, plain_losses[2], rtol=1e-5, atol=1e-6)
