"""One GRPO batch through TRL's GRPOTrainer and through Ember's trainer (megatron-core on CPU),
from the same initial weights and the same batch: per-token log-probs, the loss, every
parameter's gradient and the parameters after each optimizer step of one rollout, compared
element by element.

TRL's side is its own trainer, run by `trainer.train()`. The one stand-in is its sampler
(`_generate_single_turn` returns the batch's fixed responses); its rewards call, advantages,
old-policy forward, shuffle and mini-batch split, loss, clipping, AdamW and schedule are TRL's
and transformers' own, recorded by wrappers that call them unchanged. Ember's side is
`MegatronWorker.prepare` and `train` on the same samples in the order TRL's shuffle left them,
with TRL's old-policy log-probs as the generation log-probs (the engine's, in Ember's in-turn
loop). The settings are `tools/bench_peer.py`'s mapping of one Ember config to `GRPOConfig`,
and TRL starts from the bench's export of Ember's initial weights.

docs/learning-stability.md ("One batch against TRL") has the measured figures and what cannot
be made alike; `pytest -s` prints each case's largest differences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tools_loader import load_tool

pytest.importorskip("trl", reason="TRL is in the `peer` dependency group only")

pytestmark = pytest.mark.slow  # imports both stacks, then about 1 s per run: 25 s on 2 cores

bench_peer = load_tool("bench_peer")
peer_trl = load_tool("peer_trl")

PROMPTS, GROUP = 4, 4
"""One rollout of 16 samples; the default 4 optimizer steps take 4 samples each."""
STEPS = 4
"""Optimizer steps of one rollout (the default `train.num_steps_per_rollout`): all inside the
4-step warm-up, where the two schedules are the same step for step."""
ADAM_EPS = 1e-4
"""Adam's epsilon on both sides. At the default 1e-8, Adam divides a gradient of rounding size
by its own magnitude and the update there is rounding too (see
`test_default_adam_eps_turns_gradient_rounding_into_update_differences`)."""
TRL_STD_EPS = 1e-4
"""TRL 1.16 divides by the group std + 1e-4 (`_generate_and_score_completions`), a constant
and no setting; Ember by + 1e-6 (`ember_core.algorithms.advantages.GROUP_STD_EPS`)."""

LOG_PROB_TOL = 1e-5
LOSS_TOL = 1e-6
GRAD_TOL = 1e-6
PARAM_TOL = 1e-6

SETS = (
    f"rollout.rollout_batch_size={PROMPTS}",
    f"rollout.n_samples_per_prompt={GROUP}",
    "rollout.temperature=0.7",  # not 1: both sides must divide the logits by it
    "algorithm.entropy_coef=0",
    "train.optimizer.weight_decay=0.1",  # both exempt the norms: the same parameter groups
    f"train.optimizer.adam_eps={ADAM_EPS}",
    "run.save_interval=0",
    # Ember is handed the samples in the order TRL's shuffle left them: dealt as they come.
    "train.shuffle_mini_batches=false",
    *bench_peer.IN_TURN_SETS,
)
"""Over the default config: what makes one small rollout, in turn (the bench's in-turn loop)."""


def run_sets(*extra: str) -> list[str]:
    """The overrides of one case: the bench's for the default task and length, then SETS."""
    return bench_peer.ember_overrides("copy", 3, 3, 200, None, [*SETS, *extra])


# -- the batch -------------------------------------------------------------------------------------


def fixed_batch(tokenizer: Any, max_len: int) -> tuple[list[list[int]], list[float]]:
    """16 distinct responses of 1 to `max_len` tokens, digits and, in two of three, a final EOS
    (the others count as cut), and their rewards; the third group's rewards are all alike, so
    its standard deviation is 0."""
    rng = random.Random(0)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    responses: list[list[int]] = []
    while len(responses) < PROMPTS * GROUP:
        ids = [rng.choice(digits) for _ in range(rng.randint(1, max_len - 1))]
        if rng.random() < 2 / 3:
            ids.append(tokenizer.eos_token_id)
        if ids not in responses:
            responses.append(ids)
    rewards = [round(rng.random(), 3) for _ in responses]
    rewards[2 * GROUP : 3 * GROUP] = [0.5] * GROUP
    return responses, rewards


@dataclass
class Step:
    """What one optimizer step saw and did, on one side."""

    log_probs: list[torch.Tensor]
    """Training-forward log-probs of each sample's response tokens, in mini-batch order."""
    entropy: list[torch.Tensor]
    """The same tokens' entropies."""
    loss: float
    grads: dict[str, torch.Tensor]
    """Gradients before clipping, under transformers' in-memory names."""
    grad_norm: float
    lr: float
    params: dict[str, torch.Tensor]
    """Parameters after the step."""


@dataclass
class Run:
    """One side's rollout: its advantages per sample (training order) and its steps."""

    advantages: torch.Tensor
    steps: list[Step] = field(default_factory=list)
    initial: dict[str, torch.Tensor] | None = None
    """The parameters before the first step."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    """Ember's train/* metrics per step."""
    samples: list[Any] = field(default_factory=list)
    """TRL's run: the batch as Ember's samples, in the order TRL trained on them."""


@contextlib.contextmanager
def wrapped(owner: Any, name: str, make: Any):
    """Replace `owner.name` by `make(original)` for the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def then(record: Any) -> Any:
    """For `wrapped`: call the original, then `record(result)`."""

    def make(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            record(out)
            return out

        return call

    return make


# -- the two sides ---------------------------------------------------------------------------------


class Sides:
    """Both trainers on one batch, each run cached by its settings."""

    def __init__(self, root: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.root = root
        self.hf_init = root / "hf_init"
        bench_peer.export_init(str(self.hf_init), run_sets())
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_init, padding_side="left")
        config = bench_peer.load_run_config(run_sets())
        self.responses, self.rewards = fixed_batch(self.tokenizer, config.rollout.max_response_len)
        self.mirror = AutoModelForCausalLM.from_pretrained(self.hf_init, dtype=torch.float32)
        self._trl: dict[Any, Run] = {}
        self._ember: dict[Any, Run] = {}

    def as_hf(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors (per expert) under transformers' in-memory names (experts
        fused), through the engine's own loader; every parameter must receive one."""
        from ember_rollout.models import load_hf_weights

        with torch.no_grad():
            for param in self.mirror.parameters():
                param.fill_(math.nan)
        assert load_hf_weights(self.mirror, named.items()) == len(named)
        out = {k: v.detach().clone() for k, v in self.mirror.named_parameters()}
        assert all(torch.isfinite(v).all() for v in out.values()), "a parameter got no tensor"
        return out

    # -- TRL ---------------------------------------------------------------------------------

    def trl(self, sets: tuple[str, ...] = (), changes: tuple[tuple[str, Any], ...] = (),
            steps: int = STEPS) -> Run:  # fmt: skip
        """TRL's GRPOTrainer on the batch with the bench's GRPOConfig for `sets` (`changes`
        on top: TRL's side only), `steps` optimizer steps."""
        config = bench_peer.load_run_config(run_sets(*sets))
        kwargs = {**bench_peer.trl_mapping(config).kwargs, **dict(changes)}
        key = (repr(sorted(kwargs.items())), steps)
        if key not in self._trl:
            self._trl[key] = self._run_trl(config, kwargs, steps)
        return self._trl[key]

    def _run_trl(self, config: Any, kwargs: dict[str, Any], steps: int) -> Run:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from ember_core.types import Sample, SampleStatus
        from ember_rollout.data import PromptEncoder, load_prompts
        from ember_rollout.tokenizer import load_tokenizer

        args = GRPOConfig(output_dir=str(self.root / "trl"), disable_tqdm=True, **kwargs)
        records = load_prompts(config.data)
        encoder = PromptEncoder(load_tokenizer(str(self.hf_init)),
                                apply_chat_template=config.data.apply_chat_template)  # fmt: skip
        rows = peer_trl.trl_rows(records, chat=encoder.use_template)
        peer_trl.check_prompt_ids(rows[:8], records[:8], self.tokenizer, encoder)

        def reward(completion_ids, **_):
            assert completion_ids == self.responses
            return list(self.rewards)

        seen: dict[str, Any] = {"log_probs": [], "entropy": [], "loss": [], "grads": [],
                                "norm": [], "lr": [], "params": []}  # fmt: skip

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                seen["params"].append(
                    {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
                )
                control.should_training_stop = state.global_step >= steps

        trainer = GRPOTrainer(model=str(self.hf_init), reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_list(rows),
                              processing_class=self.tokenizer, callbacks=[Record()])  # fmt: skip
        initial = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}

        def sampler(original):
            def fixed(prompt_ids, images, multimodal_fields, num_generations, **_):
                assert len(prompt_ids) == len(self.responses)
                for g in range(PROMPTS):  # the sampler repeats each prompt GROUP times
                    assert all(p == prompt_ids[g * GROUP] for p in prompt_ids[g * GROUP :][:GROUP])
                return [list(r) for r in self.responses], None

            return fixed

        def log_probs(out):
            if torch.is_grad_enabled():  # the training forward, not the old-policy one
                seen["log_probs"].append(out[0].detach().clone())
                seen["entropy"].append(out[1].detach().clone())

        def clip(original):
            def record(model):
                seen["grads"].append(
                    {
                        k: (v.grad if v.grad is not None else torch.zeros_like(v)).detach().clone()
                        for k, v in model.named_parameters()
                    }  # fmt: skip
                )
                seen["lr"].append(trainer.optimizer.param_groups[0]["lr"])
                norm = original(model)
                seen["norm"].append(float(norm))
                return norm

            return record

        with contextlib.ExitStack() as stack:
            stack.enter_context(wrapped(trainer, "_generate_single_turn", sampler))
            stack.enter_context(
                wrapped(trainer, "_get_per_token_logps_and_entropies", then(log_probs))
            )
            loss = then(lambda out: seen["loss"].append(float(out.detach())))
            stack.enter_context(wrapped(trainer, "compute_loss", loss))
            stack.enter_context(wrapped(trainer, "_clip_grad_norm", clip))
            trainer.train()
        assert trainer.state.global_step == steps

        # The mini-batches TRL trained on (its shuffle of the generation batch, split in order).
        samples, advantages, runs = [], [], []
        slots = {tuple(r): i for i, r in enumerate(self.responses)}
        for k, mb in enumerate(trainer._buffered_inputs):
            mask = mb["completion_mask"].bool()
            lps, ents = [], []
            for row in range(mask.shape[0]):
                response = mb["completion_ids"][row][mask[row]].tolist()
                prompt = mb["prompt_ids"][row][mb["prompt_mask"][row].bool()].tolist()
                slot = slots[tuple(response)]
                samples.append(
                    Sample(
                        tokens=prompt + response,
                        response_length=len(response),
                        index=len(samples),
                        group_index=slot // GROUP,
                        reward=self.rewards[slot],
                        rollout_log_probs=mb["old_per_token_logps"][row][mask[row]].tolist(),
                        status=SampleStatus.COMPLETED
                        if response[-1] == self.tokenizer.eos_token_id
                        else SampleStatus.TRUNCATED,
                    )
                )
                if k < steps:
                    lps.append(seen["log_probs"][k][row][mask[row]])
                    ents.append(seen["entropy"][k][row][mask[row]])
            advantages.append(mb["advantages"])
            if k < steps:
                runs.append(Step(lps, ents, seen["loss"][k], seen["grads"][k], seen["norm"][k],
                                 seen["lr"][k], seen["params"][k]))  # fmt: skip
        return Run(torch.cat(advantages), runs, initial=initial, samples=samples)

    # -- Ember -------------------------------------------------------------------------------

    def ember(self, sets: tuple[str, ...] = (), trl: Run | None = None,
              std_eps: float = TRL_STD_EPS) -> Run:  # fmt: skip
        """Ember's trainer on `trl`'s samples (default: TRL's run with the same `sets`), with
        `std_eps` added to the group std."""
        trl = trl if trl is not None else self.trl(sets)
        key = (sets, id(trl), std_eps)
        if key not in self._ember:
            self._ember[key] = self._run_ember(list(sets), trl, std_eps)
        return self._ember[key]

    def _run_ember(self, sets: list[str], trl: Run, std_eps: float) -> Run:
        import copy

        from ember_core.algorithms import advantages as advantages_module
        from ember_megatron_backend import worker as worker_module
        from ember_megatron_backend.hf_layout import hf_rule
        from ember_megatron_backend.worker import MegatronWorker

        config = bench_peer.load_run_config(run_sets(*sets))
        worker = MegatronWorker(config.train, config.algorithm, config.rollout)
        initial = self.as_hf(dict(worker.hf_weights()))
        heads: list[Any] = []
        seen: dict[str, list[Any]] = {"grads": [], "params": []}

        def step(original):
            def record(step_index):
                # The accumulated gradients before clipping, split into checkpoint tensors by
                # the same rules as the weights.
                grads = {}
                for name, param in worker.actor.module.named_parameters():
                    rule = hf_rule(name, worker.model_config)
                    grads.update(zip(rule.hf_names, rule.split(param.main_grad.detach().clone()),
                                     strict=True))  # fmt: skip
                seen["grads"].append(self.as_hf(grads))
                result = original(step_index)
                seen["params"].append(self.as_hf(dict(worker.hf_weights())))
                return result

            return record

        samples = copy.deepcopy(trl.samples)
        with contextlib.ExitStack() as stack:
            stack.enter_context(wrapped(advantages_module, "GROUP_STD_EPS", lambda _: std_eps))
            stack.enter_context(wrapped(worker_module, "policy_head", then(heads.append)))
            stack.enter_context(wrapped(worker.actor_optimizer, "step", step))
            batch = worker.prepare(0, samples)
            metrics = worker.train(0, batch)
        assert len(metrics) == STEPS and len(heads) == STEPS
        run = Run(torch.stack([a[0] for a in batch.advantages]), initial=initial, metrics=metrics)
        for k, m in enumerate(metrics):
            run.steps.append(Step([lp.detach() for lp in heads[k].log_probs],
                                  [e.detach() for e in heads[k].entropy], m["train/loss"],
                                  seen["grads"][k], m["train/grad_norm"], m["train/lr"],
                                  seen["params"][k]))  # fmt: skip
        return run


# -- comparison ------------------------------------------------------------------------------------


@dataclass
class Gaps:
    """Largest absolute differences between the two sides, per step."""

    advantages: float
    log_probs: list[float]
    loss: list[float]
    grads: list[float]
    grad_norm: list[float]
    lr: list[float]
    params: list[float]
    worst_param: list[str]

    def failures(self, steps: int = STEPS) -> list[str]:
        """What exceeds its tolerance within the first `steps` steps."""
        out = []
        for name, values, tol in (
            ("log_probs", self.log_probs, LOG_PROB_TOL),
            ("loss", self.loss, LOSS_TOL),
            ("grads", self.grads, GRAD_TOL),
            ("params", self.params, PARAM_TOL),
        ):
            bad = [f"step {k}: {v:.2e}" for k, v in enumerate(values[:steps]) if not v <= tol]
            if bad:
                out.append(f"{name} > {tol:g} at " + ", ".join(bad))
        return out

    def line(self, label: str) -> str:
        """The largest differences over the steps compared, for `pytest -s`."""
        text = (f"{label}: advantages {self.advantages:.1e}, log-probs {max(self.log_probs):.1e}, "
                f"loss {max(self.loss):.1e}, grads {max(self.grads):.1e}, params after step 1 "
                f"{self.params[0]:.1e}")  # fmt: skip
        if len(self.params) > 1:
            text += f", after the rollout's {len(self.params)} steps {self.params[-1]:.1e}"
        return text + f" ({self.worst_param[-1]})"


def largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between two sets of named tensors, and where."""
    assert a.keys() == b.keys()
    name = max(a, key=lambda n: float((a[n] - b[n]).abs().max()))
    return float((a[name] - b[name]).abs().max()), name


def gaps(trl: Run, ember: Run) -> Gaps:
    """Step by step, over the steps both ran."""
    out = Gaps(float((trl.advantages - ember.advantages).abs().max()), [], [], [], [], [], [], [])
    for t, e in zip(trl.steps, ember.steps, strict=False):
        lps = zip(t.log_probs, e.log_probs, strict=True)
        out.log_probs.append(max(float((a - b).abs().max()) for a, b in lps))
        out.loss.append(abs(t.loss - e.loss))
        out.grads.append(largest(t.grads, e.grads)[0])
        out.grad_norm.append(abs(t.grad_norm - e.grad_norm))
        out.lr.append(abs(t.lr - e.lr))
        gap, name = largest(t.params, e.params)
        out.params.append(gap)
        out.worst_param.append(name)
    return out


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """The export, the batch and the run caches; a single-process group for Ember's worker,
    left as found (other modules may hold one)."""
    import torch.distributed as dist

    from ember_megatron_backend.parallel import destroy_distributed, init_distributed

    owned = not dist.is_initialized()
    init_distributed()
    yield Sides(tmp_path_factory.mktemp("trl_parity"))
    if owned:
        destroy_distributed()


# -- tests -----------------------------------------------------------------------------------------

PARITY_CASES = {
    # The bench's in-turn config: per-sample token mean (TRL's grpo), the ratio against the
    # generation log-probs.
    "grpo": (),
    # The same with Ember's own old-policy forward instead of the generation log-probs.
    "grpo, Ember's old-policy forward": ("algorithm.use_rollout_log_probs=false",),
    # Token mean (TRL's bnpo), where both reduce the entropy bonus as the loss: it can be on.
    "bnpo with entropy bonus": ("algorithm.loss_reduction=token", "algorithm.entropy_coef=0.03"),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_one_grpo_batch_matches_trl(sides, case):
    sets = PARITY_CASES[case]
    trl = sides.trl(sets)
    ember = sides.ember(sets)
    # The same initial weights (the bench's export), bit for bit.
    assert all(torch.equal(trl.initial[n], ember.initial[n]) for n in trl.initial)
    # Both see the rollout as 4 mini-batches of 4 samples, in TRL's shuffled order; the third
    # group (equal rewards) has no advantage.
    assert [len(s.log_probs) for s in ember.steps] == [PROMPTS * GROUP // STEPS] * STEPS
    assert [len(s.log_probs) for s in trl.steps] == [PROMPTS * GROUP // STEPS] * STEPS
    third = [i for i, s in enumerate(trl.samples) if s.group_index == 2]
    assert ember.advantages[third].abs().max() == 0 and trl.advantages[third].abs().max() == 0
    found = gaps(trl, ember)
    print(found.line(case))
    assert found.advantages <= 1e-6
    assert found.failures() == []
    assert max(found.grad_norm) <= 1e-5 * max(s.grad_norm for s in trl.steps)
    assert max(found.lr) <= 1e-12  # the warm-up, step for step
    # Clipping acted (norms above train.optimizer.clip_grad = 1); the first step is on-policy
    # (ratio 1), the later ones moved off it far enough for the PPO clip to act.
    assert all(s.grad_norm > 1.0 for s in trl.steps)
    per_step = PROMPTS * GROUP // STEPS
    for k, step in enumerate(trl.steps):
        group = trl.samples[k * per_step : (k + 1) * per_step]
        old = torch.cat([torch.tensor(s.rollout_log_probs) for s in group])
        moved = float((torch.cat(step.log_probs) - old).abs().max())
        assert moved < 1e-5 if k == 0 else moved > 1e-3
    assert ember.metrics[0]["train/pg_clipfrac"] == 0
    assert any(m["train/pg_clipfrac"] > 0 for m in ember.metrics[1:])


ONE_SIDED = {
    # TRL averages over tokens (bnpo), Ember keeps its per-sample mean.
    "loss aggregation on TRL's side": ((("loss_type", "bnpo"),), ()),
    # Ember averages over tokens, TRL keeps grpo.
    "loss aggregation on Ember's side": ((), ("algorithm.loss_reduction=token",)),
    # TRL only centres the rewards, Ember still divides by the group std.
    "advantage normalisation on TRL's side": ((("scale_rewards", "none"),), ()),
    # Ember only centres the rewards, TRL still divides by the group std.
    "advantage normalisation on Ember's side": ((), ("algorithm.normalize_group_std=false",)),
}
"""(TRL's GRPOConfig changes, Ember's overrides): one setting on one side only."""


@pytest.mark.parametrize("case", ONE_SIDED)
def test_a_setting_changed_on_one_side_breaks_parity(sides, case):
    trl_changes, ember_sets = ONE_SIDED[case]
    trl = sides.trl(changes=trl_changes)
    found = gaps(trl, sides.ember(ember_sets, trl))
    print(found.line(case))
    failed = " ".join(found.failures(steps=1))
    # From the first step on, with the parameters still the same on both sides.
    assert "loss >" in failed and "grads >" in failed and "params >" in failed, failed
    assert found.loss[0] > 10 * LOSS_TOL and found.grads[0] > 10 * GRAD_TOL


def test_group_std_epsilon_is_the_one_difference_in_advantages(sides):
    """Ember's own + 1e-6 against TRL's + 1e-4: each group's advantages differ by the factor
    (std + 1e-4) / (std + 1e-6), nothing else; the tests above give Ember TRL's constant."""
    trl = sides.trl()
    ember = sides.ember(trl=trl, std_eps=1e-6)
    rewards = torch.tensor([s.reward for s in trl.samples], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in trl.samples])
    for g in groups.unique():
        members = groups == g
        std = float(rewards[members].std())
        if std == 0:
            assert ember.advantages[members].abs().max() == 0
            continue
        factor = (std + TRL_STD_EPS) / (std + 1e-6)
        torch.testing.assert_close(ember.advantages[members], trl.advantages[members] * factor,
                                   rtol=0, atol=1e-6)  # fmt: skip
    found = gaps(trl, ember)
    print(found.line("Ember's group std + 1e-6"))
    assert found.advantages > 1e-5 and "grads >" in " ".join(found.failures(steps=1))


def test_entropy_bonus_under_grpo_differs_by_the_two_means(sides):
    """Per-sample token mean (TRL's grpo, Ember's sample reduction) with an entropy bonus:
    TRL's bonus is the token mean of the mini-batch's entropy, Ember's the per-sample mean,
    so the losses differ by exactly coef x (the difference of the two means)."""
    coef = 0.03
    sets = (f"algorithm.entropy_coef={coef}",)
    trl = sides.trl(sets, steps=1)
    ember = sides.ember(sets, trl)
    t, e = trl.steps[0], ember.steps[0]
    token_mean = float(torch.cat(t.entropy).mean())
    sample_mean = float(torch.stack([h.mean() for h in e.entropy]).mean())
    # Near-uniform at initialisation, yet far apart for the loss tolerance.
    assert coef * abs(sample_mean - token_mean) > 5 * LOSS_TOL
    found = gaps(trl, ember)
    print(found.line("entropy bonus under grpo") + f"; mean entropy per sample {sample_mean:.6f}"
          f" against per token {token_mean:.6f}")  # fmt: skip
    assert found.log_probs[0] <= LOG_PROB_TOL
    assert e.loss - t.loss == pytest.approx(-coef * (sample_mean - token_mean), abs=LOSS_TOL)


def test_default_adam_eps_turns_gradient_rounding_into_update_differences(sides):
    """At the default adam_eps 1e-8 the first AdamW step moves each weight by
    lr x g / (|g| + eps) (bias-corrected, g the clipped gradient): where |g| is near eps that is
    the sign of a gradient made of rounding, and the two sides' rounding differs. Their
    parameters after one step differ exactly by that function of their own gradients."""
    sets = ("train.optimizer.adam_eps=1e-8",)
    trl = sides.trl(sets, steps=1)
    ember = sides.ember(sets, trl)
    found = gaps(trl, ember)
    print(found.line("adam_eps 1e-8, one step"))
    # Log-probs, loss and gradients are those of the same weights: still within tolerance.
    assert all(f.startswith("params") for f in found.failures(steps=1)), found.failures(1)
    t, e = trl.steps[0], ember.steps[0]
    lr, eps = t.lr, 1e-8
    clip_grad = bench_peer.load_run_config(run_sets(*sets)).train.optimizer.clip_grad

    def update(step: Step, name: str) -> torch.Tensor:
        g = step.grads[name].double() * min(1.0, clip_grad / (step.grad_norm + 1e-6))
        return -lr * g / (g.abs() + eps)

    unexplained = 0.0
    for name, before in trl.initial.items():
        # Weight decay scales both sides' (identical) initial weights alike: it cancels here.
        predicted = update(e, name) - update(t, name)
        measured = (e.params[name] - t.params[name]).double()
        # Each side rounds its new weights to fp32 once: half a unit in the last place each.
        rounding = before.double().abs() * 2.0**-23 + 1e-9
        unexplained = max(unexplained, float(((measured - predicted).abs() - rounding).max()))
    assert unexplained <= 0, unexplained


def test_trls_shuffle_decides_the_mini_batches(sides):
    """TRL shuffles the generation batch before splitting it into mini-batches; Ember splits
    its samples in the order they arrive (whole prompt groups per step, in rollout order), and
    neither has a switch for the other's way. The tests above hand Ember TRL's order; in the
    rollout's own order the same 16 samples make other mini-batches."""
    trl = sides.trl()
    in_groups = sorted(trl.samples, key=lambda s: s.group_index)
    assert [s.group_index for s in in_groups] != [s.group_index for s in trl.samples]
    ember = sides.ember(trl=dataclasses.replace(trl, samples=in_groups))
    loss = abs(trl.steps[0].loss - ember.steps[0].loss)
    grads = largest(trl.steps[0].grads, ember.steps[0].grads)[0]
    params = largest(trl.steps[-1].params, ember.steps[-1].params)[0]
    print(
        f"mini-batches of whole groups: loss at step 1 {loss:.1e}, grads {grads:.1e}, "
        f"params after the rollout {params:.1e}"
    )
    assert loss > LOSS_TOL and grads > GRAD_TOL and params > PARAM_TOL
