"""PruLong's gates: the hard-concrete distribution and its expected L0 sparsity.

One gate z per (layer, KV head), parametrised by log_alpha (Louizos et al. 2018, "Learning
Sparse Neural Networks through L0 Regularization"; the paper's appendix "The details of the
pruning process"). Exactly what is computed here:

    u  ~ Uniform(EPS, 1 - EPS),   EPS = 1e-6            (u = EPS + (1 - 2 EPS) * rand)
    g  = sigmoid((log u - log(1 - u) + log_alpha) / TAU)
    z  = clamp(L + g * (R - L), 0, 1),                   (L, R) = (-0.1, 1.1),  TAU = 2/3

    P(z > 0) = sigmoid(log_alpha - TAU * log(-L / R))
    s        = 1 - mean_{layers, heads} P(z > 0)          (expected L0 sparsity)

Derivation of P(z > 0): z > 0 iff g > -L / (R - L) iff (logit u + log_alpha) / TAU >
logit(-L / (R - L)) = log(-L / R) iff logit u > TAU log(-L / R) - log_alpha, and logit u of a
uniform u is standard logistic, so the probability is sigmoid(log_alpha - TAU log(-L / R)).

Where this differs from the appendix's text, and why:
- temperature: the appendix says "fixed at 3/2" while describing the common implementations,
  which use beta = 2/3 (Louizos et al.; CoFi; Sheared-LLaMA); our issue tracker settled on 2/3.
  TAU = 2/3 here.
- the appendix writes g = sigmoid(log(u / (1 - u)) / tau + log alpha), i.e. log alpha outside
  the 1/tau; we use Louizos' form (log alpha inside), as the issue specifies. Both are monotone
  in log_alpha; the closed form above belongs to ours.
- the appendix stretches to [l, r] = [-0.1, 1]; we use (-0.1, 1.1) as Louizos et al., so that
  z = 1 also has probability mass (otherwise a gate could never be exactly 1).
- the appendix's sparsity formula, s = 1 - 1/(LH) sum sigmoid(alpha - log(-l/r)), omits the
  temperature (and writes alpha for log alpha); with a temperature other than 1 the exact
  probability needs TAU * log(-l/r), which `expected_sparsity` uses (tests check it against a
  Monte-Carlo estimate).

At export the gate written to the mask file is pi = sigmoid(log_alpha), the Bernoulli parameter
of the paper's objective: a strictly increasing function of log_alpha, so the global top-k of
the gates is the appendix's "top k of the log alphas" (masks.full_heads_at_sparsity).
"""

from __future__ import annotations

import math

import torch

LIMIT_L = -0.1
LIMIT_R = 1.1
TEMPERATURE = 2.0 / 3.0
EPS = 1e-6
# Short-run stabilisers (not in the paper; see `clamp_log_alpha_`): keep the logit of P(z > 0)
# within +-2.5 (P(z > 0) in [7.6 %, 92.4 %]) and start at its upper end.
DEFAULT_GATE_LOGIT_CLAMP = 2.5
FULL_MODEL_LOG_ALPHA = 3.0  # P(z > 0) = 0.99: the start when no clamp is used


def uniform_noise(shape: tuple[int, ...], generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """u ~ Uniform(EPS, 1 - EPS), float32, on `device` (default CPU). Drawn on the CPU (with
    `generator`, a CPU generator, for the same noise on every device), then moved."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32, device="cpu")
    u = EPS + (1.0 - 2.0 * EPS) * u
    return u if device is None else u.to(device)


def gates_from_noise(log_alpha: torch.Tensor, u: torch.Tensor,
                     temperature: float = TEMPERATURE) -> torch.Tensor:
    """z = clamp(L + sigmoid((log u - log(1 - u) + log_alpha) / tau) * (R - L), 0, 1)."""
    g = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / temperature)
    return torch.clamp(LIMIT_L + g * (LIMIT_R - LIMIT_L), 0.0, 1.0)


def sample_gates(log_alpha: torch.Tensor, generator: torch.Generator | None = None,
                 temperature: float = TEMPERATURE) -> torch.Tensor:
    """One hard-concrete sample per entry of log_alpha (differentiable in log_alpha)."""
    u = uniform_noise(tuple(log_alpha.shape), generator, device=log_alpha.device)
    return gates_from_noise(log_alpha, u, temperature)


def sample_gates_with_saturation(log_alpha: torch.Tensor,
                                 generator: torch.Generator | None = None,
                                 temperature: float = TEMPERATURE
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, saturated): a sample as `sample_gates`, and bool where the stretched value lies
    strictly outside [0, 1], so that z is exactly 0 or 1 and has zero gradient."""
    u = uniform_noise(tuple(log_alpha.shape), generator, device=log_alpha.device)
    g = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / temperature)
    stretched = LIMIT_L + g * (LIMIT_R - LIMIT_L)
    with torch.no_grad():
        saturated = (stretched < 0) | (stretched > 1)
    return torch.clamp(stretched, 0.0, 1.0), saturated


def deterministic_gates(log_alpha: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """The gate at u = 1/2: clamp(L + sigmoid(log_alpha / tau) * (R - L), 0, 1)."""
    return torch.clamp(LIMIT_L + torch.sigmoid(log_alpha / temperature) * (LIMIT_R - LIMIT_L),
                       0.0, 1.0)


def prob_nonzero(log_alpha: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """P(z > 0) = sigmoid(log_alpha - tau * log(-L / R)), per gate."""
    return torch.sigmoid(log_alpha - temperature * math.log(-LIMIT_L / LIMIT_R))


def expected_sparsity(log_alpha: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """s = 1 - mean P(z > 0): the expected share of gates exactly 0 (streaming heads)."""
    return 1.0 - prob_nonzero(log_alpha, temperature).mean()


def log_alpha_bounds(gate_logit_clamp: float,
                     temperature: float = TEMPERATURE) -> tuple[float, float]:
    """The log_alpha range in which the logit of P(z > 0), log_alpha - tau log(-L / R), lies
    in [-c, c]: with c = 4.6 and tau = 2/3 about [-6.2, 3.0]."""
    shift = temperature * math.log(-LIMIT_L / LIMIT_R)
    return -gate_logit_clamp + shift, gate_logit_clamp + shift


def default_init_log_alpha(gate_logit_clamp: float | None) -> float:
    """Start as close to the full model as allowed: the clamp's upper bound, or
    FULL_MODEL_LOG_ALPHA without a clamp (the target sparsity starts at 0, "the full model")."""
    if gate_logit_clamp:
        return log_alpha_bounds(gate_logit_clamp)[1]
    return FULL_MODEL_LOG_ALPHA


def clamp_log_alpha_(log_alpha: torch.Tensor, gate_logit_clamp: float,
                     temperature: float = TEMPERATURE) -> None:
    """In place, after an optimizer step: keep every P(z > 0) within
    [sigmoid(-c), sigmoid(c)]. The paper mentions no clamp; Louizos et al.'s reference code
    clamps log_alpha (to [log 1e-2, log 1e2]) in the same spirit.

    Why: at a saturated log_alpha the sample z is 0 or 1 almost surely, so the next-token loss
    gives it no gradient, and the Lagrangian's gradient through s shrinks like
    sigmoid'(log_alpha - tau log(-l/r)); with Adam's second-moment memory (beta2 = 0.95) of the
    earlier, larger gradients such a gate needs on the order of a hundred steps to come back.
    The paper's 1000 steps absorb that; a CPU run of ~50 steps does not. Measured on
    SmolLM2-135M (40 steps, seq-len 512): without a clamp the expected sparsity stuck at 0.000
    while the target rose to 0.7; with c = 4.6 it overshot to 0.99 and stuck at the lower
    bound; with c = 2.5 and lr 0.5 it followed the target and ended at 0.700. The price: a gate
    at the upper bound is exactly 1 in only a third of the samples, so training sees softer
    hybrids than the paper's; export rounds to binary anyway. Pass c = 0 to turn it off."""
    lo, hi = log_alpha_bounds(gate_logit_clamp, temperature)
    with torch.no_grad():
        log_alpha.clamp_(lo, hi)


def export_gates(log_alpha: torch.Tensor) -> torch.Tensor:
    """Gates written to the mask file: pi = sigmoid(log_alpha), computed in float64.

    In float32 sigmoid(x) rounds to exactly 1.0 for x > ~16.6; such heads tie and
    `full_heads_at_sparsity` then orders them by flat index. That only matters when asking for
    more streaming heads than there are log_alphas below ~16.6 (the file keeps the exact
    log_alphas too).
    """
    return torch.sigmoid(log_alpha.detach().to(torch.float64)).to(torch.float32)
