"""The `ppo` section and the generation settings it shares with the audit."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import field_validator, model_validator

from rlhf_cli.recipe.base import Section, described
from rlhf_cli.recipe.names import ESTIMATORS, EstimatorName, GenerationBackend


class VllmSection(Section):
    gpu_memory_utilization: float = described(
        0.3,
        "Share of each GPU's memory the vLLM engine may take (weights and KV cache); the rest "
        "is the training's. CUDA only.",
        gt=0.0,
        lt=1.0,
    )
    tensor_parallel_size: int = described(
        1,
        "Processes (GPUs) that share one vLLM engine, its weights split across them. Under "
        "`accelerate launch` the processes form groups of this size (it must divide their "
        "number); each group samples its members' prompts together.",
        ge=1,
    )
    sleep: bool = described(
        False,
        "Put the vLLM engine to sleep (level 1: weights offloaded to the CPU, KV cache "
        "released) after every batch it generates, and wake it before the next one and before "
        "a weight sync: the update gets its GPU memory. CUDA only.",
    )


class ServerSection(Section):
    urls: list[str] = described(
        [],
        "Base URLs of the vLLM servers (`rlhf serve` prints the line that sets them), e.g. "
        "`[http://10.0.0.5:8000]`; each process's prompts are split across them.",
    )
    timeout_s: float = described(
        300.0,
        "Longest wait for one answer (or one sync step, an NCCL broadcast included) from a "
        "server before it is retried; a batch's answers all arrive within (retries + 1) × "
        "timeout_s and the pauses between tries, or the server is lost.",
        gt=0.0,
    )
    retries: int = described(
        2,
        "Tries after the first for a request that fails, times out or answers malformed (cut "
        "short, not JSON); then the run "
        "checkpoints and exits 2 with the `--resume` line.",
        ge=0,
    )
    sync: Literal["auto", "lora", "weights"] = described(
        "auto",
        "How the policy reaches the servers after every update: `lora` writes the adapter "
        "into `shared_dir` and loads it under a new name (vLLM's runtime LoRA loading); "
        "`weights` writes the merged weights there and reloads them in place (vLLM's dev "
        "endpoints); `auto`: `lora` for a LoRA policy, else `weights`.",
    )
    weight_transfer: Literal["auto", "disk", "nccl"] = described(
        "auto",
        "How `sync: weights` moves the weights: `disk` writes them into `shared_dir` and the "
        "servers reload them; `nccl` sends them GPU to GPU over vLLM's NCCL weight-transfer "
        "engine (one trainer process on CUDA with the vllm package; servers started with "
        "`--weight-transfer-config`, as `rlhf serve` does on GPUs); `auto`: `nccl` where the "
        "trainer has what it needs, else `disk`.",
    )
    shared_dir: str | None = described(
        None,
        "A folder the trainer writes and every server reads (the same path on both sides: a "
        "shared disk across machines); default: the run's `ppo/.server-sync` (one machine).",
    )

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url):
                raise ValueError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000")
        return [url.rstrip("/") for url in urls]


# fields that moved under `generation.vllm` in 0.1.0: named in the error until 0.2.0, then removed
RENAMED_VLLM_FIELDS = {
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "vllm_sleep": "vllm.sleep",
}


class GenerationSection(Section):
    max_new_tokens: int = described(200, "Longest response in tokens.", gt=0)
    temperature: float = described(
        0.8, "Sampling temperature; the PPO log-probs use the same one.", gt=0.0
    )
    top_p: float = described(0.9, "Nucleus sampling mass.", gt=0.0, le=1.0)
    top_k: int = described(0, "Top-k sampling (0: off).", ge=0)
    do_sample: bool = described(True, "Sample (True) or decode greedily.")
    backend: GenerationBackend = described(
        "hf",
        "Generation engine: transformers `generate`, a colocated vLLM engine that gets the "
        "policy's weights after every update (`pip install 'rlhf-cli[vllm]'`), or vLLM "
        "servers of their own (`vllm_server`: `server.urls`, started by `rlhf serve`). "
        "`ppo.generation.backend` samples the rollouts (and the in-training audit); "
        "`audit.generation.backend` serves `rlhf audit` and `rlhf compare`.",
    )
    vllm: VllmSection = described(VllmSection(), "The vLLM engine's settings (`backend: vllm`).")
    server: ServerSection = described(
        ServerSection(), "The vLLM servers' addresses and sync (`backend: vllm_server`)."
    )
    async_steps: int = described(
        0,
        "With `backend: vllm_server`, generate the next N rollouts while the update runs, each "
        "at most N policy versions behind (`rollout/staleness`; `tis_cap` corrects the gap). "
        "0: every rollout from the latest weights, and `--resume` is exact.",
        ge=0,
    )
    tis_cap: float | None = described(
        None,
        "Truncated importance sampling: weight each token's policy loss by "
        "min(π_train / π_sampler, tis_cap), correcting for the rollout engine's numerics "
        "(off by default).",
        gt=0.0,
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED_VLLM_FIELDS.items():
                if old in data:
                    raise ValueError(f"{old} is now {new}: move it under generation.vllm")
        return data

    @model_validator(mode="after")
    def _server(self) -> GenerationSection:
        if self.backend == "vllm_server" and not self.server.urls:
            raise ValueError(
                "server.urls: backend vllm_server needs the servers' URLs (`rlhf serve` prints "
                "the --set line)"
            )
        if self.async_steps and self.backend != "vllm_server":
            raise ValueError(
                f"async_steps: {self.async_steps} overlaps generation with the update, which "
                "needs backend: vllm_server (a colocated engine shares the update's device)"
            )
        return self


LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class PpoSection(Section):
    iterations: int = described(500, "PPO iterations (rollout + update).", gt=0)
    batch_size: int = described(32, "Prompts per iteration (global, across processes).", gt=0)
    mini_batch_size: int = described(4, "Rollouts per forward/backward pass.", gt=0)
    gradient_accumulation_steps: int = described(2, "Mini-batches per optimiser step.", gt=0)
    ppo_epochs: int = described(4, "Passes over each rollout batch (the guide: at most 4).", gt=0)
    learning_rate: float = described(1.4e-5, "AdamW learning rate.", gt=0.0)
    adam_eps: float = described(
        1e-5, "AdamW epsilon (1e-5, as in the N-implementation-details).", gt=0.0
    )
    weight_decay: float = described(
        0.0, "AdamW weight decay (0: TRL's PPO used Adam without decay).", ge=0.0
    )
    adaptive_kl: bool = described(True, "Adapt β toward `target_kl` (Ziegler et al. 2019).")
    init_kl_coef: float = described(
        0.2,
        "Starting β of the per-token KL penalty. 0 makes a no-KL run: no reference forward at "
        "rollout and no `objective/kl` while β is 0 (the adaptive update, multiplicative, "
        "keeps it there; only an audit raise moves it).",
        ge=0.0,
    )
    target_kl: float = described(6.0, "Target KL in nats for the adaptive controller.", gt=0.0)
    horizon: int = described(10000, "Adaptive controller horizon.", gt=0)
    gamma: float = described(
        1.0, "Discount (1.0: no discounting inside a response).", ge=0.0, le=1.0
    )
    lam: float = described(0.95, "GAE λ.", ge=0.0, le=1.0)
    advantage_estimator: EstimatorName = described(
        "gae",
        "`gae`: PPO with a critic (value head); critic-free, no value model built: `rloo` "
        "(leave-one-out baseline over a prompt's completions), `grpo` (group-normalised "
        "scores), `reinforce_pp` (REINFORCE++: KL-shaped token returns whitened over the batch).",
    )
    num_generations: int = described(
        1,
        "Completions per prompt in a batch (`batch_size` counts completions; rloo and grpo "
        "need at least 2).",
        ge=1,
    )
    dynamic_sampling: bool = described(
        False,
        "DAPO's dynamic sampling (rloo, grpo): a group whose answers all score the same gives "
        "no gradient; drop it and fill its place with a fresh prompt's group, sampling again "
        "up to `dynamic_sampling_max_rounds` batches an iteration (`rollout/dropped_groups_rate`, "
        "`rollout/sampling_rounds`); docs/ppo.md#dynamic-sampling.",
    )
    dynamic_sampling_max_rounds: int = described(
        3,
        "Most batches generated an iteration with `dynamic_sampling`; groups still uniform "
        "then are trained on as they are (no gradient from them: `rollout/uniform_groups_kept`).",
        ge=1,
    )
    importance_ratio: Literal["token", "sequence"] = described(
        "token",
        "The clipped surrogate's importance ratio: per token (PPO, GRPO), or one per answer, "
        "exp of the mean over its tokens of log π − log π_old, on every token of it (GSPO, "
        "TRL's `importance_sampling_level: sequence`); docs/ppo.md#sequence-level-ratios-gspo.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = described(
        "k1",
        "Per-token estimator of KL(π‖π_ref) used for the penalty (Schulman's k1 = log π/π_ref, "
        "k2 = ½(log π/π_ref)², k3 = π_ref/π − 1 − log π_ref/π). `objective/kl` is k1 whatever "
        "this is.",
    )
    kl_in: Literal["reward", "loss"] = described(
        "reward",
        "Where β·KL goes: subtracted from the per-token rewards (Ziegler et al., InstructGPT), "
        "or added to the policy loss as a differentiable term (GRPO, usually with k3).",
    )
    kl_importance_weight: bool = described(
        True,
        "With `kl_in: loss`, weight each token's KL estimate by the ratio π/π_old, so that its "
        "gradient is KL(π‖π_ref)'s (TRL's `use_bias_correction_kl`); why: docs/ppo.md.",
    )
    cliprange: float = described(
        0.2, "ε of the clipped surrogate (the lower ε when `cliprange_high` is set).", gt=0.0
    )
    cliprange_high: float | None = described(
        None,
        "Upper ε of the clipped surrogate: the ratio is clipped to [1 − cliprange, 1 + "
        "cliprange_high] (DAPO's clip-higher, which uses 0.28 with cliprange 0.2); None: "
        "symmetric.",
        gt=0.0,
    )
    loss_aggregation: LossAggregation = described(
        "token_mean",
        "How a mini-batch's per-token losses become one: the mean over its tokens (TRL's "
        "`dapo`), of each response's token mean (`grpo`), or of each response's token sum over "
        "`max_new_tokens` (`dr_grpo`); docs/ppo.md#loss-options.",
    )
    logprob_support: Literal["sampled", "full"] = described(
        "sampled",
        "The distribution the ratio, KL and loss score tokens under: `sampled` (temperature, "
        "top-k, top-p, as drawn) or `full` (temperature only, TRL's); docs/ppo.md#loss-options.",
    )
    cliprange_value: float = described(0.2, "Value clipping range.", gt=0.0)
    vf_coef: float = described(0.1, "c₁: weight of the value loss.", ge=0.0)
    entropy_coef: float = described(0.0, "c₂: entropy bonus (0 allowed).", ge=0.0)
    max_grad_norm: float = described(0.5, "Gradient clipping norm.", gt=0.0)
    whiten_rewards: bool = described(False, "Whiten the KL-shaped rewards before GAE.")
    missing_eos_penalty: float | None = described(
        None,
        "Subtract this from the score of responses that never end (the EOS trick; TRL's examples "
        "use 1.0). Applied before `score_norm` and `reward_clip`.",
        ge=0.0,
    )
    score_norm: bool = described(
        False,
        "Normalise scores by running mean and std over all iterations (TRL's `use_score_norm`, "
        "OpenRLHF's `normalize_reward`), before `reward_clip`.",
    )
    reward_clip: float | None = described(
        None, "Clip the (penalised, normalised) scores to ±this value.", gt=0.0
    )
    value_model: Literal["shared", "separate"] = described(
        "shared", "Value head on the policy's backbone, or a separate critic model."
    )
    value_init: Literal["policy", "reward_model"] = described(
        "policy", "Separate critic initialised from the policy or from the reward model."
    )
    max_nonfinite: int = described(
        3,
        "Stop (with a checkpoint) after this many iterations in a row "
        "with non-finite rewards or losses.",
        gt=0,
    )
    allow_prompt_overlap: bool = described(
        False,
        "Silence the warning about PPO prompts that were in the reward model's training pairs.",
    )
    eval_every: int | None = described(
        None,
        "Evaluate on the held-out prompts (`data.prompts.eval_fraction`) every N iterations; "
        "they are evaluated at the end in any case.",
        gt=0,
    )
    eval_samples_per_prompt: int = described(
        1,
        "Answers sampled per held-out prompt: with n > 1 the evaluation adds `eval/mean_at_k` "
        "(the mean reward over a prompt's n) and the unbiased `eval/pass_at_1`, "
        "`eval/pass_at_<n>` (Chen et al. 2021); docs/ppo.md#passk-in-the-held-out-evaluation.",
        ge=1,
    )
    pass_threshold: float = described(
        1.0,
        "A held-out answer passes when its reward is at least this (1.0: a right answer "
        "under a 0/1 verifiable reward).",
    )
    save_freq: int = described(50, "Checkpoint every N iterations (and at the end).", gt=0)
    log_every: int = described(
        25, "Console health block and samples.jsonl every N iterations.", gt=0
    )
    generation: GenerationSection = described(GenerationSection(), "Rollout generation settings.")

    @model_validator(mode="after")
    def _divisible(self) -> PpoSection:
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size: {self.mini_batch_size} must divide "
                f"ppo.batch_size ({self.batch_size})"
            )
        if self.batch_size % step:
            raise ValueError(
                f"gradient_accumulation_steps: mini_batch_size × gradient_accumulation_steps "
                f"({step}) must divide ppo.batch_size ({self.batch_size})"
            )
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"num_generations: {self.num_generations} must divide "
                f"ppo.batch_size ({self.batch_size}), which counts completions"
            )
        if ESTIMATORS[self.advantage_estimator].grouped and self.num_generations < 2:
            raise ValueError(
                f"num_generations: {self.advantage_estimator} compares each completion with "
                "the prompt's others; set ppo.num_generations to 2 or more"
            )
        if self.dynamic_sampling and not ESTIMATORS[self.advantage_estimator].grouped:
            raise ValueError(
                f"dynamic_sampling: drops groups of a prompt's answers that all score the "
                f"same, which needs a group estimator (rloo, grpo), not "
                f"{self.advantage_estimator}"
            )
        if self.dynamic_sampling and self.generation.async_steps:
            raise ValueError(
                "dynamic_sampling: refills the batch from the latest weights, which needs "
                "generation.async_steps 0"
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """Whether `advantage_estimator` trains a value head or model (the loop, the model builder
        and `rlhf plan` ask this one table row)."""
        return ESTIMATORS[self.advantage_estimator].needs_critic
