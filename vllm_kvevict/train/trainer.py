"""The training loop shared by both objectives: data, schedules, checkpoints, export.

PruLong (`objective="prulong"`), one step (batch of B sequences, each of exactly seq_len):

    t      = s0 + (t_final - s0) min(1, step / sparsity_warmup_steps) target warm-up from s0,
                                                                     the initial expected sparsity
    z_b    = hard-concrete sample of log_alpha, one per sequence b   (hard_concrete.py)
    L_lm   = 1/B sum_b mean_n -log p(x_{n+1} | x_{<=n}; z_b)        hybrid model, frozen weights
    s      = 1 - mean sigmoid(log_alpha - tau log(-l / r))           expected L0 sparsity
    L      = L_lm + lambda1 (s - t) + lambda2 (s - t)^2
    log_alpha <- AdamW step on  dL/dlog_alpha                         (descent)
    lambda    <- AdamW step on -dL/dlambda                            (ascent: grads negated)
    log_alpha <- clamp so that log_alpha - tau log(-l/r) in [-c, c]    (ours, c = 2.5; 0 = off)

log_alpha starts at the clamp's upper bound (0.90; 3.0 without clamp), lambdas at 0. The
clamp and that start are not in the paper; they make runs of tens of steps work (the reasons
and measurements are in `hard_concrete.clamp_log_alpha_`).

DuoAttention (`objective="duo"`), one step:

    alpha in [0, 1]^{L x H}, initialised to 1 (every head full), clamped after every step
    h_full = final hidden states (after the final RMSNorm) of the unmodified model, no grad
    h_mix  = the same with hybrid attention alpha * full + (1 - alpha) * streaming
    L      = 1/(B a D) sum_b ||h_full - h_mix||^2 over the a answer tokens (the recited
             passkeys at the end of each sequence) and D hidden dims
             + duo_lambda * mean |alpha|                              (L1, normalised by L x H)

Both: weights frozen (requires_grad False), AdamW with betas (0.9, 0.95), weight decay 0 (the
paper gives none; decay would pull log_alpha toward 0 and has no meaning for a multiplier),
learning rate linearly warmed up over the first warmup_frac (10 %) of the steps, then linearly
decayed to final_lr_frac (1 %) of the peak at the last step. Every random draw (hard-concrete
noise, data order, passkeys) is a pure function of (seed, step), so a resumed run is identical
to an uninterrupted one.

Device (`TrainConfig.device`, `--device`: "cpu" by default, "cuda", or any torch device
string): the model is moved there and every tensor the trainer creates (gate parameters, the
Lagrange multipliers, positions, loss targets, the streaming masks, the hard-concrete noise) is
created on it with an explicit `device=`, except the random draws, which come from CPU
generators (so a run is reproducible across devices) and are then moved. CUDA placement holds
by construction but is untested: the machine this was written on has no GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import vllm_kvevict.train.data as data_mod
import vllm_kvevict.train.hard_concrete as hc
from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW, KVPolicyConfig
from vllm_kvevict.masks import HeadGates, model_key, save_head_gates
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner
from vllm_kvevict.train.hybrid import StreamingMask, full_attention, hybrid_attention

OBJECTIVES = ("prulong", "duo")
DEFAULT_LR = {"prulong": 1.0, "duo": 0.02}
CHECKPOINT_NAME = "checkpoint.pt"
LOG_NAME = "train_log.jsonl"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Changing these between a checkpoint and its resumption would silently train something else.
RESUME_MUST_MATCH = ("objective", "seq_len", "chunk", "sink", "window", "seed", "batch_size",
                     "init_log_alpha", "gate_logit_clamp", "text_share", "held_out_fraction",
                     "max_source_chars", "duo_passkeys", "duo_passkey_words")


@dataclass
class TrainConfig:
    objective: str = "prulong"
    model: str = ""
    out: str | None = None
    target_sparsity: float = 0.7
    seq_len: int = 4096
    steps: int = 100
    batch_size: int = 1
    chunk: int = 1024
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    lr: float | None = None  # None: 1.0 for prulong (paper), 0.02 for duo (DuoAttention)
    lambda_lr: float = 1.0
    warmup_frac: float = 0.1
    final_lr_frac: float = 0.01
    sparsity_warmup_steps: int | None = None  # None: round(0.8 * steps) (paper: 800 of 1000)
    init_log_alpha: float | None = None  # None: hc.default_init_log_alpha(gate_logit_clamp)
    # After every step keep log_alpha - tau log(-l/r) (the logit of P(z > 0)) in [-c, c];
    # 0 or None: no clamp. See hard_concrete.clamp_log_alpha_.
    gate_logit_clamp: float | None = hc.DEFAULT_GATE_LOGIT_CLAMP
    duo_lambda: float = 0.05
    duo_passkeys: int = 10
    duo_passkey_words: int = 8
    seed: int = 0
    ckpt_every: int = 0  # 0: only at the end (when ckpt_dir is set)
    ckpt_dir: str | None = None
    resume: bool = False
    dtype: str = "float32"
    text_share: float = data_mod.DEFAULT_TEXT_SHARE
    held_out_fraction: float = data_mod.DEFAULT_HELD_OUT_FRACTION
    max_source_chars: int = data_mod.DEFAULT_MAX_SOURCE_CHARS
    query_block: int = 512
    loss_block: int = 1024
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...: the model and every trainer tensor

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0.0 <= self.target_sparsity <= 1.0:
            raise ValueError(f"target sparsity must be in [0, 1], got {self.target_sparsity}")
        for name in ("seq_len", "steps", "batch_size", "chunk", "window", "query_block",
                     "loss_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sink < 0 or self.ckpt_every < 0:
            raise ValueError("sink and ckpt_every must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.objective]
        if self.init_log_alpha is None:
            self.init_log_alpha = hc.default_init_log_alpha(self.gate_logit_clamp)
        if self.sparsity_warmup_steps is None:
            self.sparsity_warmup_steps = round(0.8 * self.steps)
        torch.device(self.device)  # raises on a malformed device string
        if self.resume and not self.ckpt_dir:
            raise ValueError("--resume needs --ckpt-dir")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- schedules ----------------------------------------------------------------------------------

class FusedLMLoss(torch.autograd.Function):
    """mean_i CE(h_i W^T, y_i) with its gradient to h computed in the forward pass, block by
    block, so the [n, vocab] logits never exist at once and are never recomputed (the weights
    W are frozen: no gradient for them). Logits and softmax in float32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                block: int) -> torch.Tensor:
        num = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, num, block):
            h = hidden[start:start + block]
            y = targets[start:start + block]
            logits = (h @ weight.t()).float()
            logp = torch.log_softmax(logits, dim=-1)
            total += -logp.gather(1, y[:, None]).sum()
            if grad is not None:
                probs = logp.exp_()
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                grad[start:start + block] = (probs.to(weight.dtype) @ weight) / num
        ctx.save_for_backward(grad)
        return total / num

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out.to(grad.dtype)), None, None, None


def lr_factor(step: int, total: int, warmup_frac: float = 0.1, final_frac: float = 0.01) -> float:
    """Multiplier of the peak learning rate at 0-based `step` of `total`: (step + 1) / W for the
    W = max(1, round(warmup_frac * total)) warm-up steps, then linear from 1 at step W - 1 to
    final_frac at the last step."""
    warmup = max(1, round(warmup_frac * total))
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total - warmup
    if decay_steps <= 0:
        return 1.0
    progress = (step - warmup + 1) / decay_steps
    return 1.0 - (1.0 - final_frac) * min(1.0, progress)


def target_sparsity_at(step: int, final: float, warmup_steps: int, start: float = 0.0) -> float:
    """t = start + (final - start) * min(1, step / warmup_steps): `start` at step 0, `final`
    from warmup_steps on. The trainer starts at the gates' initial expected sparsity (0 in the
    paper; 0.076 with our clamp): a target below it would first push the multipliers the wrong
    way, and in a run of tens of steps they never recover (measured: s stuck at 0.076 after
    17 of 45 steps at seq-len 4096)."""
    if warmup_steps <= 0:
        return final
    return start + (final - start) * min(1.0, step / warmup_steps)


def lagrangian(s: torch.Tensor, t: float, lambdas: torch.Tensor) -> torch.Tensor:
    """lambda1 (s - t) + lambda2 (s - t)^2."""
    return lambdas[0] * (s - t) + lambdas[1] * (s - t) ** 2


def ascend_(lambdas: torch.nn.Parameter) -> None:
    """Turn the optimizer's descent on the multipliers into ascent: negate their gradient."""
    if lambdas.grad is not None:
        lambdas.grad.neg_()


def _generator(seed: int, step: int, micro: int) -> torch.Generator:
    """A CPU generator whatever the device: draws are made on the CPU and then moved, so the
    noise of (seed, step, micro) is the same on every device."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + micro)


# -- the trainer --------------------------------------------------------------------------------

@dataclass
class StepResult:
    step: int  # 1-based: the number of steps done after this one
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Trains the gates of one model; `model` is a transformers Llama (loaded from cfg.model if
    None), `encode`/`eos_id` its tokenizer, `sources` the data (discovered if None)."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module | None = None,
                 encode: data_mod.Encode | None = None, eos_id: int | None = None,
                 sources: list[data_mod.Source] | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.log = log
        dtype = DTYPES[cfg.dtype]
        if model is None or encode is None:
            loaded_model, encode, eos_id = load_model_and_tokenizer(cfg.model, dtype)
            model = loaded_model if model is None else model
        self.encode, self.eos_id = encode, eos_id
        self.device = torch.device(cfg.device)
        model = model.to(self.device)
        for p in model.parameters():
            p.requires_grad_(False)
        mcfg = model.config
        self.num_layers, self.num_kv_heads = mcfg.num_hidden_layers, mcfg.num_key_value_heads
        policy = build_policy(KVPolicyConfig(policy="full"), self.num_layers, self.num_kv_heads)
        self.runner = ReferenceRunner(model, policy, dtype=dtype)
        self.streaming = StreamingMask(cfg.seq_len, cfg.chunk, cfg.sink, cfg.window,
                                       cfg.query_block, device=self.device)
        self.positions = torch.arange(cfg.seq_len, device=self.runner.device)

        if sources is None:
            sources = data_mod.discover_sources(cfg.max_source_chars)
        self.train_sources, self.held_out_sources = data_mod.split_sources(
            sources, cfg.held_out_fraction)
        if not self.train_sources:
            raise ValueError("no training sources")

        shape = (self.num_layers, self.num_kv_heads)
        if cfg.objective == "prulong":
            self.log_alpha = torch.nn.Parameter(torch.full(shape, float(cfg.init_log_alpha),
                                                            device=self.device))
            with torch.no_grad():
                self.start_sparsity = min(float(hc.expected_sparsity(self.log_alpha)),
                                          cfg.target_sparsity)
            self.lambdas = torch.nn.Parameter(torch.zeros(2, device=self.device))
            groups = [{"params": [self.log_alpha], "lr": cfg.lr, "name": "log_alpha"},
                      {"params": [self.lambdas], "lr": cfg.lambda_lr, "name": "lambdas"}]
        else:
            self.alpha = torch.nn.Parameter(torch.ones(shape, device=self.device))
            groups = [{"params": [self.alpha], "lr": cfg.lr, "name": "alpha"}]
        for group in groups:
            group["peak_lr"] = group["lr"]
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.elapsed = 0.0
        self.history: list[dict[str, float]] = []
        self._data: Iterator | None = None
        if cfg.resume:
            self.load_checkpoint()

    # -- data -------------------------------------------------------------------------------
    def _data_iter(self) -> Iterator[tuple[list[int], int]]:
        """(ids, answer_len) per sequence from the start; answer_len 0 for plain text."""
        cfg = self.cfg
        if cfg.objective == "prulong":
            for seq in data_mod.mixed_stream(self.train_sources, self.encode, self.eos_id,
                                             cfg.seq_len, cfg.seed, cfg.text_share, "train"):
                yield list(seq.ids), 0
            return
        haystack_sources = [s for s in self.train_sources if s.kind == "text"] \
            or self.train_sources
        stream = data_mod.mixed_stream(haystack_sources, self.encode, self.eos_id,
                                       cfg.seq_len, cfg.seed, 1.0, "haystack")
        for index, hay in enumerate(stream):
            seq = data_mod.passkey_sequence(hay.ids, self.encode, cfg.seq_len, cfg.seed, index,
                                            cfg.duo_passkeys, cfg.duo_passkey_words)
            yield list(seq.ids), seq.answer_len

    def _next_batch(self) -> list[tuple[list[int], int]]:
        if self._data is None:
            self._data = self._data_iter()
            for _ in range(self.step * self.cfg.batch_size):  # resumed: skip what was used
                next(self._data)
        return [next(self._data) for _ in range(self.cfg.batch_size)]

    # -- losses -----------------------------------------------------------------------------
    def _hidden(self, ids: list[int], attention) -> torch.Tensor:
        return self.runner.run_layers(ids, self.positions, attention)

    def _lm_loss(self, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Mean next-token cross-entropy of the final hidden states (`FusedLMLoss`)."""
        targets = torch.tensor(ids[1:], dtype=torch.long, device=hidden.device)
        return FusedLMLoss.apply(hidden[:-1], self.runner.model.lm_head.weight, targets,
                                 self.cfg.loss_block)

    def _prulong_micro(self, ids: list[int], micro: int) -> tuple[torch.Tensor, dict]:
        z, saturated = hc.sample_gates_with_saturation(
            self.log_alpha, _generator(self.cfg.seed, self.step, micro))

        def attention(layer, q, k, v, scale):
            return hybrid_attention(q, k, v, scale, z[layer], self.streaming, saturated[layer])

        loss = self._lm_loss(self._hidden(ids, attention), ids)
        return loss, {"z_zero_share": float((z == 0).float().mean()),
                      "z_one_share": float((z == 1).float().mean())}

    def _duo_micro(self, ids: list[int], answer_len: int) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            teacher = self._hidden(ids, lambda layer, q, k, v, scale:
                                   full_attention(q, k, v, scale))[-answer_len:]
        alpha = self.alpha

        def attention(layer, q, k, v, scale):
            return hybrid_attention(q, k, v, scale, alpha[layer], self.streaming)

        student = self._hidden(ids, attention)[-answer_len:]
        distill = (student.float() - teacher.float()).pow(2).mean()
        return distill, {}

    # -- one optimisation step --------------------------------------------------------------
    def train_step(self) -> StepResult:
        cfg = self.cfg
        started = time.perf_counter()
        factor = lr_factor(self.step, cfg.steps, cfg.warmup_frac, cfg.final_lr_frac)
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
        self.optimizer.zero_grad(set_to_none=True)
        batch = self._next_batch()
        main_loss, extra = 0.0, {}
        for micro, (ids, answer_len) in enumerate(batch):
            if cfg.objective == "prulong":
                loss, info = self._prulong_micro(ids, micro)
            else:
                loss, info = self._duo_micro(ids, answer_len)
            (loss / len(batch)).backward()
            main_loss += float(loss.detach()) / len(batch)
            for key, value in info.items():
                extra[key] = extra.get(key, 0.0) + value / len(batch)

        metrics: dict[str, float] = {"lr_factor": factor}
        if cfg.objective == "prulong":
            t = target_sparsity_at(self.step, cfg.target_sparsity, cfg.sparsity_warmup_steps,
                                   self.start_sparsity)
            s = hc.expected_sparsity(self.log_alpha)
            penalty = lagrangian(s, t, self.lambdas)
            penalty.backward()
            ascend_(self.lambdas)
            total = main_loss + float(penalty.detach())
            metrics.update(lm_loss=main_loss, lagrangian=float(penalty.detach()),
                           expected_sparsity=float(s.detach()), target_sparsity=t, **extra)
        else:
            reg = self.alpha.abs().mean()
            (cfg.duo_lambda * reg).backward()
            total = main_loss + cfg.duo_lambda * float(reg.detach())
            metrics.update(distill_loss=main_loss, l1=float(reg.detach()))
        self.optimizer.step()
        if cfg.objective == "prulong":
            if cfg.gate_logit_clamp:
                hc.clamp_log_alpha_(self.log_alpha, cfg.gate_logit_clamp)
            lam = self.lambdas.detach()
            metrics.update(lambda1=float(lam[0]), lambda2=float(lam[1]))
        else:
            with torch.no_grad():
                self.alpha.clamp_(0.0, 1.0)
            metrics["alpha_mean"] = float(self.alpha.detach().mean())
        if not math.isfinite(total):
            raise FloatingPointError(f"loss is {total} at step {self.step + 1}")
        self.step += 1
        seconds = time.perf_counter() - started
        self.elapsed += seconds
        metrics.update(loss=total, seconds=seconds)
        record = {"step": self.step, **metrics}
        self.history.append(record)
        if self.cfg.ckpt_dir:
            Path(self.cfg.ckpt_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.cfg.ckpt_dir) / LOG_NAME, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        return StepResult(self.step, total, metrics)

    def train(self, stop_at: int | None = None, progress: bool = True) -> list[StepResult]:
        """Run steps until cfg.steps (or `stop_at`), checkpointing as configured."""
        from tqdm import tqdm

        cfg = self.cfg
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        results = []
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress,
                   desc=f"{cfg.objective} masks", unit="step", dynamic_ncols=True)
        try:
            while self.step < end:
                result = self.train_step()
                results.append(result)
                m = result.metrics
                if cfg.objective == "prulong":
                    bar.set_postfix(lm=f"{m['lm_loss']:.3f}", s=f"{m['expected_sparsity']:.3f}",
                                    t=f"{m['target_sparsity']:.3f}", l1=f"{m['lambda1']:.2f}",
                                    sec=f"{m['seconds']:.1f}")
                else:
                    bar.set_postfix(distill=f"{m['distill_loss']:.4f}",
                                    alpha=f"{m['alpha_mean']:.3f}", sec=f"{m['seconds']:.1f}")
                bar.update(1)
                if cfg.ckpt_dir and (self.step == end or (
                        cfg.ckpt_every and self.step % cfg.ckpt_every == 0)):
                    self.save_checkpoint()
        finally:
            bar.close()
        return results

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_path(self) -> Path:
        if not self.cfg.ckpt_dir:
            raise ValueError("no ckpt_dir configured")
        return Path(self.cfg.ckpt_dir) / CHECKPOINT_NAME

    def _params(self) -> dict[str, torch.Tensor]:
        if self.cfg.objective == "prulong":
            return {"log_alpha": self.log_alpha.detach().cpu().clone(),
                    "lambdas": self.lambdas.detach().cpu().clone()}
        return {"alpha": self.alpha.detach().cpu().clone()}

    def save_checkpoint(self) -> Path:
        path = self.checkpoint_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "elapsed": self.elapsed, "config": self.cfg.to_dict(),
                 "params": self._params(), "optimizer": self.optimizer.state_dict(),
                 "history": self.history, "shape": [self.num_layers, self.num_kv_heads]}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint
        return path

    def load_checkpoint(self) -> None:
        path = self.checkpoint_path()
        if not path.is_file():
            self.log(f"--resume: no checkpoint at {path}, starting from step 0")
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = state["config"]
        if state["shape"] != [self.num_layers, self.num_kv_heads]:
            raise ValueError(f"{path}: gates of shape {state['shape']}, the model has "
                             f"{[self.num_layers, self.num_kv_heads]}")
        mismatch = {k: (saved.get(k), getattr(self.cfg, k)) for k in RESUME_MUST_MATCH
                    if saved.get(k) != getattr(self.cfg, k)}
        if mismatch:
            raise ValueError(f"{path}: cannot resume with different settings "
                             f"(checkpoint, now): {mismatch}")
        other = {k: (saved.get(k), v) for k, v in self.cfg.to_dict().items()
                 if k not in RESUME_MUST_MATCH and saved.get(k) != v
                 and k not in ("resume", "ckpt_every", "out")}
        if other:
            self.log(f"resuming with changed settings (checkpoint, now): {other}")
        with torch.no_grad():
            for name, value in state["params"].items():
                getattr(self, name).copy_(value.to(self.device))
        self.optimizer.load_state_dict(state["optimizer"])
        for group, peak in zip(self.optimizer.param_groups,
                               [g["peak_lr"] for g in self._fresh_groups()]):
            group["peak_lr"] = peak  # the peak lr comes from the current settings
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.history = list(state["history"])
        self._data = None
        self.log(f"resumed from {path} at step {self.step}")

    def _fresh_groups(self) -> list[dict]:
        if self.cfg.objective == "prulong":
            return [{"peak_lr": self.cfg.lr}, {"peak_lr": self.cfg.lambda_lr}]
        return [{"peak_lr": self.cfg.lr}]

    # -- export -----------------------------------------------------------------------------
    def head_gates(self) -> HeadGates:
        cfg = self.cfg
        extra: dict[str, Any] = {
            "steps": self.step, "seq_len": cfg.seq_len, "chunk": cfg.chunk,
            "batch_size": cfg.batch_size, "wall_time_s": round(self.elapsed, 1),
            "seed": cfg.seed, "lr": cfg.lr, "warmup_frac": cfg.warmup_frac,
            "final_lr_frac": cfg.final_lr_frac, "dtype": cfg.dtype, "device": cfg.device,
            "torch_threads": torch.get_num_threads(),
            "data": self.data_description(),
        }
        last = self.history[-1] if self.history else {}
        if cfg.objective == "prulong":
            log_alpha = self.log_alpha.detach().cpu().clone()
            gates = hc.export_gates(log_alpha)
            extra.update(
                gate_rule="gate = sigmoid(log_alpha) (the Bernoulli parameter pi); a head "
                          "sparsity S streams the round(S N) lowest gates",
                hard_concrete={"temperature": hc.TEMPERATURE, "limit_l": hc.LIMIT_L,
                               "limit_r": hc.LIMIT_R, "eps": hc.EPS},
                init_log_alpha=cfg.init_log_alpha, gate_logit_clamp=cfg.gate_logit_clamp,
                lambda_lr=cfg.lambda_lr,
                sparsity_warmup_steps=cfg.sparsity_warmup_steps,
                final_expected_sparsity=float(hc.expected_sparsity(log_alpha)),
                final_deterministic_zero_share=float(
                    (hc.deterministic_gates(log_alpha) == 0).float().mean()),
                final_lambdas=[float(x) for x in self.lambdas.detach().cpu()],
                final_lm_loss=last.get("lm_loss"))
            notes = ("PruLong gates: hard-concrete log_alphas trained with the next-token loss "
                     "of the hybrid (full/streaming per KV head) model and a Lagrangian toward "
                     "the target sparsity; `python -m vllm_kvevict.train --objective prulong`.")
            log_alphas, train_sparsity = log_alpha, cfg.target_sparsity
        else:
            gates = self.alpha.detach().cpu().clamp(0, 1).clone()
            extra.update(duo_lambda=cfg.duo_lambda, passkeys=cfg.duo_passkeys,
                         passkey_words=cfg.duo_passkey_words,
                         final_distill_loss=last.get("distill_loss"))
            notes = ("DuoAttention gates: continuous alpha in [0, 1] trained with the L2 "
                     "distance of final hidden states (full vs hybrid model) on passkey data "
                     "plus an L1 penalty; `python -m vllm_kvevict.train --objective duo`.")
            log_alphas, train_sparsity = None, None
        meta = {"model": model_key(cfg.model) if cfg.model else "unknown",
                "objective": cfg.objective, "sink": cfg.sink, "window": cfg.window,
                "train_sparsity": train_sparsity, "notes": notes, "extra": extra}
        return HeadGates(gates=gates, log_alphas=log_alphas, meta=meta)

    def data_description(self) -> dict[str, Any]:
        cfg = self.cfg
        train = data_mod.describe(self.train_sources)
        held = data_mod.describe(self.held_out_sources)
        return {
            "train_sources": {k: v["count"] for k, v in train.items()},
            "held_out_sources": held,
            "text_share": cfg.text_share, "held_out_fraction": cfg.held_out_fraction,
            "max_source_chars": cfg.max_source_chars,
            "kind": ("natural long text and repository-level code packed into seq_len "
                     "sequences" if cfg.objective == "prulong" else
                     f"passkey retrieval: {cfg.duo_passkeys} passkeys of "
                     f"{cfg.duo_passkey_words} words in a prose haystack"),
            "description": "see vllm_kvevict/train/data.py",
        }

    def export(self, path: str | Path | None = None) -> Path:
        path = Path(path or self.cfg.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_head_gates(path, self.head_gates())
        return path


def load_model_and_tokenizer(model_dir: str, dtype: torch.dtype = torch.float32):
    """(LlamaForCausalLM in eval mode, encode(text) -> ids without special tokens, eos id)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not model_dir:
        raise ValueError("no model directory given")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.model_max_length = 1 << 30  # we pack long documents ourselves
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{model_dir}: the tokenizer has no EOS token to separate documents")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return model, encode, eos
